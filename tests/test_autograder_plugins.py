"""The course's collect and export rules as nbgrader plugins (``autograder.plugins``).

Each LMS preset, run as nbgrader's collector plugin on the extracted download, gives the student,
notebook and time ``autograder collect`` gives on the same download; plain ``nbgrader zip_collect``
and ``nbgrader export`` (nbgrader's own command line, in a subprocess) load the plugins and write
the submitted tree and the same CSV as ``autograder``. No notebook is executed here.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import zipfile
from datetime import datetime
from pathlib import Path

import nbformat
import pytest
from helpers import M1_ASSIGNMENT, M1_NOTEBOOK, REPO_ROOT, m1_course, m1_release, notebook_bytes, zip_with_times

from autograder import cli, notebooks, plugins
from autograder.collect import collect, compile_pattern, find_student
from autograder.config import nbgrader_config

ASSIGNMENT, NAME = M1_ASSIGNMENT, M1_NOTEBOOK  # the release these tests collect
OLDER, NEWER = (2026, 11, 29, 8, 0, 0), (2026, 11, 30, 22, 10, 6)  # zip times have 2 s resolution
GRADESCOPE_YML = (
    "submission_101:\n  :submitters:\n  - :name: Jane Doe\n    :sid: '2026001'\n    :email: jane@uni.edu\n"
    "  :created_at: 2026-11-30 10:00:00.000000000 +00:00\n"
)


@pytest.fixture(scope="module")
def release():
    return m1_release()


@pytest.fixture
def course_root(tmp_path):
    return m1_course(tmp_path, nbgrader_config=True)


def answered(release) -> bytes:
    """Another (worked) version of the notebook, so which file was kept can be told apart."""
    return notebook_bytes(
        notebooks.with_answers(release, {"ex1_4": "# EXERCISE: ex1_4\ndef quiz_answers():\n    return {}"})
    )


def zip_collect_app(root: Path, extractor=plugins.CourseExtractor):
    """An nbgrader ZipCollectApp for ``root``'s assignment, configured as `nbgrader zip_collect` would be."""
    from nbgrader.apps.zipcollectapp import ZipCollectApp
    from nbgrader.coursedir import CourseDirectory

    app = ZipCollectApp(config=nbgrader_config(root))
    app.coursedir = CourseDirectory(parent=app)
    app.coursedir.assignment_id = ASSIGNMENT
    app.extractor_plugin = extractor
    return app


def run_plugin(root: Path, download: Path, pattern: str) -> set[tuple[str, str, str | None]]:
    """(student, notebook, time) of every file the preset's plugin collects under nbgrader's layout."""
    app = zip_collect_app(root)
    archive = root / "downloaded" / ASSIGNMENT / "archive"
    extracted = root / "downloaded" / ASSIGNMENT / "extracted"
    archive.mkdir(parents=True)
    (archive / download.name).write_bytes(download.read_bytes())
    plugins.CourseExtractor(parent=app).extract(str(archive), str(extracted))
    collector = type(compile_pattern(pattern))(parent=app)
    if isinstance(collector, plugins.PatternCollector):
        collector.pattern = pattern
    found = set()
    for path in sorted(p for p in extracted.rglob("*") if p.is_file()):
        info = collector.collect(str(path))
        if info is not None:
            when = info["timestamp"].isoformat(sep=" ") if info["timestamp"] else None
            found.add((info["student_id"], info["file_id"], when))
    return found


