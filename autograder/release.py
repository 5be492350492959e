"""``autograder release``: regenerate the student notebooks in modules/ from solutions/.

It also pins everything a learner opens to one release tag, ``course.env.REPO_REF``
(``v`` + ``course.env.VERSION``): the setup cell of every notebook installs the course from that
tag, the README's Colab badges open the notebooks at that tag, and ``autograder check`` downloads
the hidden tests from it. Cutting a release is: bump ``VERSION``, run ``autograder release``,
commit, then ``git tag v<VERSION>`` and push the tag (docs/maintainers.md, "Cutting a release").
"""

from __future__ import annotations

import re
from pathlib import Path

from autograder import notebooks
from autograder.config import (
    RELEASE_DIRECTORY,
    SOURCE_DIRECTORY,
    assignments,
    ensure_tools_on_path,
    nbgrader_app,
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


def colab_badge_pattern() -> re.Pattern:
    """The README's Colab links into this repository; group 1 is the git ref they open."""
    from course.env import REPO_URL

    repo = re.escape(REPO_URL.removeprefix("https://github.com/"))
    return re.compile(rf"(?<=https://colab\.research\.google\.com/github/{repo}/blob/)([^/\s)]+)(?=/)")


def sync_readme_badges(root: Path) -> list[Path]:
    """Point the README's Colab badges at the release tag (REPO_REF). Returns [README] if it changed."""
    from course.env import REPO_REF

    readme = root / "README.md"
    if not readme.is_file():
        return []
    text = readme.read_text()
    pinned = colab_badge_pattern().sub(REPO_REF, text)
    if pinned == text:
        return []
    readme.write_text(pinned)
    return [readme]


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
        with nbgrader_app():
            result = api.generate_assignment(assignment, force=True, create=True)
        if not result["success"]:
            raise ReleaseError(f"nbgrader could not generate {assignment}:\n{result['log']}\n{result.get('error', '')}")
        released += sorted((root / RELEASE_DIRECTORY / assignment).glob("*.ipynb"))
    return released


def release(root: str | Path | None = None, assignment_ids: list[str] | None = None, db_url: str | None = None):
    """Sync setup cells and badges, clear source outputs, then regenerate modules/ (the whole release step)."""
    root = Path(root or repo_root())
    touched = sync_setup_cells(root) + sync_readme_badges(root) + clear_outputs(root)
    return touched, generate(root, assignment_ids, db_url)
