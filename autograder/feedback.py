"""``autograder feedback``: one HTML report per student that keeps hidden tests hidden.

nbgrader's ``generate_feedback`` shows hidden tests, and even with its ``ClearHiddenTests`` the
traceback of a failing hidden assert still prints the hidden line. Here nbgrader renders the
autograded notebook through :class:`autograder.nbgrader_ext.SafeFeedback`: hidden-test lines are
removed, a failing test cell shows one line (visible or hidden test, and the test's message) instead
of its outputs, scriptable outputs become text, and a summary at the top gives the score per
exercise and what the grader did (repairs, timeouts, restarted kernels). Students whose notebook
could not be graded get a short page saying so.
"""

from __future__ import annotations

import contextlib
import html
import io
import warnings
from pathlib import Path

from autograder.config import ensure_tools_on_path, nbgrader_config
from autograder.course_dir import Course


def feedback_config(course: Course):
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import GetGrades

    from autograder.nbgrader_ext import SafeFeedback

    config = nbgrader_config(course.root, db_url=course.db_url)
    config.GenerateFeedback.preprocessors = [GetGrades, SafeFeedback, CSSHTMLHeaderPreprocessor]
    return config


def generate_feedback(
    course: Course, assignment: str, students: list[str] | None = None, progress: bool = False
) -> dict[str, Path]:
    """Write feedback/<student>/<assignment>/<notebook>.html; returns {student: folder}."""
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    ensure_tools_on_path()
    config = feedback_config(course)
    api = NbGraderAPI(coursedir=CourseDirectory(config=config), config=config)
    students = students if students is not None else course.students(assignment)
    names = list(course.release_notebooks(assignment))
    written: dict[str, Path] = {}
    todo = students
    if progress:
        from tqdm import tqdm

        todo = tqdm(students, desc="feedback", unit="student")
    for student in todo:
        target = course.feedback / student / assignment
        graded = course.autograded / student / assignment
        if all((graded / name).is_file() for name in names):
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
                warnings.catch_warnings(),
            ):
                warnings.simplefilter("ignore")
                result = api.generate_feedback(assignment, student, force=True)
            if not result["success"]:
                _failure_page(target, names, f"the feedback could not be rendered: {result.get('error', '')[-500:]}")
        else:
            record = course.load_result(assignment, student) or {}
            _failure_page(target, names, record.get("message") or "your notebook has not been graded yet")
        written[student] = target
    return written


def _failure_page(folder: Path, names: list[str], message: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        page = (
            "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Feedback</title></head><body>"
            f"<h1>{html.escape(Path(name).stem)}</h1>"
            "<p><strong>Your notebook could not be graded automatically:</strong> "
            f"{html.escape(message)}.</p><p>Your instructor will grade it by hand.</p></body></html>"
        )
        (folder / f"{Path(name).stem}.html").write_text(page)
