"""``course``: the course's tools on the command line, for practitioners and for CI.

course info                      what this runtime is (Python, torch, device)
course tiny-model DIR            write the tiny offline model for `transformers serve` & co.
course summarize TRACES.json     TTFT / ITL / TPOT / E2E percentiles of a trace file
course simulate [--config FILE]  simulate a batching scheduler on a workload (course simulate -h)
course kv MODEL --gpu H100-SXM   KV-cache size and vLLM's memory budget (course kv --list)
course serve [--port 8000]       the OpenAI-compatible reference server (continuous batching)
course bench --base-url URL      load-test any OpenAI-compatible server: TTFT / ITL / TPOT / E2E, traces
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def _info(args: argparse.Namespace) -> int:
    from course.env import runtime_info

    print(runtime_info().summary())
    return 0


def _tiny_model(args: argparse.Namespace) -> int:
    from course.models import save_tiny_model

    path = save_tiny_model(args.directory, seed=args.seed)
    print(f"wrote the tiny model (seed {args.seed}) to {path}; load it with from_pretrained({str(path)!r})")
    return 0


def _summarize(args: argparse.Namespace) -> int:
    from course.metrics import summarize
    from course.trace import load_traces

    traces = load_traces(args.traces)
    summary = summarize(traces, percentiles=args.percentiles)
    if args.json:
        print(json.dumps(summary.to_dict(), indent=1))
    else:
        print(summary.table())
    return 0


def _kv(args: argparse.Namespace) -> int:
    from course.kv import run_cli

    return run_cli(args)


def _simulate(args: argparse.Namespace) -> int:
    from course.sim.cli import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="course", description="Tools of the LLM inference serving course.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = commands.add_parser("info", help="print Python, torch, transformers and the device")
    info.set_defaults(run=_info)

    tiny = commands.add_parser("tiny-model", help="save the tiny offline Llama and its tokenizer to a folder")
    tiny.add_argument("directory", help="folder to write (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    tiny.set_defaults(run=_tiny_model)

    summ = commands.add_parser("summarize", help="latency percentiles of a request-trace JSON file")
    summ.add_argument("traces", help="a trace file written by course bench or course.trace.save_traces")
    summ.add_argument("--percentiles", type=float, nargs="+", default=[50, 95, 99], metavar="Q")
    summ.add_argument("--json", action="store_true", help="print JSON instead of a table")
    summ.set_defaults(run=_summarize)

    kv = commands.add_parser("kv", help="KV-cache bytes and vLLM's memory budget of a model on a GPU")
    from course.kv import add_cli_arguments

    add_cli_arguments(kv)
    kv.set_defaults(run=_kv)

    sim = commands.add_parser("simulate", help="simulate a batching scheduler (static, continuous, prefill-first)")
    from course.sim.cli import add_arguments as add_simulate_arguments

    add_simulate_arguments(sim)
    sim.set_defaults(run=_simulate)

    from course.serving.api.cli import add_bench_arguments, add_serve_arguments

    add_serve_arguments(commands.add_parser("serve", help="run the OpenAI-compatible reference server"))
    add_bench_arguments(commands.add_parser("bench", help="load-test an OpenAI-compatible server, write traces"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:
        print(f"course {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
