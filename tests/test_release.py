"""modules/ is generated from solutions/ and stays in sync; every notebook follows the contract."""

import json
import re
import shutil
from pathlib import Path

import pytest

from autograder import notebooks
from autograder.config import assignments
from autograder.release import generate
from course.env import bootstrap_cell_source

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "solutions").glob("*/*.ipynb"))
RELEASED = sorted((ROOT / "modules").glob("*/*.ipynb"))
HEADING = re.compile(r"^### Exercise (\d+)\.(\d+) — .+ \((\d+) points?\)$", re.MULTILINE)


def test_there_is_a_module_and_it_is_released():
    assert SOURCES, "solutions/ holds no notebooks"
    assert [p.relative_to(ROOT / "modules") for p in RELEASED] == [p.relative_to(ROOT / "solutions") for p in SOURCES]


def test_modules_are_in_sync_with_solutions(tmp_path):
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    fresh = generate(tmp_path, db_url=f"sqlite:///{tmp_path / 'gradebook.db'}")
    assert len(fresh) == len(RELEASED)
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert json.loads(path.read_text()) == json.loads(committed.read_text()), (
            f"{committed.relative_to(ROOT)} is out of date: run `autograder release` and commit modules/"
        )


@pytest.mark.parametrize("path", SOURCES + RELEASED, ids=lambda p: str(p.relative_to(ROOT)))
def test_notebooks_are_kept_without_outputs(path):
    for cell in notebooks.read(path).cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs: clear them"


@pytest.mark.parametrize("path", SOURCES + RELEASED, ids=lambda p: str(p.relative_to(ROOT)))
def test_first_code_cell_is_the_setup_cell(path):
    first = next(c for c in notebooks.read(path).cells if c.cell_type == "code")
    assert first.source == bootstrap_cell_source(), "run `autograder release` to rewrite the setup cells"


@pytest.mark.parametrize("path", RELEASED, ids=lambda p: str(p.relative_to(ROOT)))
def test_release_holds_no_solutions_or_hidden_tests(path):
    text = path.read_text()
    for leak in ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "reveal=False"):
        assert leak not in text, f"{path.name} contains {leak!r}"
    nb = notebooks.read(path)
    for cell in nb.cells:
        if notebooks.is_answer_cell(cell):
            assert "raise NotImplementedError()" in cell.source


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_graded_cells_carry_their_marker_and_a_docstring(path):
    nb = notebooks.read(path)
    graded = [c for c in nb.cells if notebooks.grade_id(c)]
    assert graded, "no graded cells"
    for cell in graded:
        kind = "EXERCISE" if notebooks.is_answer_cell(cell) else "TEST"
        assert notebooks.marker(cell) == (kind, notebooks.grade_id(cell)), cell.source[:80]
        notebooks.exercise_of(notebooks.grade_id(cell))  # named after its exercise
        if kind == "TEST":
            second = cell.source.split("\n")[1]
            assert second.startswith('"""') and second.endswith('"""'), (
                f"{notebooks.grade_id(cell)} needs a one-line docstring"
            )


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_exercise_headings_state_the_points_the_tests_give(path):
    nb = notebooks.read(path)
    points: dict[str, float] = {}
    for grade_id, value in notebooks.test_points(nb).items():
        points[notebooks.exercise_of(grade_id)] = points.get(notebooks.exercise_of(grade_id), 0) + value
    headings = {}
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for module, number, stated in HEADING.findall(cell.source):
                headings[f"ex{module}_{number}"] = float(stated)
    assert headings == points, "each '### Exercise N.M — ... (k points)' heading must match its test cells' points"
    answers = set(notebooks.answer_sources(nb))
    assert answers == set(points), "every exercise has one answer cell and at least one test cell"


def test_assignment_ids_are_the_solution_folders():
    assert assignments(ROOT) == sorted(p.parent.name for p in SOURCES)
