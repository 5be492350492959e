"""The hostile-submission corpus, graded end to end by ``autograder run`` in the bubblewrap sandbox.

Each case in tests/fixtures/hostile/ is one student's module-1 submission (blank, correct, partly
wrong, damaged by Colab or by hand, hanging, crashing, bombing memory or output, forking, trying to
read the solutions, write the gradebook or reach the network). They are zipped like an LMS download
(with a few files that must not be collected) and graded in one `autograder run`; every case must
get its exact expected score and its expected feedback line, no feedback may show a hidden test,
the host must receive no connection, and the gradebook must hold nothing but the merged scores.
Damaged files (malformed JSON shapes, a bad CRC, a symbolic link) must not stop the run: their
students get 0 and "needs manual grading". The run's limits are scaled by the machine's load
(:func:`load_factor`), so a loaded CI machine gives the same scores.

To keep the suite fast, the assignment is module 1 reduced to what its exercises need (the setup
cell, the imports cell, the answer and test cells, the prose), built from solutions/ here: the real
exercises and the real hidden tests, without the minute of measurements in between.
"""

from __future__ import annotations

import copy
import csv
import html
import io
import json
import re
import socket
import sqlite3
import threading
import time
import zipfile
from pathlib import Path

import pytest
from helpers import corrupt_member, damage, lite_source

from autograder import cli, notebooks
from autograder.execution import hidden_region
from autograder.sandbox import bwrap_problem

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "fixtures" / "hostile"
ASSIGNMENT = "m1_prefill_decode"
NOTEBOOK = "prefill_decode.ipynb"
CASES = sorted(path.stem for path in FIXTURES.glob("*.py"))
HEADER = re.compile(r"^# (CASE|FILE|DAMAGE|SCORE|STATUS|FEEDBACK): ?(.*)$", re.MULTILINE)


def load_factor() -> float:
    """How much slower than idle this machine runs a cell now: 1 when idle, at most 4.

    The corpus's limits (cell timeout, job timeout) are scaled by it, so a loaded CI machine gives
    the same scores: a legitimate cell never meets its limit, and the cases that must hit a limit
    (endless loops) hit it whatever the load, only later.
    """
    import os

    try:
        load = os.getloadavg()[0]
    except OSError:
        return 1.0
    return min(4.0, max(1.0, load / (os.cpu_count() or 1)))


pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no grading sandbox: {bwrap_problem()}")


def parse_case(path: Path) -> dict:
    """Header fields and answer cells (grade_id -> source) of one corpus file."""
    text = path.read_text()
    case = {"FILE": "{student}/" + NOTEBOOK, "DAMAGE": "", "STATUS": "graded", "FEEDBACK": []}
    for key, value in HEADER.findall(text.split("# EXERCISE:", 1)[0]):
        if key == "FEEDBACK":
            case["FEEDBACK"].append(value)
        elif key == "CASE" and "CASE" in case:
            case["CASE"] += " " + value
        else:
            case[key] = value
    answers = {}
    for chunk in re.split(r"(?m)^(?=# EXERCISE: )", text)[1:]:
        answers[notebooks.MARKER.match(chunk.split("\n", 1)[0]).group(2)] = chunk.strip("\n")
    case["answers"] = answers
    case["SCORE"] = float(case["SCORE"])
    return case


