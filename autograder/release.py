"""``autograder release``: regenerate the student notebooks in modules/ from solutions/."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from autograder import notebooks
from autograder.config import (
    RELEASE_DIRECTORY,
    SOURCE_DIRECTORY,
    assignments,
    ensure_tools_on_path,
    nbgrader_config,
    repo_root,
)


class ReleaseError(RuntimeError):
    """nbgrader could not generate an assignment; the message holds its log."""


def sync_setup_cells(root: Path) -> list[Path]:
    """Make every source notebook's first code cell the course's setup cell.

    The setup cell carries the repository URL from course/env.py; rewriting it here keeps that
    URL configured in one place. Returns the notebooks that changed.
    """
    from course.env import bootstrap_cell_source

    changed = []
    for path in sorted((root / SOURCE_DIRECTORY).glob("*/*.ipynb")):
        nb = notebooks.read(path)
        if notebooks.set_first_code_cell(nb, bootstrap_cell_source()):
            notebooks.write(nb, path)
            changed.append(path)
    return changed


def clear_outputs(root: Path) -> list[Path]:
    """Strip outputs and execution counts from the source notebooks (they are kept clean in git)."""
    changed = []
    for path in sorted((root / SOURCE_DIRECTORY).glob("*/*.ipynb")):
        nb = notebooks.read(path)
        dirty = False
        for cell in nb.cells:
            if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
                cell.outputs, cell.execution_count, dirty = [], None, True
        if dirty:
            notebooks.write(nb, path)
            changed.append(path)
    return changed


def generate(root: Path, assignment_ids: list[str] | None = None, db_url: str | None = None) -> list[Path]:
    """Run nbgrader's generate_assignment for each assignment; returns the released notebooks."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    ensure_tools_on_path()
    config = nbgrader_config(root, db_url=db_url)
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    released = []
    for assignment in assignment_ids or assignments(root):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            result = api.generate_assignment(assignment, force=True, create=True)
        if not result["success"]:
            raise ReleaseError(f"nbgrader could not generate {assignment}:\n{result['log']}\n{result.get('error', '')}")
        released += sorted((root / RELEASE_DIRECTORY / assignment).glob("*.ipynb"))
    return released


def release(root: str | Path | None = None, assignment_ids: list[str] | None = None, db_url: str | None = None):
    """Sync setup cells, clear source outputs, then regenerate modules/ (the whole release step)."""
    root = Path(root or repo_root())
    touched = sync_setup_cells(root) + clear_outputs(root)
    return touched, generate(root, assignment_ids, db_url)
