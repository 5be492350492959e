"""The instructor's grading pipeline over one nbgrader course directory (:class:`Course`).

:func:`repair_submissions` restores what students' notebook editors broke; a notebook that cannot be
read or repaired is taken out of submitted/ and its student flagged for manual grading.

:func:`grade` grades every submitted student in parallel worker processes, each in its own sandbox
(:mod:`autograder.sandbox`), and merges the scores into the real gradebook one at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from autograder import collect, notebooks, repair
from autograder.config import SOURCE_DIRECTORY, ensure_tools_on_path
from autograder.course_dir import DB_URL_ENV, Course
from autograder.sandbox import Job, JobResult, Limits, UidLease, resolve_sandbox, run_job

__all__ = ["DB_URL_ENV", "Course", "grade", "repair_submissions"]

# --- repair -------------------------------------------------------------------------------------


def repair_submissions(course: Course, assignment: str, students: list[str] | None = None, progress: bool = False):
    """Repair every submitted notebook of ``assignment`` against its release; returns {student: notes}.

    The notebook as received is kept in ``grading/<assignment>/received/`` and always repaired from
    there, so repairing twice gives the same result. A notebook that cannot be read or repaired (or
    a symbolic link in submitted/) is taken out of submitted/ and the student is flagged for manual
    grading with the reason; repair goes on with the others.
    """
    releases = {name: notebooks.read(path) for name, path in course.release_notebooks(assignment).items()}
    done: dict[str, list[str]] = {}
    problems: dict[str, list[str]] = {}
    todo = students or course.students(assignment)
    if progress:
        from tqdm import tqdm

        todo = tqdm(todo, desc="repair", unit="student")
    for student in todo:
        notes_all: list[str] = []
        for name, release in releases.items():
            notes, problem = _repair_notebook(course, assignment, student, name, release)
            if problem:
                problems.setdefault(student, []).append(problem)
            notes_all += notes
        done[student] = notes_all
    course.set_flags(assignment, "repair", problems, set(done))
    record = course.work(assignment) / "repair.json"
    previous = json.loads(record.read_text()) if record.is_file() else {}
    record.write_text(json.dumps({**previous, **done}, indent=1, ensure_ascii=False))
    return done


def _repair_notebook(course: Course, assignment: str, student: str, name: str, release) -> tuple[list[str], str]:
    """Repair ``student``'s submitted notebook ``name`` in place from the copy as received; returns (the notes
    for the student, the problem that took it out of submitted/ or ""). A notebook not submitted gives ([], "")."""
    target = course.submitted / student / assignment / name
    if target.is_symlink():
        collect.remove_submission(course, assignment, student, name)
        return [], f"{name}: a symbolic link in submitted/, not graded"
    if not target.is_file():
        return [], ""
    received = course.work(assignment) / "received" / student / name
    if not received.is_file():  # delivered by nbgrader's exchange or copied by hand
        received.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(target, received)
    try:
        result = repair.repair(repair.read_submission(received.read_bytes()), release)
    except repair.UnreadableNotebook as err:
        problem = f"{name}: {err}"
    except Exception as err:  # a notebook shape nobody foresaw: never stop the class
        problem = f"{name}: could not be repaired ({type(err).__name__}: {str(err)[:300]})"
    else:
        problem = ""
    if problem:
        collect.remove_submission(course, assignment, student, name)
        return [problem], problem
    notes = []
    original = collect.received_name(course, assignment, student, name)
    if original and Path(original).name != name:
        note = f"Your file {Path(original).name!r} was graded as {name!r}."
        result.notebook.metadata["autograder"]["collect"] = [note]
        notes.append(note)
    notebooks.write(result.notebook, target)
    return notes + result.notes, ""


# --- templates and the gradebook ----------------------------------------------------------------


def _sources_digest(course: Course, assignment: str) -> str:
    import nbgrader

    digest = hashlib.sha256(nbgrader.__version__.encode())
    for path in sorted((course.source_dir / assignment).rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(course.source_dir).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def template_gradebook(course: Course, assignment: str) -> Path:
    """A sqlite gradebook holding only ``assignment`` (made from solutions/ by nbgrader), cached.

    Every grading sandbox gets a copy: nbgrader restores the test cells, hidden tests included,
    from it. It is rebuilt whenever solutions/<assignment>/ changes.
    """
    cache = course.work(assignment) / "template"
    digest = _sources_digest(course, assignment)
    db = cache / f"gradebook-{digest}.db"
    if db.is_file():
        return db
    with tempfile.TemporaryDirectory(prefix="autograder-template-") as tmp:
        _generate(course, assignment, Path(tmp), f"sqlite:///{Path(tmp) / 'gradebook.db'}")
        cache.mkdir(parents=True, exist_ok=True)
        for stale in cache.glob("gradebook-*.db"):
            stale.unlink()
        shutil.copyfile(Path(tmp) / "gradebook.db", db)
    os.chmod(db, 0o600)
    return db


def grade_cells(db_url: str, assignment: str) -> dict[str, dict[str, float]]:
    """notebook name -> grade_id -> max score, as the gradebook knows the assignment (empty if absent)."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(db_url) as gradebook:
        try:
            found = gradebook.find_assignment(assignment)
        except MissingEntry:
            return {}
        return {nb.name: {cell.name: cell.max_score for cell in nb.grade_cells} for nb in found.notebooks}


