"""The ``autograder`` command line: every step documents itself and bad input gets a clear message."""

from __future__ import annotations

import pytest

from autograder import cli

STEPS = ["release", "collect", "repair", "grade", "feedback", "export", "run", "check"]


@pytest.mark.parametrize("step", STEPS)
def test_every_step_has_help(step, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main([step, "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: autograder {step}") and len(text) > 300


def test_top_level_help_lists_the_steps(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    text = capsys.readouterr().out
    assert all(step in text for step in STEPS)


def test_missing_input_is_a_clear_error(tmp_path, capsys):
    code = cli.main(["--root", str(tmp_path), "collect", str(tmp_path / "nowhere.zip"), "--assignment", "m1"])
    assert code == 2, "errors exit 2, as the course command's do"
    assert "no release notebooks" in capsys.readouterr().err


def test_grading_without_a_release_says_what_to_run(tmp_path, capsys):
    code = cli.main(["--root", str(tmp_path), "grade", "m1_prefill_decode", "--sandbox", "none"])
    assert code == 2
    assert "autograder release m1_prefill_decode" in capsys.readouterr().err


def test_help_documents_ids_duplicates_and_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["collect", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "latest LMS timestamp" in text and "never resolved silently or by zip order" in text
    assert "Canvas" in text and "Blackboard" in text and "Gradescope" in text and "NFC" in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "2 on errors" in " ".join(capsys.readouterr().out.split())


def test_a_damaged_download_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "class.zip"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "modules" / "m1").mkdir(parents=True)
    (tmp_path / "modules" / "m1" / "x.ipynb").write_text(
        '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}'
    )
    code = cli.main(["--root", str(tmp_path), "collect", str(bad), "--assignment", "m1"])
    assert code == 2
    assert "autograder collect:" in capsys.readouterr().err


def test_outside_a_course_it_refuses_and_says_how(tmp_path, monkeypatch, capsys):
    """Without --root, never act on the checkout the autograder is installed from (another course copy)."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(["collect", str(tmp_path / "nowhere.zip"), "--assignment", "m1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "not inside a course" in err and "--root" in err and str(tmp_path) in err


def test_it_acts_on_the_course_of_the_current_folder_and_says_which(tmp_path, monkeypatch, capsys):
    """A second course copy (sharing this virtual environment): commands run in it act on it, and print it."""
    clone = tmp_path / "copy"
    (clone / "solutions").mkdir(parents=True)
    (clone / "modules" / "m1").mkdir(parents=True)
    (clone / "modules" / "m1" / "x.ipynb").write_text(
        '{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}'
    )
    (clone / "nbgrader_config.py").write_text("")
    (clone / "sub").mkdir()
    monkeypatch.chdir(clone / "sub")
    code = cli.main(["collect", str(tmp_path / "nowhere.zip"), "--assignment", "m1"])
    err = capsys.readouterr().err
    assert f"course root {clone.resolve()}" in err, err
    assert code == 2 and "neither a zip file nor a folder" in err
    assert (clone / "grading").is_dir(), "the working folders are the copy's"
    explicit = tmp_path / "other"
    code = cli.main(["--root", str(explicit), "collect", str(tmp_path / "nowhere.zip"), "--assignment", "m1"])
    assert f"course root {explicit.resolve()}" in capsys.readouterr().err


def test_collect_and_export_name_their_nbgrader_plugins(tmp_path, capsys):
    """The presets and the CSV are nbgrader plugins: the help says how plain nbgrader loads them."""
    for step, words in (
        ("collect", ["nbgrader zip_collect --collector", "FileNameCollectorPlugin"]),
        ("export", ["nbgrader export --exporter=autograder.plugins.CourseCsvExport"]),
    ):
        with pytest.raises(SystemExit):
            cli.main([step, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(word in text for word in words), (step, text)
    code = cli.main(
        ["--root", str(tmp_path), "collect", str(tmp_path), "--assignment", "m1", "--pattern", "json.JSONDecoder"]
    )
    assert code == 2 and "not an nbgrader FileNameCollectorPlugin" in capsys.readouterr().err
