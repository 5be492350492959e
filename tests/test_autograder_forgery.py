"""Forged marks: one-cell forgeries that scored full marks unflagged before the kernel's seal.

A small assignment whose tests compare the way the course's tests do (``math.isclose``,
``numpy.allclose``, ``course.grading.assert_close``, a bare ``==``, ``isinstance``, the reference-call
check of ``forbid_reference``) is graded in the bubblewrap sandbox with a stub answer plus one
forgery per case. Each forgery made every test pass before autograder.seal existed (the last two got
past the seal's first version instead); each must now be flagged for manual grading ("score not
trusted"). An honest notebook, with a callback registered as matplotlib registers one, is graded in
the same run and must keep full marks with no flag.
"""

from __future__ import annotations

import csv

import nbformat
import pytest
from helpers import _meta
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from autograder import notebooks
from autograder.course_dir import Course
from autograder.pipeline import grade
from autograder.sandbox import bwrap_problem

ASSIGNMENT, NAME = "forge", "forge.ipynb"
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no grading sandbox: {bwrap_problem()}")

SETUP = (
    "import math\nimport numpy as np\nimport course.metrics\nfrom course.grading import assert_close, forbid_reference"
)
ANSWER = (
    "# EXERCISE: ex1_1\n"
    "def p50(values):\n"
    "    ### BEGIN SOLUTION\n"
    "    ordered = sorted(values)\n"
    "    middle = len(ordered) // 2\n"
    "    return float(ordered[middle]) if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2\n"
    "    ### END SOLUTION"
)
TESTS = {
    "ex1_1_isclose": (
        '# TEST: ex1_1_isclose\n"""p50 of an odd count, compared with math.isclose."""\n'
        "assert math.isclose(p50([1, 3, 2]), 2.0)\n"
        "### BEGIN HIDDEN TESTS\nassert math.isclose(p50([4, 1, 3, 2]), 2.5), 'an even count'\n"
        "### END HIDDEN TESTS"
    ),
    "ex1_1_allclose": (
        '# TEST: ex1_1_allclose\n"""compared with numpy."""\nassert np.allclose(p50([5.0, 1.0, 3.0]), 3.0)'
    ),
    "ex1_1_assert_close": (
        '# TEST: ex1_1_assert_close\n"""compared with the course\'s helper."""\n'
        'assert_close(p50([2, 9, 4]), 4.0, "p50")'
    ),
    "ex1_1_equal": '# TEST: ex1_1_equal\n"""one value."""\nassert p50([7]) == 7',
    "ex1_1_type": '# TEST: ex1_1_type\n"""a float."""\nassert isinstance(p50([1.0, 2.0, 3.0]), float)',
    "ex1_1_own_code": (
        '# TEST: ex1_1_own_code\n"""computed, not delegated."""\n'
        "with forbid_reference(course.metrics):\n    value = p50([1, 2, 3])\nassert value == 2"
    ),
}
STUB = "# EXERCISE: ex1_1\ndef p50(values):\n    raise NotImplementedError()"
CORRECT = "# EXERCISE: ex1_1\n" + "\n".join(line for line in ANSWER.split("\n")[1:] if "### " not in line)