def ensure_assignment(course: Course, assignment: str, template: Path) -> None:
    """Make sure the real gradebook knows ``assignment`` exactly as solutions/ defines it."""
    ensure_tools_on_path()
    wanted = grade_cells(f"sqlite:///{template}", assignment)
    have = grade_cells(course.db_url, assignment)
    if have == wanted:
        return
    if have:
        raise RuntimeError(
            f"the gradebook ({_safe_url(course.db_url)}) holds a different version of {assignment} than "
            f"solutions/: release it again (`autograder release {assignment} --db-url ...`), or grade into a "
            "new gradebook"
        )
    with tempfile.TemporaryDirectory(prefix="autograder-gradebook-") as tmp:
        _generate(course, assignment, Path(tmp), course.db_url)


def _generate(course: Course, assignment: str, workdir: Path, db_url: str) -> None:
    """nbgrader generate_assignment of ``assignment`` in ``workdir`` (modules/ untouched), into ``db_url``."""
    from autograder.release import generate

    shutil.copytree(course.source_dir / assignment, workdir / SOURCE_DIRECTORY / assignment)
    generate(workdir, [assignment], db_url)


def _safe_url(url: str) -> str:
    """A database URL without its password, for messages."""
    return __import__("re").sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def merge_result(course: Course, assignment: str, result: JobResult, timestamp: str | None) -> None:
    """Write one student's scores into the real gradebook (one transaction)."""
    from nbgrader.api import Gradebook

    with warnings.catch_warnings(), Gradebook(course.db_url) as gradebook:
        warnings.simplefilter("ignore")  # SQLAlchemy's cosmetic SAWarnings about nbgrader's models (#1963)
        gradebook.update_or_create_student(result.student)
        if timestamp:
            gradebook.update_or_create_submission(assignment, result.student, timestamp=timestamp)
        else:
            gradebook.update_or_create_submission(assignment, result.student)
        graded = result.status == "graded"
        for notebook_name in grade_cells(course.db_url, assignment):
            file_name = f"{notebook_name}.ipynb"
            scores = result.grades.get(file_name, {})
            notebook = gradebook.find_submission_notebook(notebook_name, assignment, result.student)
            notebook.flagged = not graded or bool(result.flags)
            for grade in notebook.grades:
                entry = scores.get(grade.name)
                if graded and entry is not None:
                    grade.auto_score = entry["auto_score"]
                    grade.needs_manual_grade = (
                        bool(entry["needs_manual_grade"]) or grade.manual_score is not None or bool(result.flags)
                    )
                else:  # not graded: 0 until someone looks at it
                    grade.auto_score = 0.0
                    grade.needs_manual_grade = True
            comments = result.comments.get(file_name, {})
            for comment in notebook.comments:
                if comment.name in comments:
                    comment.auto_comment = comments[comment.name]
        gradebook.db.commit()


