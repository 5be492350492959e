"""Grade a class on a Dask cluster: the same per-student job, sandbox and limits, on whichever worker takes it.

``autograder grade ASSIGNMENT --scheduler tcp://HOST:PORT`` (or ``--scheduler config``: the address
dask's configuration names, ``DASK_SCHEDULER_ADDRESS`` or ``scheduler-address`` in
``~/.config/dask/``) sends each student's job to the cluster. Only *where* a job runs changes:

* the job travels whole: the submitted notebooks, the assignment's template gradebook and its extra
  files go with it as bytes (no shared file system needed), and the graded notebooks and scores come
  back the same way. On the worker, :func:`grade_on_worker` stages them in a private temporary
  folder and calls :func:`autograder.sandbox.run_job`, the function a local run calls: the same
  bubblewrap sandbox, the same limits, a kernel uid leased machine-wide (so several worker
  processes on one machine never share one);
* the results are merged on this machine, one student at a time, by
  :func:`autograder.pipeline.store`: the same gradebook (SQLite, or PostgreSQL), feedback and
  export files as a local run.

Exactly one grade per student. A worker killed mid-job: the scheduler gives its job to another
worker (a student whose job kills ``distributed.scheduler.allowed-failures`` + 1 workers is graded
0 and marked for manual grading, like any failed job). The scheduler restarted: the client
reconnects (for as long as dask's ``distributed.comm.timeouts.connect`` allows, at least
:data:`RECONNECT_S`), checks the workers again and resubmits only the students whose results are not
yet in the gradebook. A result arriving twice is merged once. The same run started twice: the
course lock refuses it on this machine, and a cluster-wide lock named after the gradebook and the
assignment refuses a second run from another machine grading into the same gradebook.

Before any job runs, every worker is asked (:func:`worker_report`) for its course version (a hash of
the installed ``autograder`` and ``course`` packages and the nbgrader version), whether it is root
and has a working bubblewrap; any worker that cannot grade exactly as this machine would stops the
run with a message naming the worker and the fix. Jobs only go to the workers that passed, and a
job checks the version again on the worker it lands on, so a class is never graded half in one
course version and half in another.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import queue
import shutil
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from autograder.sandbox import JobResult, Limits, UidLease, bwrap_problem, run_job

RECONNECT_S = 300  # how long a run waits for a restarted scheduler at least
REFRESH_S = 5.0  # how often a run waiting for results looks at the workers


class WrongVersion(RuntimeError):
    """A job landed on a worker whose course version is not the run's (it graded nothing)."""