# Each forgery: (the answer cell, an extra cell run before the tests). Every one scored 6/6 unflagged
# with the sealed kernel's predecessor (a tripwire asked through the kernel's own user_expressions).
FORGERIES = {
    # answers equal to everything, and the comparison functions that would see through them replaced
    "liar_with_patched_comparisons": (
        "# EXERCISE: ex1_1\nimport math, numpy\n"
        "class Anything:\n    def __eq__(self, other):\n        return True\n"
        "    def __float__(self):\n        return 0.0\n"
        "math.isclose = lambda *args, **kwargs: True\nnumpy.allclose = lambda *args, **kwargs: True\n"
        "def p50(values):\n    return Anything()",
        "isinstance = lambda *args: True",
    ),
    # a look-alike course.grading placed in sys.modules and imported again under the notebook's names
    "fake_course_grading_module": (
        STUB,
        "import sys, types, contextlib, course\nfake = types.ModuleType('course.grading')\n"
        "fake.assert_close = lambda *args, **kwargs: None\n"
        "fake.forbid_reference = lambda *modules: contextlib.nullcontext()\n"
        "sys.modules['course.grading'] = fake\ncourse.grading = fake\n"
        "from course.grading import assert_close, forbid_reference\n"
        "import math, numpy\nmath.isclose = lambda *a, **k: True\nnumpy.allclose = lambda *a, **k: True",
    ),
    # the notebook's own helpers under the names the tests use
    "helpers_redefined": (
        "# EXERCISE: ex1_1\ndef p50(values):\n    return 2.0",
        "import contextlib\nassert_close = lambda *args, **kwargs: None\n"
        "forbid_reference = lambda *modules: contextlib.nullcontext()\n"
        "class _AnyFloat(float):\n    def __eq__(self, other):\n        return True\n"
        "def p50(values):\n    return _AnyFloat(2.0)\n"
        "class _Math:\n    isclose = staticmethod(lambda *a, **k: True)\nmath = _Math()\n"
        "class _Np:\n    allclose = staticmethod(lambda *a, **k: True)\nnp = _Np()",
    ),
    # a fake autograder.guard (the old tripwire's reporter) in sys.modules, with the test cells
    # rewritten to `pass` by an input transformer
    "fake_guard_in_sys_modules": (
        STUB,
        "import sys, types\nfake = types.ModuleType('autograder.guard')\nfake.report = lambda *args: 'ok'\n"
        "sys.modules['autograder.guard'] = fake\n"
        "get_ipython().input_transformers_cleanup.append(\n"
        "    lambda lines: ['pass\\n'] if any('# TEST:' in line for line in lines) else lines)",
    ),
    # the same through builtins.__import__
    "fake_guard_through_import": (
        STUB,
        "import builtins, types\nfake = types.ModuleType('autograder.guard')\nfake.report = lambda *args: 'ok'\n"
        "_import = builtins.__import__\n"
        "def _fake_import(name, *args, **kwargs):\n"
        "    if name == 'autograder.guard':  # the old tripwire asked for it with a fromlist\n"
        "        return fake\n"
        "    return _import(name, *args, **kwargs)\n"
        "builtins.__import__ = _fake_import\n"
        "get_ipython().input_transformers_cleanup.append(\n"
        "    lambda lines: ['pass\\n'] if any('# TEST:' in line for line in lines) else lines)",
    ),
    # a post_run_cell callback that clears the error from the execution result, and an output channel
    # that drops error messages: the tests fail, nothing says so
    "callback_and_quiet_channel": (
        STUB,
        "ip = get_ipython()\n"
        "def _forget(result):\n    result.error_in_exec = None\n"
        "ip.events.register('post_run_cell', _forget)\n"
        "class _DropErrors:\n"
        "    def __init__(self, inner):\n        self._inner = inner\n"
        "    def send_multipart(self, parts, *args, **kwargs):\n"
        "        if any(b'\"error\"' in bytes(part) for part in parts[:6]):\n            return None\n"
        "        return self._inner.send_multipart(parts, *args, **kwargs)\n"
        "    def __getattr__(self, name):\n        return getattr(self._inner, name)\n"
        "ip.displayhook.pub_socket = _DropErrors(ip.displayhook.pub_socket)",
    ),
    # the profile function made a no-op, so calls into the course's reference go unseen
    "reference_call_unseen": (
        "# EXERCISE: ex1_1\nimport course.metrics\n"
        "def p50(values):\n    return float(course.metrics.percentile(values, 50))",
        "import sys, threading\nsys.setprofile = lambda function: None\nthreading.setprofile = lambda function: None",
    ),
    # the reference-call check switched off from inside the answer, while the test runs
    "reference_call_profile_cleared": (
        "# EXERCISE: ex1_1\nimport sys, course.metrics\n"
        "def p50(values):\n    sys.setprofile(None)\n    return float(course.metrics.percentile(values, 50))",
        "pass",
    ),
    # the garbage collector walked to the seal's key: the kernel is stopped before the call returns
    "collector_walk": (CORRECT, "import gc\nfound = [o for o in gc.get_objects() if type(o).__name__ == 'cell']"),
    # Two found in the seal itself (passed unflagged by its first version). A module the notebook made, registered
    # in sys.modules under a name of its own and put in place of the math module assert_close reads: a wrong
    # answer passes assert_close.
    "planted_module_over_a_library_module": (
        "# EXERCISE: ex1_1\ndef p50(values):\n    return 0.0",
        "import sys, types, course.grading\nplanted = types.ModuleType('planted')\n"
        "planted.isclose = lambda *args, **kwargs: True\nsys.modules['planted'] = planted\n"
        "course.grading.math = planted",
    ),
    # a library's dict replaced by one whose key is not a string, so that the code it holds went unlooked-at
    "dict_keyed_to_hide_code": (STUB, "import linecache\nlinecache.cache = {1: lambda *args: True}"),
}
# An honest notebook: a library registers IPython callbacks (as matplotlib does); the notebook names things.
HONEST = (CORRECT, "from course.grading import announce_passing_tests\nannounce_passing_tests()\nx = 1")