# --- grading ------------------------------------------------------------------------------------


def default_workers(limits: Limits | None = None) -> int:
    """One worker per CPU, but no more than the memory holds at the kernels' memory limit."""
    memory = (limits or Limits()).memory_bytes
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        physical = 0
    by_memory = physical // (memory + 2**30) if physical else os.cpu_count() or 1
    return max(1, min(os.cpu_count() or 1, by_memory))


def grade(
    course: Course,
    assignment: str,
    students: list[str] | None = None,
    workers: int | None = None,
    sandbox: str = "auto",
    limits: Limits | None = None,
    template: Path | None = None,
    progress: bool = False,
    keep_jobs: bool = False,
    on_result: Callable[[JobResult], None] | None = None,
    scheduler=None,
) -> list[JobResult]:
    """Autograde the submitted notebooks of ``assignment`` in parallel sandboxes; merge into the gradebook.

    Returns one result per student, in student order. A student whose grading failed or timed out
    gets 0 on every cell, marked for manual grading, and a result whose message says why.

    ``scheduler``: grade on a Dask cluster instead of this machine (a ``tcp://HOST:PORT`` address,
    ``"config"`` for the one dask's configuration names, or a ``distributed.Client``); see
    :mod:`autograder.cluster`. ``workers`` is then the cluster's business and must be None.
    """
    with course.exclusive(f"grade {assignment}"):
        if scheduler is not None:
            from autograder import cluster

            if workers is not None:
                raise ValueError("--workers is for grading on this machine; on a cluster, each worker's threads are")
            return cluster.grade(
                course, assignment, students, scheduler, sandbox, limits, template, progress, keep_jobs, on_result
            )
        return _grade(course, assignment, students, workers, sandbox, limits, template, progress, keep_jobs, on_result)


def _grade(course, assignment, students, workers, sandbox, limits, template, progress, keep_jobs, on_result):
    ensure_tools_on_path()
    mode = resolve_sandbox(sandbox)
    students = students if students is not None else course.students(assignment)
    limits = limits or Limits()
    workers = max(1, min(workers or default_workers(limits), len(students) or 1))
    if limits.threads <= 0:
        limits = dataclasses.replace(limits, threads=max(1, (os.cpu_count() or 1) // workers))
    template = template or template_gradebook(course, assignment)
    ensure_assignment(course, assignment, template)
    extra = extra_files(course, assignment)
    bindings = release_bindings(course, assignment)  # once, before the threads: the same for every student
    jobs_root = Path(tempfile.mkdtemp(prefix=f"autograder-{assignment}-"))
    lease = UidLease(workers) if mode == "bwrap" else None  # uids no other run on this machine holds
    slots: list[int] = list(lease.slots) if lease else list(range(workers))
    slot_lock, merge_lock = threading.Lock(), threading.Lock()
    results: dict[str, JobResult] = {}

    def one(student: str) -> JobResult:
        job, flags = student_job(course, assignment, student, template, extra, limits, bindings)
        if job is None:  # nothing readable: 0, marked for manual grading, with the reasons
            result = JobResult(student, "failed", "; ".join(flags) or "no notebook was submitted", flags=flags)
            with merge_lock:
                store(course, assignment, result, _timestamp(course, assignment, student))
            return result
        with slot_lock:
            slot = slots.pop()
        try:
            result = run_job(job, jobs_root / _job_folder(student), slot=slot, sandbox=mode)
        finally:
            with slot_lock:
                slots.append(slot)
        result.flags = flags + result.flags  # collect's and repair's, then the sandbox's (replaced test machinery)
        with merge_lock:
            store(course, assignment, result, job.timestamp)
        if not keep_jobs:
            shutil.rmtree(jobs_root / _job_folder(student), ignore_errors=True)
        return result

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(students), desc=f"grade ({workers} workers, sandbox: {mode})", unit="student")
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(one, student): student for student in students}
            for future in as_completed(futures):
                result = future.result()
                results[result.student] = result
                _announce(result, on_result, bar)
    finally:
        if bar is not None:
            bar.close()
        if lease is not None:
            lease.release()
        if not keep_jobs:
            shutil.rmtree(jobs_root, ignore_errors=True)
    return [results[student] for student in students]