# Real-looking LMS downloads (the names of the collect tests) and the student ids they must give.
DOWNLOADS = {
    "moodle": (
        [
            ("Jane Doe_12345_assignsubmission_file_/Copy of prefill_decode.ipynb", OLDER),
            ("Jöhn Smith_67890_assignsubmission_file_/prefill_decode (1).ipynb", NEWER),
        ],
        {"jane_doe_12345", "jöhn_smith_67890"},
    ),
    "canvas": (
        [
            ("doejane_12345_6789012_prefill_decode-1.ipynb", OLDER),
            ("smithjohn_LATE_67890_1234_Copy of prefill_decode.ipynb", NEWER),
        ],
        {"doejane_12345", "smithjohn_67890"},
    ),
    "blackboard": (
        [
            ("Module 1_jdoe7_attempt_2026-11-30-22-10-05_prefill_decode.ipynb", OLDER),
            ("Module 1_jdoe7_attempt_2026-11-29-08-00-00_prefill_decode.ipynb", NEWER),
        ],
        {"jdoe7"},
    ),
    "gradescope": ([(f"assignment_9_export/submission_101/{NAME}", OLDER)], {"jane_doe_2026001"}),
    "folder": ([(f"amy/{NAME}", OLDER), (f"bob/Copy of {NAME}", NEWER)], {"amy", "bob"}),
    "file": ([("s1234567-week1.ipynb", OLDER), ("s7654321_prefill_decode.ipynb", NEWER)], {"s1234567", "s7654321"}),
    r"(?P<student>s\d{7})-": ([("s1234567-week1.ipynb", OLDER)], {"s1234567"}),
    "auto": ([("Jane Doe_12345_assignsubmission_file_/x.ipynb", OLDER), (f"amy/{NAME}", NEWER)], None),
}


@pytest.mark.parametrize("pattern", sorted(DOWNLOADS))
def test_each_preset_plugin_gives_the_student_notebook_and_time_of_autograder_collect(
    course_root, release, tmp_path, pattern
):
    files, students = DOWNLOADS[pattern]
    members = [(name, notebook_bytes(release), when) for name, when in files]
    if pattern == "gradescope":
        members.append(("assignment_9_export/submission_metadata.yml", GRADESCOPE_YML.encode(), OLDER))
    download = tmp_path / "download.zip"
    download.write_bytes(zip_with_times(members))
    report = collect(download, course_root, [ASSIGNMENT], pattern)
    today = {(e.student, e.notebook, e.time) for e in [*report.collected, *report.superseded]}
    assert len(today) == len(files), report.table()
    if students is not None:
        assert {student for student, _, _ in today} == students, "the LMS user ids the collect tests pin"
    assert run_plugin(course_root, download, pattern) == today
    if pattern == "blackboard":  # the attempt's time in the name, not the zip's
        assert ("jdoe7", NAME, "2026-11-30 22:10:05") in today
    if pattern == "gradescope":  # :created_at: (UTC) in local time
        created = datetime.fromisoformat("2026-11-30 10:00:00+00:00").astimezone().replace(tzinfo=None)
        assert today == {("jane_doe_2026001", NAME, created.isoformat(sep=" "))}


def test_without_the_course_extractor_only_the_lms_time_is_returned(course_root, release, tmp_path):
    """nbgrader's default extractor writes extraction times: no submission time for nbgrader to compare."""
    from nbgrader.plugins import ExtractorPlugin

    app = zip_collect_app(course_root, extractor=ExtractorPlugin)
    extracted = course_root / "downloaded" / ASSIGNMENT / "extracted" / "canvas"
    extracted.mkdir(parents=True)
    (extracted / "doejane_12345_6789012_Copy of prefill_decode.ipynb").write_bytes(notebook_bytes(release))
    board = extracted / "Module 1_jdoe7_attempt_2026-11-30-22-10-05_x.ipynb"
    board.write_bytes(notebook_bytes(release))
    info = plugins.AutoCollector(parent=app).collect(
        str(extracted / "doejane_12345_6789012_Copy of prefill_decode.ipynb")
    )
    assert info == {"student_id": "doejane_12345", "file_id": NAME, "timestamp": None}
    info = plugins.BlackboardCollector(parent=app).collect(str(board))
    assert info["timestamp"] == datetime(2026, 11, 30, 22, 10, 5) and info["file_id"] == NAME


