"""``autograder collect`` (LMS downloads, any file names, student ids, unmatched report) and
``autograder repair`` (lost metadata, deleted and duplicated cells, Colab's format), on module 1's
release notebook. No notebook is executed here."""

from __future__ import annotations

import copy
import io
import json
import os
import re
import shutil
import zipfile

import nbformat
import pytest
from helpers import M1_ASSIGNMENT, M1_NOTEBOOK, corrupt_member, m1_course, m1_release, notebook_bytes, zip_with_times

from autograder import notebooks, repair
from autograder.collect import collect, compile_pattern, find_student, student_id
from autograder.course_dir import Course

ASSIGNMENT, NAME = M1_ASSIGNMENT, M1_NOTEBOOK  # the release these tests collect and repair


@pytest.fixture(scope="module")
def release():
    return m1_release()


@pytest.fixture
def course_root(tmp_path):
    return m1_course(tmp_path)


def make_zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return buffer.getvalue()


def strip(nb):
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        cell.metadata.pop("nbgrader", None)
    return nb


# --- collect ------------------------------------------------------------------------------------


def test_moodle_zip_with_renamed_notebooks(course_root, release, tmp_path):
    download = tmp_path / "moodle.zip"
    download.write_bytes(
        make_zip(
            {
                "Jane Doe_12345_assignsubmission_file_/Copy of prefill_decode.ipynb": notebook_bytes(release),
                "Jöhn Smith_67890_assignsubmission_file_/prefill_decode (1).ipynb": notebook_bytes(strip(release)),
                "Ann Lee_11111_assignsubmission_file_/notes.pdf": b"%PDF-1.4",
                "Ann Lee_11111_assignsubmission_file_/Untitled3.ipynb": notebook_bytes(release),
            }
        )
    )
    report = collect(download, course_root, [ASSIGNMENT], "auto")
    got = {entry.student: entry for entry in report.collected}
    assert set(got) == {"jane_doe_12345", "jöhn_smith_67890", "ann_lee_11111"}, "Moodle's participant id is kept"
    for student in got:
        assert (course_root / "submitted" / student / ASSIGNMENT / NAME).is_file()
        assert (course_root / "submitted" / student / ASSIGNMENT / "timestamp.txt").is_file()
    assert got["ann_lee_11111"].source.endswith("Untitled3.ipynb")
    assert [e.source for e in report.unmatched] == ["Ann Lee_11111_assignsubmission_file_/notes.pdf"]
    saved = json.loads((course_root / "grading" / "collect-report.json").read_text())
    assert len(saved["collected"]) == 3 and saved["unmatched"][0]["reason"].startswith("not a notebook")
    assert (course_root / "grading" / ".gitignore").read_text().strip().endswith("*")


def test_canvas_names_and_late_flag(course_root, release, tmp_path):
    folder = tmp_path / "canvas"
    folder.mkdir()
    (folder / "doejane_12345_6789012_prefill_decode-1.ipynb").write_bytes(notebook_bytes(release))
    (folder / "smithjohn_LATE_67890_1234_Copy of prefill_decode.ipynb").write_bytes(notebook_bytes(release))
    report = collect(folder, course_root, [ASSIGNMENT], "canvas")
    assert sorted(e.student for e in report.collected) == ["doejane_12345", "smithjohn_67890"]


def test_custom_pattern_nested_zip_and_newest_duplicate(course_root, release, tmp_path):
    inner = make_zip({"prefill_decode.ipynb": notebook_bytes(release)})
    download = tmp_path / "class.zip"
    files = {"s1234567-week1.zip": inner, "s7654321-week1/prefill_decode.ipynb": notebook_bytes(release)}
    download.write_bytes(make_zip(files))
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(download, folder / "class.zip")
    old, new = folder / "s7654321-old.ipynb", folder / "s7654321-new.ipynb"
    old.write_bytes(notebook_bytes(release))
    empty_quiz = "# EXERCISE: ex1_4\ndef quiz_answers():\n    return {}"
    new.write_bytes(notebook_bytes(notebooks.with_answers(release, {"ex1_4": empty_quiz})))
    os.utime(old, (1_000_000_000, 1_000_000_000))
    report = collect(folder, course_root, [ASSIGNMENT], r"(?P<student>s\d{7})-")
    assert sorted(e.student for e in report.collected) == ["s1234567", "s7654321"]
    assert [e.source for e in report.superseded] != []
    kept = notebooks.read(course_root / "submitted" / "s7654321" / ASSIGNMENT / NAME)
    assert "return {}" in notebooks.answer_sources(kept)["ex1_4"], "the newest file wins"


