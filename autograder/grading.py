"""Autograde notebooks through nbgrader in a throwaway course directory.

Used by the tests (the grading contract of every module) and, later, by the instructor
pipeline. Each call builds a fresh course directory holding only what grading needs: the
nbgrader sources of one assignment (copied into ``solutions/``), a gradebook made by
``generate_assignment``, and the submissions. nbgrader runs in a subprocess so a notebook
that crashes its kernel cannot take the caller down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from autograder.config import SOURCE_DIRECTORY, ensure_tools_on_path, repo_root

CONFIG_TEMPLATE = """\
import os
from autograder.config import configure
configure(get_config(), root=os.path.dirname(os.path.abspath(__file__)))
"""


@dataclass(frozen=True)
class CellScore:
    """The score nbgrader gave one autograded test cell."""

    grade_id: str
    score: float
    max_score: float


@dataclass
class GradingRun:
    """Scores per student and grade_id, plus nbgrader's log."""

    scores: dict[str, dict[str, CellScore]]
    log: str
    workdir: Path

    def total(self, student: str) -> tuple[float, float]:
        cells = self.scores[student].values()
        return sum(c.score for c in cells), sum(c.max_score for c in cells)


def _nbgrader(workdir: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    ensure_tools_on_path()  # alembic and jupyter must be found by the nbgrader subprocess
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo_root()) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "nbgrader", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def prepare_course(assignment: str, workdir: Path, root: Path | None = None, timeout: float = 300) -> Path:
    """Copy one assignment's sources into ``workdir`` and generate its release and gradebook.

    Returns the folder of the generated student notebooks.
    """
    root = Path(root or repo_root())
    shutil.copytree(root / SOURCE_DIRECTORY / assignment, workdir / SOURCE_DIRECTORY / assignment)
    (workdir / "nbgrader_config.py").write_text(CONFIG_TEMPLATE)
    result = _nbgrader(workdir, "generate_assignment", assignment, "--force", timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"generate_assignment {assignment} failed:\n{result.stdout}\n{result.stderr}")
    return workdir / "modules" / assignment


def autograde(
    assignment: str,
    submissions: Mapping[str, Mapping[str, object]],
    root: Path | None = None,
    workdir: Path | None = None,
    timeout: float = 1800,
) -> GradingRun:
    """Autograde notebooks and read the per-cell scores back from the gradebook.

    Args:
        assignment: assignment id (a folder of solutions/).
        submissions: student id -> {notebook file name -> notebook (NotebookNode)}.
        root: the course repository (default: this one).
        workdir: where to build the course directory (default: a new temporary folder).
        timeout: seconds for the whole nbgrader run.
    """
    import nbformat
    from nbgrader.api import Gradebook, MissingEntry

    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"grade-{assignment}-"))
    prepare_course(assignment, workdir, root)
    for student, files in submissions.items():
        for name, nb in files.items():
            target = workdir / "submitted" / student / assignment / name
            target.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, str(target))
    result = _nbgrader(workdir, "autograde", assignment, "--force", timeout=timeout)
    log = result.stdout + result.stderr
    scores: dict[str, dict[str, CellScore]] = {}
    with Gradebook(f"sqlite:///{workdir / 'gradebook.db'}") as gradebook:
        for student, files in submissions.items():
            scores[student] = {}
            for name in files:
                try:
                    notebook = gradebook.find_submission_notebook(Path(name).stem, assignment, student)
                except MissingEntry:
                    continue  # nbgrader could not grade it at all; the log says why
                for grade in notebook.grades:
                    if grade.max_score > 0 and grade.auto_score is not None:
                        scores[student][grade.name] = CellScore(grade.name, grade.auto_score, grade.max_score)
    return GradingRun(scores, log, workdir)
