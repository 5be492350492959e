"""Time every solution notebook top to bottom, in full mode (what learners run) and quick mode
(what the tests run), plus how fast the tiny model is ready. Prints the figures; asserts nothing.

    .venv/bin/python benchmarks/notebook_runtime.py [--quick-only]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_notebook(path: Path, quick: bool) -> tuple[float, list[str]]:
    """Execute a copy of the notebook in a fresh kernel; returns (seconds, errors)."""
    import nbformat
    from nbclient import NotebookClient

    os.environ["COURSE_QUICK"] = "1" if quick else "0"
    nb = nbformat.read(str(path), as_version=4)
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path.parent)}}
    )
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    errors = [
        f"cell {i}: {o.ename}: {o.evalue}"
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    ]
    return seconds, errors


def tiny_model_ready_seconds() -> str:
    """Import cost and build cost of the tiny model, in a fresh interpreter."""
    code = (
        "import time; t0 = time.perf_counter()\n"
        "import torch, transformers\n"
        "from course.models import build_tiny_model\n"
        "t1 = time.perf_counter(); build_tiny_model(); t2 = time.perf_counter()\n"
        "print(f'imports {t1 - t0:.2f} s, tiny model built in {t2 - t1:.2f} s')"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick-only", action="store_true", help="skip the full-mode runs")
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; {tiny_model_ready_seconds()}")
    failed = False
    for path in sorted((ROOT / "solutions").glob("*/*.ipynb")):
        for quick in [True] if args.quick_only else [False, True]:
            seconds, errors = run_notebook(path, quick)
            mode = "quick" if quick else "full"
            problems = f"  ERRORS: {'; '.join(errors)}" if errors else ""
            print(f"{path.relative_to(ROOT)}  {mode:5s} mode: {seconds:6.1f} s{problems}")
            failed |= bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
