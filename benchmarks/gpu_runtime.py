"""Run the course on a GPU runtime, for real: every solution notebook top to bottom, and module 1's figures.

On a machine with CUDA it executes each ``solutions/*/*.ipynb`` with nbclient (full mode unless
``--quick``; the notebooks then use the GPU and Qwen2.5-0.5B-Instruct from the Hub, or its
architecture with random weights without the Hub), records the seconds and any errors per
notebook, then measures module 1's phase figures on the GPU (``course.phases``) and compares the
achieved decode bandwidth and prefill FLOP/s with the card's datasheet (``course.hardware.GPUS``)
and with its measured roofs. Everything goes to one JSON file.

    .venv/bin/python benchmarks/gpu_runtime.py --out gpu_runtime.json          # on the GPU machine
    .venv/bin/python benchmarks/gpu_runtime.py --dry-run --out /tmp/dry.json   # anywhere: CPU, seconds

``--dry-run`` checks the whole pipeline on a CPU without a GPU: it reads every notebook, checks that
nbclient and a Jupyter kernel are there, and measures the module-1 figures on the tiny model with
quick sweeps (figures that mean nothing; the point is that the script and its JSON work). It
executes no notebook. CI runs it (tests/test_gpu_runtime.py).
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

from course import hardware, phases  # noqa: E402

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
    """Module 1's phase figures on ``device``, with the datasheet comparison where the card is known."""
    from course.models import build_tiny_model, load_phase_model

    lm = build_tiny_model(device=device) if tiny else load_phase_model(device=device)
    figures = phases.measure_phases(lm, quick=quick)
    result = figures.to_dict()
    result["model_source"] = lm.source
    sheet = datasheet_for(figures.roofs.name) if device.startswith("cuda") else None
    if sheet is not None:
        best_prefill = max(figures.prefill, key=lambda t: t.size)
        result["datasheet"] = {
            "name": sheet.name,
            "source": sheet.source,
            "bandwidth_gbs": sheet.bandwidth / 1e9,
            "flops_tflops": sheet.flops / 1e12,
            "decode_bandwidth_fraction_of_datasheet": figures.decode_bandwidth(1) / sheet.bandwidth,
            "prefill_flops_fraction_of_datasheet": figures.prefill_flops_per_s(best_prefill) / sheet.flops,
            "measured_roofs_fraction_of_datasheet": {
                "bandwidth": figures.roofs.bandwidth / sheet.bandwidth,
                "flops": figures.roofs.flops / sheet.flops,
            },
        }
    return result


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_runtime.json"), help="where to write the JSON")
    parser.add_argument("--dry-run", action="store_true", help="CPU check of the pipeline; executes no notebook")
    parser.add_argument("--quick", action="store_true", help="run the notebooks in quick mode")
    args = parser.parse_args(argv)

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
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else f"cpu ({platform.processor() or 'unknown'})",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "notebooks": {},
    }
    import nbformat

    for path in notebooks():
        name = str(path.relative_to(ROOT))
        if args.dry_run:
            nb = nbformat.read(str(path), as_version=4)
            report["notebooks"][name] = {"cells": len(nb.cells), "executed": False}
            continue
        seconds, errors = run_notebook(path, quick=args.quick)
        report["notebooks"][name] = {"seconds": seconds, "errors": errors, "executed": True, "quick": args.quick}
        print(f"{name}: {seconds:.1f} s{'  ERRORS: ' + '; '.join(errors) if errors else ''}", flush=True)
    report["module1"] = module1_figures(device, quick=args.dry_run or args.quick, tiny=args.dry_run)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    failed = any(nb.get("errors") for nb in report["notebooks"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
