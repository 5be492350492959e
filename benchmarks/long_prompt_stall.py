"""How long a 4,000-token prompt stalls the running streams: chunked prefill against whole-prompt admission.

Issue 24 item 7. The engine (in-process, its own background thread, the chatty tiny model) runs
``--streams`` greedy streams; once they decode steadily, a ``--prompt-tokens`` prompt arrives. Each
stream's token arrival times give its largest gap between consecutive tokens while that prompt is
prefilled, beside the streams' steady gap (the median before it arrived) and the long prompt's time
to first token. Budgets run side by side, interleaved, ``--rounds`` times each:

* ``--budgets`` (default 512 and 2048): the iteration's token budget (``max_prefill_tokens``), shared
  by the streams' decodes and the prompt's chunks, as vLLM V1 shares ``max_num_batched_tokens``;
* ``whole``: a budget larger than the prompt, so it is prefilled in one pass: what the engine did for
  any prompt before chunked prefill (it admitted the first waiting prompt whole, whatever its length).

    .venv/bin/python benchmarks/long_prompt_stall.py [--rounds 3] [--streams 8] [--prompt-tokens 4000]

Printed per budget: the median over rounds (and the worst round) of the largest stream gap, the
steady gap, the long prompt's TTFT and the number of forward passes its prefill took.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

WHOLE = 10**6


def one_round(lm, budget: int, streams: int, prompt_tokens: int, seed: int) -> dict:
    import torch

    from course.serving.engine import Engine, SamplingParams

    engine = Engine(lm, max_batch_size=streams + 1, max_prefill_tokens=budget)
    params = SamplingParams(max_tokens=lm.model.config.max_position_embeddings - 64, ignore_eos=True)
    running = [engine.submit(list(range(10 + i, 30 + i)), params) for i in range(streams)]
    arrivals: list[list[float]] = [[] for _ in running]

    def read(request, times):
        for _ in request:
            times.append(time.perf_counter())

    readers = [threading.Thread(target=read, args=(r, t), daemon=True) for r, t in zip(running, arrivals)]
    for reader in readers:
        reader.start()
    while min(map(len, arrivals)) < 20:
        time.sleep(0.005)
    prompt = torch.randint(4, lm.vocab_size, (prompt_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    prefills_before = engine.counters.prefills
    submitted = time.perf_counter()
    long = engine.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    list(long)
    passes = engine.counters.prefills - prefills_before
    first = long.first_token_time
    time.sleep(0.05)  # a few more tokens after it, so the gap that ends after it is seen
    engine.stop()
    for reader in readers:
        reader.join(10)
    gaps, steady = [], []
    for times in arrivals:
        steady += [b - a for a, b in zip(times, times[1:]) if b < submitted]
        gaps += [b - a for a, b in zip(times, times[1:]) if b > submitted and a < first]
    return {
        "gap": max(gaps),
        "steady": statistics.median(steady),
        "ttft": first - submitted,
        "passes": passes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()

    import torch

    from course.serving.testing import chatty_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    lm = chatty_tiny_model(seed=6)
    budgets = [*args.budgets, WHOLE]
    results: dict[int, list[dict]] = {b: [] for b in budgets}
    print(
        f"{args.streams} running streams, then one {args.prompt_tokens:,}-token prompt; tiny chatty model on "
        f"{lm.device}, {torch.get_num_threads()} torch threads; {args.rounds} interleaved rounds"
    )
    for round_ in range(args.rounds):
        for budget in budgets:
            results[budget].append(one_round(lm, budget, args.streams, args.prompt_tokens, seed=round_))
    print(f"{'budget':>22} {'largest stream gap':>22} {'steady gap':>11} {'long prompt TTFT':>17} {'passes':>7}")
    for budget in budgets:
        runs = results[budget]
        gaps = [r["gap"] * 1e3 for r in runs]
        label = "whole prompt (old)" if budget == WHOLE else f"{budget} tokens (chunked)"
        print(
            f"{label:>22} {statistics.median(gaps):9.0f} ms (max {max(gaps):4.0f})"
            f" {statistics.median(r['steady'] * 1e3 for r in runs):8.1f} ms"
            f" {statistics.median(r['ttft'] * 1e3 for r in runs):14.0f} ms"
            f" {statistics.median(r['passes'] for r in runs):7.0f}"
        )


if __name__ == "__main__":
    main()