def test_unmatched_files_are_reported_with_reasons(course_root, release, tmp_path):
    unrelated = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('hello')")])
    folder = tmp_path / "in"
    (folder / "amy").mkdir(parents=True)
    (folder / "amy" / "prefill_decode.ipynb").write_text('{"cells": [')
    (folder / "amy" / "holiday.ipynb").write_bytes(notebook_bytes(unrelated))
    (folder / "loose.ipynb").write_bytes(notebook_bytes(release))
    (folder / "bob").mkdir()
    (folder / "bob" / "prefill_decode.ipynb").write_bytes(notebook_bytes(unrelated))  # no markers, but the right name
    report = collect(folder, course_root, [ASSIGNMENT], "folder")
    reasons = {e.source: e.reason for e in report.unmatched}
    assert "not valid notebook JSON" in reasons["amy/prefill_decode.ipynb"]
    assert "does not look like" in reasons["amy/holiday.ipynb"]
    assert "no student id" in reasons["loose.ipynb"]
    assert [e.student for e in report.collected] == ["bob"] and "file name" in report.collected[0].reason


def test_student_ids_and_patterns():
    assert student_id("  Zoë  O'Brien ").startswith("zoë_o_brien-"), "Unicode kept; a lossy id gets a hash"
    assert student_id("alice") == "alice"
    assert find_student("Jane Doe_1_assignsubmission_file_/x.ipynb", compile_pattern("moodle")).student == "jane_doe_1"
    assert find_student("alice/hw/x.ipynb", compile_pattern("folder")).student == "alice"
    with pytest.raises(ValueError, match="named group"):
        compile_pattern(r"(\w+)_")
    with pytest.raises(ValueError, match="not a valid regular expression"):
        compile_pattern("(?P<student>")


# --- repair -------------------------------------------------------------------------------------


def graded_metadata(nb) -> dict[str, dict]:
    return {notebooks.grade_id(c): c.metadata["nbgrader"] for c in nb.cells if notebooks.grade_id(c)}


def test_stripped_metadata_is_restored_from_markers(release):
    result = repair.repair(strip(release), release)
    assert graded_metadata(result.notebook) == graded_metadata(release)
    graded = len(graded_metadata(release))  # every graded cell of the release (module 1's count changes with it)
    assert f"Restored the grading metadata of {graded} cell(s)" in result.notes[0]


def test_deleted_test_cell_comes_back_after_its_neighbour(release):
    nb = copy.deepcopy(release)
    index = next(i for i, c in enumerate(nb.cells) if notebooks.grade_id(c) == "ex1_2_itl")
    del nb.cells[index]
    fixed = repair.repair(nb, release).notebook
    ids = [notebooks.grade_id(c) for c in fixed.cells if notebooks.grade_id(c)]
    assert ids == [notebooks.grade_id(c) for c in release.cells if notebooks.grade_id(c)]
    back = next(c for c in fixed.cells if notebooks.grade_id(c) == "ex1_2_itl")
    assert back.source == release.cells[index].source


