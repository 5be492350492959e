"""``autograder check``: a learner's self-check with the visible and hidden tests, no gradebook."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import nbformat
from helpers import damage, lite_source

from autograder import cli, notebooks
from autograder.check import download_course, release_like
from autograder.execution import without_hidden_tests

ROOT = Path(__file__).resolve().parents[1]
WRONG_TPOT = """# EXERCISE: ex1_2
def request_latencies(trace):
    times = trace.chunk_times
    ttft = times[0] - trace.send_time
    e2e = times[-1] - trace.send_time
    itl = [later - earlier for earlier, later in zip(times, times[1:])]
    tpot = (e2e - ttft) / (len(times) - 1) if trace.output_tokens > 1 else None
    return {"ttft": ttft, "e2e": e2e, "itl": itl, "tpot": tpot}"""


def test_check_grades_a_damaged_notebook_with_the_hidden_tests(tmp_path, capsys):
    source = lite_source()
    notebooks.write(source, tmp_path / "course" / "solutions" / "m1_prefill_decode" / "prefill_decode.ipynb")
    learner = release_like(source)  # what the learner got: no solutions, no hidden tests
    for cell in learner.cells:
        if notebooks.is_test_cell(cell):
            cell.source = without_hidden_tests(cell.source)
    answers = {**notebooks.answer_sources(source), "ex1_2": WRONG_TPOT}
    learner = damage(notebooks.with_answers(learner, answers), "strip-metadata,colab")
    path = tmp_path / "Copy of prefill_decode.ipynb"
    path.write_text(nbformat.writes(learner, version=4))

    code = cli.main(["check", str(path), "--source", str(tmp_path / "course"), "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "assignment m1_prefill_decode" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "4 / 6" in lines["ex1_2"] and "5 / 5" in lines["ex1_1"] and "12 / 12" in lines["ex1_4"]
    assert "32 / 34" in lines["total"]
    assert "ex1_2_tpot: A hidden test failed: AssertionError: TPOT counts tokens, not chunks" in out
    assert "bundled = RequestTrace" not in out, "a hidden test's code must not be printed"


def test_check_finds_no_assignment_for_an_unrelated_notebook(tmp_path, capsys):
    path = tmp_path / "holiday.ipynb"
    path.write_text(nbformat.writes(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])))
    assert cli.main(["check", str(path), "--source", str(ROOT)]) == 2, "errors exit 2, as the course command's do"
    assert "does not look like any assignment" in capsys.readouterr().err


def test_download_course_keeps_only_solutions_and_modules(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in {
            "repo-main/solutions/m1/a.ipynb": "{}",
            "repo-main/modules/m1/a.ipynb": "{}",
            "repo-main/course/secret.py": "x",
            "repo-main/solutions/../../evil.txt": "x",
        }.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    tarball = tmp_path / "main.tar.gz"
    tarball.write_bytes(buffer.getvalue())
    root = download_course(url=tarball.as_uri(), ref="main", cache=tmp_path / "cache")
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert files == ["modules/m1/a.ipynb", "solutions/m1/a.ipynb"]
    assert not (tmp_path / "evil.txt").exists()
    assert download_course(url="file:///nonexistent", ref="main", cache=tmp_path / "cache") == root  # cached