@functools.cache
def course_version() -> str:
    """A hash of the installed ``autograder`` and ``course`` packages (every file) and nbgrader's version."""
    import nbgrader

    import autograder
    import course

    digest = hashlib.sha256(f"nbgrader {nbgrader.__version__}\n".encode())
    for package in (autograder, course):
        folder = Path(package.__file__).resolve().parent
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                digest.update(f"{package.__name__}/{path.relative_to(folder).as_posix()}\n".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def worker_report() -> dict:
    """What a worker can do (run on every worker before any job); it also removes the job folders that
    workers killed earlier on this machine left behind."""
    sweep_stale_jobs()
    return {
        "host": socket.gethostname(),
        "version": course_version(),
        "sandbox": bwrap_problem(),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count() or 1,
    }


def _same(value):
    return value


def grade_on_worker(payload: dict) -> dict:
    """Grade one student on this worker: stage the job's bytes, run :func:`run_job`, send the results back."""
    started = time.perf_counter()
    where = _worker_address()
    if payload["version"] != course_version():
        raise WrongVersion(
            f"worker {where} ({socket.gethostname()}) has course version {course_version()}, the run "
            f"{payload['version']}: nothing was graded there"
        )
    mode = payload["sandbox"]
    if mode == "bwrap" and bwrap_problem():
        raise WrongVersion(f"worker {where} ({socket.gethostname()}) cannot sandbox: {bwrap_problem()}")
    limits = Limits(**payload["limits"])
    if limits.threads <= 0:  # this machine's cores shared by every worker thread on it (several processes too)
        threads = payload.get("host_threads", {}).get(_host(where)) or _worker_threads()
        limits = dataclasses.replace(limits, threads=max(1, (os.cpu_count() or 1) // threads))
    sweep_stale_jobs()
    with _job_folder() as folder:
        (folder / "submitted").mkdir()
        notebooks = {}
        for name, data in payload["notebooks"].items():
            (folder / "submitted" / name).write_bytes(data)
            notebooks[name] = str(folder / "submitted" / name)
        (folder / "template.db").write_bytes(payload["template"])
        extra = None
        if payload["extra"]:
            extra = folder / "extra"
            for relative, data in payload["extra"].items():
                (extra / relative).parent.mkdir(parents=True, exist_ok=True)
                (extra / relative).write_bytes(data)
        from autograder.sandbox import Job

        job = Job(
            assignment=payload["assignment"],
            student=payload["student"],
            notebooks=notebooks,
            template_db=str(folder / "template.db"),
            extra_files=str(extra) if extra else None,
            timestamp=payload["timestamp"],
            limits=limits,
            bindings=payload.get("bindings") or {},
        )
        lease = UidLease(1) if mode == "bwrap" else None  # machine-wide: other worker processes, other runs
        try:
            result = run_job(job, folder / "job", slot=lease.slots[0] if lease else 0, sandbox=mode)
        finally:
            if lease is not None:
                lease.release()
        data = asdict(result)
        data["autograded"] = {name: Path(path).read_bytes() for name, path in result.autograded.items()}
    data["worker"] = where
    data["worker_seconds"] = time.perf_counter() - started
    return data


JOBS_FOLDER = "autograder-jobs"


def jobs_root() -> Path:
    """Where workers stage their jobs on this machine (root-only): one folder per job, named after the
    worker process that made it, so that the folder of a worker killed mid-job can be told and removed."""
    root = Path(tempfile.gettempdir()) / f"{JOBS_FOLDER}-{os.geteuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    if root.is_symlink() or root.stat().st_uid != os.geteuid():
        raise RuntimeError(f"{root} is not this user's own folder: remove it, then start the worker again")
    os.chmod(root, 0o700)
    return root


def _process_tag(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), which tells it from a later process with
    the same pid; None when no such process exists."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def _job_folder():
    """A fresh, root-only folder for one job, removed afterwards; a worker killed in between leaves it for
    :func:`sweep_stale_jobs`."""
    pid = os.getpid()
    folder = Path(tempfile.mkdtemp(prefix=f"job-{pid}-{_process_tag(pid) or 0}-", dir=jobs_root()))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def sweep_stale_jobs(root: Path | None = None) -> list[str]:
    """Remove the job folders of worker processes that are gone (killed mid-job: the student's notebooks and
    a gradebook with the hidden tests would otherwise stay on the machine); returns the names removed."""
    root = root or jobs_root()
    removed = []
    for folder in root.glob("job-*"):
        parts = folder.name.split("-")
        if len(parts) < 4 or not parts[1].isdigit():
            continue
        if _process_tag(int(parts[1])) != parts[2]:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder.name)
    return removed


def _worker_address() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except ValueError:  # not on a worker (called directly)
        return socket.gethostname()


def _host(address: str) -> str:
    """The host part of a worker address (tcp://HOST:PORT)."""
    return address.split("://")[-1].rsplit(":", 1)[0]


def _worker_threads() -> int:
    try:
        from distributed import get_worker

        return max(1, get_worker().state.nthreads)
    except (ValueError, AttributeError):
        return 1


# --- this machine's side --------------------------------------------------------------------------


def connect(scheduler):
    """A ``distributed.Client`` for ``scheduler`` (an address, "config", or a Client, used as it is)."""
    import dask
    from distributed import Client

    if isinstance(scheduler, Client):
        return scheduler, False
    address = scheduler
    if scheduler == "config":
        address = dask.config.get("scheduler-address", None)
        if not address:
            raise RuntimeError(
                "--scheduler config: dask's configuration names no scheduler: set DASK_SCHEDULER_ADDRESS="
                "tcp://HOST:PORT (or scheduler-address in ~/.config/dask/), or pass --scheduler tcp://HOST:PORT"
            )
    connect_s = dask.utils.parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), default="s")
    try:
        client = Client(address, timeout=max(RECONNECT_S, connect_s), set_as_default=False)
    except OSError as err:
        raise RuntimeError(
            f"cannot reach the Dask scheduler at {address}: {err}; start it (`dask scheduler`) or check the address"
        ) from None
    return client, True