def test_colab_format_is_normalised(release):
    nb = json.loads(nbformat.writes(release))
    nb["nbformat_minor"] = 0
    nb["metadata"]["colab"] = {"provenance": []}
    for number, cell in enumerate(nb["cells"]):
        cell.pop("id", None)
        cell["metadata"]["id"] = "same-id-everywhere"
        if cell["cell_type"] == "code":
            cell["metadata"]["executionInfo"] = {"status": "ok"}
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": f"{number}\n"}]
    result = repair.repair(repair.read_submission(json.dumps(nb)), release)
    fixed = result.notebook
    assert (fixed.nbformat, fixed.nbformat_minor) == (4, 5)
    assert len({c.id for c in fixed.cells}) == len(fixed.cells)
    assert not any(key in c.metadata for c in fixed.cells for key in ("id", "colab", "executionInfo"))
    assert "colab" not in fixed.metadata
    nbformat.validate(fixed)
    assert any("Colab" in note for note in result.notes)


def test_duplicates_markdown_and_unmarked_answers(release):
    nb = copy.deepcopy(release)
    answers = {notebooks.grade_id(c): i for i, c in enumerate(nb.cells) if notebooks.is_answer_cell(c)}
    # ex1_2: the student pasted an answered copy below the starter cell (both carry the marker)
    answered = copy.deepcopy(nb.cells[answers["ex1_2"]])
    answered.source = answered.source.replace("raise NotImplementedError()", "return {}")
    answered.id = "pasted"
    nb.cells.insert(answers["ex1_2"] + 1, answered)
    # ex1_1: the marker line and the metadata are gone, the functions are there
    cell = nb.cells[answers["ex1_1"]]
    cell.source = cell.source.split("\n", 1)[1]
    del cell.metadata["nbgrader"]
    # a test cell turned into markdown
    quiz_test = next(i for i, c in enumerate(nb.cells) if notebooks.grade_id(c) == "ex1_4_q01")
    nb.cells[quiz_test] = nbformat.v4.new_markdown_cell(nb.cells[quiz_test].source)
    # stray metadata on an ordinary cell
    nb.cells[3].metadata["nbgrader"] = {"grade_id": "bogus", "grade": True, "points": 9}
    result = repair.repair(nb, release)
    fixed = result.notebook
    holders = [c for c in fixed.cells if notebooks.grade_id(c) == "ex1_2"]
    assert len(holders) == 1 and "return {}" in holders[0].source
    assert notebooks.grade_id(fixed.cells[answers["ex1_1"]]) == "ex1_1"
    assert next(c for c in fixed.cells if notebooks.grade_id(c) == "ex1_4_q01").cell_type == "code"
    assert "bogus" not in {notebooks.grade_id(c) for c in fixed.cells}
    text = " ".join(result.notes)
    assert "by the functions they define" in text and "Several cells claimed ex1_2" in text
    assert "back into code cells" in text and "stray grading metadata" in text


def test_deleted_answer_cell_gets_the_empty_starter(release):
    nb = copy.deepcopy(release)
    nb.cells = [c for c in nb.cells if notebooks.grade_id(c) != "ex1_3"]
    result = repair.repair(nb, release)
    stub = next(c for c in result.notebook.cells if notebooks.grade_id(c) == "ex1_3")
    assert "raise NotImplementedError()" in stub.source
    assert any("ex1_3 were missing" in note for note in result.notes)


def test_repair_is_idempotent(release):
    once = repair.repair(strip(release), release).notebook
    twice = repair.repair(once, release)
    assert not twice.notes
    assert [c.source for c in twice.notebook.cells] == [c.source for c in once.cells]


def test_unreadable_files_say_why():
    with pytest.raises(repair.UnreadableNotebook, match="not valid notebook JSON"):
        repair.read_submission(b'{"cells": [')
    with pytest.raises(repair.UnreadableNotebook, match="not a Jupyter notebook"):
        repair.read_submission(b'{"hello": 1}')


# --- a damaged class never stops collect or repair ---------------------------------------------


