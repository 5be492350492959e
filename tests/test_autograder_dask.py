"""Grading a class on a Dask cluster: a real ``dask scheduler`` and ``dask worker`` processes on 127.0.0.1.

A class of tiny students (tests/helpers.py) is graded on the cluster while a worker is killed in
the middle of a job, and while the scheduler itself is killed and restarted; the gradebook and
grades.csv must hold every student once with the scores a local run gives the same class. Workers
that cannot grade as this machine would (no bubblewrap, not root, another course version) stop the
run before any job, named with the fix; a second run of the same class is refused.

Every wait is on a condition (a port that answers, a worker count, a sandbox process), bounded.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from distributed import Client, Lock  # noqa: E402
from helpers import CORRECT, TINY_ASSIGNMENT, submit, tiny_course  # noqa: E402
from test_autograder_postgres import postgres  # noqa: E402, F401  (the fixture: a throwaway PostgreSQL server)

from autograder import cli, pipeline  # noqa: E402
from autograder.cluster import _lock_name  # noqa: E402
from autograder.sandbox import bwrap_problem  # noqa: E402

pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no grading sandbox: {bwrap_problem()}")

BIN = Path(sys.executable).parent
WRONG = "# EXERCISE: ex1_1\ndef add(a, b):\n    return a - b"
HALF = "# EXERCISE: ex1_1\ndef add(a, b):\n    return int(a + b)"  # passes 1 + 2, fails the float test
CLASS = {"alice": CORRECT, "bob": WRONG, "carol": HALF, "dave": CORRECT}
WAIT_S = 120


def _until(condition, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """A scheduler and worker processes on 127.0.0.1, each a process this test started (and stops)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.port = _free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        self.scheduler: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self.client: Client | None = None

    def _spawn(self, args: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        with open(self.folder / log, "ab") as out:
            return subprocess.Popen(
                [str(BIN / "dask"), *args], stdout=out, stderr=subprocess.STDOUT, env=env or dict(os.environ)
            )

    def start_scheduler(self) -> None:
        self.scheduler = self._spawn(
            ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"], "scheduler.log"
        )

        def answers():
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            except OSError:
                return False

        _until(answers, f"the scheduler on port {self.port}")

    def start_worker(self, env: dict | None = None, prefix: list[str] = (), folder: Path | None = None):
        local = folder or self.folder / f"w{len(self.workers)}"
        local.mkdir(exist_ok=True)
        args = ["worker", self.address, "--nthreads", "1", "--no-nanny", "--no-dashboard", "--host", "127.0.0.1"]
        args += ["--local-directory", str(local)]
        if prefix:
            with open(self.folder / "workers.log", "ab") as out:
                worker = subprocess.Popen(
                    [*prefix, str(BIN / "dask"), *args], stdout=out, stderr=subprocess.STDOUT, env=env
                )
        else:
            worker = self._spawn(args, "workers.log", env)
        self.workers.append(worker)
        return worker

    def connect(self) -> Client:
        if self.client is None:
            self.client = Client(self.address, timeout=60, set_as_default=False)
        return self.client

    def wait_for_workers(self, count: int) -> dict:
        def enough():
            info = self.connect().scheduler_info(n_workers=-1)["workers"]
            return info if len(info) == count else None

        return _until(enough, f"{count} worker(s) registered")

    def worker_address(self, process: subprocess.Popen) -> str:
        pids = self.connect().run(os.getpid, on_error="return")
        return next(address for address, pid in pids.items() if pid == process.pid)

    def stop(self, process: subprocess.Popen) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        for process in [*self.workers, self.scheduler]:
            if process is not None:
                self.stop(process)


@pytest.fixture
def cluster(tmp_path):
    made = Cluster(tmp_path)
    try:
        made.start_scheduler()
        yield made
    finally:
        made.close()


def _class_course(root: Path, db_url: str | None = None):
    course = tiny_course(root, db_url)
    for student, body in CLASS.items():
        submit(course, student, body)
    return course


@pytest.fixture(scope="module")
def local_csv(tmp_path_factory) -> list[dict]:
    """grades.csv of the class graded on this machine, the local way."""
    root = tmp_path_factory.mktemp("local")
    _class_course(root)
    assert cli.main(["--root", str(root), "grade", TINY_ASSIGNMENT]) == 0
    assert cli.main(["--root", str(root), "export", TINY_ASSIGNMENT]) == 0
    rows = _csv(root)
    assert {row["student"]: row["total"] for row in rows} == {
        "alice": "2.0",
        "bob": "0.0",
        "carol": "1.0",
        "dave": "2.0",
    }
    return rows


def _csv(root: Path) -> list[dict]:
    with open(root / "grading" / TINY_ASSIGNMENT / "grades.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _gradebook_submissions(root: Path) -> list[str]:
    """One entry per submission row of the tiny assignment in the SQLite gradebook (duplicates would show)."""
    with sqlite3.connect(root / "gradebook.db") as db:
        rows = db.execute(
            "SELECT student.id FROM submitted_assignment JOIN assignment ON assignment.id = "
            "submitted_assignment.assignment_id JOIN student ON student.id = submitted_assignment.student_id "
            "WHERE assignment.name = ?",
            (TINY_ASSIGNMENT,),
        ).fetchall()
    return sorted(student for (student,) in rows)


def _sandboxes_of(pid: int) -> bool:
    """Whether process ``pid`` has a bubblewrap sandbox among its children (a job is being graded there)."""
    import psutil

    try:
        return any(child.name() == "bwrap" for child in psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return False


def test_a_worker_killed_mid_job_costs_no_grade_and_the_class_matches_a_local_run(cluster, tmp_path, local_csv):
    first, second = cluster.start_worker(), cluster.start_worker()
    cluster.wait_for_workers(2)
    root = tmp_path / "course"
    _class_course(root)
    outcome = {}
    run = threading.Thread(
        target=lambda: outcome.setdefault(
            "code", cli.main(["--root", str(root), "grade", TINY_ASSIGNMENT, "--scheduler", cluster.address])
        )
    )
    run.start()
    try:
        # Kill the first worker while a student's sandbox runs in it (its job is half done). A sandbox
        # alone is not enough: the pre-flight check runs bubblewrap on every worker before any job, so
        # wait until the scheduler also says a job is processing there.
        victim = cluster.worker_address(first)
        held = {}

        def job_in_sandbox() -> bool:
            if not _sandboxes_of(first.pid):
                return False
            held["keys"] = cluster.connect().processing(workers=[victim])[victim]
            return bool(held["keys"])

        _until(job_in_sandbox, "a student's job in the first worker's sandbox")
        running = held["keys"]
        cluster.stop(first)
    finally:
        run.join(timeout=600)
    assert outcome.get("code") == 0, "the run failed (see the output above)"
    killed = [s for s in CLASS if any(f"-{s}-" in str(key) for key in running)]
    assert killed, f"the killed worker held no student's job: {running}"
    survivor = cluster.worker_address(second)
    for student in killed:
        log = (root / "grading" / TINY_ASSIGNMENT / "logs" / f"{student}.log").read_text()
        assert log.startswith(f"graded on Dask worker {survivor}"), f"{student}'s killed job was not graded elsewhere"
    assert cli.main(["--root", str(root), "export", TINY_ASSIGNMENT]) == 0
    assert _csv(root) == local_csv, "the cluster's grades.csv differs from the local run's"
    assert _gradebook_submissions(root) == sorted(CLASS), "every student exactly once in the gradebook"
    assert sorted(p.name for p in (root / "autograded").iterdir()) == sorted(CLASS)
    from autograder.cluster import jobs_root

    left = sorted(p.name for p in jobs_root().glob(f"job-{first.pid}-*"))
    assert not left, f"the killed worker's job folder (a gradebook with the hidden tests) is still there: {left}"


def test_a_class_graded_on_the_cluster_lands_in_a_postgresql_gradebook(cluster, tmp_path, local_csv, postgres):  # noqa: F811
    """The cluster's usual gradebook: scores merged into PostgreSQL, once per student, as a local run's."""
    from nbgrader.api import Gradebook

    cluster.start_worker()
    cluster.wait_for_workers(1)
    root = tmp_path / "course"
    _class_course(root, db_url=postgres)
    grade = ["--root", str(root), "grade", TINY_ASSIGNMENT, "--scheduler", cluster.address, "--db-url", postgres]
    assert cli.main(grade) == 0
    assert cli.main(["--root", str(root), "export", TINY_ASSIGNMENT, "--db-url", postgres]) == 0
    assert _csv(root) == local_csv, "the cluster's grades.csv (PostgreSQL) differs from the local run's"
    with Gradebook(postgres) as gradebook:
        submissions = [s.student.id for s in gradebook.find_assignment(TINY_ASSIGNMENT).submissions]
    assert sorted(submissions) == sorted(CLASS), "every student exactly once in the PostgreSQL gradebook"
    assert not (root / "gradebook.db").exists(), "the SQLite default must not be used"


def _closed_to_others(path: Path) -> Path | None:
    """The first folder on ``path``'s way down that other users cannot enter (no o+x), or None."""
    for folder in [*reversed(path.resolve().parents), path.resolve()]:
        if not folder.stat().st_mode & 0o001:
            return folder
    return None


def test_workers_that_cannot_grade_are_named_before_any_job_runs(cluster, tmp_path, capsys, request):
    # The non-root worker runs this checkout's Python as uid 65534: a checkout inside a folder only its owner can
    # enter (a clone made in `mktemp -d`, mode 700) cannot start it at all, which is not what this test is about.
    if closed := _closed_to_others(Path(sys.executable).parent):
        pytest.skip(f"uid 65534 cannot enter {closed} (mode {closed.stat().st_mode & 0o777:o}) to run {sys.executable}")
    good = cluster.start_worker()
    # No bubblewrap on its PATH.
    no_bwrap = cluster.start_worker(env={**os.environ, "PATH": str(BIN)})
    # Another course version: a copy of the autograder with one changed file first on its path.
    other = tmp_path / "other-version"
    shutil.copytree(Path(pipeline.__file__).parent, other / "autograder", ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "autograder" / "export.py", "a") as handle:
        handle.write("\n# a newer release of the course\n")
    old = cluster.start_worker(env={**os.environ, "PYTHONPATH": str(other)})
    # Not root (its folders outside the root-only pytest folder).
    home = Path(tempfile.mkdtemp(prefix="autograder-dask-nobody-"))
    request.addfinalizer(lambda: shutil.rmtree(home, ignore_errors=True))
    os.chmod(home, 0o777)
    nobody = cluster.start_worker(
        env={**os.environ, "HOME": str(home)},
        prefix=["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"],
        folder=home,
    )
    cluster.wait_for_workers(4)
    names = {p: cluster.worker_address(p) for p in (good, no_bwrap, old, nobody)}
    root = tmp_path / "course"
    _class_course(root)
    capsys.readouterr()
    code = cli.main(["--root", str(root), "grade", TINY_ASSIGNMENT, "--scheduler", cluster.address])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "3 of 4 worker(s)" in err and "no student was graded" in err, err
    lines = {line.strip() for line in err.splitlines()}
    assert any(line.startswith(names[no_bwrap]) and "apt-get install bubblewrap" in line for line in lines), err
    assert any(line.startswith(names[old]) and "course version" in line and "same checkout" in line for line in lines)
    assert any(line.startswith(names[nobody]) and "needs root" in line for line in lines), err
    assert not any(line.startswith(names[good]) for line in lines), err
    assert _gradebook_submissions(root) == [] and not (root / "autograded").exists()
    assert not (root / "grading" / TINY_ASSIGNMENT / "results").exists()


def test_a_restarted_scheduler_resumes_the_run_and_skips_those_already_graded(cluster, tmp_path, monkeypatch):
    cluster.start_worker()
    cluster.wait_for_workers(1)  # one job at a time: the restart comes with students left to grade
    root = tmp_path / "course"
    course = _class_course(root)
    stored: list[str] = []
    store = pipeline.store

    def counted(course, assignment, result, timestamp):
        stored.append(result.student)
        store(course, assignment, result, timestamp)

    monkeypatch.setattr(pipeline, "store", counted)
    first_done = threading.Event()
    outcome = {}

    def grade():
        try:
            outcome["results"] = pipeline.grade(
                course, TINY_ASSIGNMENT, scheduler=cluster.address, on_result=lambda result: first_done.set()
            )
        except BaseException as err:  # noqa: BLE001 (reported by the test)
            outcome["error"] = err

    run = threading.Thread(target=grade)
    run.start()
    try:
        assert first_done.wait(WAIT_S), "no student was graded"
        cluster.client.close()
        cluster.client = None
        cluster.stop(cluster.scheduler)  # the scheduler dies; its workers go with it
        for worker in cluster.workers:
            cluster.stop(worker)
        cluster.start_scheduler()  # the cluster comes back at the same address
        cluster.start_worker()
    finally:
        run.join(timeout=600)
    assert "error" not in outcome, f"the run did not survive the restart: {outcome.get('error')!r}"
    assert sorted(stored) == sorted(CLASS), f"every student merged exactly once: {stored}"
    new_worker = cluster.worker_address(cluster.workers[-1])
    logs = {s: (root / "grading" / TINY_ASSIGNMENT / "logs" / f"{s}.log").read_text() for s in CLASS}
    after = {s for s, log in logs.items() if log.startswith(f"graded on Dask worker {new_worker}")}
    assert stored[0] not in after, f"{stored[0]}, graded before the restart, was graded again after it"
    assert after, "the restart came after the class was done: nothing was left to resume"
    assert all(log.startswith("graded on Dask worker tcp://127.0.0.1:") for log in logs.values())
    totals = {r.student: sum(g["auto_score"] for g in r.grades["tiny.ipynb"].values()) for r in outcome["results"]}
    assert totals == {"alice": 2.0, "bob": 0.0, "carol": 1.0, "dave": 2.0}
    assert _gradebook_submissions(root) == sorted(CLASS)


def test_the_same_class_graded_twice_at_once_is_refused(cluster, tmp_path, capsys):
    import dask

    cluster.start_worker()
    cluster.wait_for_workers(1)
    course = _class_course(tmp_path / "course")
    # On one machine: the course lock (here held by another thread, as by another process).
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with course.exclusive("grade tiny --scheduler"):
            entered.set()
            leave.wait(WAIT_S)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(WAIT_S)
        code = cli.main(["--root", str(course.root), "grade", TINY_ASSIGNMENT, "--scheduler", cluster.address])
    finally:
        leave.set()
        holder.join(WAIT_S)
    assert code == 2 and "another autograder run is using the course" in capsys.readouterr().err
    # From another machine (another copy of the course) into the same gradebook: the cluster's lock.
    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    copies = [_class_course(tmp_path / f"copy{i}", shared) for i in range(2)]
    lock = Lock(
        _lock_name(copies[0], TINY_ASSIGNMENT), scheduler_rpc=cluster.connect().scheduler, loop=cluster.client.loop
    )
    assert lock.acquire(timeout=30)
    try:
        with dask.config.set({"scheduler-address": cluster.address}):  # --scheduler config: dask's own setting
            code = cli.main(
                ["--root", str(copies[1].root), "grade", TINY_ASSIGNMENT, "--scheduler", "config", "--db-url", shared]
            )
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert code == 2 and "another autograder run is grading tiny into the gradebook" in err, err
    assert not (copies[1].root / "autograded").exists(), "the refused run graded someone"


def test_job_folders_of_processes_that_are_gone_are_removed(tmp_path):
    from autograder.cluster import _process_tag, sweep_stale_jobs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = tmp_path / f"job-{os.getpid()}-{_process_tag(os.getpid())}-abc"
    gone = tmp_path / f"job-{dead.pid}-{_process_tag(os.getpid())}-def"  # its pid may be reused: tagged apart
    reused = tmp_path / f"job-{os.getpid()}-1-ghi"  # this pid, but another process's start time
    for folder in (mine, gone, reused):
        (folder / "in").mkdir(parents=True)
        (folder / "in" / "gradebook.db").write_text("hidden tests")
    removed = sweep_stale_jobs(tmp_path)
    assert sorted(removed) == sorted([gone.name, reused.name])
    assert mine.is_dir() and not gone.exists() and not reused.exists()


def test_bad_cluster_options_are_clear_errors(tmp_path, capsys):
    import dask

    root = tmp_path / "course"
    _class_course(root)
    code = cli.main(
        ["--root", str(root), "grade", TINY_ASSIGNMENT, "--scheduler", "tcp://127.0.0.1:1", "--workers", "2"]
    )
    assert code == 2 and "--workers is for grading on this machine" in capsys.readouterr().err
    with dask.config.set({"scheduler-address": None}):
        code = cli.main(["--root", str(root), "grade", TINY_ASSIGNMENT, "--scheduler", "config"])
    err = capsys.readouterr().err
    assert code == 2 and "DASK_SCHEDULER_ADDRESS" in err and "--scheduler tcp://HOST:PORT" in err, err
    assert not (root / "autograded").exists()