def host_ip() -> str:
    """This machine's address on its outbound interface (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        return probe.getsockname()[0]
    except OSError:
        return "10.255.255.1"
    finally:
        probe.close()


class Listener:
    """A TCP server on every host interface that records whoever connects."""

    def __init__(self):
        self.server = socket.create_server(("0.0.0.0", 0))
        self.server.settimeout(0.2)
        self.port = self.server.getsockname()[1]
        self.connections: list[str] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stopped.is_set():
            try:
                conn, addr = self.server.accept()
            except OSError:
                continue
            self.connections.append(f"{addr[0]}:{addr[1]}")
            conn.close()

    def close(self):
        self.stopped.set()
        self.thread.join()
        self.server.close()


def build_zip(course_root: Path, release, source, listener: Listener) -> bytes:
    """An LMS-style zip: one folder per student, plus files that must not be collected."""
    solutions = notebooks.answer_sources(source)
    buffer = io.BytesIO()
    corrupt = []
    with zipfile.ZipFile(buffer, "w") as archive:
        for case_name in CASES:
            case = parse_case(FIXTURES / f"{case_name}.py")
            nb = copy.deepcopy(release)
            if "blank" not in case["DAMAGE"]:
                answers = {gid: src.replace("@@PORT@@", str(listener.port)) for gid, src in case["answers"].items()}
                answers = {
                    gid: src.replace("@@HOST_IP@@", host_ip())
                    .replace("@@ROOT@@", str(course_root))
                    .replace("@@REPO@@", str(ROOT))
                    for gid, src in answers.items()
                }
                nb = notebooks.with_answers(nb, {**solutions, **answers})
            nb = damage(nb, case["DAMAGE"])
            name = case["FILE"].format(student=case_name)
            if "symlink" in case["DAMAGE"]:
                link = zipfile.ZipInfo(name)
                link.create_system, link.external_attr = 3, 0o120777 << 16
                archive.writestr(link, str(ROOT / "solutions" / ASSIGNMENT / NOTEBOOK))
                continue
            archive.writestr(name, json.dumps(nb))
            if "bad-crc" in case["DAMAGE"]:
                corrupt.append(name)
        archive.writestr("index.html", "<html>LMS index page</html>")
        archive.writestr("unreadable/prefill_decode.ipynb", '{"cells": [')
        archive.writestr(
            "stranger/untitled.ipynb",
            json.dumps(notebooks.read(ROOT / "modules" / ASSIGNMENT / NOTEBOOK) | {"cells": []}),
        )
    data = buffer.getvalue()
    for name in corrupt:
        data = corrupt_member(data, name)
    return data


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from autograder.release import release as release_assignment

    root = tmp_path_factory.mktemp("hostile") / "course"
    source = lite_source()
    notebooks.write(source, root / "solutions" / ASSIGNMENT / NOTEBOOK)
    release_assignment(root, [ASSIGNMENT], f"sqlite:///{root / 'gradebook.db'}")
    release = notebooks.read(root / "modules" / ASSIGNMENT / NOTEBOOK)
    listener = Listener()
    download = root.parent / "submissions.zip"
    download.write_bytes(build_zip(root, release, source, listener))
    factor = load_factor()
    started = time.perf_counter()
    code = cli.main(
        [
            "--root",
            str(root),
            "run",
            ASSIGNMENT,
            str(download),
            "--pattern",
            "folder",
            "--workers",
            "2",
            "--sandbox",
            "bwrap",
            "--cell-timeout",
            str(round(15 * factor)),
            "--timeout",
            str(round(400 * factor)),
            "--memory",
            "2",
            "--processes",
            "64",
        ]
    )
    seconds = time.perf_counter() - started
    time.sleep(0.5)
    listener.close()
    with open(root / "grading" / ASSIGNMENT / "grades.csv") as handle:
        grades = {row["student"]: row for row in csv.DictReader(handle)}
    feedback = {}
    for case_name in CASES:
        page = root / "feedback" / case_name / ASSIGNMENT / "prefill_decode.html"
        feedback[case_name] = page.read_text() if page.is_file() else ""
    report = json.loads((root / "grading" / "collect-report.json").read_text())
    print(f"\nhostile corpus: {len(CASES)} submissions graded in {seconds:.1f} s (2 workers, limits x{factor:.1f})")
    return {
        "root": root,
        "code": code,
        "grades": grades,
        "feedback": feedback,
        "source": source,
        "listener": listener,
        "report": report,
        "seconds": seconds,
    }


def test_the_run_completes(corpus):
    assert corpus["code"] == 0
    # the unreadable notebook's student is marked for manual grading, so gets a row too
    assert set(corpus["grades"]) == set(CASES) | {"unreadable"}, "every case must be collected and exported"
    assert corpus["grades"]["unreadable"]["status"].startswith("needs manual grading: ")


@pytest.mark.parametrize("case_name", CASES)
def test_case_gets_its_score_and_feedback(corpus, case_name):
    case = parse_case(FIXTURES / f"{case_name}.py")
    row = corpus["grades"][case_name]
    log = corpus["root"] / "grading" / ASSIGNMENT / "logs" / f"{case_name}.log"
    assert float(row["total"]) == case["SCORE"], (
        f"{case_name} ({case['CASE']}): scored {row['total']}, expected {case['SCORE']}; status {row['status']}\n"
        f"{log.read_text()[-4000:] if log.exists() else ''}"
    )
    assert row["status"].startswith(case["STATUS"]), row["status"]
    page = corpus["feedback"][case_name]
    assert len(page) < 2_000_000, f"{case_name}: the feedback page is {len(page):,} bytes"
    text = html.unescape(page)
    for line in case["FEEDBACK"]:
        assert line in text, f"{case_name}: feedback lacks {line!r}"


def test_feedback_never_shows_hidden_tests(corpus):
    hidden_lines = set()
    for cell in corpus["source"].cells:
        if notebooks.is_test_cell(cell):
            lines = cell.source.split("\n")
            hidden_lines |= {lines[n - 1].strip() for n in hidden_region(cell.source)}
    hidden_lines = {line for line in hidden_lines if len(line) > 20 and "HIDDEN TESTS" not in line}
    assert len(hidden_lines) > 20
    for case_name, page in corpus["feedback"].items():
        text = html.unescape(page)
        leaked = [line for line in hidden_lines if line in text]
        assert not leaked, f"{case_name}: feedback shows hidden test code: {leaked[:3]}"


def test_feedback_pages_hold_no_script_or_javascript_link(corpus):
    for case_name, page in corpus["feedback"].items():
        body = page[page.find("<body") :]
        assert "<script" not in body.lower(), f"{case_name}: a script in the feedback body"
        assert not re.search(r"""(?:href|src)\s*=\s*["']?\s*javascript:""", page, re.I), case_name


def test_no_connection_reached_the_host(corpus):
    assert corpus["listener"].connections == [], "student code connected to the host"


def test_gradebook_holds_only_the_merged_scores(corpus):
    with sqlite3.connect(corpus["root"] / "gradebook.db") as db:
        triggers = db.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall()
        inflated = db.execute(
            "SELECT grade.auto_score FROM grade JOIN grade_cells ON grade.cell_id = grade_cells.id "
            "WHERE grade.auto_score > grade_cells.max_score"
        ).fetchall()
    assert triggers == [] and inflated == []


def test_collect_reports_what_it_could_not_match(corpus):
    unmatched = {entry["source"]: entry["reason"] for entry in corpus["report"]["unmatched"]}
    assert "not a notebook" in unmatched["index.html"]
    assert "not valid notebook JSON" in unmatched["unreadable/prefill_decode.ipynb"]
    assert "does not look like" in unmatched["stranger/untitled.ipynb"]