def check_workers(client, sandbox: str, workers: list[str] | None = None) -> tuple[str, set[str], list[str]]:
    """(sandbox mode, workers that can grade, one line per worker that cannot, with the fix).

    On a cluster "auto" means bwrap: every job of a class runs in the same kind of sandbox.
    """
    if sandbox not in {"auto", "bwrap", "none"}:
        raise ValueError(f"sandbox must be auto, bwrap or none, not {sandbox!r}")
    mode = "none" if sandbox == "none" else "bwrap"
    reports = client.run(worker_report, workers=workers, on_error="return")
    version = course_version()
    good, problems = set(), []
    for address, report in sorted(reports.items()):
        if isinstance(report, BaseException):
            problems.append(
                f"{address}: cannot run the autograder ({type(report).__name__}: {report}): install the course on "
                "the worker (pip install -e '.[grading]' in the same checkout as this machine) and restart it"
            )
        elif report["version"] != version:
            problems.append(
                f"{address} ({report['host']}): course version {report['version']}, this machine's is {version}: "
                "install the same checkout of the course there (git checkout the same commit; pip install -e "
                "'.[grading]') and restart the worker"
            )
        elif mode == "bwrap" and report["sandbox"]:
            problems.append(
                f"{address} ({report['host']}): {report['sandbox']}; then restart the worker "
                "(or grade with --sandbox none: trusted notebooks only, on every worker)"
            )
        else:
            good.add(address)
    return mode, good, problems


def _payload(job, version: str, mode: str, template, host_threads: dict[str, int]) -> dict:
    extra = {}
    if job.extra_files:
        base = Path(job.extra_files)
        extra = {
            p.relative_to(base).as_posix(): p.read_bytes()
            for p in sorted(base.rglob("*"))
            if p.is_file() and p.suffix != ".ipynb"
        }
    return {
        "assignment": job.assignment,
        "student": job.student,
        "notebooks": {name: Path(path).read_bytes() for name, path in job.notebooks.items()},
        "template": template,
        "extra": extra,
        "timestamp": job.timestamp,
        "limits": asdict(job.limits),
        "bindings": job.bindings,
        "version": version,
        "sandbox": mode,
        "host_threads": host_threads,
    }


def _lock_name(course, assignment: str) -> str:
    from autograder.pipeline import _safe_url

    return f"autograder:{_safe_url(course.db_url)}:{assignment}"


def grade(course, assignment, students, scheduler, sandbox, limits, template, progress, keep_jobs, on_result):
    """:func:`autograder.pipeline.grade` on a Dask cluster (called by it, holding the course lock)."""
    from distributed import Lock

    from autograder.config import ensure_tools_on_path
    from autograder.course_dir import CourseBusy
    from autograder.pipeline import ensure_assignment, extra_files, template_gradebook

    ensure_tools_on_path()
    students = students if students is not None else course.students(assignment)
    limits = limits or Limits()
    template = template or template_gradebook(course, assignment)
    ensure_assignment(course, assignment, template)
    client, owned = connect(scheduler)
    try:
        _wait_for_a_worker(client)
        mode, good, problems = check_workers(client, sandbox)
        if problems:
            raise RuntimeError(
                f"{len(problems)} of {len(problems) + len(good)} worker(s) of the cluster at "
                f"{client.scheduler.address} cannot grade as this machine would; no student was graded:\n  "
                + "\n  ".join(problems)
            )
        lock = Lock(_lock_name(course, assignment), scheduler_rpc=client.scheduler, loop=client.loop)
        if not lock.acquire(blocking=False):
            raise CourseBusy(
                f"another autograder run is grading {assignment} into the gradebook {_lock_name(course, assignment)} "
                f"on the cluster at {client.scheduler.address}; wait for it to finish"
            )
        try:
            run = _ClusterRun(course, assignment, client, mode, good, limits, template, extra_files(course, assignment))
            return run.grade(students, progress, keep_jobs, on_result)
        finally:
            with contextlib.suppress(Exception):  # the scheduler restarted and forgot the lock: nothing to release
                lock.release()
    finally:
        if owned:
            client.close()