def test_the_plugin_skips_what_autograder_collect_skips(course_root, release, tmp_path, caplog):
    app = zip_collect_app(course_root)
    extracted = course_root / "downloaded" / ASSIGNMENT / "extracted"
    (extracted / "amy").mkdir(parents=True)
    (extracted / "amy" / NAME).write_text('{"cells": [')
    unrelated = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('hello')")])
    (extracted / "bob").mkdir()
    (extracted / "bob" / "holiday.ipynb").write_bytes(notebook_bytes(unrelated))
    (extracted / "bob" / "notes.pdf").write_bytes(b"%PDF-1.4")
    (extracted / "cat").mkdir()
    (extracted / "cat" / NAME).symlink_to(REPO_ROOT / "solutions" / ASSIGNMENT / NAME)
    # nbgrader's own logger does not propagate (traitlets): a plain one that pytest's caplog sees
    collector = plugins.FolderCollector(parent=app, log=logging.getLogger("zip_collect"))
    with caplog.at_level("WARNING"):
        got = {path: collector.collect(str(extracted / path)) for path in ("amy/" + NAME, "bob/holiday.ipynb")}
        got["bob/notes.pdf"] = collector.collect(str(extracted / "bob" / "notes.pdf"))
        got["cat/" + NAME] = collector.collect(str(extracted / "cat" / NAME))
    assert set(got.values()) == {None}
    text = caplog.text
    assert "not valid notebook JSON" in text and "marks the student for manual grading" in text
    assert "does not look like any assignment's notebook" in text and "symbolic link" in text


