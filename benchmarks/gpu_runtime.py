"""Run the course on a GPU runtime, for real: module 1's figures, then every solution notebook top to bottom.

On a machine with CUDA it first measures module 1's phase figures on the GPU (``course.phases``:
Qwen2.5-0.5B-Instruct from the Hub, or its architecture with random weights without the Hub):
decode eagerly and as CUDA-graph replays of a static-cache step (``course.cuda_graphs``), side by side,
plus the same static-cache step run eagerly (which separates what the static cache changes from
what the graph removes), and a check that the graph's logits match the dynamic cache's. It compares
the achieved decode bandwidth and prefill FLOP/s with the card's datasheet
(``course.hardware.GPUS``) and with its measured roofs. Then it executes each
``solutions/*/*.ipynb`` with nbclient (full mode unless ``--quick``) and records the seconds and
any errors per notebook. The JSON file is rewritten after each stage, so a run cut short still
leaves what it measured.

    .venv/bin/python benchmarks/gpu_runtime.py --out gpu_runtime.json          # on the GPU machine
    .venv/bin/python benchmarks/gpu_runtime.py --dry-run --out /tmp/dry.json   # anywhere: CPU, seconds

Then the final lab (module 7): where vLLM's GPU build of the release the course follows
(``course.vllm_release``) is installed, it runs the lab's phases against ``vllm serve`` on the real small
model (``course.models.HUB_MODEL``; the course's tiny model when the Hub cannot be reached) with a KV
cache of 128 blocks of 16 tokens (the 2,048 tokens of the recorded CPU run) and records the lab's figures:
the startup log's KV line, what ``/metrics`` counted in each phase, ``vllm bench serve``'s percentiles and
the simulator's held-out error. Without vLLM the JSON says why.

``--dry-run`` checks the whole pipeline on a CPU without a GPU: it reads every notebook, checks that
nbclient and a Jupyter kernel are there, and measures the module-1 figures on the tiny model with
quick sweeps (figures that mean nothing; the point is that the script and its JSON work), with the
static-cache step run eagerly and checked against the dynamic cache; the CUDA-graph part reports
why it did not run. The lab's figures come from the run recorded with vLLM's CPU build that ships with
the course, through the same code. It executes no notebook and starts no server. CI runs it
(tests/test_gpu_runtime.py). docs/maintainers.md ("Running the course on a GPU machine") gives the one
command a machine without Jupyter runs, with the wheels to carry.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from notebook_runtime import run_notebook  # noqa: E402  (the benchmarks folder is not a package)

from course import cuda_graphs, hardware, phases, vllm_lab  # noqa: E402

# Substrings of torch.cuda.get_device_name() -> the catalogue entry with that card's datasheet.
DATASHEET_NAMES = [
    ("H200", "H200-SXM"),
    ("H100", "H100-SXM"),
    ("A100-SXM4-80GB", "A100-80GB"),
    ("A100 80GB", "A100-80GB"),
    ("A100", "A100-40GB"),
    ("A10G", "A10G"),
    ("L4", "L4"),
    ("T4", "T4"),
]


def datasheet_for(device_name: str) -> hardware.HardwareSpec | None:
    """The catalogue spec of a CUDA device name (e.g. "NVIDIA H100 80GB HBM3"), None when unknown.

    A PCIe H100 matches the SXM datasheet here; the JSON records the device name, so the reader
    can tell (its bandwidth is lower, 2.0 TB/s).
    """
    for needle, name in DATASHEET_NAMES:
        if needle.lower() in device_name.lower():
            return hardware.gpu(name)
    return None


def notebooks() -> list[Path]:
    return sorted((ROOT / "solutions").glob("*/*.ipynb"))


def module1_figures(device: str, quick: bool, tiny: bool) -> dict:
    """Module 1's phase figures on ``device``, with the datasheet comparison where the card is known.

    Beside :meth:`course.phases.PhaseFigures.to_dict`'s keys (eager and CUDA-graph decode side by
    side): ``decode_steps_static_eager`` (the graph's static-cache step without the graph, timed over
    ``decode_steps_per_sweep`` steps per batch size, as each round's eager steps and the graph's
    replays are) and ``static_cache_check`` (largest logit difference from the dynamic cache, graph
    replays where CUDA allows).
    """
    import torch

    from course.models import build_tiny_model, load_phase_model

    lm = build_tiny_model(device=device) if tiny else load_phase_model(device=device)
    steps = phases.STEPS[quick]  # both sweeps time the same steps (a phase timing's n counts rounds, not steps)
    figures = phases.measure_phases(lm, quick=quick, steps=steps)
    result = figures.to_dict()
    result["model_source"] = lm.source
    result["decode_steps_per_sweep"] = steps
    static = cuda_graphs.decode_sweep(lm, [t.size for t in figures.decode], figures.context, steps, graph=False)
    result["decode_steps_static_eager"] = {str(t.size): phases.timing_dict(t) for t in static}
    graph_check = cuda_graphs.graph_unavailable(lm) is None
    with torch.inference_mode():
        max_abs_logit = float(lm.model(lm.random_ids(1, 12, seed=1)).logits.abs().max())
    result["static_cache_check"] = {
        "max_abs_difference": cuda_graphs.max_logit_difference(lm, graph=graph_check),
        "max_abs_logit": max_abs_logit,
        "dtype": str(lm.dtype).removeprefix("torch."),
        "compared": "CUDA-graph replays" if graph_check else "eager static-cache steps",
    }
    sheet = datasheet_for(figures.roofs.name) if device.startswith("cuda") else None
    if sheet is not None:
        best_prefill = max(figures.prefill, key=lambda t: t.size)
        result["datasheet"] = {
            "name": sheet.name,
            "source": sheet.source,
            "bandwidth_gbs": sheet.bandwidth / 1e9,
            "flops_tflops": sheet.flops / 1e12,
            "decode_bandwidth_fraction_of_datasheet": figures.decode_bandwidth(1) / sheet.bandwidth,
            "decode_bandwidth_fraction_of_datasheet_eager": figures.decode_bandwidth(1, graph=False) / sheet.bandwidth,
            "prefill_flops_fraction_of_datasheet": figures.prefill_flops_per_s(best_prefill) / sheet.flops,
            "measured_roofs_fraction_of_datasheet": {
                "bandwidth": figures.roofs.bandwidth / sheet.bandwidth,
                "flops": figures.roofs.flops / sheet.flops,
            },
        }
    return result


# vllm serve on a GPU for the lab: the CPU run's 2,048 KV tokens as 128 blocks of vLLM's CUDA block size
# (16, course.kv.vllm.BLOCK_SIZE), so the same loads preempt and are refused; half the card is plenty for 0.5 B.
LAB_GPU_ARGS = [
    "--max-model-len", "512", "--num-gpu-blocks-override", "128", "--max-num-queued-reqs", "16",
    "--gpu-memory-utilization", "0.5", "--disable-uvicorn-access-log",
]  # fmt: skip


def lab_figures(run: vllm_lab.RecordedRun, device: hardware.HardwareSpec | str = "CPU") -> dict:
    """The lab's figures from a run (live or recorded): the KV line, counters per phase, the benchmark's
    percentiles, the simulator's held-out error and, where the run has it, the reference-server comparison."""
    figures: dict = {
        "recorded_utc": run.meta["recorded_utc"],
        "command": run.meta["command"],
        "startup_line": run.startup.line,
        "counters": {},
        "bench_ms": {f"{q}_{m}": run.bench[f"{q}_{m}_ms"] for m in ("ttft", "tpot", "itl") for q in ("p50", "p99")},
    }
    for phase in run.meta["phases"]:
        c = run.counters(phase)
        figures["counters"][phase] = {
            "prefix_hit_rate": c.prefix_hit_rate,
            "preemptions": c.preemptions,
            "admission_rejections": c.admission_rejections,
        }
    if run.startup.device == "CPU" and (run.root / "model_config.json").exists():
        figures["predicted_line"] = run.predicted_budget().log_line
    figures["heldout_errors"] = vllm_lab.predict_heldout(run, device=device).errors
    if "reference" in run.benches:
        figures["server_comparison"] = vllm_lab.server_comparison(run)
    return figures


