"""Grade a class of module-1 submissions end to end and print seconds per submission by worker count.

    .venv/bin/python benchmarks/grading.py                  # 30 submissions, 1 and 2 workers
    .venv/bin/python benchmarks/grading.py --workers 1 2 4 --students 30

The class is built from module 1 (solutions/m1_prefill_decode): solutions, blank notebooks, the
answer fixtures of tests/fixtures/answers/ (plausible wrong answers, answers calling the library's
reference, noisy correct answers), and copies damaged the way Colab and students damage them
("Copy of" names, Colab's nbformat 4.0, stripped metadata). They are zipped like a Moodle download
and run through every step of the pipeline (collect, repair, sandboxed grade, feedback, export) in
a fresh course directory per worker count. Each submission runs the whole module-1 notebook in
quick mode, as autograding does. The target is at most 10 s per submission on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autograder import notebooks  # noqa: E402
from autograder.collect import collect  # noqa: E402
from autograder.export import export  # noqa: E402
from autograder.feedback import generate_feedback  # noqa: E402
from autograder.pipeline import Course, grade, repair_submissions  # noqa: E402
from autograder.release import generate  # noqa: E402
from autograder.sandbox import bwrap_problem  # noqa: E402

ASSIGNMENT = "m1_prefill_decode"
NAME = "prefill_decode.ipynb"
FIXTURES = ROOT / "tests" / "fixtures" / "answers" / ASSIGNMENT


def fixture_answers(path: Path) -> dict[str, str]:
    chunks = re.split(r"(?m)^(?=# EXERCISE: )", path.read_text())[1:]
    return {notebooks.MARKER.match(chunk.split("\n", 1)[0]).group(2): chunk.strip("\n") for chunk in chunks}


def damaged(nb, kind: str):
    nb = copy.deepcopy(nb)
    if kind == "stripped":
        for cell in nb.cells:
            cell.metadata.pop("nbgrader", None)
    elif kind == "colab":
        nb.nbformat_minor = 0
        nb.metadata["colab"] = {"provenance": []}
        for number, cell in enumerate(nb.cells):
            cell.pop("id", None)
            cell.metadata["id"] = f"c{number}"
    return nb


def build_class(release, source, students: int) -> bytes:
    """A Moodle-style zip of ``students`` submissions cycling through answers and damage."""
    solution = notebooks.answer_sources(source)
    variants = [("solution", {})]
    variants += [(path.stem, fixture_answers(path)) for path in sorted(FIXTURES.glob("*.py"))]
    variants.append(("blank", None))
    damage = ["none", "copy", "colab", "stripped", "none"]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for number in range(students):
            label, answers = variants[number % len(variants)]
            nb = release if answers is None else notebooks.with_answers(release, {**solution, **answers})
            kind = damage[number % len(damage)]
            file_name = f"Copy of {NAME}" if kind == "copy" else NAME
            folder = f"Student {number:02d} {label}_{1000 + number}_assignsubmission_file_"
            archive.writestr(f"{folder}/{file_name}", json.dumps(damaged(nb, kind)))
    return buffer.getvalue()


def run_once(workers: int, students: int, sandbox: str, base: Path) -> dict[str, float]:
    course_root = base / f"course-{workers}"
    shutil.copytree(ROOT / "solutions" / ASSIGNMENT, course_root / "solutions" / ASSIGNMENT)
    generate(course_root, [ASSIGNMENT], f"sqlite:///{course_root / 'gradebook.db'}")
    release = notebooks.read(course_root / "modules" / ASSIGNMENT / NAME)
    download = base / f"class-{workers}.zip"
    download.write_bytes(build_class(release, notebooks.read(course_root / "solutions" / ASSIGNMENT / NAME), students))
    course = Course(course_root)
    times: dict[str, float] = {}
    started = time.perf_counter()
    report = collect(download, course_root, [ASSIGNMENT], "moodle")
    times["collect"] = time.perf_counter() - started
    assert len(report.collected) == students, report.table()
    step = time.perf_counter()
    repair_submissions(course, ASSIGNMENT)
    times["repair"] = time.perf_counter() - step
    step = time.perf_counter()
    results = grade(course, ASSIGNMENT, workers=workers, sandbox=sandbox, progress=True)
    times["grade"] = time.perf_counter() - step
    step = time.perf_counter()
    generate_feedback(course, ASSIGNMENT)
    times["feedback"] = time.perf_counter() - step
    step = time.perf_counter()
    exported, _, _ = export(course, ASSIGNMENT)
    times["export"] = time.perf_counter() - step
    times["total"] = time.perf_counter() - started
    times["graded"] = sum(r.status == "graded" for r in results)
    times["per_job_mean"] = sum(r.seconds for r in results) / len(results)
    print(exported.table(), file=sys.stderr)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sandbox", default="auto", choices=["auto", "bwrap", "none"])
    args = parser.parse_args()
    mode = "none" if args.sandbox == "none" or (args.sandbox == "auto" and bwrap_problem()) else "bwrap"
    print(
        f"{args.students} module-1 submissions end to end; {os.cpu_count()} CPUs; sandbox: {mode}; "
        f"load average before: {os.getloadavg()[0]:.1f}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="grading-benchmark-") as tmp:
        for workers in args.workers:
            times = run_once(workers, args.students, mode, Path(tmp))
            rows.append((workers, times))
            print(f"  workers={workers}: done, load average now {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"\n{'workers':>7} {'collect':>8} {'repair':>7} {'grade':>7} {'feedback':>9} {'export':>7} {'total':>7} "
        f"{'s/submission':>13} {'job mean':>9} {'speed-up':>9}"
    )
    base_workers, base = min(rows, key=lambda row: row[0])
    base_total = base["total"]
    for workers, t in rows:
        print(
            f"{workers:7d} {t['collect']:8.1f} {t['repair']:7.1f} {t['grade']:7.1f} {t['feedback']:9.1f} "
            f"{t['export']:7.1f} {t['total']:7.1f} {t['total'] / args.students:13.2f} {t['per_job_mean']:9.1f} "
            f"{base_total / t['total']:8.2f}x"
        )
    print(
        "(seconds; s/submission = total end-to-end time / submissions; job mean = one student's sandboxed "
        f"grading, wall clock; speed-up against {base_workers} worker(s))"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
