"""Are a server's decode steps slower in a Poisson run than in a closed loop at the same concurrency?

``benchmarks/sim_fidelity.py`` calibrates the decode step with closed waves (N requests sent at once, then N
more) and predicts a Poisson run. On vLLM the run's gaps at 13-16 streams came out 10-25 % above the simulated
ones in all 26 kept runs, while the waves lie on the fitted line (benchmarks/RESULTS.md, "What the simulator
would need to predict vLLM"). This benchmark asks which difference between the two does it. In rounds, on one
server, it sends the same prompts four ways:

* **wave**: the calibration's closed wave: ``--streams`` requests at once, twice over;
* **turnover**: a closed loop that keeps ``--streams`` requests in flight for ten times as many requests, so
  the batch turns over all the time (one request leaves, the next joins and is prefilled) as a busy run's does;
* **queue**: the same loop with twice as many in flight: the batch is full and as many wait in the server's
  queue, as when a Poisson run outruns the server;
* **poisson**: Poisson arrivals at ``--rate``, as the run to predict (no cap on requests in flight: a queue forms).

For each it prints the decode-only gaps (a gap in which no other request got its first token; the steps that
carry a prefill are left out) and the p50 of all gaps while 13 to 16 requests streamed
(``course.metrics.itl_by_streams``); then, per request, what each of the server's processes had of the CPUs
(its threads' ``/proc/<pid>/task/*/schedstat``): the time on a CPU, and the time it was ready to run but another
process held the core. On vLLM three processes share the server's core (the API server, the engine core and the
model's worker), so one's work is the others' wait.

    .venv/bin/python benchmarks/turnover_steps.py [--engine vllm|course] [--rounds 3] [--rate 30]

The server is pinned to core 0 and the client to core 1, as in ``sim_fidelity.py``. ``--engine vllm`` needs
``.vllm-venv`` (``bin/vllm-env``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_fidelity  # noqa: E402  (benchmarks/ is not a package)
from _processes import CoreTime, core_time_by_process, start_server, stop  # noqa: E402

from course import metrics  # noqa: E402
from course.capacity import holds_a_first_token  # noqa: E402
from course.trace import RequestTrace  # noqa: E402

BUSY_STREAMS = 13  # itl_by_streams' bin of 13-16 requests streaming (width 4)


def decode_only_gaps(traces: list[RequestTrace]) -> list[float]:
    """The gaps (s) between a request's chunks in which no request got its first token: steps without a prefill."""
    first_tokens = sorted(t.chunk_times[0] for t in traces if t.succeeded)
    return [later - earlier for t in traces if t.succeeded
            for earlier, later in zip(t.chunk_times, t.chunk_times[1:])
            if not holds_a_first_token(first_tokens, earlier, later)]  # fmt: skip


def gaps_line(name: str, traces: list[RequestTrace]) -> str:
    """One line: the decode-only gaps' median and mean, and the p50 of all gaps at 13-16 streams (ms)."""
    gaps = decode_only_gaps(traces)
    busy = metrics.itl_by_streams(traces).get(BUSY_STREAMS, [])
    decode = "no decode-only gaps"
    if gaps:
        median, mean = statistics.median(gaps) * 1e3, statistics.fmean(gaps) * 1e3
        decode = f"decode-only gaps median {median:5.2f} ms, mean {mean:5.2f} ({len(gaps)})"
    crowded = (f"all gaps at 13-16 streams p50 {metrics.percentile(busy, 50) * 1e3:5.2f} ms ({len(busy)})" if busy
               else "never 13-16 streams")  # fmt: skip
    return f"{name:9s} {decode}; {crowded}"


def core_line(before: dict[str, CoreTime], after: dict[str, CoreTime], requests: int) -> str:
    """One line: each server process's time on a CPU and its wait for one between two reads, per request (ms),
    the busiest first."""
    used = {name: after[name].since(before.get(name, CoreTime(0.0, 0.0, 0))) for name in after}
    requests = max(requests, 1)
    busiest = sorted(used.items(), key=lambda pair: -pair[1].ran)
    cells = [f"{name} {t.ran / requests * 1e3:.2f} ran, {t.waited / requests * 1e3:.2f} waited, "
             f"{t.slices / requests:.0f} slices" for name, t in busiest]  # fmt: skip
    return (
        f"          per request: {'; '.join(cells)}"
        if cells
        else "          per request: the server's processes unread"
    )


def shapes(streams: int, rate: float) -> list[tuple[str, list[str]]]:
    """The ways to send the prompts: ``course bench`` options for each."""
    return [
        ("wave", ["--concurrency", str(streams), "--num-requests", str(2 * streams)]),
        ("turnover", ["--concurrency", str(streams), "--num-requests", str(10 * streams)]),
        ("queue", ["--concurrency", str(2 * streams), "--num-requests", str(10 * streams)]),
        ("poisson", ["--request-rate", f"{rate:g}", "--num-requests", str(10 * streams)]),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=("vllm", "course"), default="vllm")
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=float, default=30.0, help="Poisson arrivals (req/s): vLLM's runs were 24-35")
    parser.add_argument("--streams", type=int, default=16, help="the server's --max-num-seqs and the loops' width")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.rate <= 0 or args.streams < 1:
        parser.error("--rounds and --streams must be at least 1 and --rate above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="turnover-"))
    if args.engine == "vllm":
        if not sim_fidelity.VLLM_PYTHON.exists():
            print(f"vLLM's environment is not built ({sim_fidelity.VLLM_PYTHON}); build it with bin/vllm-env")
            return 2
        from course.models import save_tiny_model

        save_tiny_model(work / "tiny")
        command = sim_fidelity.vllm_server_command(args.port, work / "tiny", args.streams, 512)
    else:
        command = sim_fidelity.course_server_command(args.port, args.streams, 512)
    print(f"{args.engine}: {args.prompt_tokens} prompt + {args.output_tokens} output tokens, {args.streams} streams, "
          f"Poisson at {args.rate:g} req/s; {sim_fidelity.load_average()}")  # fmt: skip
    with (work / "server.log").open("w+") as log:
        health = f"http://127.0.0.1:{args.port}/health"  # start_server pins it to the server's core
        server = start_server(command, health, log, timeout=sim_fidelity.VLLM_START_TIMEOUT_S)
        try:
            for index in range(args.rounds):
                for name, options in shapes(args.streams, args.rate):
                    before = core_time_by_process(server.pid)
                    traces = sim_fidelity.bench(args.port, work / f"{index}_{name}.json", *options, "--prompt-tokens",
                                                str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
                                                "--seed", str(400 + index))  # fmt: skip
                    print(f"round {index + 1} {gaps_line(name, traces)}")
                    print(core_line(before, core_time_by_process(server.pid), len(traces)), flush=True)
        finally:
            stop(server)
    print(f"{sim_fidelity.load_average()} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
