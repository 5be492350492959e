"""``autograder export``: the grades of one assignment as CSV, and a per-exercise summary.

``grades.csv``: one row per student: the score of every exercise (grade cells summed by their
exercise id, ``ex1_3_pooled_itl`` -> ``ex1_3``), the total, the maximum, and the status
("graded", "needs manual grading: <why>"). Manual scores entered in nbgrader's formgrader win over
automatic ones, as in nbgrader's own export.

``summary.csv``: one row per exercise: its points, the mean score, the share of students with full
marks, and how many students were counted.
"""

from __future__ import annotations

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
    """Read the assignment's grades from the gradebook."""
    from nbgrader.api import Gradebook

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SQLAlchemy's cosmetic SAWarnings (nbgrader #1963)
        with Gradebook(course.db_url) as gradebook:
            found = gradebook.find_assignment(assignment)
            exercises: dict[str, float] = {}
            for notebook in found.notebooks:
                for cell in notebook.grade_cells:
                    key = _exercise(cell.name)
                    exercises[key] = exercises.get(key, 0.0) + float(cell.max_score)
            rows = []
            for submission in sorted(found.submissions, key=lambda s: s.student.id):
                scores = dict.fromkeys(exercises, 0.0)
                manual = False
                flagged = False
                for notebook in submission.notebooks:
                    flagged = flagged or bool(notebook.flagged)
                    for grade in notebook.grades:
                        scores[_exercise(grade.name)] += float(grade.score or 0.0)
                        manual = manual or bool(grade.needs_manual_grade)
                record = course.load_result(assignment, submission.student.id) or {}
                if record.get("status") not in (None, "graded"):
                    status = f"needs manual grading: {record.get('message') or 'grading failed'}"
                elif record.get("flags"):
                    status = f"needs manual grading: {'; '.join(record['flags'])}"
                elif flagged:
                    status = "needs manual grading: grading failed"
                elif manual:
                    status = "needs manual grading"
                else:
                    status = "graded"
                rows.append(
                    {
                        "student": submission.student.id,
                        **{key: round(value, 4) for key, value in scores.items()},
                        "total": round(sum(scores.values()), 4),
                        "max": sum(exercises.values()),
                        "status": status,
                    }
                )
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
    return Export(exercises, rows, summary)


def export(course: Course, assignment: str, output: Path | None = None) -> tuple[Export, Path, Path]:
    """Write grades.csv and summary.csv (default folder: grading/<assignment>/)."""
    result = collect_grades(course, assignment)
    folder = Path(output) if output else course.work(assignment)
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
    return result, grades_path, summary_path
