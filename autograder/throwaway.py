"""Autograde notebooks through the grading pipeline in a throwaway course directory.

Used by the tests (the grading contract of every module). Each call builds a fresh course
directory holding only what grading needs: the nbgrader sources of one assignment (copied into
``solutions/``), a gradebook and release made by ``generate_assignment``, and the submissions.
The submissions are then graded exactly as an instructor's class is: in parallel worker processes,
each student in its own sandbox (:mod:`autograder.sandbox`; unconfined where bubblewrap cannot run),
with scores merged into the course's gradebook.

(Named for what it builds, and so that it does not collide with :mod:`course.grading`, the helpers
the notebooks' test cells use.)
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from autograder.config import SOURCE_DIRECTORY, repo_root

CONFIG_TEMPLATE = """\
import os
from autograder.config import configure
configure(get_config(), root=os.path.dirname(os.path.abspath(__file__)), db_url={db_url!r})
"""


@dataclass(frozen=True)
class CellScore:
    """The score nbgrader gave one autograded test cell."""

    grade_id: str
    score: float
    max_score: float


@dataclass
class GradingRun:
    """Scores per student and grade_id, plus the grading logs."""

    scores: dict[str, dict[str, CellScore]]
    log: str
    workdir: Path
    results: dict | None = None  # student -> autograder.sandbox.JobResult

    def total(self, student: str) -> tuple[float, float]:
        cells = self.scores[student].values()
        return sum(c.score for c in cells), sum(c.max_score for c in cells)


def prepare_course(assignment: str, workdir: Path, root: Path | None = None, db_url: str | None = None) -> Path:
    """Copy one assignment's sources into ``workdir`` and generate its release and gradebook.

    ``db_url`` puts the assignment into that gradebook instead of ``workdir/gradebook.db``; an
    ``nbgrader_config.py`` lets the plain ``nbgrader`` command work in ``workdir`` too.
    Returns the folder of the generated student notebooks.
    """
    from autograder.release import generate

    root = Path(root or repo_root())
    workdir = Path(workdir)
    shutil.copytree(root / SOURCE_DIRECTORY / assignment, workdir / SOURCE_DIRECTORY / assignment)
    (workdir / "nbgrader_config.py").write_text(CONFIG_TEMPLATE.format(db_url=db_url))
    generate(workdir, [assignment], db_url or f"sqlite:///{workdir / 'gradebook.db'}")
    return workdir / "modules" / assignment


def autograde(
    assignment: str,
    submissions: Mapping[str, Mapping[str, object]],
    root: Path | None = None,
    workdir: Path | None = None,
    timeout: float = 1800,
    workers: int | None = None,
    sandbox: str = "auto",
    limits=None,
) -> GradingRun:
    """Autograde notebooks and read the per-cell scores back from the gradebook.

    Args:
        assignment: assignment id (a folder of solutions/).
        submissions: student id -> {notebook file name -> notebook (NotebookNode)}.
        root: the course repository (default: this one).
        workdir: where to build the course directory (default: a new temporary folder).
        timeout: seconds allowed for grading one student (the whole notebook).
        workers: students graded at once (default: the number of CPUs).
        sandbox: "auto" (bubblewrap where it works), "bwrap" (required) or "none".
        limits: an :class:`autograder.sandbox.Limits` (default: the course's limits).
    """
    import dataclasses

    import nbformat
    from nbgrader.api import Gradebook, MissingEntry

    from autograder.course_dir import Course
    from autograder.pipeline import grade
    from autograder.sandbox import Limits

    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"grade-{assignment}-"))
    prepare_course(assignment, workdir, root)
    course = Course(workdir, db_url=f"sqlite:///{workdir / 'gradebook.db'}")
    template = course.work(assignment) / "template.db"
    shutil.copyfile(workdir / "gradebook.db", template)  # still without submissions: the sandboxes' template
    for student, files in submissions.items():
        for name, nb in files.items():
            target = course.submitted / student / assignment / name
            target.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, str(target))
    limits = dataclasses.replace(limits or Limits(), job_timeout_s=int(timeout))
    results = grade(
        course, assignment, list(submissions), workers=workers, sandbox=sandbox, limits=limits, template=template
    )
    log = "\n".join(f"=== {r.student}: {r.status} {r.message}\n{r.log}" for r in results)
    scores: dict[str, dict[str, CellScore]] = {}
    with Gradebook(course.db_url) as gradebook:
        for student, files in submissions.items():
            scores[student] = {}
            for name in files:
                try:
                    notebook = gradebook.find_submission_notebook(Path(name).stem, assignment, student)
                except MissingEntry:
                    continue  # nbgrader could not grade it at all; the log says why
                if notebook.flagged:
                    continue  # grading failed: nothing was scored
                for grade_row in notebook.grades:
                    if grade_row.max_score > 0 and grade_row.auto_score is not None:
                        scores[student][grade_row.name] = CellScore(
                            grade_row.name, grade_row.auto_score, grade_row.max_score
                        )
    return GradingRun(scores, log, workdir, {r.student: r for r in results})
