"""``autograder collect`` (LMS downloads, any file names, student ids, unmatched report) and
``autograder repair`` (lost metadata, deleted and duplicated cells, Colab's format), on module 1's
release notebook. No notebook is executed here."""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import notebooks, repair
from autograder.collect import collect, compile_pattern, find_student, student_id

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT = "m1_prefill_decode"
NAME = "prefill_decode.ipynb"


@pytest.fixture(scope="module")
def release():
    return notebooks.read(ROOT / "modules" / ASSIGNMENT / NAME)


@pytest.fixture
def course_root(tmp_path):
    root = tmp_path / "course"
    shutil.copytree(ROOT / "modules" / ASSIGNMENT, root / "modules" / ASSIGNMENT)
    return root


def as_bytes(nb) -> bytes:
    return nbformat.writes(nb).encode()


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
                "Jane Doe_12345_assignsubmission_file_/Copy of prefill_decode.ipynb": as_bytes(release),
                "Jöhn Smith_67890_assignsubmission_file_/prefill_decode (1).ipynb": as_bytes(strip(release)),
                "Ann Lee_11111_assignsubmission_file_/notes.pdf": b"%PDF-1.4",
                "Ann Lee_11111_assignsubmission_file_/Untitled3.ipynb": as_bytes(release),
            }
        )
    )
    report = collect(download, course_root, [ASSIGNMENT], "auto")
    got = {entry.student: entry for entry in report.collected}
    assert set(got) == {"jane_doe", "john_smith", "ann_lee"}
    for student in got:
        assert (course_root / "submitted" / student / ASSIGNMENT / NAME).is_file()
        assert (course_root / "submitted" / student / ASSIGNMENT / "timestamp.txt").is_file()
    assert got["ann_lee"].source.endswith("Untitled3.ipynb")
    assert [e.source for e in report.unmatched] == ["Ann Lee_11111_assignsubmission_file_/notes.pdf"]
    saved = json.loads((course_root / "grading" / "collect-report.json").read_text())
    assert len(saved["collected"]) == 3 and saved["unmatched"][0]["reason"].startswith("not a notebook")
    assert (course_root / "grading" / ".gitignore").read_text().strip().endswith("*")


def test_canvas_names_and_late_flag(course_root, release, tmp_path):
    folder = tmp_path / "canvas"
    folder.mkdir()
    (folder / "doejane_12345_6789012_prefill_decode-1.ipynb").write_bytes(as_bytes(release))
    (folder / "smithjohn_LATE_67890_1234_Copy of prefill_decode.ipynb").write_bytes(as_bytes(release))
    report = collect(folder, course_root, [ASSIGNMENT], "canvas")
    assert sorted(e.student for e in report.collected) == ["doejane", "smithjohn"]


def test_custom_pattern_nested_zip_and_newest_duplicate(course_root, release, tmp_path):
    inner = make_zip({"prefill_decode.ipynb": as_bytes(release)})
    download = tmp_path / "class.zip"
    files = {"s1234567-week1.zip": inner, "s7654321-week1/prefill_decode.ipynb": as_bytes(release)}
    download.write_bytes(make_zip(files))
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(download, folder / "class.zip")
    old, new = folder / "s7654321-old.ipynb", folder / "s7654321-new.ipynb"
    old.write_bytes(as_bytes(release))
    empty_quiz = "# EXERCISE: ex1_4\ndef quiz_answers():\n    return {}"
    new.write_bytes(as_bytes(notebooks.with_answers(release, {"ex1_4": empty_quiz})))
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
    (folder / "amy" / "holiday.ipynb").write_bytes(as_bytes(unrelated))
    (folder / "loose.ipynb").write_bytes(as_bytes(release))
    (folder / "bob").mkdir()
    (folder / "bob" / "prefill_decode.ipynb").write_bytes(as_bytes(unrelated))  # no markers, but the right name
    report = collect(folder, course_root, [ASSIGNMENT], "folder")
    reasons = {e.source: e.reason for e in report.unmatched}
    assert "not valid notebook JSON" in reasons["amy/prefill_decode.ipynb"]
    assert "does not look like" in reasons["amy/holiday.ipynb"]
    assert "no student id" in reasons["loose.ipynb"]
    assert [e.student for e in report.collected] == ["bob"] and "file name" in report.collected[0].reason


def test_student_ids_and_patterns():
    assert student_id("  Zoë  O'Brien ") == "zoe_o_brien"
    assert find_student("Jane Doe_1_assignsubmission_file_/x.ipynb", compile_pattern("moodle")) == "jane_doe"
    assert find_student("alice/hw/x.ipynb", compile_pattern("folder")) == "alice"
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
    assert "Restored the grading metadata of 26 cell(s)" in result.notes[0]


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