def _announce(result: JobResult, on_result: Callable[[JobResult], None] | None, bar) -> None:
    """Tell the caller (``on_result``) and the progress bar (a tqdm, or None) that a student's result is merged."""
    if on_result:
        on_result(result)
    if bar is not None:
        bar.update(1)
        bar.set_postfix_str(f"{result.student}: {result.status}")


def extra_files(course: Course, assignment: str) -> Path | None:
    """The assignment's folder in solutions/ when it holds files other than notebooks (they go with each job)."""
    extra = course.source_dir / assignment
    if extra.is_dir() and any(p.is_file() and p.suffix != ".ipynb" for p in extra.rglob("*")):
        return extra
    return None


def _timestamp(course: Course, assignment: str, student: str) -> str | None:
    stamp = course.submitted / student / assignment / "timestamp.txt"
    return stamp.read_text().strip() if stamp.is_file() and not stamp.is_symlink() else None


def student_job(
    course: Course,
    assignment: str,
    student: str,
    template: Path,
    extra: Path | None,
    limits: Limits,
    bindings: dict[str, str],
) -> tuple[Job | None, list[str]]:
    """(the job that grades ``student``, or None when nothing of theirs is readable; their flags).

    ``bindings``: :func:`release_bindings` of the assignment, read once per grading run by the caller (the same
    for every student, and read before the grading threads start)."""
    flags = course.flag_reasons(assignment, student)
    submitted = course.submitted_notebooks(assignment, student)
    if not submitted:
        return None, flags
    job = Job(
        assignment=assignment,
        student=student,
        notebooks={name: str(path) for name, path in submitted.items()},
        template_db=str(template),
        extra_files=str(extra) if extra else None,
        timestamp=_timestamp(course, assignment, student),
        limits=limits,
        bindings=bindings,
    )
    return job, flags


def release_bindings(course: Course, assignment: str) -> dict[str, str]:
    """What the released notebooks' own cells import, by name (see :func:`autograder.seal.expected_bindings`)."""
    from autograder.seal import expected_bindings

    bindings: dict[str, str] = {}
    for path in sorted((course.release_dir / assignment).glob("*.ipynb")):
        try:
            bindings.update(expected_bindings(notebooks.read(path).cells))
        except (OSError, ValueError):
            continue
    return bindings


def _job_folder(student: str) -> str:
    """A folder name for a student's job: ASCII, so every tool in the sandbox handles the path."""
    return hashlib.sha256(student.encode()).hexdigest()[:16]


def store(course: Course, assignment: str, result: JobResult, timestamp: str | None) -> None:
    """Merge a result into the gradebook and the course folders (called one at a time)."""
    merge_result(course, assignment, result, timestamp)
    target = course.autograded / result.student / assignment
    if target.exists():
        shutil.rmtree(target)
    notes = []
    if result.status != "graded":
        notes.append(
            f"Your notebook could not be graded automatically: {result.message}. Your instructor will grade it by hand."
        )
    elif result.flags:
        notes.append(f"Your instructor will check this grade by hand: {'; '.join(result.flags)}.")
    for name, path in result.autograded.items():
        nb = notebooks.read(path)
        nb.metadata.setdefault("autograder", {})["grade"] = notes
        notebooks.write(nb, target / name)
    if timestamp and target.exists():
        (target / "timestamp.txt").write_text(timestamp)
    record = course.result_path(assignment, result.student)
    record.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(result)
    data.pop("log")
    data["autograded"] = sorted(result.autograded)
    data["scores"] = {name: _totals(grades) for name, grades in result.grades.items()}
    record.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    log = course.work(assignment) / "logs" / f"{result.student}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(result.log)


def _totals(grades: dict[str, dict]) -> dict[str, float]:
    return {
        "score": sum(g["auto_score"] or 0 for g in grades.values()),
        "max_score": sum(g["max_score"] or 0 for g in grades.values()),
    }
