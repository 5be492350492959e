"""Reading and editing nbgrader notebooks: graded cells, their markers, and answers.

Every graded cell of the course starts with a stable marker comment, ``# EXERCISE: <grade_id>``
for answer cells and ``# TEST: <grade_id>`` for test cells, so a cell can be recognised even
when a notebook editor (Colab, copy and paste) lost its nbgrader metadata.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import nbformat

from course.grading import MARKER  # the marker comment of graded cells, defined once for both sides


def read(path: str | Path) -> nbformat.NotebookNode:
    return nbformat.read(str(path), as_version=4)


def write(nb: nbformat.NotebookNode, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    return path


def marker(cell) -> tuple[str, str] | None:
    """("EXERCISE" | "TEST", grade_id) from the cell's first line, or None."""
    first = cell.source.split("\n", 1)[0] if cell.source else ""
    match = MARKER.match(first.strip())
    return (match.group(1), match.group(2)) if match else None


def grade_id(cell) -> str | None:
    """The cell's nbgrader grade_id (None when it has none, or a value that is not a string)."""
    meta = cell.get("metadata", {})
    nbgrader = meta.get("nbgrader", {}) if isinstance(meta, dict) else {}
    value = nbgrader.get("grade_id") if isinstance(nbgrader, dict) else None
    return value if isinstance(value, str) else None


def is_answer_cell(cell) -> bool:
    return bool(cell.get("metadata", {}).get("nbgrader", {}).get("solution"))


def is_test_cell(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return bool(meta.get("grade")) and not meta.get("solution")


def answer_sources(nb) -> dict[str, str]:
    """grade_id -> source of every answer (solution) cell."""
    return {grade_id(cell): cell.source for cell in nb.cells if is_answer_cell(cell)}


def test_points(nb) -> dict[str, float]:
    """grade_id -> points of every autograded test cell."""
    return {grade_id(cell): float(cell.metadata.nbgrader.get("points", 0)) for cell in nb.cells if is_test_cell(cell)}


def exercise_of(cell_grade_id: str) -> str:
    """The exercise a grade_id belongs to: ``ex1_3_pooled_itl`` -> ``ex1_3``."""
    match = re.match(r"(ex\d+_\d+)", cell_grade_id)
    if not match:
        raise ValueError(f"grade_id {cell_grade_id!r} does not start with an exercise id like ex1_3")
    return match.group(1)


def with_answers(nb, answers: dict[str, str]):
    """A copy of ``nb`` whose answer cells named in ``answers`` hold the given sources."""
    filled = copy.deepcopy(nb)
    unknown = set(answers) - set(answer_sources(filled))
    if unknown:
        raise KeyError(f"no answer cells with grade_id {sorted(unknown)} in this notebook")
    for cell in filled.cells:
        if is_answer_cell(cell) and grade_id(cell) in answers:
            cell.source = answers[grade_id(cell)]
    return filled


def set_first_code_cell(nb, source: str) -> bool:
    """Replace the first code cell's source; True when it changed."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            if cell.source == source:
                return False
            cell.source = source
            return True
    raise ValueError("the notebook has no code cell")
