"""``autograder``: the instructor's command line (and the learners' self-check).

autograder release [ASSIGNMENT ...]     regenerate modules/ from solutions/ (outputs cleared)
autograder collect SUBMISSIONS          LMS zip or folder -> submitted/<student>/<assignment>/
autograder repair ASSIGNMENT            restore lost nbgrader metadata, deleted test cells, Colab format
autograder grade ASSIGNMENT             sandboxed parallel autograding into the gradebook
autograder feedback ASSIGNMENT          one HTML report per student, hidden tests kept hidden
autograder export ASSIGNMENT            grades.csv and a per-exercise summary.csv
autograder run ASSIGNMENT SUBMISSIONS   all of the above in one go
autograder check NOTEBOOK               self-grading for learners: visible and hidden tests, no gradebook

Exit status (the same convention as the ``course`` command): 0 when the step did its work (students
whose notebooks need manual grading are a result, listed in the output and grades.csv, not an
error); 2 on an error: bad input (a missing or damaged download, a bad --pattern, nothing to
collect), a missing release, another run holding the course; argparse's usage errors are 2 as well.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

GiB = 2**30
EXIT_ERROR = 2  # as `course`: errors and bad input exit 2, argparse's usage errors too
DUPLICATES_RULE = (
    "Duplicates: when a student has several files for one notebook, the one with the latest LMS timestamp "
    "is graded (the time in a Blackboard file name or Gradescope's metadata, else the time stored in the zip "
    "or the file's modification time); the others are listed as superseded. Two files with the same latest "
    "time are a tie: the one whose path sorts last is graded and the student is marked for manual grading "
    "with both paths named; a tie is never resolved silently or by zip order."
)
IDS_RULE = (
    "Student ids keep the LMS's user id where the download has one (Moodle's participant id, Canvas's user "
    "id, Blackboard's username, Gradescope's student id or e-mail): <name>_<id>. Names keep their Unicode "
    "letters (NFC-normalised, never transliterated) in lower case; an id without an LMS user id that lost "
    "anything of the exact name (case, spaces, punctuation, Unicode normalisation, length) ends in a hash of "
    "that name, so 'Alice' and 'alice', or two long names with the same beginning, stay two students. Files "
    "under names that still give one id (NFC and NFD, or spaces: leading, trailing, repeated, non-breaking, "
    "tabs) are taken as one student, who is marked for manual grading with every path named."
)


def _release(args: argparse.Namespace) -> int:
    from autograder.release import ReleaseError, release

    try:
        touched, released = release(args.root, args.assignments or None, args.db_url)
    except ReleaseError as err:
        print(f"autograder release: {err}", file=sys.stderr)
        return EXIT_ERROR
    for path in touched:
        print(f"cleaned source notebook {path}")
    for path in released:
        print(f"released {path}")
    return 0


def _course(args: argparse.Namespace):
    from autograder.course_dir import Course

    return Course(args.root, db_url=getattr(args, "db_url", None))


def _assignments(args: argparse.Namespace, course) -> list[str]:
    from autograder.config import assignments

    chosen = getattr(args, "assignment", None)
    if chosen:
        return chosen if isinstance(chosen, list) else [chosen]
    return assignments(course.root)


def _collect(args: argparse.Namespace) -> int:
    from autograder.collect import collect

    course = _course(args)
    with course.exclusive("collect"):
        report = collect(args.submissions, course.root, _assignments(args, course), args.pattern, progress=True)
    print(report.table())
    print(f"report: {course.grading / 'collect-report.json'}")
    if not report.collected and not report.manual:
        print("autograder collect: no notebook of these assignments was found (see the report)", file=sys.stderr)
        return EXIT_ERROR
    return 0


def _repair(args: argparse.Namespace) -> int:
    from autograder.pipeline import repair_submissions

    course = _course(args)
    with course.exclusive(f"repair {args.assignment}"):
        done = repair_submissions(course, args.assignment, args.student or None, progress=True)
    for student, notes in done.items():
        print(f"{student}: " + ("; ".join(notes) if notes else "nothing to repair"))
    return 0


def _limits(args: argparse.Namespace):
    from autograder.sandbox import Limits

    limits = Limits()
    limits.cell_timeout_s = args.cell_timeout or limits.cell_timeout_s
    limits.job_timeout_s = args.timeout or limits.job_timeout_s
    limits.memory_bytes = int(args.memory * GiB) if args.memory else limits.memory_bytes
    limits.cpu_seconds = args.cpu_time or limits.cpu_seconds
    limits.processes = args.processes or limits.processes
    return limits


def _grade(args: argparse.Namespace) -> int:
    from autograder.pipeline import grade

    course = _course(args)
    results = grade(
        course,
        args.assignment,
        args.student or None,
        workers=args.workers,
        sandbox=args.sandbox,
        limits=_limits(args),
        progress=True,
        keep_jobs=args.keep_jobs,
        scheduler=args.scheduler,
    )
    for result in results:
        if result.status != "graded":
            print(
                f"{result.student}: NOT GRADED ({result.message}); log: "
                f"{course.work(args.assignment) / 'logs' / (result.student + '.log')}"
            )
    failed = sum(r.status != "graded" for r in results)
    print(
        f"graded {len(results) - failed} of {len(results)} submission(s) of {args.assignment}"
        + (f"; {failed} need manual grading" if failed else "")
    )
    return 0


def _feedback(args: argparse.Namespace) -> int:
    from autograder.feedback import generate_feedback

    course = _course(args)
    written = generate_feedback(course, args.assignment, args.student or None, progress=True)
    print(f"feedback for {len(written)} student(s) in {course.feedback}/<student>/{args.assignment}/")
    return 0


def _export(args: argparse.Namespace) -> int:
    from autograder.export import export

    course = _course(args)
    result, grades, summary = export(course, args.assignment, args.output)
    print(result.table())
    print(f"wrote {grades} and {summary}")
    return 0


def _run(args: argparse.Namespace) -> int:
    from autograder.collect import collect

    course = _course(args)
    with course.exclusive(f"run {args.assignment}"):
        report = collect(args.submissions, course.root, [args.assignment], args.pattern, progress=True)
        print(report.table())
        if not report.collected and not report.manual:
            print("autograder run: nothing to grade (see the collect report)", file=sys.stderr)
            return EXIT_ERROR
        args.student = sorted({entry.student for entry in report.collected} | set(report.manual))
        for step in (_repair, _grade, _feedback, _export):
            code = step(args)
            if code:
                return code
    return 0


def _check(args: argparse.Namespace) -> int:
    from autograder.check import check_notebook

    try:
        report = check_notebook(args.notebook, source=args.source, timeout=args.timeout)
    except (LookupError, ValueError, OSError) as err:
        print(f"autograder check: {err}", file=sys.stderr)
        return EXIT_ERROR
    print(report.table())
    return 0


def _grade_options(parser: argparse.ArgumentParser) -> None:
    from autograder.sandbox import Limits

    defaults = Limits()
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="students graded at once (default: the CPU count, at most as many as the memory holds at --memory each)",
    )
    parser.add_argument(
        "--sandbox",
        choices=["auto", "bwrap", "none"],
        default="auto",
        help="bwrap: every student in a bubblewrap sandbox (needs root and bubblewrap); none: unconfined "
        "(trusted notebooks only); auto: bwrap where it works (default)",
    )
    limits = (  # flag, type, what it limits; None means the sandbox's default (autograder.sandbox.Limits)
        ("--cell-timeout", int, f"seconds per cell (default {defaults.cell_timeout_s})"),
        ("--timeout", int, f"seconds per student (default {defaults.job_timeout_s})"),
        ("--memory", float, f"GiB of address space per kernel (default {defaults.memory_bytes / GiB:g})"),
        ("--cpu-time", int, f"CPU seconds per kernel (default {defaults.cpu_seconds})"),
        ("--processes", int, f"processes and threads per kernel (default {defaults.processes})"),
    )
    for flag, kind, text in limits:
        parser.add_argument(flag, type=kind, default=None, help=text)
    parser.add_argument("--keep-jobs", action="store_true", help="keep each student's sandbox folder (debugging)")
    parser.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDRESS",
        help="grade on a Dask cluster: its scheduler's tcp://HOST:PORT, or 'config' for the one dask's configuration "
        "names (DASK_SCHEDULER_ADDRESS, ~/.config/dask/). Each job runs in the same sandbox with the same limits on "
        "whichever worker takes it; every worker needs root, bubblewrap and this course version (checked first); "
        "scores are merged here (default: grade on this machine)",
    )


def _db_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--db-url",
        default=None,
        help="gradebook URL, e.g. postgresql+psycopg2://user:pass@host/db (default: $AUTOGRADER_DB_URL, else "
        "sqlite gradebook.db in the course root)",
    )


def _command(
    commands, name: str, run, summary: str, description: str, *, students: bool = False
) -> argparse.ArgumentParser:
    """A subcommand that calls ``run(args)``; ``students``: it takes an ASSIGNMENT and --student filters.

    ``summary`` is its line in ``autograder --help``, ``description`` the text of ``autograder NAME --help``.
    """
    parser = commands.add_parser(name, help=summary, description=description)
    parser.set_defaults(run=run)
    if students:
        parser.add_argument("assignment")
        parser.add_argument("--student", action="append", help="only this student (repeatable)")
    return parser


PATTERN_HELP = (
    "student id from the path: a preset, the dotted name of an nbgrader collector plugin class (an "
    "autograder.plugins.CourseCollector subclass, or any nbgrader FileNameCollectorPlugin, configured by the "
    "course's nbgrader_config.py), or a regex applied to the path inside the download with a named group "
    "'student' (a name) and/or 'id' (the LMS's user id), optionally 'time' (YYYY-MM-DD-HH-MM-SS). Presets "
    "(nbgrader collector plugins in autograder.plugins, which plain `nbgrader zip_collect --collector` can load "
    "too): gradescope (submission_metadata.yml), moodle ('Name_<participant id>_assignsubmission_file_'), canvas "
    "('lastfirst[_LATE]_<user id>_<attachment id>_file'), blackboard ('<assignment>_<username>_attempt_<time>_file'), "
    "folder (first folder), file (file name up to the first _, - or space), auto (try those in that order; default)"
)


def build_parser() -> argparse.ArgumentParser:
    """The ``autograder`` command line: one subcommand per step (``_add_<step>``)."""
    parser = argparse.ArgumentParser(
        prog="autograder",
        description="Instructor tools of the LLM serving course: release, collect, repair, grade, feedback, "
        "export; and `check` for learners.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="A class in one go: autograder run m1_prefill_decode submissions.zip\n\n"
        "Exit status: 0 when the step did its work (students needing manual grading are listed, not an error); "
        "2 on errors and bad input, as the `course` command.",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=None,
        help="nbgrader course root (default: the course the current folder is in; a command run outside a course "
        "refuses instead of acting on the checkout the autograder is installed from)",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_release, _add_collect, _add_repair, _add_grade, _add_feedback, _add_export, _add_run, _add_check):
        add(commands)
    return parser


def _add_release(commands) -> None:
    rel = _command(
        commands,
        "release",
        _release,
        "regenerate the student notebooks in modules/ from the nbgrader sources in solutions/",
        "Rewrite each source notebook's setup cell from course/env.py, clear source outputs, "
        "then run nbgrader generate_assignment so modules/ holds the student notebooks (solutions and "
        "hidden tests removed, outputs cleared). Commit solutions/ and modules/ together.",
    )
    rel.add_argument("assignments", nargs="*", help="assignment ids (default: all folders of solutions/)")
    rel.add_argument("--db-url", default=None, help="gradebook URL (default: sqlite gradebook.db in the root)")


def _add_collect(commands) -> None:
    col = _command(
        commands,
        "collect",
        _collect,
        "copy submissions from an LMS zip or a folder into submitted/<student>/<assignment>/",
        "Find every notebook in SUBMISSIONS (a zip, nested zips, or a folder), take the student id "
        "from its path with --pattern, recognise its assignment by the marker comments of its graded cells "
        "(any file name: 'Copy of ...', 'name (1).ipynb', Colab's), and copy it under its canonical name. "
        "Every entry of the download is listed in grading/collect-report.json: collected, superseded, or skipped "
        "with the reason; a student whose file could not be read is marked for manual grading. "
        + IDS_RULE
        + " "
        + DUPLICATES_RULE,
    )
    col.add_argument("submissions", type=Path, help="LMS download: a .zip file or a folder")
    col.add_argument("--assignment", action="append", help="only this assignment (repeatable; default: all)")
    col.add_argument("--pattern", default="auto", help=PATTERN_HELP)


def _add_repair(commands) -> None:
    _command(
        commands,
        "repair",
        _repair,
        "restore lost nbgrader metadata, deleted test cells and Colab's format in submitted notebooks",
        "Match every graded cell of each submitted notebook to the release notebook by its marker "
        "comment (# EXERCISE: / # TEST:) and restore its nbgrader metadata; re-add deleted test cells; turn "
        "graded cells back into code cells; convert Colab's nbformat 4.0 (no cell ids). The notebook as "
        "received is kept in grading/<assignment>/received/ and repair always starts from it.",
        students=True,
    )


def _add_grade(commands) -> None:
    gra = _command(
        commands,
        "grade",
        _grade,
        "autograde every submission in parallel sandboxes and merge the scores into the gradebook",
        "Each student's nbgrader run and kernel execute in a bubblewrap sandbox: no network, no "
        "access to solutions/ or the gradebook, limits on memory, CPU time, processes, file and output size, a "
        "per-cell timeout. A crashing or hanging cell is marked, the kernel restarted and grading goes on; a "
        "student whose grading fails gets 0 marked for manual grading, never stopping the others. Scores are "
        "merged into the gradebook one student at a time.",
        students=True,
    )
    _db_option(gra)
    _grade_options(gra)


def _add_feedback(commands) -> None:
    fee = _command(
        commands,
        "feedback",
        _feedback,
        "write feedback/<student>/<assignment>/<notebook>.html without hidden tests or their tracebacks",
        "Render each autograded notebook with a summary (score per exercise, what the grader "
        "repaired or interrupted); test cells show only their visible tests, a failing test says whether it "
        "was visible or hidden and gives its message, never hidden code or a traceback through it.",
        students=True,
    )
    _db_option(fee)


def _add_export(commands) -> None:
    exp = _command(
        commands,
        "export",
        _export,
        "write grades.csv and a per-exercise summary.csv",
        "grades.csv: per student, the score of each exercise, total, max and status; summary.csv: "
        "per exercise, points, mean and share of full marks. Default folder: grading/<assignment>/. The same "
        "files as `nbgrader export --exporter=autograder.plugins.CourseCsvExport` (an nbgrader export plugin).",
    )
    exp.add_argument("assignment")
    exp.add_argument("--output", type=Path, default=None, help="folder for the CSV files")
    _db_option(exp)


def _add_run(commands) -> None:
    run = _command(
        commands,
        "run",
        _run,
        "collect, repair, grade, feedback and export in one go",
        "autograder collect + repair + grade + feedback + export for one assignment. Students whose "
        "files could not be read are graded 0 and marked for manual grading; a damaged file never stops the class. "
        + DUPLICATES_RULE,
    )
    run.add_argument("assignment")
    run.add_argument("submissions", type=Path, help="LMS download: a .zip file or a folder")
    run.add_argument("--pattern", default="auto", help="student id pattern (see `autograder collect --help`)")
    run.add_argument("--output", type=Path, default=None, help="folder for the CSV files")
    _db_option(run)
    _grade_options(run)


def _add_check(commands) -> None:
    chk = _command(
        commands,
        "check",
        _check,
        "self-check for learners: run one notebook with its visible and hidden tests, score per exercise",
        "Grades one notebook without a gradebook or nbgrader: repairs it like the instructor's "
        "pipeline, runs it in a fresh kernel with the full tests from the course's solutions/ (this checkout, "
        "or the public repository downloaded once), and prints the score per exercise. In Colab: "
        "`from autograder.check import check_colab; check_colab()`.",
    )
    chk.add_argument("notebook", type=Path)
    chk.add_argument("--source", type=Path, default=None, help="course root, solutions/ folder or source notebook")
    chk.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")


def find_course(start: Path) -> Path | None:
    """The course holding ``start``: the nearest folder with nbgrader_config.py, or solutions/ and modules/."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if (folder / "nbgrader_config.py").is_file() or (
            (folder / "solutions").is_dir() and (folder / "modules").is_dir()
        ):
            return folder
    return None


