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

import csv

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
    # a bomb whose children fork too, for ever, at the process limit: the restart must still bring a kernel up
    "children_keep_forking": (
        "import os, time\n"
        "for _ in range(100000):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            while True:\n"
        "                try:\n"
        "                    os.fork()\n"
        "                except OSError:\n"
        "                    time.sleep(0.001)\n"
        "    except OSError:\n"
        "        break\n"
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


# --- replaced test machinery ---------------------------------------------------------------------------

# Each keeps the release's stub (no working answer) and, in one cell before the tests, replaces part
# of what the tests run through so that they pass (or their failure is not shown).
TAMPERING = {
    "input_transformer_cleanup": (
        "get_ipython().input_transformers_cleanup.append(\n"
        "    lambda lines: ['pass\\n'] if any('# TEST:' in line for line in lines) else lines)"
    ),
    "input_transformer_post": (
        "get_ipython().input_transformers_post.append(\n"
        "    lambda lines: ['pass\\n'] if any('# TEST:' in line for line in lines) else lines)"
    ),
    "input_transformer_manager_line": (
        "get_ipython().input_transformer_manager.line_transforms.append(\n"
        "    lambda lines: ['pass\\n'] if any('# TEST:' in line for line in lines) else lines)"
    ),
    "transform_cell_method": (
        "ip = get_ipython()\n_original = ip.transform_cell\n"
        "ip.transform_cell = lambda cell: 'pass\\n' if '# TEST:' in cell else _original(cell)"
    ),
    "run_cell_methods": (
        "ip = get_ipython()\n_async, _sync = ip.run_cell_async, ip.run_cell\n"
        "async def run_cell_async(raw_cell, *args, **kwargs):\n"
        "    return await _async('pass' if '# TEST:' in raw_cell else raw_cell, *args, **kwargs)\n"
        "def run_cell(raw_cell, *args, **kwargs):\n"
        "    return _sync('pass' if '# TEST:' in raw_cell else raw_cell, *args, **kwargs)\n"
        "ip.run_cell_async, ip.run_cell = run_cell_async, run_cell"
    ),
    "run_cell_class_method": (
        "import IPython.core.interactiveshell as shell_module\n"
        "_cls = type(get_ipython())\n_async = _cls.run_cell_async\n"
        "async def run_cell_async(self, raw_cell, *args, **kwargs):\n"
        "    return await _async(self, 'pass' if '# TEST:' in raw_cell else raw_cell, *args, **kwargs)\n"
        "_cls.run_cell_async = run_cell_async"
    ),
    "execute_handler": (
        "kernel = get_ipython().kernel\n_handler = kernel.shell_handlers['execute_request']\n"
        "async def execute_request(stream, ident, parent):\n"
        "    if '# TEST:' in parent['content'].get('code', ''):\n"
        "        parent['content']['code'] = 'pass'\n"
        "    return await _handler(stream, ident, parent)\n"
        "kernel.shell_handlers['execute_request'] = execute_request"
    ),
    "do_execute_class_method": (
        "_kernel_class = type(get_ipython().kernel)\n_do = _kernel_class.do_execute\n"
        "async def do_execute(self, code, *args, **kwargs):\n"
        "    return await _do(self, 'pass' if '# TEST:' in code else code, *args, **kwargs)\n"
        "_kernel_class.do_execute = do_execute"
    ),
    "ast_transformer": (
        "import ast\nclass DropAsserts(ast.NodeTransformer):\n"
        "    def visit_Assert(self, node):\n        return ast.Pass()\n"
        "get_ipython().ast_transformers.append(DropAsserts())\n"
        "import builtins\nbuiltins.add = lambda a, b: a + b"
    ),
    "custom_exception_handler": "get_ipython().set_custom_exc((BaseException,), lambda *args, **kwargs: None)",
    "showtraceback_replaced": "get_ipython().showtraceback = lambda *args, **kwargs: None",
}
STUB = None  # keep the release's answer cell (raise NotImplementedError)


def _stub_submission(course, student: str, extra: str) -> None:
    release = notebooks.read(course.release_dir / ASSIGNMENT / NAME)
    stub = next(c.source for c in release.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade_id") == "ex1_1")
    submit_with(course, student, stub, extra, before_test="ex1_1_add")


@pytest.fixture(scope="module")
def tampered(course):
    for case, cell in TAMPERING.items():
        _stub_submission(course, f"tamper_{case}", cell)
    # an honest notebook that has a library register event callbacks (as matplotlib does) and defines names
    submit_with(
        course,
        "honest",
        CORRECT,
        "from course.grading import announce_passing_tests\nannounce_passing_tests()\nx = 1",
        before_test="ex1_1_add",
    )
    students = [f"tamper_{case}" for case in TAMPERING] + ["honest"]
    results = {r.student: r for r in grade(course, ASSIGNMENT, students, workers=2)}
    from autograder.export import export

    _, grades_csv, _ = export(course, ASSIGNMENT)
    with grades_csv.open() as handle:
        rows = {row["student"]: row for row in csv.DictReader(handle)}
    return results, rows


@pytest.mark.parametrize("case", sorted(TAMPERING))
def test_replaced_test_machinery_is_flagged_for_manual_grading(tampered, case):
    results, rows = tampered
    result = results[f"tamper_{case}"]
    assert result.status == "graded", result.log[-3000:]
    reasons = " ".join(result.flags)
    assert "score not trusted" in reasons, (case, scores(result), result.flags, result.log[-2000:])
    status = rows[f"tamper_{case}"]["status"]
    assert status.startswith("needs manual grading") and "score not trusted" in status, status


@pytest.mark.parametrize("case", ["custom_exception_handler", "showtraceback_replaced"])
def test_a_silenced_test_failure_still_fails(tampered, case):
    results, _ = tampered
    assert scores(results[f"tamper_{case}"]) == {"ex1_1_add": 0.0, "ex1_1_types": 0.0}


def test_an_honest_notebook_is_not_flagged(tampered):
    results, rows = tampered
    assert results["honest"].flags == [] and rows["honest"]["status"] == "graded", results["honest"].flags
    assert scores(results["honest"]) == {"ex1_1_add": 1.0, "ex1_1_types": 1.0}
