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

On a Dask cluster (``autograder grade --scheduler``): the same class, graded through the scheduler.

    .venv/bin/python benchmarks/grading.py --scheduler local --cluster-workers 1 2 4 --students 12
    .venv/bin/python benchmarks/grading.py --scheduler tcp://HOST:PORT --students 200

``local`` starts a ``dask scheduler`` and N ``dask worker --nthreads 1`` processes on 127.0.0.1 for
each N (and stops them); an address uses that cluster as it is. It prints students per minute by
worker processes, the overhead per job (a no-op job's round trip with a module-1 job's payload, the
staging on the worker, and each worker slot's time per job outside the sandbox), the merge time per
student on this machine, and a paper estimate of the cluster a 5,000-student, five-module class
needs to be graded overnight, from the measured per-job cost.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import math
import os
import re
import shutil
import subprocess
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


def run_once(workers: int, students: int, sandbox: str, base: Path, scheduler: str | None = None) -> dict[str, float]:
    course_root = base / (f"course-{workers}" if scheduler is None else f"course-cluster-{workers}")
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
    if scheduler is None:
        results = grade(course, ASSIGNMENT, workers=workers, sandbox=sandbox, progress=True)
    else:
        results = grade(course, ASSIGNMENT, sandbox=sandbox, progress=True, scheduler=scheduler)
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
    if scheduler is not None:
        on_worker = [r.timings["on_worker_s"] for r in results if "on_worker_s" in r.timings]
        times["on_worker_mean"] = sum(on_worker) / max(1, len(on_worker))
        times["merge_mean"] = sum(r.timings.get("merge_s", 0.0) for r in results) / len(results)
    print(exported.table(), file=sys.stderr)
    return times


# --- on a Dask cluster --------------------------------------------------------------------------------

CLASS_STUDENTS, CLASS_MODULES, NIGHT_S = 5000, 5, 8 * 3600


class LocalCluster:
    """A ``dask scheduler`` and ``workers`` worker processes (one thread each) on 127.0.0.1."""

    def __init__(self, workers: int, folder: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        dask = str(Path(sys.executable).parent / "dask")
        log = open(folder / f"dask-{workers}.log", "ab")  # noqa: SIM115 (closed with the processes)
        self.log = log
        self.processes = [
            subprocess.Popen(
                [dask, "scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        ]
        self.processes += [
            subprocess.Popen(
                [dask, "worker", self.address, "--nthreads", "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1"]
                + ["--local-directory", str(folder / f"worker-{workers}-{n}")],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            for n in range(workers)
        ]
        from distributed import Client

        with Client(self.address, timeout=120, set_as_default=False) as client:
            client.wait_for_workers(workers, timeout=300)

    def close(self) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.log.close()


def dispatch_round_trip(address: str, payload_bytes: int, jobs: int = 40) -> float:
    """Mean seconds from submit to result of a no-op job carrying ``payload_bytes`` each way, one at a time."""
    from distributed import Client

    from autograder.cluster import _same

    data = os.urandom(payload_bytes)
    with Client(address, timeout=120, set_as_default=False) as client:
        client.submit(_same, b"", pure=False).result()  # warm the connection
        started = time.perf_counter()
        for _ in range(jobs):
            client.submit(_same, data, pure=False).result()
        return (time.perf_counter() - started) / jobs


def cluster_threads(address: str) -> int:
    from distributed import Client

    with Client(address, timeout=120, set_as_default=False) as client:
        return sum(w["nthreads"] for w in client.scheduler_info(n_workers=-1)["workers"].values())


def cluster_main(args, mode: str) -> int:
    release_bytes = (ROOT / "modules" / ASSIGNMENT / NAME).stat().st_size
    print(
        f"{args.students} module-1 submissions graded through a Dask scheduler; {os.cpu_count()} CPUs here; "
        f"sandbox: {mode}; load average before: {os.getloadavg()[0]:.1f}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="grading-benchmark-") as tmp:
        counts = args.cluster_workers if args.scheduler == "local" else [None]
        for count in counts:
            cluster = LocalCluster(count, Path(tmp)) if count else None
            address = cluster.address if cluster else args.scheduler
            try:
                threads = cluster_threads(address)
                times = run_once(threads, args.students, mode, Path(tmp), scheduler=address)
                template = next(Path(tmp).glob(f"course-cluster-{threads}/grading/{ASSIGNMENT}/template/*.db"))
                payload = template.stat().st_size + release_bytes
                times["round_trip"] = dispatch_round_trip(address, payload)
                times["payload"] = payload
            finally:
                if cluster:
                    cluster.close()
            rows.append((threads, times))
            print(f"  {threads} worker process(es): done, load average now {os.getloadavg()[0]:.1f}", flush=True)
    print(
        f"\n{'workers':>7} {'grade s':>8} {'students/min':>13} {'job s':>6} {'on worker':>10} {'slot s/job':>11} "
        f"{'outside':>8} {'round trip':>11} {'merge':>6} {'total s':>8}"
    )
    for threads, t in rows:
        slot = t["grade"] * threads / args.students  # each worker slot's seconds per student
        print(
            f"{threads:7d} {t['grade']:8.1f} {60 * args.students / t['grade']:13.1f} {t['per_job_mean']:6.1f} "
            f"{t['on_worker_mean']:10.2f} {slot:11.2f} {slot - t['per_job_mean']:8.2f} {t['round_trip']:11.3f} "
            f"{t['merge_mean']:6.3f} {t['total']:8.1f}"
        )
    print(
        "(grade s: the grading step's wall clock; job s: one student's sandboxed run (run_job) on the worker; on "
        "worker: the job's whole time there, staging the bytes included; slot s/job: grade s x workers / students; "
        "outside: slot s/job - job s, the overhead per job of the scheduler, transfers, staging and the idle tail; "
        f"round trip: a no-op job carrying a module-1 payload ({rows[0][1]['payload'] / 1024:.0f} KiB) each way, "
        "submit to result; merge: this machine's gradebook merge per student, one at a time)"
    )
    estimate(rows, args.students)
    return 0


def estimate(rows, students: int) -> None:
    """A paper estimate of the cluster for CLASS_STUDENTS x CLASS_MODULES jobs in one night."""
    cpus = os.cpu_count() or 1
    # Core-seconds per job: the grading wall clock times this machine's cores (all given to grading), per
    # student, from the fastest row (the kernels' math threads may use every core even with one worker).
    threads, t = min(rows, key=lambda row: row[1]["grade"])
    core_s = t["grade"] * cpus / students
    jobs = CLASS_STUDENTS * CLASS_MODULES
    cores = jobs * core_s / NIGHT_S
    headroom = 1.5  # retries after dead workers, stragglers, heavier modules than module 1
    slot_gib = 4 + 1  # a kernel's memory limit (4 GiB) plus nbgrader and the worker
    node_cores, node_gib = 16, 64
    slots_per_node = min(node_cores, node_gib // slot_gib)
    slots = cores * headroom
    nodes = math.ceil(slots / slots_per_node)
    merge = jobs * t["merge_mean"]
    print(
        f"\nPaper estimate for {CLASS_STUDENTS:,} students x {CLASS_MODULES} modules = {jobs:,} jobs overnight "
        f"({NIGHT_S / 3600:.0f} h), from the measured cost of a module-1 job ({core_s:.1f} core-seconds, the "
        f"{threads}-worker row on {cpus} cores):\n"
        f"  {jobs:,} x {core_s:.1f} s = {jobs * core_s / 3600:,.0f} core-hours -> {cores:.1f} cores busy all night; "
        f"x{headroom} headroom = {slots:.0f} worker threads (--nthreads 1 each, one job at a time)\n"
        f"  each thread may hold a {slot_gib - 1} GiB kernel plus ~1 GiB: {slots * slot_gib:,.0f} GiB in all; "
        f"on {node_cores}-core {node_gib} GiB machines that is {slots_per_node} workers per machine -> {nodes} "
        f"machine(s)\n"
        f"  merging on the machine running autograder: {jobs:,} x {t['merge_mean'] * 1000:.0f} ms = "
        f"{merge / 60:.0f} min of the night, one student at a time (SQLite here; PostgreSQL for a cluster)\n"
        f"  assumes every module costs what module 1 costs; scale the cores by the ratio for heavier modules"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sandbox", default="auto", choices=["auto", "bwrap", "none"])
    parser.add_argument(
        "--scheduler",
        default=None,
        help="grade through Dask: 'local' (a scheduler and --cluster-workers worker processes started here) or "
        "tcp://HOST:PORT of a running cluster",
    )
    parser.add_argument("--cluster-workers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    mode = "none" if args.sandbox == "none" or (args.sandbox == "auto" and bwrap_problem()) else "bwrap"
    if args.scheduler:
        return cluster_main(args, mode)
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
