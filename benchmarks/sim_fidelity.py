"""Does the simulator predict a real server? (issue 4: TTFT and ITL p50/p95 within 10 % / 15 %.)

1. Starts module 2's reference server, ``course serve`` (the tiny model, one CPU thread, its engine
   on a thread, ``--engine-core thread``, pinned to core 0), and drives it with ``course bench``
   pinned to core 1, as peers.md recommends.
2. **Calibration** from separate microbenchmarks, each a small controlled ``course bench`` run:
   prefill: one request at a time with prompts of 16..512 tokens and 2 output tokens (median TTFT);
   decode: closed-loop waves of 1, 4 and 16 requests with 32- and 256-token prompts (median TPOT,
   i.e. the step time at that batch and context). ``course.sim.LinearCost.fit`` turns them into
   ``a + b*prefill + c*decode + d*KV read``. The microbenchmarks run once before and twice after the
   run to predict; the fit uses each one's median over the three rounds.
3. **The run to predict**: Poisson arrivals measured with ``course bench --request-rate ... --output``.
4. **The simulation**: ``course.workload.from_traces`` replays that run's arrivals and token counts
   through ``course.sim.simulate`` with the server's policy. The reference server prefills admitted
   prompts in a pass of their own and then decodes every running request (``course/serving/engine.py``),
   which is vLLM V0's prefill-first schedule with one decode step after every prefill step:
   ``scheduler="prefill-first", decode_after_prefill=True``, ``max_num_seqs`` = the server's
   ``--max-batch-size``, its ``--max-prefill-tokens`` budget, and no KV-block limit (its cache grows).
5. Prints measured vs simulated TTFT and ITL (p50, p95), the errors, and the targets.

    .venv/bin/python benchmarks/sim_fidelity.py [--rate 5] [--requests 150] [--keep DIR]

Timings on a shared machine are noisy; run it on a quiet one for the figures in benchmarks/RESULTS.md. The cost model is
deterministic (no step-to-step variance), so where the runtime's steps jitter, and where a busy client reads
chunks in bursts, the measured p95s are wider than the simulated ones.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import IO

from _processes import CLIENT_CORE, pinned, single_thread_env, start_server, stop

from course import metrics
from course.sim import LinearCost, SimConfig, StepSample, simulate
from course.trace import load_traces
from course.workload import from_traces

TARGETS = {"p50": 0.10, "p95": 0.15}


def start_course_server(port: int, max_batch_size: int, max_prefill_tokens: int, log: IO):
    # The engine on a thread of the server, all on core 0: the server the simulator was fitted to.
    command = [sys.executable, "-m", "course.cli", "serve", "--port", str(port), "--threads", "1",
               "--max-batch-size", str(max_batch_size), "--max-prefill-tokens", str(max_prefill_tokens),
               "--engine-core", "thread"]  # fmt: skip
    return start_server(command, f"http://127.0.0.1:{port}/health", log)


def bench(port: int, out: Path, *options: str) -> list:
    """Run ``course bench`` on core 1 and return its traces (failed requests raise)."""
    command = [sys.executable, "-m", "course.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
               "--no-progress", "--json", "--output", str(out), *options]  # fmt: skip
    result = subprocess.run(pinned(CLIENT_CORE, command), capture_output=True, text=True, env=single_thread_env())
    if result.returncode != 0:
        raise RuntimeError(f"course bench {' '.join(options)} failed:\n{result.stderr[-2000:]}")
    traces = load_traces(out)
    failed = [t for t in traces if not t.succeeded]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed in course bench {' '.join(options)}: {failed[0].error}")
    return traces


def calibrate(port: int, work: Path) -> list[StepSample]:
    """Step-time samples from small controlled runs (none of them is the run to predict)."""
    work.mkdir(parents=True, exist_ok=True)
    samples = []
    for prompt in (16, 64, 128, 256, 512):
        traces = bench(port, work / f"prefill_{prompt}.json", "--concurrency", "1", "--num-requests", "8",
                       "--prompt-tokens", str(prompt), "--output-tokens", "2", "--seed", "101")  # fmt: skip
        ttft = statistics.median(metrics.ttft(t) for t in traces)
        samples.append(StepSample(prompt, 0, 0, ttft))
        print(f"  prefill {prompt:4d} tokens: median TTFT {ttft * 1e3:7.2f} ms", flush=True)
    output = 64
    for context in (32, 256):
        for batch in (1, 4, 16):
            traces = bench(port, work / f"decode_{context}_{batch}.json", "--concurrency", str(batch),
                           "--num-requests", str(max(2 * batch, 6)), "--prompt-tokens", str(context),
                           "--output-tokens", str(output), "--seed", "202")  # fmt: skip
            # All requests of a wave start and finish together, so a request's TPOT is the decode step
            # time; unlike single chunk gaps it does not shrink when a busy client reads chunks in bursts.
            step = statistics.median(metrics.tpot(t) for t in traces)
            # during a decode step a sequence holds its prompt plus, on average, half the output
            samples.append(StepSample(0, batch, batch * (context + output // 2), step))
            print(f"  decode {batch:2d} x {context:3d}-token prompts: median TPOT {step * 1e3:6.2f} ms", flush=True)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--rate", type=float, default=5.0, help="Poisson arrivals of the run to predict (req/s)")
    parser.add_argument("--requests", type=int, default=150, help="requests in the run to predict")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=16, help="the server's --max-batch-size")
    parser.add_argument("--max-prefill-tokens", type=int, default=512, help="the server's --max-prefill-tokens")
    parser.add_argument("--keep", help="keep the trace files in this folder")
    args = parser.parse_args()

    work = Path(args.keep or tempfile.mkdtemp(prefix="sim-fidelity-"))
    work.mkdir(parents=True, exist_ok=True)
    server_log = (work / "server.log").open("w+")
    server = start_course_server(args.port, args.max_batch_size, args.max_prefill_tokens, server_log)
    try:
        # Calibrate once before and twice after the run, and fit the per-configuration median of the
        # three rounds: a machine that gets busier or quieter disturbs calibration and run alike, and
        # one disturbed microbenchmark (another program's burst) does not drag the fit.
        print("calibration before the run (microbenchmarks against the server):", flush=True)
        rounds = [calibrate(args.port, work / "before")]
        print(f"run to predict: {args.requests} requests, Poisson {args.rate:g} req/s, "
              f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens", flush=True)  # fmt: skip
        measured = bench(args.port, work / "run.json", "--request-rate", str(args.rate), "--num-requests",
                         str(args.requests), "--prompt-tokens", str(args.prompt_tokens), "--output-tokens",
                         str(args.output_tokens), "--seed", "303")  # fmt: skip
        with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=5) as response:
            health = json.load(response)
        for index in (1, 2):
            print(f"calibration {index} after the run:", flush=True)
            rounds.append(calibrate(args.port, work / f"after{index}"))
    finally:
        stop(server)
        server_log.close()
    samples = []
    for same in zip(*rounds):  # one microbenchmark, measured in each round
        seconds = statistics.median(sample.seconds for sample in same)
        samples.append(StepSample(same[0].prefill_tokens, same[0].decode_tokens, same[0].kv_tokens_read, seconds))
    cost = LinearCost.fit(samples)
    print(f"fitted {cost.describe()}")

    replay = from_traces(measured, name="the measured run")
    config = SimConfig(
        scheduler="prefill-first",
        decode_after_prefill=True,
        max_num_seqs=args.max_batch_size,
        max_num_batched_tokens=args.max_prefill_tokens,
        num_blocks=10**7,
    )
    simulated = simulate(replay, config, cost)
    real, model = metrics.summarize(measured), simulated.summary()
    print(f"\nserver: mean decode batch {health.get('mean_batch_size', 0):.1f}, "
          f"mean decode step {health.get('mean_decode_step_ms', 0):.2f} ms (all runs); "
          f"simulated mean batch {simulated.mean_batch_size:.1f}")  # fmt: skip
    print(f"{'metric':8s} {'measured ms':>12s} {'simulated ms':>13s} {'error':>8s} {'target':>7s}")
    ok = True
    for name in ("ttft", "itl", "tpot", "e2e"):
        for q in ("p50", "p95"):
            got, want = getattr(model, name)[q], getattr(real, name)[q]
            error = got / want - 1
            target = TARGETS[q] if name in ("ttft", "itl") else None
            mark = "" if target is None else ("  ok" if abs(error) <= target else "  MISSED")
            ok &= target is None or abs(error) <= target
            shown = f"{target:.0%}" if target is not None else "-"
            print(f"{name.upper() + ' ' + q:8s} {want * 1e3:12.2f} {got * 1e3:13.2f} {error:+8.1%} {shown:>7s}{mark}")
    print(f"\ntraces and server log in {work}" if args.keep else "")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("all targets met" if ok else "some targets missed (on a busy machine, rerun on a quiet one)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