class _ClusterRun:
    def __init__(self, course, assignment, client, mode, good, limits, template, extra):
        self.course, self.assignment, self.client = course, assignment, client
        self.mode, self.good, self.limits = mode, set(good), limits
        self.template, self.extra = Path(template), extra
        self.version = course_version()
        self.run_id = uuid.uuid4().hex[:8]
        self.attempts: dict[str, int] = {}
        self.allowed: dict[str, frozenset[str]] = {}  # student -> the workers their live job may run on
        self._warned: set[str] = set()
        self._alone_since: float | None = None
        self.host_threads: dict[str, int] = {}

    def _submit(self, student: str, job):
        self.attempts[student] = self.attempts.get(student, 0) + 1
        self.allowed[student] = frozenset(self.good)
        future = self.client.submit(
            grade_on_worker,
            _payload(job, self.version, self.mode, self._template_future, self.host_threads),
            key=f"autograde-{self.assignment}-{self.run_id}-{student}-{self.attempts[student]}",
            workers=sorted(self.good),
            allow_other_workers=False,
            pure=False,
        )
        future.add_done_callback(self._done.put)
        return future

    def _look_at_workers(self) -> set[str]:
        """The live workers; notes how many worker threads each machine has (they share its cores)."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        self.host_threads: dict[str, int] = {}
        for address, info in workers.items():
            self.host_threads[_host(address)] = self.host_threads.get(_host(address), 0) + int(info["nthreads"])
        return set(workers)

    def _submit_template(self) -> None:
        data = self.template.read_bytes()
        key = f"autograder-template-{self.run_id}-{hashlib.sha256(data).hexdigest()[:12]}-{time.monotonic_ns()}"
        self._template_future = self.client.submit(_same, data, key=key, pure=False)

    def grade(self, students, progress, keep_jobs, on_result) -> list[JobResult]:
        from autograder.pipeline import _announce, _job_folder, store

        jobs_root = Path(tempfile.mkdtemp(prefix=f"autograder-{self.assignment}-"))
        results: dict[str, JobResult] = {}
        bar = self._progress_bar(len(students)) if progress else None

        def finish(result: JobResult, timestamp) -> None:
            started = time.perf_counter()
            store(self.course, self.assignment, result, timestamp)
            result.timings["merge_s"] = time.perf_counter() - started  # in memory only: for the benchmark
            results[result.student] = result
            if not keep_jobs:
                shutil.rmtree(jobs_root / _job_folder(result.student), ignore_errors=True)
            _announce(result, on_result, bar)

        self._done: queue.Queue = queue.Queue()
        pending: dict[str, object] = {}  # student -> their live future
        try:
            self._look_at_workers()
            self._submit_template()
            jobs, flags_of = self._submit_all(students, pending, finish)
            while pending:
                try:
                    future = self._done.get(timeout=REFRESH_S)
                except queue.Empty:
                    self._refresh(pending, jobs)
                    continue
                student = next((s for s, f in pending.items() if f is future), None)
                if student is None or student in results:  # a replaced future, or a result already merged
                    continue
                result = self._outcome(student, future, pending, jobs, jobs_root)
                if result is None:  # submitted again: its new future will come
                    continue
                del pending[student]
                result.flags = flags_of[student] + result.flags
                finish(result, jobs[student].timestamp)
        finally:
            for future in pending.values():
                future.release()
            if bar is not None:
                bar.close()
            if not keep_jobs:
                shutil.rmtree(jobs_root, ignore_errors=True)
        return [results[student] for student in students]

    def _progress_bar(self, total: int):
        from tqdm import tqdm

        return tqdm(
            total=total,
            desc=f"grade (cluster {self.client.scheduler.address}, {len(self.good)} workers, sandbox: {self.mode})",
            unit="student",
        )

    def _submit_all(self, students, pending: dict, finish) -> tuple[dict, dict[str, list[str]]]:
        """Submit every student's job (into ``pending``); one with nothing to grade is ``finish``ed as failed
        at once. Returns (student -> job submitted, student -> the flags their submission raised)."""
        from autograder.pipeline import _timestamp, release_bindings, student_job

        jobs, flags_of = {}, {}
        bindings = release_bindings(self.course, self.assignment)
        for student in students:
            job, flags = student_job(
                self.course, self.assignment, student, self.template, self.extra, self.limits, bindings
            )
            flags_of[student] = flags
            if job is None:
                reason = "; ".join(flags) or "no notebook was submitted"
                finish(
                    JobResult(student, "failed", reason, flags=flags),
                    _timestamp(self.course, self.assignment, student),
                )
                continue
            jobs[student] = job
            pending[student] = self._submit(student, job)
        return jobs, flags_of

    def _outcome(self, student: str, future, pending: dict, jobs: dict, jobs_root: Path) -> JobResult | None:
        """The result ``student``'s finished ``future`` brings, or None when the job was submitted again (the
        scheduler went away, or the worker changed under the run) and its new future is pending."""
        from autograder.pipeline import _job_folder

        if future.status == "cancelled":  # the scheduler went away: wait for it, resubmit what is left
            self._resume(pending, jobs)
            return None
        if future.status == "error":
            error = future.exception()
            if isinstance(error, WrongVersion):  # a worker changed under the run: never grade there
                self.good = {w for w in self.good if w not in str(error)}
                self._refresh(pending, jobs, resubmit=[student])
                return None
            return JobResult(student, "failed", _failure(error))
        try:
            data = future.result()
        except Exception as error:  # noqa: BLE001 (cancelled as it was fetched: the scheduler went)
            if future.status == "cancelled" or self.client.status != "running":
                self._resume(pending, jobs)
                return None
            return JobResult(student, "failed", _failure(error))
        return self._result(data, jobs_root / _job_folder(student))

    @staticmethod
    def _result(data: dict, folder: Path) -> JobResult:
        graded = data.pop("autograded")
        on_worker = data.pop("worker_seconds", None)
        worker = data.pop("worker", "")
        result = JobResult(**data)
        result.log = f"graded on Dask worker {worker}\n{result.log}"
        if on_worker is not None:
            result.timings["on_worker_s"] = on_worker  # the job's whole time there, staging included
        out = folder / "autograded"
        out.mkdir(parents=True, exist_ok=True)
        for name, content in graded.items():
            (out / Path(name).name).write_bytes(content)
            result.autograded[name] = str(out / Path(name).name)
        return result

    def _resume(self, pending: dict, jobs: dict) -> None:
        """The scheduler was lost: wait for the client to reconnect, check the workers, resubmit the rest."""
        deadline = time.monotonic() + RECONNECT_S
        while self.client.status != "running":
            if self.client.status in ("closed", "closing") or time.monotonic() > deadline:
                raise RuntimeError(
                    f"lost the Dask scheduler and could not reconnect: {len(pending)} student(s) not graded "
                    "(those graded are in the gradebook); run the command again for the rest with --student"
                )
            time.sleep(0.2)
        while not self._drain():
            pass
        _wait_for_a_worker(self.client)
        _, self.good, problems = check_workers(self.client, "none" if self.mode == "none" else "bwrap")
        self._warn(problems)
        if not self.good:
            raise RuntimeError("after the scheduler restarted, no worker can grade:\n  " + "\n  ".join(problems))
        self._submit_template()
        for student in list(pending):
            pending[student] = self._submit(student, jobs[student])

    def _drain(self) -> bool:
        """Drop the notices of futures cancelled with the old scheduler; True when none is left."""
        try:
            while True:
                self._done.get_nowait()
        except queue.Empty:
            return True

    def _refresh(self, pending: dict, jobs: dict, resubmit: list[str] = ()) -> None:
        """New workers that pass the check may take jobs; jobs whose workers all left go to the others."""
        live = self._look_at_workers()
        new = sorted(live - self.good)
        if new:
            _, good, problems = check_workers(self.client, "none" if self.mode == "none" else "bwrap", workers=new)
            self.good |= good
            self._warn(problems)
        self.good &= live
        if not self.good and pending:  # wait for a worker that can grade, for a while
            self._alone_since = self._alone_since or time.monotonic()
            if time.monotonic() - self._alone_since > RECONNECT_S:
                raise RuntimeError(
                    f"no worker of the cluster at {self.client.scheduler.address} could grade for {RECONNECT_S} s: "
                    f"{len(pending)} student(s) not graded (those graded are in the gradebook); start workers and "
                    "run the command again for the rest with --student"
                )
            return
        self._alone_since = None
        for student, future in list(pending.items()):
            if student in resubmit or not (self.allowed[student] & self.good):
                future.release()
                pending[student] = self._submit(student, jobs[student])

    def _warn(self, problems: list[str]) -> None:
        for problem in problems:
            if problem not in self._warned:
                self._warned.add(problem)
                print(f"autograder grade: not using a worker: {problem}", file=sys.stderr)


def _wait_for_a_worker(client) -> None:
    try:
        client.wait_for_workers(1, timeout=RECONNECT_S)
    except TimeoutError:
        raise RuntimeError(
            f"no worker joined the cluster at {client.scheduler.address} within {RECONNECT_S} s: start workers "
            f"(`dask worker {client.scheduler.address}` on each grading machine, as root)"
        ) from None


def _failure(error: BaseException) -> str:
    name = type(error).__name__
    if name == "KilledWorker":
        return f"the worker grading this notebook died every time it was tried ({error})"
    return f"grading on the cluster failed ({name}: {str(error)[:300]})"
