"""Benchmark module 2's serving stack: the batched engine vs one-at-a-time vs `transformers serve`.

Everything runs on this machine in one go. The load client (`course bench`) is pinned to core 1 and
every server gets the whole machine (cores 0-1, less what the client takes), each with one math
thread (OMP_NUM_THREADS=1, as peers.md recommends for fair numbers on 2 cores). Printed:

1. the raw in-process decode step of the tiny model (batch 1 and 16, KV cache, 64-token prompt, core 0,
   one thread) with each of the engine's two model runners (`course.serving.runner`: the lean Llama
   runner the server uses, and the transformers forward pass), measured again beside every
   single-stream run, and the server's ITL p50 at concurrency 1 over the lean runner's step
   (target <= 1.10x); then the same ratio finely interleaved (--pairs times: the raw step, 64
   steps in a process kept running on core 0, then one request to the server; the median of the
   per-pair ratios), which cancels the machine's drift from one second to the next;
2. throughput, TTFT p50, ITL p50 and TPOT p50 at concurrency 1, 4, 16 for the course server as
   `course serve` runs it (continuous batching, max batch 64, the engine core in its own process), the
   same server one request at a time (max batch 1), on the transformers forward pass (`--runner
   transformers`: what the lean runner buys), and with the engine on a thread of the server's process
   (`--engine-core thread`), on both cores and on core 0 alone (what the separate process buys)
   (target at 16: >= 3x throughput with ITL p50 <= 2x the single-stream ITL p50); each line adds the
   server process's CPU time per output token (its own threads, not its children: for `course serve`
   with its engine core in a child process, the API server alone; otherwise the whole server);
3. the same workload against `transformers serve --continuous-batching` running the same tiny model
   saved with `course tiny-model`, its KV cache capped as peers.md explains (target at 16: >= 1.5x its
   output tokens/s with TTFT p50 and ITL p50 no worse). Needs the `bench` extra (accelerate, rich):
   `.venv/bin/pip install -c requirements/constraints.txt -e ".[dev,bench]"`; skipped with that
   note when it is missing.

4. with `--peers`: the course's server beside vLLM's CPU build (`.vllm-venv`, `bin/vllm-env`) and
   `transformers serve` on one saved model (`--model tiny` or `170m`, module 1's 170 M-parameter Llama in
   float32), all up at once and driven in rotating order by the same client: output tokens/s, TTFT p50,
   ITL p50, CPU per output token of each server's process tree, its memory and start-up time
   (`benchmarks/_peers.py`; targets: `course serve` >= 0.8x vLLM's tokens/s at 1 and 16 streams, ITL p50
   <= 1.25x vLLM's).

`--itl-only` runs the first part alone, against `course serve` (about a minute at --repeats 1: for A/B runs
of one change). The run starts by printing the load average and how the machine's idle cores wait
(``_processes.idle_policy``), which sets what each token's wake-up of the API server costs the engine.

Every request sends the same payload to every server (greedy, 64 prompt tokens, max_tokens 64, no
`ignore_eos`: `transformers serve` rejects that field), and the script checks the token counts the
servers report. Each figure is the median over --repeats runs.

    .venv/bin/python benchmarks/serving.py [--repeats 3] [--quick] [--skip-transformers] [--itl-only]
    .venv/bin/python benchmarks/serving.py --peers [--model tiny|170m] [--repeats 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from _processes import (
    CLIENT_CORE,
    SERVER_CORE,
    WHOLE_MACHINE,
    free_port,
    idle_policy,
    pinned,
    single_thread_env,
    start_server,
    stop,
    values_at,
)

ROOT = Path(__file__).resolve().parents[1]
INSTALL_BENCH = '.venv/bin/pip install -c requirements/constraints.txt -e ".[dev,bench]"'
BIN = Path(sys.executable).parent

# The raw decode step (`course.measure.runner_decode_steps`), run in its own process pinned to the
# server's core: a prefill of ``prompt`` tokens for ``batch`` rows, then ``count`` decode steps, each timed (s).
RAW_STEP_SETUP = """
import json, statistics, sys, torch
torch.set_num_threads(1)
from course.measure import runner_decode_steps
from course.models import build_tiny_model
from course.serving.runner import runner_for
lm = build_tiny_model()