def test_the_course_extractor_reads_hostile_zips_as_collect_does(course_root, release, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(zipfile.ZipInfo(f"amy/{NAME}", date_time=OLDER), notebook_bytes(release))
        archive.writestr("../escape/prefill_decode.ipynb", notebook_bytes(release))
        archive.writestr(f"__MACOSX/amy/._{NAME}", b"\x00\x05")
        archive.writestr("amy/notes.pdf", b"%PDF-1.4")
        link = zipfile.ZipInfo(f"dan/{NAME}")
        link.create_system, link.external_attr = 3, (0o120777 << 16)
        archive.writestr(link, "../../solutions/m1_prefill_decode/prefill_decode.ipynb")
    archive_dir, extracted = tmp_path / "archive", tmp_path / "extracted"
    archive_dir.mkdir()
    (archive_dir / "class.zip").write_bytes(buffer.getvalue())
    plugins.CourseExtractor().extract(str(archive_dir), str(extracted))
    written = sorted(p.relative_to(extracted).as_posix() for p in extracted.rglob("*") if p.is_file())
    assert written == [f"class/amy/{NAME}"]
    assert datetime.fromtimestamp((extracted / "class" / "amy" / NAME).stat().st_mtime) == datetime(*OLDER)
    assert not (tmp_path / "escape").exists()


def nbgrader(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """nbgrader's own command line, as an instructor runs it in the course folder."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [sys.executable, "-m", "nbgrader", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def test_plain_nbgrader_zip_collect_with_the_course_plugins(course_root, release, tmp_path):
    archive = course_root / "downloaded" / ASSIGNMENT / "archive"
    archive.mkdir(parents=True)
    moodle = "Jane Doe_12345_assignsubmission_file_"
    (archive / "moodle.zip").write_bytes(
        zip_with_times(
            [
                (f"{moodle}/Copy of {NAME}", answered(release), NEWER),  # renamed, newer: this one counts
                (f"{moodle}/{NAME}", notebook_bytes(release), OLDER),
                ("Ann Lee_11111_assignsubmission_file_/Untitled3.ipynb", notebook_bytes(release), OLDER),
                (f"{moodle}/notes.pdf", b"%PDF-1.4", OLDER),
                (f"__MACOSX/{moodle}/._{NAME}", b"\x00\x05", OLDER),
            ]
        )
    )
    done = nbgrader(
        "zip_collect",
        ASSIGNMENT,
        "--collector=autograder.plugins.AutoCollector",
        "--extractor=autograder.plugins.CourseExtractor",
        cwd=course_root,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    submitted = course_root / "submitted"
    tree = sorted(p.relative_to(submitted).as_posix() for p in submitted.rglob("*") if p.is_file())
    assert tree == [
        f"ann_lee_11111/{ASSIGNMENT}/{NAME}",
        f"ann_lee_11111/{ASSIGNMENT}/timestamp.txt",
        f"jane_doe_12345/{ASSIGNMENT}/{NAME}",
        f"jane_doe_12345/{ASSIGNMENT}/timestamp.txt",
    ], done.stderr[-3000:]
    kept = notebooks.read(submitted / "jane_doe_12345" / ASSIGNMENT / NAME)
    assert "return {}" in notebooks.answer_sources(kept)["ex1_4"], "the newer file wins, whatever its name"
    assert (submitted / "jane_doe_12345" / ASSIGNMENT / "timestamp.txt").read_text() == "2026-11-30 22:10:06"
    assert "Skipped submission file with older timestamp" in done.stderr
    # Canvas's names, nbgrader's own extractor, the collector set in nbgrader_config.py: collected, without a time
    with open(course_root / "nbgrader_config.py", "a") as config:
        config.write("c.ZipCollectApp.collector_plugin = 'autograder.plugins.CanvasCollector'\n")
    canvas = course_root / "downloaded" / "canvas"
    (canvas / ASSIGNMENT / "archive").mkdir(parents=True)
    (canvas / ASSIGNMENT / "archive" / "canvas.zip").write_bytes(
        zip_with_times([(f"doejane_12345_6789012_Copy of {NAME}", notebook_bytes(release), OLDER)])
    )
    done = nbgrader(
        "zip_collect", ASSIGNMENT, "--ZipCollectApp.downloaded_directory=downloaded/canvas", cwd=course_root
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Using file collector: CanvasCollector" in done.stderr, done.stderr[-3000:]
    assert (submitted / "doejane_12345" / ASSIGNMENT / NAME).is_file()
    assert not (submitted / "doejane_12345" / ASSIGNMENT / "timestamp.txt").exists()


# --- export ----------------------------------------------------------------------------------------

CELLS = {"ex1_1_a": 2.0, "ex1_1_b": 1.0, "ex1_2": 3.0}  # grade cell -> points
SCORES = {  # student -> grade cell -> (auto score, manual score)
    "amy": {"ex1_1_a": (2.0, None), "ex1_1_b": (1 / 3, None), "ex1_2": (3.0, None)},
    "bob": {"ex1_1_a": (0.0, 1.5), "ex1_1_b": (1.0, None), "ex1_2": (None, None)},
}


def make_gradebook(root: Path) -> None:
    """A gradebook with one assignment graded for two students (bob: a manual score and an ungraded cell)."""
    import warnings

    from nbgrader.api import Gradebook

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gradebook:
            gradebook.update_or_create_assignment(ASSIGNMENT)
            gradebook.add_notebook("prefill_decode", ASSIGNMENT)
            for cell, points in CELLS.items():
                gradebook.add_grade_cell(cell, "prefill_decode", ASSIGNMENT, max_score=points, cell_type="code")
            for student, scores in SCORES.items():
                gradebook.add_student(student)
                gradebook.add_submission(ASSIGNMENT, student)
                for cell, (auto, manual) in scores.items():
                    grade = gradebook.find_grade(cell, "prefill_decode", ASSIGNMENT, student)
                    grade.auto_score, grade.manual_score = auto, manual
                    grade.needs_manual_grade = auto is None
            gradebook.db.commit()
    results = root / "grading" / ASSIGNMENT / "results"
    results.mkdir(parents=True)
    (results / "bob.json").write_text(json.dumps({"status": "graded", "flags": ["2 files with the same time"]}))


def test_nbgrader_export_with_the_plugin_writes_autograder_exports_csv(course_root, tmp_path):
    make_gradebook(course_root)
    assert cli.main(["--root", str(course_root), "export", ASSIGNMENT, "--output", str(tmp_path / "ours")]) == 0
    ours = (tmp_path / "ours" / "grades.csv").read_text(encoding="utf-8")
    assert ours.splitlines() == [
        "student,ex1_1,ex1_2,total,max,status",
        "amy,2.3333,3.0,5.3333,6.0,graded",
        "bob,2.5,0.0,2.5,6.0,needs manual grading: 2 files with the same time",
    ], "manual scores win, points rounded to 4 decimals, the pipeline's reason in the status"
    done = nbgrader(
        "export", "--exporter=autograder.plugins.CourseCsvExport", f"--to={tmp_path / 'nb'}", cwd=course_root
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("grades.csv", "summary.csv"):
        assert (tmp_path / "nb" / ASSIGNMENT / name).read_bytes() == (tmp_path / "ours" / name).read_bytes(), name
    done = nbgrader("export", "--exporter=autograder.plugins.CourseCsvExport", cwd=course_root)  # default folder
    assert done.returncode == 0, done.stderr[-3000:]
    assert (course_root / "grading" / ASSIGNMENT / "grades.csv").read_text(encoding="utf-8") == ours


def test_the_export_plugin_takes_nbgraders_student_filter(course_root, tmp_path):
    from autograder.course_dir import Course
    from autograder.export import open_gradebook

    make_gradebook(course_root)
    course = Course(course_root)
    with open_gradebook(course) as gradebook:
        result, grades, _ = plugins.CourseCsvExport(student=["bob"]).write(gradebook, course, ASSIGNMENT, tmp_path)
    assert [row["student"] for row in result.rows] == ["bob"] and grades.read_text().count("\n") == 2
    with open_gradebook(course) as gradebook, pytest.raises(ValueError, match="no assignment 'm9'"):
        plugins.CourseCsvExport().write(gradebook, course, "m9", tmp_path)


# --- choosing a collector ---------------------------------------------------------------------------


class Mine(plugins.FolderCollector):
    """An instructor's subclass: autograder collect --pattern test_autograder_plugins.Mine."""


def test_collect_pattern_names_a_preset_a_class_or_a_regex():
    assert isinstance(compile_pattern("canvas"), plugins.CanvasCollector)
    assert isinstance(compile_pattern("auto"), plugins.AutoCollector)
    assert isinstance(compile_pattern(f"{__name__}.Mine"), Mine)
    assert find_student("alice/x.ipynb", compile_pattern(f"{__name__}.Mine")).student == "alice"
    with pytest.raises(ValueError, match="not an nbgrader FileNameCollectorPlugin"):
        compile_pattern("json.JSONDecoder")
    custom = compile_pattern(r"(?P<student>s\d{7})-")
    assert isinstance(custom, plugins.PatternCollector) and find_student("S1234567-x.ipynb", custom) is None
    assert find_student("x/s1234567-x.ipynb", custom).student == "s1234567"
    with pytest.raises(ValueError, match="named group"):
        compile_pattern("os.path")  # a module attribute that is no class: read as a regex, which has no group


def test_the_rules_live_in_the_plugin_classes(monkeypatch):
    """autograder collect uses the plugin classes' rules: changing a class changes collect."""
    assert plugins.PRESETS["moodle"] is plugins.MoodleCollector
    found = find_student("Jane Doe_12345_assignsubmission_file_/x.ipynb", compile_pattern("moodle"))
    assert (found.student, found.name) == ("jane_doe_12345", "'Jane Doe' (user id '12345')")
    monkeypatch.setattr(plugins.CanvasCollector, "rule", r"^(?P<student>[^/]+)/")
    assert find_student("amy/x.ipynb", compile_pattern("canvas")).student == "amy"


def test_autograder_collect_reuses_an_instructors_own_nbgrader_plugin(course_root, release, tmp_path):
    """nbgrader's own FileNameCollectorPlugin, configured in the course's nbgrader_config.py as for zip_collect."""
    with open(course_root / "nbgrader_config.py", "a") as config:
        config.write("c.FileNameCollectorPlugin.named_regexp = r'(?P<student_id>[^/_]+)_(?P<file_id>[^/]+)'\n")
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("amy_prefill_decode.ipynb", f"bob_Copy of {NAME}", "Zoë Smith_x.ipynb"):
        (folder / name).write_bytes(notebook_bytes(release))
    (folder / "notes.pdf").write_bytes(b"%PDF-1.4")
    report = collect(folder, course_root, [ASSIGNMENT], "nbgrader.plugins.FileNameCollectorPlugin")
    got = sorted((e.student, e.notebook) for e in report.collected)
    assert [student for student, _ in got][:2] == ["amy", "bob"], "the plugin's ids, kept when safe"
    assert got[2][0].startswith("zoë_smith-") and {notebook for _, notebook in got} == {NAME}
    assert [e.source for e in report.unmatched] == ["notes.pdf"]
