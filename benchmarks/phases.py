"""Does this runtime show the course's central claim? Prefill and decode against its own roofs.

Measures the runtime's roofs (a streaming read far larger than the last-level cache; a matmul in
the model's dtype), then decode steps against batch size and prefills against prompt length on
module 1's phase model (``course.models.load_phase_model``: a 170 M-parameter offline Llama on a
CPU, Qwen2.5-0.5B-Instruct or its random-weight twin on a GPU), on each kernel path and dtype
asked for, side by side. On a CPU it runs on one torch thread by default, as module 1 does
(``course.phases.CPU_THREADS``; ``--torch-threads`` keeps torch's own count, ``--threads 1 2`` runs
both); on a GPU decode is timed eagerly and as CUDA-graph replays (``course.cuda_graphs``). The issue's
targets on a 2-core CPU (shown here, never asserted in tests): decode at batch 1 >= 50 % of the
measured bandwidth, step at batch 8 <= 1.5x batch 1, prefill at >= 512 tokens >= 50 % of the
measured matmul FLOP/s.

    .venv/bin/python benchmarks/phases.py                      # a table per path
    .venv/bin/python benchmarks/phases.py --json               # one JSON object (the first path)
    .venv/bin/python benchmarks/phases.py --torch-threads      # torch's default threads instead of one
    .venv/bin/python benchmarks/phases.py --paths stock weight-major --dtypes float32 bfloat16 --threads 1 2

With ``--json`` the one object holds the figures of the first configuration at top level
(``decode_bandwidth_fraction``, ``decode_step_ratio_batch8``, ``prefill_flops_fraction``,
``measured_bandwidth_gbs``, ``measured_flops_gflops``, ``model_params``, ``device``, ...) and
every configuration measured under ``"runs"``. Run it on a quiet machine: it prints its own
noise check, and the figures mean little when it fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from course import kernels, phases
from course.models import build_tiny_model, load_phase_model

DTYPES = ("float32", "bfloat16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--quick", action="store_true", help="short sweeps (smoke test; the figures are rough)")
    parser.add_argument(
        "--paths",
        nargs="+",
        default=[kernels.PACKED, kernels.STOCK, kernels.WEIGHT_MAJOR],
        choices=list(kernels.KERNEL_PATHS),
    )
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=DTYPES)
    parser.add_argument(
        "--threads",
        nargs="+",
        type=int,
        default=None,
        help=f"torch threads on a CPU (default: {phases.CPU_THREADS}, as module 1; a GPU keeps torch's own)",
    )
    parser.add_argument(
        "--torch-threads", action="store_true", help="keep torch's default thread count on a CPU too (not module 1's)"
    )
    parser.add_argument("--context", type=int, default=256, help="cached tokens per sequence in the decode sweep")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the GPU when there is one)")
    parser.add_argument(
        "--tiny", action="store_true", help="use the tiny model (a smoke test of the script; its figures mean nothing)"
    )
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if any(t < 1 for t in args.threads or []):
        parser.error("--threads wants positive thread counts")
    if args.threads and args.torch_threads:
        parser.error("--threads and --torch-threads contradict each other: give one")
    default_threads = torch.get_num_threads()
    if args.threads is None:
        args.threads = [phases.CPU_THREADS if device == "cpu" and not args.torch_threads else default_threads]
    started = time.perf_counter()
    runs = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name) if device == "cpu" else None
        if args.tiny:
            lm = build_tiny_model(device=device, dtype=dtype)
        else:
            lm = load_phase_model(device=device, dtype=dtype, verbose=not args.json)
        for threads in args.threads:
            torch.set_num_threads(threads)
            roofs = None
            for path in args.paths if device == "cpu" else [kernels.STOCK]:
                if path == kernels.PACKED and (reason := kernels.packed_path_available(lm.model)):
                    print(f"skipping {path}: {reason}", file=sys.stderr)
                    continue
                figures = phases.measure_phases(lm, quick=args.quick, path=path, roofs=roofs, context=args.context)
                roofs = figures.roofs  # one roof measurement per dtype and thread count
                runs.append(figures.to_dict())
                if not args.json:
                    _print_table(figures)
        del lm
    if not runs:
        print("nothing was measured", file=sys.stderr)
        return 1
    if args.json:
        first = dict(runs[0])
        first["wall_seconds"] = time.perf_counter() - started
        first["runs"] = runs
        print(json.dumps(first, indent=2))
    else:
        print(f"\n{len(runs)} configuration(s) in {time.perf_counter() - started:.0f} s")
    return 0


def _print_table(f: phases.PhaseFigures) -> None:
    d = f.to_dict()
    print(f"\n== {d['model']} ({d['model_params'] / 1e6:.0f} M parameters, {d['dtype']}) on {d['device']}, "
          f"kernel path {d['kernel_path']}")  # fmt: skip
    print(
        f"roofs: {d['measured_bandwidth_gbs']:.1f} GB/s, {d['measured_flops_gflops']:.0f} GFLOP/s ({d['roofs_source']})"
    )
    print(f"decode, {f.context} cached tokens per sequence, eager:")
    for line in f.decode_lines(graph=False):
        print("  " + line)
    if f.decode_graph:
        print("decode, CUDA-graph replays of a static-cache step (the launch overhead removed):")
        for line in f.decode_lines(graph=True):
            print("  " + line)
    print(f"CUDA graph: {f.graph_note}")
    print("prefill:")
    for line in f.prefill_lines():
        print("  " + line)
    observed = d["free_batch_observed"]
    ratio8 = d["decode_step_ratio_batch8"]
    batch8 = f"batch 8 at {ratio8:.2f}x batch 1 (<= 1.5x)" if ratio8 is not None else "batch 8 not measured"
    print(
        f"targets ({d['decode_headline']} decode): decode batch 1 at {d['decode_bandwidth_fraction']:.0%} of the "
        f"bandwidth (>= 50 %); {batch8}; "
        f"prefill at {d['prefill_flops_fraction']:.0%} of the matmul roof (>= 50 %)"
    )
    print(
        f"step stops being nearly free (> {phases.FREE_RATIO}x batch 1): predicted at batch "
        f"{d['free_batch_predicted']:.0f}, observed "
        + (f"at batch {observed:.1f}" if observed is not None else "beyond the sweep")
    )
    print(f.noise_check())


if __name__ == "__main__":
    sys.exit(main())