def malformed(release, kind: str) -> bytes:
    """A notebook that is valid JSON but has one malformed part (the shapes the issue lists)."""
    data = json.loads(nbformat.writes(release))
    graded = next(c for c in data["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == "ex1_4")
    if kind == "nbgrader-string":
        graded["metadata"]["nbgrader"] = "ex1_4"
    elif kind == "source-number":
        data["cells"][0]["source"] = 42
    elif kind == "autograder-string":
        data["metadata"]["autograder"] = "<a href='javascript:alert(1)'>grade: 1000</a>"
    elif kind == "cells-object":
        data["cells"] = {"0": data["cells"][0]}
    elif kind == "grade-id-list":
        graded["metadata"]["nbgrader"]["grade_id"] = ["ex1_4"]
    return json.dumps(data).encode()


@pytest.mark.parametrize("kind", ["nbgrader-string", "source-number", "autograder-string", "grade-id-list"])
def test_malformed_but_mendable_notebooks_are_collected_and_repaired(course_root, release, tmp_path, kind):
    from autograder.course_dir import Course
    from autograder.pipeline import repair_submissions

    download = tmp_path / "class.zip"
    download.write_bytes(make_zip({f"amy/{NAME}": malformed(release, kind), f"bob/{NAME}": notebook_bytes(release)}))
    report = collect(download, course_root, [ASSIGNMENT], "folder")
    assert sorted(e.student for e in report.collected) == ["amy", "bob"]
    done = repair_submissions(Course(course_root), ASSIGNMENT)
    fixed = notebooks.read(course_root / "submitted" / "amy" / ASSIGNMENT / NAME)
    nbformat.validate(fixed)
    assert graded_metadata(fixed) == graded_metadata(release)
    assert "javascript" not in json.dumps(fixed.metadata), "planted grader notes are dropped"
    assert set(done) == {"amy", "bob"} and not Course(course_root).flags(ASSIGNMENT)


def test_unreadable_notebooks_are_listed_and_their_students_marked_for_manual_grading(course_root, release, tmp_path):
    from autograder.course_dir import Course

    good = notebook_bytes(release)
    files = [
        (f"amy/{NAME}", malformed(release, "cells-object"), (2026, 1, 1, 9, 0, 0)),
        (f"bob/{NAME}", good, (2026, 1, 1, 9, 0, 0)),
        (f"cat/{NAME}", good, (2026, 1, 1, 9, 0, 0)),
        (f"dan/{NAME}", good, (2026, 1, 1, 9, 0, 0)),
    ]
    stored = corrupt_member(zip_with_times(files[:3], zipfile.ZIP_STORED), f"bob/{NAME}")  # bad CRC
    deflated = corrupt_member(zip_with_times(files[3:]), f"dan/{NAME}")  # broken deflate stream
    inner = corrupt_member(zip_with_times([(NAME, good, (2026, 1, 1, 9, 0, 0))]), NAME)
    download = tmp_path / "class.zip"
    download.write_bytes(make_zip({"part1.zip": stored, "part2.zip": deflated, "eve/eve-own.zip": inner}))
    report = collect(download, course_root, [ASSIGNMENT], r"(?:^|/)(?P<student>amy|bob|cat|dan|eve)/")
    assert [e.student for e in report.collected] == ["cat"]
    reasons = {e.source: e.reason for e in report.unmatched}
    assert "cells are a dict" in reasons[f"part1/amy/{NAME}"]
    assert "damaged in the zip" in reasons[f"part1/bob/{NAME}"] and "CRC" in reasons[f"part1/bob/{NAME}"]
    assert "damaged in the zip" in reasons[f"part2/dan/{NAME}"]
    assert "damaged in the zip" in reasons[f"eve/eve-own/{NAME}"], "a student's own zip with a damaged member"
    flags = Course(course_root).flags(ASSIGNMENT)
    assert set(flags) == {"amy", "bob", "dan", "eve"} == set(report.manual)
    assert Course(course_root).students(ASSIGNMENT) == ["amy", "bob", "cat", "dan", "eve"], "flagged students get a row"


def test_every_entry_of_the_archive_is_in_the_report(course_root, release, tmp_path):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(f"amy/{NAME}", notebook_bytes(release))
        archive.writestr("../escape/prefill_decode.ipynb", notebook_bytes(release))
        archive.writestr(f".hidden/{NAME}", notebook_bytes(release))
        archive.writestr(f"__MACOSX/amy/._{NAME}", b"\x00\x05")
        archive.writestr("bob/empty.zip", make_zip({}))
        archive.writestr("cat/", b"")
        link = zipfile.ZipInfo(f"dan/{NAME}")
        link.create_system, link.external_attr = 3, (0o120777 << 16)
        archive.writestr(link, "../../solutions/m1_prefill_decode/prefill_decode.ipynb")
    download = tmp_path / "class.zip"
    download.write_bytes(buffer.getvalue())
    report = collect(download, course_root, [ASSIGNMENT], "folder")
    with zipfile.ZipFile(download) as archive:
        entries = set(archive.namelist())
    listed = {e.source for group in (report.collected, report.unmatched, report.superseded) for e in group}
    assert listed == entries
    reasons = {e.source: e.reason for e in report.unmatched}
    assert "unsafe path" in reasons["../escape/prefill_decode.ipynb"]
    assert "hidden" in reasons[f".hidden/{NAME}"] and "hidden" in reasons[f"__MACOSX/amy/._{NAME}"]
    assert reasons["bob/empty.zip"] == "an empty zip file"
    assert "symbolic link" in reasons[f"dan/{NAME}"]
    assert [e.student for e in report.collected] == ["amy"]


def test_a_folder_input_never_follows_symlinks(course_root, release, tmp_path):
    solutions = tmp_path / "solutions"
    solutions.mkdir()
    (solutions / NAME).write_bytes(notebook_bytes(release))
    folder = tmp_path / "in"
    (folder / "amy").mkdir(parents=True)
    (folder / "amy" / NAME).symlink_to(solutions / NAME)
    (folder / "bob").symlink_to(solutions, target_is_directory=True)
    report = collect(folder, course_root, [ASSIGNMENT], "folder")
    assert report.collected == []
    reasons = {e.source: e.reason for e in report.unmatched}
    assert "symbolic link" in reasons[f"amy/{NAME}"] and "symbolic link" in reasons["bob"]


def _rename_while_reading(monkeypatch, first_read: str, rename: tuple) -> None:
    """Rename ``rename[0]`` to ``rename[1]`` while collect reads the file whose path ends with ``first_read``
    (an LMS sync or a colleague tidying the folder during the run), deterministically."""
    from autograder import collect as collect_module

    real = collect_module._read_bounded
    done = []

    def reading(handle, budget, limit):
        if not done and str(getattr(handle, "name", "")).endswith(first_read):
            done.append(True)
            os.rename(*rename)
        return real(handle, budget, limit)

    monkeypatch.setattr(collect_module, "_read_bounded", reading)


def test_a_student_folder_renamed_during_collect_is_not_lost(course_root, release, tmp_path, monkeypatch):
    folder = tmp_path / "in"
    for student in ("amy", "bob", "cyd"):
        (folder / student).mkdir(parents=True)
        (folder / student / NAME).write_bytes(notebook_bytes(release))
    _rename_while_reading(monkeypatch, f"amy/{NAME}", (folder / "cyd", folder / "cyd-late"))
    report = collect(folder, course_root, [ASSIGNMENT], "folder")
    reasons = {e.source: e.reason for e in report.unmatched}
    assert "changed while collecting" in reasons.get("cyd", ""), reasons
    assert "changed while collecting" in reasons.get("cyd-late", ""), reasons
    assert {e.source for e in report.collected} == {f"amy/{NAME}", f"bob/{NAME}", f"cyd-late/{NAME}"}


def test_a_file_renamed_during_collect_stops_nothing(course_root, release, tmp_path, monkeypatch):
    folder = tmp_path / "in"
    (folder / "amy").mkdir(parents=True)
    (folder / "amy" / "a.ipynb").write_bytes(notebook_bytes(release))
    (folder / "amy" / "b.ipynb").write_bytes(notebook_bytes(release))
    (folder / "bob").mkdir()
    (folder / "bob" / NAME).write_bytes(notebook_bytes(release))
    _rename_while_reading(monkeypatch, "amy/a.ipynb", (folder / "amy" / "b.ipynb", folder / "amy" / "c.ipynb"))
    report = collect(folder, course_root, [ASSIGNMENT], "folder")
    reasons = {e.source: e.reason for e in report.unmatched}
    assert "changed while collecting" in reasons.get("amy/b.ipynb", ""), reasons
    assert "changed while collecting" in reasons.get("amy/c.ipynb", ""), reasons
    assert f"bob/{NAME}" in {e.source for e in report.collected}
    sources = {e.source for e in report.collected} | {e.source for e in report.superseded}
    assert {"amy/a.ipynb", "amy/c.ipynb"} <= sources, sources


def test_members_are_streamed_with_bounds(course_root, release, tmp_path, monkeypatch):
    import tracemalloc

    from autograder import collect as collect_module

    zeros = b"\0" * (20 * 2**20)
    download = tmp_path / "zeros.zip"
    with zipfile.ZipFile(download, "w", zipfile.ZIP_DEFLATED) as archive:
        for number in range(20):
            archive.writestr(f"s{number}/{NAME}", zeros)
    assert download.stat().st_size < 2**20
    tracemalloc.start()
    report = collect(download, course_root, [ASSIGNMENT], "folder")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(report.unmatched) == 20 and report.collected == []
    assert peak < 120 * 2**20, f"collect held {peak / 2**20:.0f} MiB for a 400 MiB download"
    # and the bounds: a member over the per-member limit, members past the per-archive limit
    monkeypatch.setattr(collect_module, "MAX_FILE_BYTES", 25 * 2**20)
    monkeypatch.setattr(collect_module, "MAX_ARCHIVE_BYTES", 50 * 2**20)
    report = collect(download, course_root, [ASSIGNMENT], "folder")
    reasons = [e.reason for e in report.unmatched]
    assert len(reasons) == 20 and all("not valid notebook JSON" in r for r in reasons[:2]), reasons[:3]
    assert all("50 MiB read limit" in r for r in reasons[2:]), reasons


def test_repair_never_stops_the_class(course_root, release, tmp_path, monkeypatch):
    from autograder.course_dir import Course
    from autograder.pipeline import repair_submissions

    folder = tmp_path / "in"
    for student in ("amy", "bob"):
        (folder / student).mkdir(parents=True)
        (folder / student / NAME).write_bytes(notebook_bytes(release))
    collect(folder, course_root, [ASSIGNMENT], "folder")
    real = repair.repair
    course = Course(course_root)
    calls = []

    def tracking(nb, rel):
        calls.append(1)
        if len(calls) == 1:  # the first student (amy) cannot be repaired
            raise KeyError("a shape nobody foresaw")
        return real(nb, rel)

    monkeypatch.setattr(repair, "repair", tracking)
    done = repair_submissions(course, ASSIGNMENT)
    assert "could not be repaired (KeyError" in done["amy"][0]
    assert not (course_root / "submitted" / "amy" / ASSIGNMENT / NAME).exists(), "not graded as it is"
    assert (course_root / "grading" / ASSIGNMENT / "received" / "amy" / NAME).is_file(), "kept as received"
    assert (course_root / "submitted" / "bob" / ASSIGNMENT / NAME).is_file()
    assert list(course.flags(ASSIGNMENT)) == ["amy"] and course.students(ASSIGNMENT) == ["amy", "bob"]


# --- student ids that cannot collide ---------------------------------------------------------------


def test_ids_keep_lms_user_ids_unicode_case_and_length(course_root, release, tmp_path):
    long_a, long_b = "x" * 70 + "a", "x" * 70 + "b"
    download = tmp_path / "class.zip"
    nb = notebook_bytes(release)
    download.write_bytes(
        make_zip(
            {
                "José García_666666_assignsubmission_file_/prefill_decode.ipynb": nb,
                "Jose Garcia_777777_assignsubmission_file_/prefill_decode.ipynb": nb,
            }
        )
    )
    moodle = {e.student for e in collect(download, course_root, [ASSIGNMENT]).collected}
    assert moodle == {"josé_garcía_666666", "jose_garcia_777777"}
    canvas = tmp_path / "canvas"
    canvas.mkdir()
    for name in ("smithjohn_111_9_prefill_decode.ipynb", "smithjohn_222_9_x.ipynb", "smithjohn_LATE_333_9_y.ipynb"):
        (canvas / name).write_bytes(nb)
    got = {e.student for e in collect(canvas, course_root, [ASSIGNMENT]).collected}
    assert got == {"smithjohn_111", "smithjohn_222", "smithjohn_333"}
    folders = tmp_path / "folders"
    for person in ("张伟", "Иван Петров", "Alice", "alice", long_a, long_b):
        (folders / person).mkdir(parents=True)
        (folders / person / "Copy of prefill_decode.ipynb").write_bytes(nb)
    got = sorted(e.student for e in collect(folders, course_root, [ASSIGNMENT]).collected)
    assert len(got) == 6 and len(set(got)) == 6, got
    assert "张伟" in got and "alice" in got and any(g.startswith("иван_петров-") for g in got)
    assert all(len(g) <= 64 for g in got)
    # the same person gets the same id in every collect
    assert student_id("Иван Петров") == student_id("Иван  Петров ") == student_id("Иван Петров")


def test_blackboard_and_gradescope_exports(course_root, release, tmp_path):
    nb = notebook_bytes(release)
    answered = notebook_bytes(
        notebooks.with_answers(release, {"ex1_4": "# EXERCISE: ex1_4\ndef quiz_answers():\n    return {}"})
    )
    blackboard = tmp_path / "bb.zip"
    blackboard.write_bytes(  # the newer attempt first in the zip: order must not matter
        make_zip(
            {
                "Module 1_jdoe7_attempt_2026-11-30-22-10-05_prefill_decode.ipynb": answered,
                "Module 1_jdoe7_attempt_2026-11-29-08-00-00_prefill_decode.ipynb": nb,
                "Module 1_jdoe7_attempt_2026-11-30-22-10-05.txt": b"Name: Jane Doe",
            }
        )
    )
    report = collect(blackboard, course_root, [ASSIGNMENT])
    assert [e.student for e in report.collected] == ["jdoe7"]
    assert "2026-11-30-22-10-05" in report.collected[0].source and len(report.superseded) == 1
    metadata = (
        "submission_101:\n  :submitters:\n  - :name: Jane Doe\n    :sid: '2026001'\n    :email: jane@uni.edu\n"
        "  :created_at: 2026-11-30 10:00:00.000000000 +00:00\n"
        "submission_102:\n  :submitters:\n  - :name: Jane Doe\n    :sid: '2026002'\n    :email: other@uni.edu\n"
        "  :created_at: 2026-11-30 11:00:00.000000000 +00:00\n"
    )
    gradescope = tmp_path / "gs.zip"
    gradescope.write_bytes(
        make_zip(
            {
                "assignment_9_export/submission_metadata.yml": metadata.encode(),
                f"assignment_9_export/submission_101/{NAME}": nb,
                f"assignment_9_export/submission_102/{NAME}": nb,
            }
        )
    )
    report = collect(gradescope, course_root, [ASSIGNMENT])
    assert sorted(e.student for e in report.collected) == ["jane_doe_2026001", "jane_doe_2026002"]
    reasons = {e.source: e.reason for e in report.unmatched}
    assert reasons == {
        "assignment_9_export/submission_metadata.yml": "Gradescope's list of submitters (read for the student ids)"
    }, "the report lists the metadata file too"


@pytest.mark.parametrize("order", [("a", "b"), ("b", "a")])
def test_a_tie_is_reported_never_resolved_by_zip_order(course_root, release, tmp_path, order):
    from autograder.course_dir import Course

    same = (2026, 11, 30, 23, 59, 58)
    files = {
        "a": (f"amy/{NAME}", notebook_bytes(release), same),
        "b": (f"amy/Copy of {NAME}", notebook_bytes(release), same),
    }
    download = tmp_path / "class.zip"
    download.write_bytes(zip_with_times([files[key] for key in order]))
    report = collect(download, course_root, [ASSIGNMENT], "folder")
    assert [e.source for e in report.collected] == [f"amy/{NAME}"], "the same file whatever the zip order"
    assert [e.source for e in report.superseded] == [f"amy/Copy of {NAME}"]
    assert "same time" in report.manual["amy"][0]
    assert "same time" in Course(course_root).flag_reasons(ASSIGNMENT, "amy")[0]


# --- look-alike names never merge silently -----------------------------------------------------------

LOOK_ALIKES = {  # kind -> (a name, a look-alike of it)
    "nfc-vs-nfd": ("Zoë Smith", "Zoe\u0308 Smith"),
    "nfc-vs-nfd-lower-case": ("zoë", "zoe\u0308"),
    "leading-space": ("alice", " alice"),
    "trailing-space": ("alice", "alice "),
    "repeated-space": ("Ann Lee", "Ann  Lee"),
    "non-breaking-space": ("Ann Lee", "Ann\u00a0Lee"),
    "tab": ("Ann Lee", "Ann\tLee"),
    "lower-case-repeated-space": ("ann_lee", "ann_lee "),
}


def _blank_and_correct(release):
    """Two different files of the notebook (the second stands for a worked one)."""
    worked = copy.deepcopy(release)
    worked.metadata["worked"] = True
    return notebook_bytes(release), notebook_bytes(worked)


@pytest.mark.parametrize("kind", sorted(LOOK_ALIKES))
def test_look_alike_folder_names_never_merge_silently(course_root, release, tmp_path, kind):
    """Two folders whose names differ only invisibly: two students, or one marked for manual grading
    with both paths named; never the older (here: correct) file silently dropped for the newer blank one."""
    first, second = LOOK_ALIKES[kind]
    blank, correct = _blank_and_correct(release)
    older, newer = (2026, 11, 1, 10, 0, 0), (2026, 11, 2, 10, 0, 0)
    download = tmp_path / "class.zip"
    paths = [f"{first}/prefill_decode.ipynb", f"{second}/prefill_decode.ipynb"]
    download.write_bytes(zip_with_times([(paths[0], correct, older), (paths[1], blank, newer)]))
    report = collect(download, course_root, [ASSIGNMENT], "folder")
    students = {entry.source: entry.student for entry in report.collected}
    if len(set(students.values())) == 2:
        assert set(students) == set(paths) and not report.superseded
        return
    (student,) = set(students.values())
    reasons = " ".join(report.manual.get(student, []))
    assert paths[0] in reasons and paths[1] in reasons, f"{kind}: merged silently: {report.manual}"
    flags = Course(course_root).flag_reasons(ASSIGNMENT, student)
    assert any(paths[0] in reason and paths[1] in reason for reason in flags), flags


@pytest.mark.parametrize("kind", sorted(LOOK_ALIKES))
def test_look_alike_names_without_a_user_id_get_the_hash(kind):
    """README: an id that lost anything of the exact name ends in a hash of the name."""
    _, second = LOOK_ALIKES[kind]
    assert re.search(r"-[0-9a-f]{8}$", student_id(second)), (kind, student_id(second))


@pytest.mark.parametrize("kind", sorted(LOOK_ALIKES))
def test_look_alike_lms_names_with_one_user_id_are_marked(course_root, release, tmp_path, kind):
    """Moodle folders with one participant id under look-alike names: one person, marked, both paths named."""
    first, second = LOOK_ALIKES[kind]
    blank, correct = _blank_and_correct(release)
    paths = [f"{name}_4242_assignsubmission_file_/prefill_decode.ipynb" for name in (first, second)]
    download = tmp_path / "moodle.zip"
    download.write_bytes(
        zip_with_times([(paths[0], correct, (2026, 11, 1, 10, 0, 0)), (paths[1], blank, (2026, 11, 2, 10, 0, 0))])
    )
    report = collect(download, course_root, [ASSIGNMENT], "moodle")
    students = {entry.student for entry in report.collected}
    if len(students) == 2:
        return
    (student,) = students
    reasons = " ".join(report.manual.get(student, []))
    assert paths[0] in reasons and paths[1] in reasons, f"{kind}: merged silently: {report.manual}"
