"""`benchmarks/serving.py --peers`: the course's server beside vLLM's CPU build and `transformers serve`.

Every server serves the same saved model (the tiny model, or module 1's 170 M-parameter Llama in float32)
with one math thread, all of them up at once; the same client (`course bench`, pinned to core 1) drives
them in turn, the order rotating every round, so a machine that gets busier or quieter disturbs all of
them alike. For each server and concurrency it prints the medians over the rounds of the output tokens/s,
TTFT p50 and ITL p50, the CPU time per output token of the server's whole process tree (vLLM's API server
and its engine core; `course serve`'s API server and its engine core process), the tree's resident memory
(proportional set size, so pages the processes share count once) and the start-up time (process start to
the first answered `/v1/models`). Targets (issue 29): `course serve` at >= 0.8x vLLM's output tokens/s at
1 and 16 streams, with ITL p50 <= 1.25x vLLM's.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _processes import CLIENT_CORE, SERVER_CORE, WHOLE_MACHINE, free_port, pinned, single_thread_env, stop, values_at

from course.vllm_lab import process_tree_cpu_seconds

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
MAX_MODEL_LEN = 1024
COURSE_NAME = "course serve"
VLLM_NAME = "vllm serve (CPU build)"
TRANSFORMERS_NAME = "transformers serve --continuous-batching"


@dataclass
class Peer:
    """One running server and what was measured on it."""

    name: str
    command: list[str]
    model_name: str = "tiny"  # what clients send as ``model``
    process: subprocess.Popen | None = None
    port: int = 0
    start_seconds: float = 0.0
    runs: dict[int, list[dict]] = field(default_factory=dict)  # concurrency -> course bench summaries
    cpu_per_token: dict[int, list[float]] = field(default_factory=dict)  # concurrency -> s per output token
    memory_bytes: float = 0.0
    failure: str = ""  # why this server was dropped from the comparison ("" while it answers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def save_model(kind: str, folder: Path) -> Path:
    """Save the benchmark's model where every server can load it (``tiny`` or ``170m``)."""
    code = (
        "import sys, torch; torch.set_num_threads(1); from course import models; "
        f"lm = models.build_tiny_model() if {kind!r} == 'tiny' else models.build_realistic_model(); "
        f"models.save_model(lm, {str(folder)!r})"
    )
    subprocess.run([sys.executable, "-c", code], env=single_thread_env(), check=True, capture_output=True)
    return folder


