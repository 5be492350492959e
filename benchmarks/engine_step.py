"""What the engine adds to the forward pass, in-process: its decode step against the raw runner step.

The raw step is the lean runner's forward pass plus the argmax
(`course.measure.runner_decode_steps`, as `benchmarks/serving.py` times it); the engine's step is
one ``Engine.step()`` of a single greedy request, driven by hand (``Engine(background=False)``,
events dropped), its runner wrapped so the forward pass inside it is timed too. Both run on core 0
with one torch thread, interleaved ``--rounds`` times (a raw run of 64 steps, then a 64-token
request), so slow drift on the machine cancels. Printed: the medians of the raw step, of the
engine's step and of the engine's time outside its forward pass (sampling, emitting, the cache's
bookkeeping, scheduling), and the median of the per-round ratios.

    .venv/bin/python benchmarks/engine_step.py [--rounds 12]

No server, no second process: the engine core process's message per step and the server's hand-off
come on top (`benchmarks/serving.py`'s "the server's own mean decode step" line shows them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _processes import SERVER_CORE

PROMPT_TOKENS = OUTPUT_TOKENS = 64


class TimedRunner:
    """The engine's runner, with the duration (s) of every forward pass it runs appended to ``times``."""

    def __init__(self, runner) -> None:
        self.runner, self.name, self.mask_4d = runner, runner.name, runner.mask_4d
        self.times: list[float] = []

    def new_cache(self):
        return self.runner.new_cache()

    def __getattr__(self, name: str):  # the rest of the runner's interface (cache_from for prefix-cache hits)
        return getattr(self.runner, name)

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.runner(*args, **kwargs)
        self.times.append(time.perf_counter() - start)
        return out


def engine_steps(engine, timed: TimedRunner, prompt: list[int]) -> tuple[list[float], list[float]]:
    """(whole steps, time outside the forward pass per step) (s) of one request's decode steps."""
    from course.serving.engine import SamplingParams

    engine.submit(prompt, SamplingParams(max_tokens=OUTPUT_TOKENS + 1, ignore_eos=True))
    engine.step()  # the prefill and the first decode step
    steps, outside = [], []
    while engine.num_unfinished:
        timed.times.clear()
        start = time.perf_counter()
        engine.step()
        step = time.perf_counter() - start
        if timed.times:  # the last call may only finish the request
            steps.append(step)
            outside.append(step - sum(timed.times))
    return steps, outside


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12, help="interleaved (raw, engine) rounds (default 12)")
    args = parser.parse_args(argv)
    if hasattr(os, "sched_setaffinity") and SERVER_CORE in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {SERVER_CORE})
    import torch

    torch.set_num_threads(1)
    from course.measure import runner_decode_steps
    from course.models import build_tiny_model
    from course.serving.engine import Engine
    from course.serving.runner import runner_for

    lm = build_tiny_model()
    runner = runner_for(lm.model, "auto")
    engine = Engine(lm, background=False, on_events=lambda events: None)
    timed = TimedRunner(engine.runner)
    engine.runner = timed
    prompt = lm.random_ids(1, PROMPT_TOKENS, seed=0)[0].tolist()
    rounds = []
    for trial in range(args.rounds):
        raw = statistics.median(runner_decode_steps(lm, runner, 1, PROMPT_TOKENS, OUTPUT_TOKENS, seed=trial))
        steps, outside = engine_steps(engine, timed, prompt)
        rounds.append((raw, statistics.median(steps), statistics.median(outside)))
    raw, step, outside = (statistics.median(r[k] for r in rounds) for k in range(3))
    ratio = statistics.median(r[1] / r[0] for r in rounds)
    print(f"load average: {os.getloadavg()[0]:.2f}; {args.rounds} rounds, core {SERVER_CORE}, one torch thread")
    print(f"raw lean-runner decode step (batch 1): {raw * 1e3:.3f} ms")
    print(f"engine decode step, in-process, by hand: {step * 1e3:.3f} ms ({ratio:.3f}x the raw step, median of rounds)")
    print(f"engine time outside its forward pass per step: {outside * 1e6:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
