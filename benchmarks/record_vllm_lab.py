"""Record the vLLM run that module 7 (the final lab) reads: ``course/data/vllm_run/``.

Run it with the oracle environment's interpreter (vLLM's CPU build and the course in one environment)::

    .vllm-venv/bin/python benchmarks/record_vllm_lab.py            # rewrites course/data/vllm_run/
    .vllm-venv/bin/python benchmarks/record_vllm_lab.py --out DIR  # anywhere else

One ``vllm serve`` of the course's tiny model (built offline, seed 0) in float32, with a deliberately
small KV cache (``--kv-cache-memory-bytes``: 16 blocks of 128 tokens) and ``--max-num-queued-reqs 16``,
so that preemption and admission rejections happen on a laptop; the phases of
:func:`course.vllm_lab.record_run`, each followed by a ``/metrics`` snapshot; then the course's own server
on the same model and load. Everything written is what the servers and clients produced (the log, the
Prometheus pages, the client's per-chunk times, ``vllm bench serve``'s detailed JSON and printed table,
the CPU seconds each server used), with the temporary model path replaced by ``<model>``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course import vllm_lab  # noqa: E402
from course.models import save_tiny_model  # noqa: E402
from course.vllm_release import CPU_DISTRIBUTION, VLLM_VERSION  # noqa: E402

MAX_MODEL_LEN = 512
KV_BLOCKS = 16  # of the CPU build's 128 tokens: four requests of max_model_len
MAX_QUEUED = 16


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=vllm_lab.DATA_DIR, help="where to write the run")
    parser.add_argument("--quick", action="store_true", help="the shorter plan (LabPlan.quick)")
    args = parser.parse_args(argv)
    if missing := vllm_lab.vllm_missing():
        print(missing, file=sys.stderr)
        return 2
    model_dir = save_tiny_model(Path(tempfile.mkdtemp(prefix="lab-model-")) / "tiny")
    notes = {
        "recorded_with": ".vllm-venv/bin/python benchmarks/record_vllm_lab.py",
        "vllm": f"{CPU_DISTRIBUTION} {VLLM_VERSION} (vLLM's CPU build on PyPI)",
        "cpu": _cpu_model(),
        "course_commit": _commit(),
        "model": "the course's tiny Llama (course.models.save_tiny_model, seed 0), served in float32",
        "max_num_queued_reqs": MAX_QUEUED,
    }
    plan = vllm_lab.LabPlan.quick() if args.quick else vllm_lab.LabPlan()
    args_ = vllm_lab.lab_serve_args(model_dir, MAX_MODEL_LEN, KV_BLOCKS, MAX_QUEUED)
    run = vllm_lab.record_run(args.out, model_dir, args_, plan=plan, max_model_len=MAX_MODEL_LEN, notes=notes)
    size = sum(p.stat().st_size for p in args.out.iterdir())
    print(f"recorded {len(run.meta['phases'])} phases into {args.out} ({size / 1024:.0f} KiB)")
    print(run.startup.line)
    print(json.dumps({k: run.meta[k] for k in ("cpu_seconds", "wall_seconds")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