def decode_steps(runner, batch, prompt, count, seed):
    return runner_decode_steps(lm, runner, batch, prompt, count, seed)
"""

# Both runners at batch 1 and 16: the median step of three prefills, as JSON.
RAW_STEP = (
    RAW_STEP_SETUP
    + """
out = {}
for name in ("transformers", "auto"):
    runner = runner_for(lm.model, name)
    for batch in (1, 16):
        steps = [s for trial in range(3) for s in decode_steps(runner, batch, PROMPT, STEPS, trial)]
        out[f"{runner.name}/{batch}"] = statistics.median(steps)
print(json.dumps(out))
"""
)

# The same measurement in a process that stays up: one line "batch prompt steps" in, the median
# step (s) of a fresh prefill followed by that many decode steps out.
RAW_STEP_SERVICE = (
    RAW_STEP_SETUP
    + """
runner = runner_for(lm.model, "auto")
print("ready", flush=True)
for trial, line in enumerate(sys.stdin):
    batch, prompt, count = (int(x) for x in line.split())
    print(statistics.median(decode_steps(runner, batch, prompt, count, trial % 5)), flush=True)
"""
)


def bench(url: str, model: str, concurrency: int, args: argparse.Namespace) -> dict:
    command = [
        str(BIN / "course"),
        "bench",
        "--base-url",
        url,
        "--model",
        model,
        "--concurrency",
        str(concurrency),
        "--num-requests",
        str(max(8, args.requests_per_worker * concurrency)),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--output-tokens",
        str(args.output_tokens),
        "--no-ignore-eos",
        "--warmup",
        "2",
        "--no-progress",
        "--json",
    ]
    done = subprocess.run(
        pinned(CLIENT_CORE, command), env=single_thread_env(), capture_output=True, text=True, timeout=900
    )
    if done.returncode != 0:
        raise RuntimeError(f"course bench failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def raw_decode_step(args: argparse.Namespace) -> dict[str, float]:
    """Median in-process decode step (s) of the tiny model on the server's core, keyed
    "<runner>/<batch>": runner "llama" or "transformers", batch 1 or 16."""
    code = RAW_STEP.replace("PROMPT", str(args.prompt_tokens)).replace("STEPS", str(args.output_tokens))
    done = subprocess.run(
        pinned(SERVER_CORE, [sys.executable, "-c", code]),
        env=single_thread_env(),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return json.loads(done.stdout)


def interleaved_pairs(url: str, model: str, args: argparse.Namespace) -> list[tuple[float, float]]:
    """``args.pairs`` times: the raw batch-1 step (s, median of ``args.output_tokens`` steps, in a
    process kept running on the server's core), then one streamed request from this process on
    the client's core and its ITL p50 (s). The server is idle while the raw step runs."""
    import asyncio

    import httpx

    from course.serving.client import default_prompt_builder, request_payload, stream_request

    raw = subprocess.Popen(
        pinned(SERVER_CORE, [sys.executable, "-c", RAW_STEP_SERVICE]),
        env=single_thread_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if affinity is not None and CLIENT_CORE in affinity:
        os.sched_setaffinity(0, {CLIENT_CORE})

    def raw_step() -> float:
        raw.stdin.write(f"1 {args.prompt_tokens} {args.output_tokens}\n")
        raw.stdin.flush()
        return float(raw.stdout.readline())

    async def run() -> list[tuple[float, float]]:
        prompts = default_prompt_builder()
        pairs = []
        async with httpx.AsyncClient(timeout=120) as client:
            for i in range(args.pairs + 2):  # the first two warm the connection and the server up
                prompt = prompts.make(args.prompt_tokens, seed=i)
                payload = request_payload(model, prompt, args.output_tokens, "completions", False, True, None)
                step = raw_step()
                trace = await stream_request(client, url + "/v1/completions", payload, str(i), args.prompt_tokens)
                gaps = [b - a for a, b in zip(trace.chunk_times, trace.chunk_times[1:])]
                if trace.error or not gaps:
                    raise RuntimeError(f"interleaved request {i} failed: {trace.error or 'fewer than 2 chunks'}")
                if i >= 2:
                    pairs.append((step, statistics.median(gaps)))
        return pairs

    try:
        if raw.stdout.readline().strip() != "ready":
            raise RuntimeError("the raw-step process did not start")
        return asyncio.run(run())
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        raw.stdin.close()
        raw.wait(30)


def engine_counters(url: str) -> tuple[int, float] | None:
    """(decode steps, seconds in decode steps) from the course server's /health; None for other servers."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            health = json.loads(response.read() or b"{}")
    except (OSError, ValueError):
        return None
    if "steps" not in health:
        return None
    return health["steps"], health["steps"] * health["mean_decode_step_ms"] / 1e3


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time (s) of process ``pid`` so far (its threads, not its children); None
    where /proc is missing."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_server(
    name: str,
    command: list[str],
    model: str,
    args: argparse.Namespace,
    port: int,
    cores: str = WHOLE_MACHINE,
    interleave: bool = False,
) -> dict:
    url = f"http://127.0.0.1:{port}"
    results = {}
    with tempfile.TemporaryFile("w+") as log:
        try:
            process = start_server(command, url + "/v1/models", log, cores=cores)
        except RuntimeError as err:
            print(f"  {name}: {err}", flush=True)
            return results
        try:
            for concurrency in args.concurrency:
                runs = []
                cpu_before = cpu_seconds(process.pid)  # taskset execs the server: this is its pid
                for _ in range(args.repeats):
                    single = concurrency == min(args.concurrency)
                    if single:
                        # the raw step, measured side by side with each single-stream run (server idle meanwhile)
                        results.setdefault("raw", []).append(raw_decode_step(args)["llama/1"])
                    before = engine_counters(url)
                    runs.append(bench(url, model, concurrency, args))
                    after = engine_counters(url)
                    if single and before and after and after[0] > before[0]:
                        # the server's own decode step during this very run (forward + sampling + hand-off)
                        step = (after[1] - before[1]) / (after[0] - before[0])
                        results.setdefault("engine_step", []).append(step)
                results[concurrency] = runs
                cpu_after = cpu_seconds(process.pid)
                tokens = sum(run["output_tokens"] for run in runs)
                if cpu_before is not None and cpu_after is not None and tokens:
                    # the server's process only (an engine core process is its child); warm-up requests included
                    results.setdefault("cpu_us_per_token", {})[concurrency] = 1e6 * (cpu_after - cpu_before) / tokens
                cpu = results.get("cpu_us_per_token", {}).get(concurrency)
                cpu_note = f" | server CPU {cpu:4.0f} us/token" if cpu is not None else ""
                print(f"  {name:40s} concurrency {concurrency:2d}: " + summary_line(runs) + cpu_note, flush=True)
                if interleave and concurrency == min(args.concurrency) and args.pairs:
                    results["pairs"] = interleaved_pairs(url, model, args)
        except RuntimeError as err:
            log.seek(0)
            print(f"  {name}: {err}\n{log.read()[-1500:]}", flush=True)
        finally:
            stop(process)
    return results


def median_of(runs: list[dict], *path: str) -> float:
    return statistics.median(values_at(runs, *path))


def summary_line(runs: list[dict]) -> str:
    """One line of the runs' medians: output tok/s, TTFT, ITL and TPOT p50 (ms), failures, tokens per request."""
    tokens = {run["output_tokens"] // max(run["completed"], 1) for run in runs}
    ttft, itl, tpot = (median_of(runs, name, "p50_s") * 1e3 for name in ("ttft", "itl", "tpot"))
    return (
        f"{median_of(runs, 'output_throughput_tok_s'):7.0f} tok/s | TTFT p50 {ttft:7.1f} ms | ITL p50 {itl:6.2f} ms"
        f" | TPOT p50 {tpot:6.2f} ms | failed {sum(r['failed'] for r in runs)} | tokens/request {sorted(tokens)}"
    )


def verdict(ok: bool) -> str:
    return "meets the target" if ok else "MISSES the target"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per point; figures are medians (default 3)")
    parser.add_argument("--quick", action="store_true", help="one run per point (a smoke test)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests-per-worker", type=int, default=4)
    parser.add_argument(
        "--pairs", type=int, default=40, help="interleaved (raw step, single request) pairs (default 40; 0: none)"
    )
    parser.add_argument("--skip-transformers", action="store_true", help="do not benchmark transformers serve")
    parser.add_argument(
        "--itl-only",
        action="store_true",
        help="only the single-stream ITL target: `course serve` at concurrency 1 with the raw steps beside it and "
        "the interleaved pairs (about a minute at --repeats 1; for A/B runs of one change)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="only the peer comparison: course serve, vLLM's CPU build and transformers serve on one model",
    )
    parser.add_argument("--model", choices=("tiny", "170m"), default="tiny", help="--peers: the model served")
    parser.add_argument(
        "--start-timeout", type=float, default=900, help="--peers: seconds a server may take to start (vLLM compiles)"
    )
    args = parser.parse_args(argv)
    if args.peers:
        from _peers import run_peers

        return run_peers(args)
    if args.quick:
        args.repeats = 1
    if args.itl_only:
        args.concurrency, args.skip_transformers = [1], True
    print(
        f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores "
        "(other work on the machine disturbs every figure)",
        flush=True,
    )
    print(idle_policy(), flush=True)

    raw = raw_decode_step(args)
    for runner in ("llama", "transformers"):
        one, sixteen = raw[f"{runner}/1"], raw[f"{runner}/16"]
        print(
            f"raw in-process decode step, {runner} runner (core {SERVER_CORE}, 1 thread): batch 1 {one * 1e3:.2f} ms, "
            f"batch 16 {sixteen * 1e3:.2f} ms ({sixteen / one:.2f}x)",
            flush=True,
        )
    print(
        f"lean runner / transformers forward: batch 1 {raw['llama/1'] / raw['transformers/1']:.2f}x, "
        f"batch 16 {raw['llama/16'] / raw['transformers/16']:.2f}x",
        flush=True,
    )

    workdir = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    tiny = workdir / "tiny-llama"
    subprocess.run(
        [str(BIN / "course"), "tiny-model", str(tiny)], env=single_thread_env(), check=True, capture_output=True
    )

    servers = {}
    course_serve = [str(BIN / "course"), "serve", "--model", "tiny", "--threads", "1"]
    thread = ["--max-batch-size", "64", "--engine-core", "thread"]
    course_servers = (
        ("course, continuous batching", ["--max-batch-size", "64"], WHOLE_MACHINE),
        ("course, one at a time", ["--max-batch-size", "1"], WHOLE_MACHINE),
        ("course, transformers runner", ["--max-batch-size", "64", "--runner", "transformers"], WHOLE_MACHINE),
        ("course, engine on a thread", thread, WHOLE_MACHINE),
        ("course, engine on a thread, core 0 only", thread, str(SERVER_CORE)),
    )
    for label, options, cores in course_servers[:1] if args.itl_only else course_servers:
        port = free_port()
        command = course_serve + ["--port", str(port), *options]
        interleave = label == course_servers[0][0]  # the server the single-stream target is about
        servers[label] = run_server(label, command, "course-tiny-llama", args, port, cores, interleave)
    transformers_cli = shutil.which("transformers", path=str(BIN)) or shutil.which("transformers")
    missing = [name for name in ("accelerate", "rich") if importlib.util.find_spec(name) is None]
    if args.skip_transformers:
        print("  transformers serve: skipped (--skip-transformers)")
    elif transformers_cli is None or missing:
        print(
            f"  transformers serve: {'missing ' + ', '.join(missing) if missing else 'not installed'}; skipped. "
            f"Install the bench extra: {INSTALL_BENCH}"
        )
    else:
        port = free_port()
        from _peers import transformers_serve_command

        command = [*transformers_serve_command(tiny), "--port", str(port)]
        servers["transformers serve --continuous-batching"] = run_server(
            "transformers serve --continuous-batching", command, str(tiny), args, port
        )

    print("\nserver | concurrency | output tok/s | TTFT p50 ms | ITL p50 ms | TPOT p50 ms")
    print("---|---|---|---|---|---")
    for name, by_level in servers.items():
        for concurrency, runs in by_level.items():
            if concurrency in ("raw", "engine_step", "pairs", "cpu_us_per_token"):
                continue
            print(
                f"{name} | {concurrency} | {median_of(runs, 'output_throughput_tok_s'):.0f} | "
                f"{median_of(runs, 'ttft', 'p50_s') * 1e3:.1f} | {median_of(runs, 'itl', 'p50_s') * 1e3:.2f} | "
                f"{median_of(runs, 'tpot', 'p50_s') * 1e3:.2f}"
            )

    batched = servers.get("course, continuous batching", {})
    serial = servers.get("course, one at a time", {})
    peer = servers.get("transformers serve --continuous-batching", {})
    top, one = max(args.concurrency), min(args.concurrency)
    print()
    if one in batched:
        itl = median_of(batched[one], "itl", "p50_s")
        references = {
            "raw lean-runner decode step measured alongside": batched.get("raw"),
            "the server's own mean decode step in the same runs (robust to other load on the machine)": batched.get(
                "engine_step"
            ),
        }
        for label, steps in references.items():
            if steps:
                step = statistics.median(steps)
                print(
                    f"ITL p50 at concurrency {one} / {label} ({step * 1e3:.2f} ms, median of {len(steps)}): "
                    f"{itl / step:.2f}x (target <= 1.10x): {verdict(itl / step <= 1.10)}"
                )
        pairs = batched.get("pairs")
        if pairs:
            ratios = sorted(itl / step for step, itl in pairs)
            low, high = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
            ratio = statistics.median(ratios)
            raw_ms, itl_ms = (statistics.median(pair[k] for pair in pairs) * 1e3 for k in (0, 1))
            print(
                f"single-stream ITL p50 / raw lean-runner step, interleaved ({len(pairs)} pairs; raw "
                f"{raw_ms:.2f} ms, ITL {itl_ms:.2f} ms medians): median of the per-pair ratios {ratio:.2f}x, "
                f"quartiles {low:.2f}-{high:.2f} (target <= 1.10x): {verdict(ratio <= 1.10)}"
            )
    if top in batched and top in serial and one in batched:
        speedup = median_of(batched[top], "output_throughput_tok_s") / median_of(serial[top], "output_throughput_tok_s")
        itl_ratio = median_of(batched[top], "itl", "p50_s") / median_of(batched[one], "itl", "p50_s")
        print(
            f"at concurrency {top}: batched throughput {speedup:.2f}x one-at-a-time (target >= 3x): "
            f"{verdict(speedup >= 3)}; ITL p50 {itl_ratio:.2f}x single-stream (target <= 2x): {verdict(itl_ratio <= 2)}"
        )
    for label in ("course, engine on a thread", "course, engine on a thread, core 0 only"):
        threaded = servers.get(label, {})
        if one in batched and one in threaded and top in batched and top in threaded:
            itl = median_of(batched[one], "itl", "p50_s") / median_of(threaded[one], "itl", "p50_s")
            tokens = [median_of(runs[top], "output_throughput_tok_s") for runs in (batched, threaded)]
            gain = tokens[0] / tokens[1]
            print(
                f"engine core in its own process vs {label.removeprefix('course, ')}: single-stream ITL p50 "
                f"{itl:.2f}x, tokens/s at concurrency {top} {gain:.2f}x"
            )
    lean_vs_hf = servers.get("course, transformers runner", {})
    if top in batched and top in lean_vs_hf:
        gain = median_of(batched[top], "output_throughput_tok_s") / median_of(
            lean_vs_hf[top], "output_throughput_tok_s"
        )
        print(f"at concurrency {top}: the lean runner gives {gain:.2f}x the transformers-forward server's tokens/s")
    if top in batched and top in peer:
        speedup = median_of(batched[top], "output_throughput_tok_s") / median_of(peer[top], "output_throughput_tok_s")
        ttft = median_of(batched[top], "ttft", "p50_s") / median_of(peer[top], "ttft", "p50_s")
        itl = median_of(batched[top], "itl", "p50_s") / median_of(peer[top], "itl", "p50_s")
        print(
            f"at concurrency {top} vs transformers serve: {speedup:.2f}x its output tokens/s (target >= 1.5x): "
            f"{verdict(speedup >= 1.5)}; TTFT p50 {ttft:.2f}x and ITL p50 {itl:.2f}x of its values "
            f"(target <= 1): {verdict(ttft <= 1 and itl <= 1)}"
        )
    print(f"load average after the run: {os.getloadavg()[0]:.2f}")
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
