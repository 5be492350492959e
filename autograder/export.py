"""``autograder export``: the grades of one assignment as CSV, and a per-exercise summary.

``grades.csv``: one row per student: the score of every exercise (grade cells summed by their
exercise id, ``ex1_3_pooled_itl`` -> ``ex1_3``), the total, the maximum, and the status
("graded", "needs manual grading: <why>"). Manual scores entered in nbgrader's formgrader win over
automatic ones, as in nbgrader's own export.

``summary.csv``: one row per exercise: its points, the mean score, the share of students with full
marks, and how many students were counted.

The CSV is also an nbgrader export plugin (:class:`autograder.plugins.CourseCsvExport`):
``nbgrader export --exporter=autograder.plugins.CourseCsvExport`` writes the same files.
"""

from __future__ import annotations

import contextlib
import csv
import warnings
from dataclasses import dataclass
from pathlib import Path

from autograder.course_dir import Course


@dataclass
class Export:
    exercises: dict[str, float]  # exercise -> max points, in notebook order
    rows: list[dict]  # one per student
    summary: list[dict]  # one per exercise

    def table(self) -> str:
        lines = [f"{'exercise':12s} {'points':>6s} {'mean':>7s} {'full marks':>10s}  n"]
        for row in self.summary:
            share = f"{row['share_full_marks']:10.0%}"
            lines.append(f"{row['exercise']:12s} {row['points']:6g} {row['mean']:7.2f} {share}  {row['n']}")
        return "\n".join(lines)


def _exercise(grade_id: str) -> str:
    from autograder.notebooks import exercise_of

    try:
        return exercise_of(grade_id)
    except ValueError:
        return grade_id


def collect_grades(course: Course, assignment: str) -> Export:
    """Read the assignment's grades from the course's gradebook."""
    with open_gradebook(course) as gradebook:
        return grades_of(gradebook, course, assignment)


@contextlib.contextmanager
def open_gradebook(course: Course):
    """The course's nbgrader Gradebook, open (SQLAlchemy's cosmetic warnings silenced)."""
    from nbgrader.api import Gradebook

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SQLAlchemy's cosmetic SAWarnings (nbgrader #1963)
        with Gradebook(course.db_url) as gradebook:
            yield gradebook


def grades_of(gradebook, course: Course, assignment: str, students: set[str] | None = None) -> Export:
    """The grades of ``assignment`` in an open nbgrader ``Gradebook`` (``students``: only these ids).

    Scores are points (grade cells summed per exercise, rounded to 4 decimals); the status reads
    the pipeline's records in ``course`` (grading failures, collect and repair flags).
    """
    from nbgrader.api import MissingEntry

    try:
        found = gradebook.find_assignment(assignment)
    except MissingEntry:
        # the gradebook URL is not named: a PostgreSQL URL can carry a password
        raise ValueError(f"no assignment {assignment!r} in the gradebook: grade it first") from None
    exercises = _exercise_points(found)
    submissions = sorted(found.submissions, key=lambda s: s.student.id)
    rows = [
        _student_row(course, assignment, submission, exercises)
        for submission in submissions
        if students is None or submission.student.id in students
    ]
    return Export(exercises, rows, _summary(exercises, rows))


def _exercise_points(assignment) -> dict[str, float]:
    """exercise -> max points, in notebook order (grade cells summed by their exercise id)."""
    exercises: dict[str, float] = {}
    for notebook in assignment.notebooks:
        for cell in notebook.grade_cells:
            key = _exercise(cell.name)
            exercises[key] = exercises.get(key, 0.0) + float(cell.max_score)
    return exercises


def _student_row(course: Course, assignment: str, submission, exercises: dict[str, float]) -> dict:
    """One row of grades.csv: student, a score per exercise, total, max, status."""
    scores = dict.fromkeys(exercises, 0.0)
    manual = flagged = False
    for notebook in submission.notebooks:
        flagged = flagged or bool(notebook.flagged)
        for grade in notebook.grades:
            scores[_exercise(grade.name)] += float(grade.score or 0.0)
            manual = manual or bool(grade.needs_manual_grade)
    record = course.load_result(assignment, submission.student.id) or {}
    return {
        "student": submission.student.id,
        **{key: round(value, 4) for key, value in scores.items()},
        "total": round(sum(scores.values()), 4),
        "max": sum(exercises.values()),
        "status": _status(record, flagged, manual),
    }


def _status(record: dict, flagged: bool, manual: bool) -> str:
    """The status column: graded, or needs manual grading with the reason the pipeline recorded."""
    if record.get("status") not in (None, "graded"):
        return f"needs manual grading: {record.get('message') or 'grading failed'}"
    if record.get("flags"):
        return f"needs manual grading: {'; '.join(record['flags'])}"
    if flagged:
        return "needs manual grading: grading failed"
    return "needs manual grading" if manual else "graded"


def _summary(exercises: dict[str, float], rows: list[dict]) -> list[dict]:
    """One row per exercise: points, mean score, share of students with full marks, count."""
    summary = []
    for key, points in exercises.items():
        values = [row[key] for row in rows]
        summary.append(
            {
                "exercise": key,
                "points": points,
                "mean": sum(values) / len(values) if values else 0.0,
                "share_full_marks": sum(v >= points - 1e-9 for v in values) / len(values) if values else 0.0,
                "n": len(values),
            }
        )
    return summary


def write_csv(result: Export, folder: Path) -> tuple[Path, Path]:
    """Write ``folder``/grades.csv and ``folder``/summary.csv (UTF-8; means and shares to 4 decimals)."""
    folder.mkdir(parents=True, exist_ok=True)
    grades_path, summary_path = folder / "grades.csv", folder / "summary.csv"
    columns = ["student", *result.exercises, "total", "max", "status"]
    with open(grades_path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(result.rows)
    with open(summary_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["exercise", "points", "mean", "share_full_marks", "n"])
        writer.writeheader()
        for row in result.summary:
            writer.writerow({**row, "mean": f"{row['mean']:.4f}", "share_full_marks": f"{row['share_full_marks']:.4f}"})
    return grades_path, summary_path


def export(course: Course, assignment: str, output: Path | None = None) -> tuple[Export, Path, Path]:
    """Write grades.csv and summary.csv (default folder: grading/<assignment>/) through the nbgrader plugin.

    The same code as ``nbgrader export --exporter=autograder.plugins.CourseCsvExport``.
    """
    from autograder.plugins import CourseCsvExport

    with open_gradebook(course) as gradebook:
        return CourseCsvExport().write(gradebook, course, assignment, output)