def source() -> nbformat.NotebookNode:
    cells = [
        new_code_cell(SETUP),
        new_markdown_cell("### Exercise 1.1 — Compute a median (6 points)"),
        new_code_cell(ANSWER, metadata=_meta("ex1_1", False)),
    ]
    cells += [new_code_cell(test, metadata=_meta(grade_id, True, 1)) for grade_id, test in TESTS.items()]
    return new_notebook(
        cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    )


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    from autograder.release import generate

    root = tmp_path_factory.mktemp("forgery") / "course"
    notebooks.write(source(), root / "solutions" / ASSIGNMENT / NAME)
    generate(root, [ASSIGNMENT], f"sqlite:///{root / 'gradebook.db'}")
    course = Course(root)
    release = notebooks.read(course.release_dir / ASSIGNMENT / NAME)
    first_test = next(i for i, cell in enumerate(release.cells) if notebooks.grade_id(cell) == "ex1_1_isclose")
    for student, (answer, extra) in {**FORGERIES, "honest": HONEST}.items():
        nb = notebooks.with_answers(release, {"ex1_1": answer})
        nb.cells.insert(first_test, new_code_cell(extra))
        target = course.submitted / student / ASSIGNMENT / NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(target))
    results = {r.student: r for r in grade(course, ASSIGNMENT, [*FORGERIES, "honest"], workers=2, sandbox="bwrap")}
    from autograder.export import export

    _, grades_csv, _ = export(course, ASSIGNMENT)
    with grades_csv.open() as handle:
        rows = {row["student"]: row for row in csv.DictReader(handle)}
    return results, rows


def scores(result) -> dict[str, float]:
    return {name: grade["auto_score"] for name, grade in result.grades.get(NAME, {}).items()}


def test_the_honest_notebook_keeps_full_marks_unflagged(graded):
    results, rows = graded
    assert results["honest"].status == "graded", results["honest"].log[-3000:]
    assert results["honest"].flags == [], results["honest"].flags
    assert scores(results["honest"]) == dict.fromkeys(TESTS, 1.0)
    assert rows["honest"]["status"] == "graded"


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_a_forgery_is_flagged_for_manual_grading(graded, case):
    results, rows = graded
    result = results[case]
    assert result.status == "graded", result.log[-3000:]
    reasons = " ".join(result.flags)
    assert "score not trusted" in reasons, (case, scores(result), result.flags)
    assert rows[case]["status"].startswith("needs manual grading"), rows[case]["status"]


def test_the_flags_name_what_was_replaced(graded):
    results, _ = graded
    reasons = {case: " ".join(results[case].flags) for case in FORGERIES}
    assert "math.isclose" in reasons["liar_with_patched_comparisons"]
    assert "numpy.allclose" in reasons["liar_with_patched_comparisons"]
    assert "sys.modules['course.grading']" in reasons["fake_course_grading_module"]
    assert "assert_close" in reasons["helpers_redefined"] and "math" in reasons["helpers_redefined"]
    assert "sys.setprofile" in reasons["reference_call_unseen"]
    assert "sys.setprofile" in reasons["reference_call_profile_cleared"]
    assert "gc.get_objects" in reasons["collector_walk"]
    assert "pub_socket" in reasons["callback_and_quiet_channel"]
    assert "course.grading.math" in reasons["planted_module_over_a_library_module"]
    assert "linecache.cache" in reasons["dict_keyed_to_hide_code"]
