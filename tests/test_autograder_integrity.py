"""Grading a hostile notebook cell by cell: forks that outlive the kernel, and replaced test machinery.

On the tiny assignment (one answer, two one-point tests), graded in the bubblewrap sandbox:

* a cell that forks children (in sessions of their own, so the kernel's process group does not hold
  them) and then kills the kernel: the children keep the dead kernel's ports and use up its process
  limit; the restarted kernel must still come up, and only that cell fails;
* a notebook that replaces the machinery the tests run through (IPython input and AST transformers,
  the shell's cell-running and transform methods, the kernel's execute handler, the error display):
  its score cannot be trusted, so the student is marked for manual grading with the reason.
"""

from __future__ import annotations

import nbformat
import pytest
from helpers import CORRECT, TINY_ASSIGNMENT, TINY_NOTEBOOK, tiny_course
from nbformat.v4 import new_code_cell

from autograder import notebooks
from autograder.pipeline import grade
from autograder.sandbox import bwrap_problem

ASSIGNMENT, NAME = TINY_ASSIGNMENT, TINY_NOTEBOOK
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no grading sandbox: {bwrap_problem()}")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    return tiny_course(tmp_path_factory.mktemp("integrity") / "course")


def submit_with(course, student: str, answer: str, extra: str, before_test: str = "ex1_1_types") -> None:
    """Submit ``answer`` with an extra code cell ``extra`` placed just before the test cell ``before_test``."""
    release = notebooks.read(course.release_dir / ASSIGNMENT / NAME)
    nb = notebooks.with_answers(release, {"ex1_1": answer})
    position = next(
        i
        for i, cell in enumerate(nb.cells)
        if cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") == before_test
    )
    nb.cells.insert(position, new_code_cell(extra))
    target = course.submitted / student / ASSIGNMENT / NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(target))


def scores(result) -> dict[str, float]:
    return {name: grade["auto_score"] for name, grade in result.grades[NAME].items()}


# --- forks that outlive the kernel -------------------------------------------------------------------

FORKS = {
    # three children in sessions of their own sleep with the kernel's sockets open; the kernel exits
    "children_hold_ports": (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        time.sleep(600)\n"
        "        os._exit(0)\n"
        "os._exit(1)"
    ),
    # a fork bomb whose children survive: the process limit is used up when the kernel exits
    "fork_bomb_survivors": (
        "import os, time\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            os.setsid()\n"
        "            time.sleep(600)\n"
        "            os._exit(0)\n"
        "except OSError:\n"
        "    pass\n"
        "os._exit(1)"
    ),
}


@pytest.mark.parametrize("case", sorted(FORKS))
def test_a_forking_cell_fails_alone(course, case):
    student = f"fork_{case}"
    submit_with(course, student, CORRECT, FORKS[case])
    (result,) = grade(course, ASSIGNMENT, [student], workers=1)
    assert result.status == "graded", result.log[-3000:]
    assert scores(result) == {"ex1_1_add": 1.0, "ex1_1_types": 1.0}, (scores(result), result.log[-3000:])
    nb = notebooks.read(course.autograded / student / ASSIGNMENT / NAME)
    events = nb.metadata["autograder"]["events"]
    assert any(event["event"] == "kernel-died" for event in events), events
    assert not any(event["event"] in {"restart-failed", "not-run"} for event in events), events