def vllm_lab_stage(dry_run: bool, out_dir: Path, device_name: str = "") -> dict:
    """The lab on this runtime: the recorded CPU run's figures on a dry run, a live GPU run when vLLM is
    installed, else why not."""
    if dry_run:
        return {
            "live": False,
            "why": "dry run: the figures of the recorded CPU run",
            **lab_figures(vllm_lab.load_recorded_run()),
        }
    if missing := vllm_lab.vllm_missing():
        return {"live": False, "why": missing}
    from course.models import HUB_MODEL, save_tiny_model

    sheet = datasheet_for(device_name) or hardware.gpu("A100-40GB")
    try:
        run = vllm_lab.record_run(out_dir / "vllm_lab_run", HUB_MODEL, LAB_GPU_ARGS, plan=vllm_lab.LabPlan.quick())
        model = HUB_MODEL
    except (RuntimeError, OSError) as err:  # no Hub: the tiny model, built offline
        print(f"vLLM on {HUB_MODEL} failed ({str(err).splitlines()[0][:200]}); the tiny model instead", flush=True)
        tiny = save_tiny_model(out_dir / "tiny-model")
        run = vllm_lab.record_run(out_dir / "vllm_lab_run", tiny, LAB_GPU_ARGS, plan=vllm_lab.LabPlan.quick())
        model = "the course's tiny model"
    return {"live": True, "model": model, "datasheet_for_the_simulator": sheet.name, **lab_figures(run, sheet)}