def commands(model_dir: Path, include_transformers: bool) -> list[Peer]:
    """The servers, each told to listen on its own free port."""
    course = [str(BIN / "course"), "serve", "--model", str(model_dir), "--served-model-name", "tiny", "--threads",
              "1", "--max-batch-size", "64", "--max-model-len", str(MAX_MODEL_LEN)]  # fmt: skip
    # vLLM's CPU variables set inside the command: 1 GiB of KV cache (more than any run holds), its one
    # OpenMP thread bound to the server core; `python -m` as bin/vllm-env explains.
    vllm = ["env", "VLLM_CPU_KVCACHE_SPACE=1", f"VLLM_CPU_OMP_THREADS_BIND={SERVER_CORE}", str(VLLM_PYTHON), "-m",
            "vllm.entrypoints.cli.main", "serve", str(model_dir), "--host", "127.0.0.1", "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "tiny", "--max-num-seqs", "64"]  # fmt: skip
    peers = [Peer(COURSE_NAME, course), Peer(VLLM_NAME, vllm)]
    if include_transformers:
        peers.append(Peer(TRANSFORMERS_NAME, transformers_serve_command(model_dir), model_name=str(model_dir)))
    return peers


def transformers_serve_command(model_dir: Path) -> list[str]:
    """`transformers serve --continuous-batching` on ``model_dir`` (add ``--port``), its KV cache capped as
    the serving benchmark caps it; it serves the folder under its path and refuses other model names."""
    transformers_cli = shutil.which("transformers", path=str(BIN)) or "transformers"
    return [transformers_cli, "serve", str(model_dir), "--host", "127.0.0.1", "--device", "cpu",
            "--continuous-batching", "--cb-num-blocks", "1024", "--cb-block-size", "32",
            "--cb-max-batch-tokens", "2048"]  # fmt: skip


def transformers_missing() -> str | None:
    """Why `transformers serve` cannot run here (the bench extra), or None."""
    missing = [name for name in ("accelerate", "rich") if importlib.util.find_spec(name) is None]
    return f"missing {', '.join(missing)}" if missing else None


def start(peer: Peer, log_dir: Path, timeout: float) -> None:
    """Start ``peer`` on the whole machine and time it until ``/v1/models`` answers."""
    import urllib.request

    peer.port = free_port()
    command = [*peer.command, "--port", str(peer.port)]
    log = (log_dir / f"{peer.name.split()[0]}.log").open("w")
    started = time.monotonic()
    peer.process = subprocess.Popen(
        pinned(WHOLE_MACHINE, command), env=single_thread_env(), stdout=log, stderr=subprocess.STDOUT
    )
    while time.monotonic() - started < timeout:
        if peer.process.poll() is not None:
            raise RuntimeError(f"{peer.name} exited with {peer.process.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(peer.url + "/v1/models", timeout=2) as response:
                if response.status == 200:
                    peer.start_seconds = time.monotonic() - started
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{peer.name} did not answer within {timeout:.0f} s; see {log.name}")


def tree(pid: int) -> list:
    """The process ``pid`` and its live descendants (psutil)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def tree_memory_bytes(pid: int) -> float:
    """Proportional set size of the process tree (bytes): shared pages split among their sharers."""
    total = 0.0
    for process in tree(pid):
        with contextlib.suppress(Exception):  # a process that ended between listing and reading
            total += process.memory_full_info().pss
    return total


def bench(peer: Peer, concurrency: int, args: argparse.Namespace) -> dict:
    """One `course bench` run against ``peer`` (the same client and payload for every server)."""
    import json

    command = [str(BIN / "course"), "bench", "--base-url", peer.url, "--model", peer.model_name, "--concurrency",
               str(concurrency), "--num-requests", str(max(8, args.requests_per_worker * concurrency)),
               "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
               "--no-ignore-eos", "--warmup", "2", "--no-progress", "--json"]  # fmt: skip
    done = subprocess.run(
        pinned(CLIENT_CORE, command), env=single_thread_env(), capture_output=True, text=True, timeout=1800
    )
    if done.returncode != 0:
        raise RuntimeError(f"course bench against {peer.name} failed: {done.stderr[-1500:]}")
    return json.loads(done.stdout)


def measure(peers: list[Peer], args: argparse.Namespace) -> None:
    """``args.repeats`` rounds; in each, every concurrency on every server, the servers' order rotating."""
    for round_index in range(args.repeats):
        for concurrency in args.concurrency:
            shift = round_index % len(peers)
            for peer in peers[shift:] + peers[:shift]:
                if peer.failure:
                    continue
                cpu_before = process_tree_cpu_seconds(peer.process.pid)
                try:
                    run = bench(peer, concurrency, args)
                except RuntimeError as err:  # one server's failure leaves the others' figures standing
                    peer.failure = str(err)
                    print(f"  {peer.name}: dropped from the comparison: {err}", flush=True)
                    continue
                cpu = process_tree_cpu_seconds(peer.process.pid) - cpu_before
                peer.runs.setdefault(concurrency, []).append(run)
                tokens = run["output_tokens"] + 2 * args.output_tokens  # the warm-up requests are served too
                peer.cpu_per_token.setdefault(concurrency, []).append(cpu / max(tokens, 1))
                print(f"  round {round_index + 1} {peer.name:40s} c={concurrency:2d}: " + line(run), flush=True)
        for peer in peers:
            peer.memory_bytes = max(peer.memory_bytes, tree_memory_bytes(peer.process.pid))


def line(run: dict) -> str:
    return (
        f"{run['output_throughput_tok_s']:7.1f} tok/s | TTFT p50 {run['ttft']['p50_s'] * 1e3:7.1f} ms | "
        f"ITL p50 {run['itl']['p50_s'] * 1e3:6.2f} ms | failed {run['failed']}"
    )


def median(runs: list[dict], *path: str) -> float:
    return statistics.median(values_at(runs, *path))


def spread(runs: list[dict], *path: str, scale: float = 1.0) -> str:
    values = [value * scale for value in values_at(runs, *path)]
    return f"{min(values):.1f}-{max(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"


def report(peers: list[Peer], args: argparse.Namespace) -> None:
    """The table, then the course server against vLLM with the targets."""
    print("\nserver | streams | output tok/s (range) | TTFT p50 ms (range) | ITL p50 ms (range) | CPU us/token | "
          "memory (PSS) MiB | start-up s")  # fmt: skip
    print("---|---|---|---|---|---|---|---")
    for peer in peers:
        for concurrency, runs in peer.runs.items():
            cpu = statistics.median(peer.cpu_per_token[concurrency]) * 1e6
            print(
                f"{peer.name} | {concurrency} | {median(runs, 'output_throughput_tok_s'):.1f} "
                f"({spread(runs, 'output_throughput_tok_s')}) | {median(runs, 'ttft', 'p50_s') * 1e3:.1f} "
                f"({spread(runs, 'ttft', 'p50_s', scale=1e3)}) | {median(runs, 'itl', 'p50_s') * 1e3:.2f} "
                f"({spread(runs, 'itl', 'p50_s', scale=1e3)}) | {cpu:.0f} | {peer.memory_bytes / 2**20:.0f} | "
                f"{peer.start_seconds:.1f}"
            )
    course, vllm = (next((p for p in peers if p.name == name), None) for name in (COURSE_NAME, VLLM_NAME))
    if not (course and vllm):
        return
    print()
    for concurrency in args.concurrency:
        if concurrency not in course.runs or concurrency not in vllm.runs:
            continue
        tokens = median(course.runs[concurrency], "output_throughput_tok_s") / median(
            vllm.runs[concurrency], "output_throughput_tok_s"
        )
        itl = median(course.runs[concurrency], "itl", "p50_s") / median(vllm.runs[concurrency], "itl", "p50_s")
        ttft = median(course.runs[concurrency], "ttft", "p50_s") / median(vllm.runs[concurrency], "ttft", "p50_s")
        verdict = "meets" if tokens >= 0.8 and itl <= 1.25 else "MISSES"
        print(
            f"{concurrency:2d} streams: course serve {tokens:.2f}x vLLM's output tokens/s (target >= 0.8x), ITL p50 "
            f"{itl:.2f}x (target <= 1.25x), TTFT p50 {ttft:.2f}x: {verdict} the targets"
        )


def run_peers(args: argparse.Namespace) -> int:
    """Save the model, start the servers, measure interleaved, report; the servers are stopped at the end."""
    if not VLLM_PYTHON.exists():
        print(f"vLLM's environment is missing ({VLLM_PYTHON}); build it with bin/vllm-env", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="serving-peers-"))
    model_dir = save_model(args.model, workdir / f"model-{args.model}")
    why_not = "--skip-transformers" if args.skip_transformers else transformers_missing()
    peers = commands(model_dir, include_transformers=why_not is None)
    print(f"model: {args.model} ({model_dir}); {args.repeats} rounds at {args.concurrency} streams; "
          f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens")  # fmt: skip
    if why_not:
        print(f"transformers serve: skipped ({why_not})")
    try:
        for peer in peers:
            start(peer, workdir, args.start_timeout)
            print(f"  {peer.name}: up in {peer.start_seconds:.1f} s", flush=True)
        measure(peers, args)
    finally:
        for peer in peers:
            if peer.process is not None:
                stop(peer.process)
    report(peers, args)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0