def course_root(explicit: Path | None, cwd: Path | None = None) -> Path:
    """The course root a command acts on: ``--root`` when given, else the course the current folder is in.

    Never the checkout the installed package comes from by default: with a virtual environment shared
    by several course copies (or an editable install of another clone), that would be another course.
    """
    from autograder.config import repo_root

    if explicit is not None:
        return Path(explicit).resolve()
    here = Path.cwd() if cwd is None else Path(cwd)
    found = find_course(here)
    if found is None:
        raise RuntimeError(
            f"the current folder ({here.resolve()}) is not inside a course (no nbgrader_config.py, or solutions/ "
            f"and modules/, in it or above it): cd into the course, or name it with --root DIR (the course this "
            f"autograder is installed from is {repo_root()})"
        )
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command != "check":
            from autograder.config import repo_root

            args.root = course_root(args.root)
            print(f"autograder {args.command}: course root {args.root}", file=sys.stderr)
            installed = repo_root()
            if installed != args.root:
                print(
                    f"autograder {args.command}: note: the autograder and course library in use come from "
                    f"{installed} (this virtual environment's install), not from {args.root}",
                    file=sys.stderr,
                )
        return args.run(args)
    except (RuntimeError, FileNotFoundError, ValueError, OSError) as err:
        print(f"autograder {args.command}: {err}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