def check_jupyter() -> str | None:
    """None when nbclient and a python3 kernel are installed, else what is missing."""
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
        from jupyter_client.kernelspec import KernelSpecManager
    except ImportError as err:
        return f"{err.name} is not installed (pip install nbclient nbformat ipykernel)"
    if "python3" not in KernelSpecManager().find_kernel_specs():
        return "no python3 Jupyter kernel (pip install ipykernel)"
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_runtime.json"), help="where to write the JSON")
    parser.add_argument("--dry-run", action="store_true", help="CPU check of the pipeline; executes no notebook")
    parser.add_argument("--quick", action="store_true", help="run the notebooks in quick mode (figures stay full)")
    parser.add_argument("--skip-notebooks", action="store_true", help="measure module 1's figures only")
    parser.add_argument("--skip-lab", action="store_true", help="leave out the final lab (vLLM itself)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(
            "No CUDA device here: run this on a GPU runtime, or pass --dry-run to check the pipeline.", file=sys.stderr
        )
        return 2
    if problem := check_jupyter():
        print(f"Cannot execute notebooks: {problem}.", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    import nbformat
    import transformers

    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({platform.processor() or 'unknown'})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "notebooks": {},
    }

    def save() -> None:  # after every stage: a run cut short keeps what it measured
        args.out.write_text(json.dumps(report, indent=2))

    started = time.perf_counter()
    report["module1"] = module1_figures(device, quick=args.dry_run, tiny=args.dry_run)
    report["module1"]["seconds"] = time.perf_counter() - started
    save()
    print(_module1_summary(report["module1"]), flush=True)
    for path in [] if args.skip_notebooks else notebooks():
        name = str(path.relative_to(ROOT))
        if args.dry_run:
            nb = nbformat.read(str(path), as_version=4)
            report["notebooks"][name] = {"cells": len(nb.cells), "executed": False}
            continue
        seconds, errors = run_notebook(path, quick=args.quick)
        report["notebooks"][name] = {"seconds": seconds, "errors": errors, "executed": True, "quick": args.quick}
        save()
        print(f"{name}: {seconds:.1f} s{'  ERRORS: ' + '; '.join(errors) if errors else ''}", flush=True)
    save()
    if not args.skip_lab:
        started = time.perf_counter()
        report["vllm_lab"] = vllm_lab_stage(args.dry_run, args.out.resolve().parent, report["device"])
        report["vllm_lab"]["seconds"] = time.perf_counter() - started
        save()
        lab = report["vllm_lab"]
        print(f"final lab: {'live' if lab['live'] else 'not live'} ({lab.get('why') or lab.get('model')})"
              + (f"; {lab['startup_line']}" if "startup_line" in lab else ""), flush=True)  # fmt: skip
    print(f"wrote {args.out}")
    failed = any(nb.get("errors") for nb in report["notebooks"].values())
    return 1 if failed else 0


def _module1_summary(m: dict) -> str:
    """The module-1 figures in three lines: eager and graph decode side by side, prefill."""

    def share(x: float | None) -> str:
        return "not measured" if x is None else f"{x:.0%}"

    def ratio(x: float | None) -> str:
        return "not measured" if x is None else f"{x:.2f}x"

    return "\n".join(
        [
            f"module 1 on {m['device']} ({m['model']}, {m['dtype']}), roofs {m['measured_bandwidth_gbs']:.0f} GB/s, "
            f"{m['measured_flops_gflops']:.0f} GFLOP/s:",
            f"  decode batch 1 at {share(m['decode_bandwidth_fraction_eager'])} of the bandwidth eager, "
            f"{share(m['decode_bandwidth_fraction_graph'])} as CUDA-graph replays; batch 8 at "
            f"{ratio(m['decode_step_ratio_batch8_eager'])} / {ratio(m['decode_step_ratio_batch8_graph'])} batch 1",
            f"  CUDA graph: {m['graph_note']}",
            f"  prefill at {share(m['prefill_flops_fraction'])} of the matmul roof; static cache vs dynamic: "
            f"max |logit difference| {m['static_cache_check']['max_abs_difference']:.2g} "
            f"({m['static_cache_check']['compared']})",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
