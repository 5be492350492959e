"""Two ``grade()`` calls in threads of one process (a notebook server or a web front end grading
two courses at once) must not collide.

nbgrader's converters ``os.chdir`` into the course root and back (the working folder is one per
process), and the pipeline swallowed their console output by swapping ``sys.stdout`` and
``sys.stderr`` (also one per process): two template generations at once restored each other's
folder, a temporary folder already deleted, so one grade() failed with FileNotFoundError and the
process was left printing into a StringIO. And the course lock let a second thread of the same
process into a course another thread was grading.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback

import pytest

from autograder.course_dir import CourseBusy
from autograder.pipeline import grade, grade_cells
from tests.helpers import CORRECT, TINY_ASSIGNMENT, submit, tiny_course


def _in_threads(*calls):
    """Run the calls at once (a barrier lines them up); return each one's result or formatted exception."""
    barrier = threading.Barrier(len(calls))
    outcomes: list = [None] * len(calls)

    def run(index, call):
        barrier.wait()
        try:
            outcomes[index] = call()
        except BaseException as err:  # noqa: BLE001 (reported by the test)
            outcomes[index] = err
            err.formatted = traceback.format_exc()

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return outcomes


def test_two_courses_graded_at_once_in_one_process(tmp_path, monkeypatch):
    from nbgrader.converters.base import BaseConverter

    courses = [tiny_course(tmp_path / f"course{i}") for i in range(2)]
    for i, course in enumerate(courses):
        submit(course, f"student{i}", CORRECT)
    # Make the two template generations overlap, as they may by chance: each conversion waits (a
    # few seconds at most) for the other one to be under way too, then notes which folder the
    # process is in. One at a time, the wait times out and each sees its own course folder.
    overlap, seen = threading.Barrier(2), []
    convert = BaseConverter.convert_notebooks

    def overlapping(self):
        with contextlib.suppress(threading.BrokenBarrierError):
            overlap.wait(timeout=3)
        seen.append((self.coursedir.root, os.getcwd()))
        return convert(self)

    monkeypatch.setattr(BaseConverter, "convert_notebooks", overlapping)
    cwd, stdout, stderr = os.getcwd(), sys.stdout, sys.stderr
    outcomes = _in_threads(
        *(
            lambda course=course, i=i: grade(course, TINY_ASSIGNMENT, [f"student{i}"], workers=1)
            for i, course in enumerate(courses)
        )
    )
    monkeypatch.undo()
    assert len(seen) == 2 and all(root == folder for root, folder in seen), (
        f"a conversion ran in another course's folder (course root, working folder): {seen}"
    )
    failed = [getattr(o, "formatted", repr(o)) for o in outcomes if isinstance(o, BaseException)]
    assert not failed, "a grade() call failed while another ran in a second thread:\n" + "\n".join(failed)
    assert os.getcwd() == cwd, "grading left the process in another working folder"
    assert sys.stdout is stdout and sys.stderr is stderr, "grading left sys.stdout / sys.stderr redirected"
    for i, (course, results) in enumerate(zip(courses, outcomes)):
        (result,) = results
        assert result.status == "graded" and result.student == f"student{i}", result.message
        assert sum(entry["auto_score"] for entry in result.grades["tiny.ipynb"].values()) == 2
        assert grade_cells(course.db_url, TINY_ASSIGNMENT) == {"tiny": {"ex1_1_add": 1.0, "ex1_1_types": 1.0}}
        assert len(list((course.work(TINY_ASSIGNMENT) / "template").glob("gradebook-*.db"))) == 1


def test_a_second_thread_cannot_enter_a_course_another_thread_holds(tmp_path):
    course = tiny_course(tmp_path / "course")
    entered, leave = threading.Event(), threading.Event()

    def hold():
        with course.exclusive("grade tiny"):
            entered.set()
            leave.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(60)
        with pytest.raises(CourseBusy, match="another autograder run is using the course"):
            grade(course, TINY_ASSIGNMENT, [], workers=1)
    finally:
        leave.set()
        holder.join(60)
    with course.exclusive("run tiny"), course.exclusive("grade tiny"):  # nested in one thread: allowed
        pass


def test_the_graders_parsing_holds_when_threads_parse_at_once():
    """CPython 3.11's ast module keeps one depth counter per interpreter while it builds a tree; two grading
    threads parsing at once, with the GIL handed over in between, made ast.parse raise "SystemError: AST
    constructor recursion depth mismatch" (one CI run lost m7's grading to it). A garbage-collector callback
    that yields the GIL makes the hand-over happen every time; without the seal's lock this fails."""
    import gc
    import time

    from autograder import seal

    body = "\n".join(
        f"import numpy as np{i}\ndef f{i}(a, b):\n    return [x * {i} for x in range(a) if (x + b) % 3 == {i % 3}]"
        for i in range(200)
    )
    cells = [{"cell_type": "code", "source": body, "metadata": {}}]
    expected = seal.expected_bindings(cells)

    def parse_many():
        for _ in range(10):
            assert seal.expected_bindings(cells) == expected
            assert seal.free_names(body) == ["range"]
        return "done"

    def yield_the_gil(phase, info):
        time.sleep(0)

    gc.callbacks.append(yield_the_gil)
    try:
        outcomes = _in_threads(*[parse_many] * 4)
    finally:
        gc.callbacks.remove(yield_the_gil)
    failures = [getattr(o, "formatted", repr(o)) for o in outcomes if o != "done"]
    assert not failures, failures[0]


def test_one_grading_run_reads_the_released_notebooks_imports_once(tmp_path, monkeypatch):
    """The released notebooks' imports are the same for every student: read once, before the threads."""
    from autograder import pipeline
    from autograder.sandbox import JobResult

    course = tiny_course(tmp_path / "course")
    for i in range(3):
        submit(course, f"student{i}", CORRECT)
    reads, handed = [], []
    read = pipeline.release_bindings

    def counted(*args):
        reads.append(args)
        return read(*args)

    def no_kernel(job, job_dir, slot=0, sandbox="bwrap"):
        handed.append(job.bindings)
        return JobResult(job.student, "failed", "not run: this test counts the reads")

    monkeypatch.setattr(pipeline, "release_bindings", counted)
    monkeypatch.setattr(pipeline, "run_job", no_kernel)
    results = grade(course, TINY_ASSIGNMENT, workers=2, sandbox="none")
    assert [r.student for r in results] == ["student0", "student1", "student2"]
    assert len(reads) == 1
    assert handed == [read(course, TINY_ASSIGNMENT)] * 3
