"""The grading sandbox and the parallel pipeline on a tiny assignment (its kernel needs no torch).

What the kernel can see (uid, file system, network), a student whose grading hangs past the job
limit while the others are graded, the unconfined mode for machines without bubblewrap, and the
export and feedback of a failed student.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from helpers import CORRECT, TINY_ASSIGNMENT, TINY_NOTEBOOK, submit, tiny_course

from autograder import notebooks
from autograder.pipeline import grade
from autograder.sandbox import SANDBOX_UID_BASE, Limits, bwrap_problem

ASSIGNMENT, NAME = TINY_ASSIGNMENT, TINY_NOTEBOOK
needs_bwrap = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no grading sandbox: {bwrap_problem()}")


PROBE = """# EXERCISE: ex1_1
import json, os, socket
seen = {
    "uid": os.getuid(),
    "interfaces": [name for _, name in socket.if_nameindex()],
    "root": sorted(os.listdir("/")),
    "solutions": os.path.exists("@@REPO@@/solutions"),
    "home": os.environ.get("HOME"),
    "cwd_writable": os.access(".", os.W_OK),
    "env_has_host_secret": "AUTOGRADER_TEST_SECRET" in os.environ,
}
try:
    open("/input/gradebook.db", "rb")
    seen["input"] = "readable"
except OSError as err:
    seen["input"] = type(err).__name__
print("PROBE" + json.dumps(seen))
def add(a, b):
    return a + b"""


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    return tiny_course(tmp_path_factory.mktemp("tiny") / "course")


@needs_bwrap
def test_kernel_sees_only_its_sandbox(course, monkeypatch):
    monkeypatch.setenv("AUTOGRADER_TEST_SECRET", "1")
    submit(course, "probe", PROBE.replace("@@REPO@@", str(Path(__file__).resolve().parents[1])))
    (result,) = grade(course, ASSIGNMENT, ["probe"], workers=1, sandbox="bwrap")
    assert result.status == "graded", result.log
    nb = notebooks.read(course.autograded / "probe" / ASSIGNMENT / NAME)
    text = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs)
    seen = json.loads(text.split("PROBE", 1)[1].splitlines()[0])
    assert seen["uid"] >= SANDBOX_UID_BASE, "the kernel must run as the slot's unprivileged user"
    assert seen["interfaces"] == ["lo"], "only the sandbox's own loopback"
    assert not seen["solutions"], "solutions/ must not be mounted"
    assert "home" not in seen["root"] and "srv" not in seen["root"], "only what grading needs is mounted"
    assert seen["input"] == "PermissionError", "the staged gradebook must be root-only"
    assert not seen["env_has_host_secret"], "no host environment variables inside"
    assert seen["cwd_writable"] and seen["home"].startswith("/tmp/")
    assert result.grades[NAME]["ex1_1_add"]["auto_score"] == 1.0


@needs_bwrap
def test_a_hung_student_times_out_while_the_others_are_graded(course):
    submit(
        course,
        "hangs",
        "# EXERCISE: ex1_1\nimport time\nwhile True:\n    try:\n        time.sleep(1)\n"
        "    except BaseException:\n        pass",
    )
    submit(course, "good", CORRECT)
    submit(course, "wrong", "# EXERCISE: ex1_1\ndef add(a, b):\n    return abs(a) + b")
    # The job limit is calibrated on this machine (3 x a correct notebook's grading time, at least 8 s),
    # so a loaded machine gives the same outcome: the hung student times out, the others never do.
    (probe,) = grade(course, ASSIGNMENT, ["good"], workers=1)
    limit = max(8, round(3 * probe.seconds))
    limits = Limits(cell_timeout_s=600, job_timeout_s=limit)
    results = {r.student: r for r in grade(course, ASSIGNMENT, ["hangs", "good", "wrong"], workers=2, limits=limits)}
    assert results["hangs"].status == "timeout" and f"{limit} s" in results["hangs"].message
    assert results["good"].status == "graded"
    assert {k: v["auto_score"] for k, v in results["good"].grades[NAME].items()} == {"ex1_1_add": 1, "ex1_1_types": 1}
    assert {k: v["auto_score"] for k, v in results["wrong"].grades[NAME].items()} == {"ex1_1_add": 0, "ex1_1_types": 1}

    from autograder.export import export
    from autograder.feedback import generate_feedback

    generate_feedback(course, ASSIGNMENT, ["hangs", "good", "wrong"])
    page = (course.feedback / "hangs" / ASSIGNMENT / "tiny.html").read_text()
    assert "could not be graded automatically" in page and f"{limit} s" in page
    wrong = (course.feedback / "wrong" / ASSIGNMENT / "tiny.html").read_text()
    assert "A hidden test failed: AssertionError: the hidden case failed" in wrong
    assert "add(-1, 1)" not in wrong, "hidden test code must not be shown"
    _, grades_csv, summary_csv = export(course, ASSIGNMENT)
    rows = {row["student"]: row for row in csv.DictReader(grades_csv.open())}
    assert rows["hangs"]["total"] == "0.0" and rows["hangs"]["status"].startswith("needs manual grading")
    assert rows["good"]["total"] == "2.0" and rows["good"]["status"] == "graded"
    assert rows["wrong"]["total"] == "1.0"
    summary = list(csv.DictReader(summary_csv.open()))
    assert summary[0]["exercise"] == "ex1_1" and float(summary[0]["points"]) == 2.0


def test_unconfined_mode_grades_the_same(course):
    submit(course, "free_good", CORRECT)
    submit(course, "free_wrong", "# EXERCISE: ex1_1\ndef add(a, b):\n    return abs(a) + b")
    results = {r.student: r for r in grade(course, ASSIGNMENT, ["free_good", "free_wrong"], workers=2, sandbox="none")}
    assert results["free_good"].grades[NAME]["ex1_1_add"]["auto_score"] == 1.0
    assert results["free_wrong"].grades[NAME]["ex1_1_add"]["auto_score"] == 0.0
    assert course.load_result(ASSIGNMENT, "free_good")["status"] == "graded"


def test_regrading_replaces_the_scores(course):
    submit(course, "again", "# EXERCISE: ex1_1\ndef add(a, b):\n    return abs(a) + b")
    grade(course, ASSIGNMENT, ["again"], workers=1)
    submit(course, "again", CORRECT)
    grade(course, ASSIGNMENT, ["again"], workers=1)
    from autograder.export import collect_grades

    rows = {row["student"]: row for row in collect_grades(course, ASSIGNMENT).rows}
    assert rows["again"]["total"] == 2.0


# --- two runs on one machine ----------------------------------------------------------------------

HOLD = """
import sys, time
from autograder.sandbox import UidLease
from autograder.course_dir import Course
what = sys.argv[1]
if what == "slots":
    lease = UidLease(int(sys.argv[2]))
    print(" ".join(map(str, lease.slots)), flush=True)
else:
    held = Course(sys.argv[2]).exclusive("grade tiny")
    held.__enter__()
    print("held", flush=True)
sys.stdin.readline()
"""


def _holder(*args: str):
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    first = process.stdout.readline().strip()
    return process, first


def test_uid_slots_are_never_shared_between_runs(tmp_path, monkeypatch):
    from autograder.sandbox import UidLease

    monkeypatch.setenv("AUTOGRADER_LOCK_DIR", str(tmp_path / "locks"))
    other, line = _holder("slots", "3")  # another run on this machine, in another process
    try:
        theirs = set(map(int, line.split()))
        with UidLease(3) as first, UidLease(2) as second:
            assert len(theirs) == 3 and len(set(first.slots)) == 3 and len(set(second.slots)) == 2
            assert not theirs & set(first.slots) and not theirs & set(second.slots)
            assert not set(first.slots) & set(second.slots)
    finally:
        other.communicate("\n")
    with UidLease(3) as again:  # the other run ended: its slots are free again
        assert set(again.slots) == {0, 1, 2}


def test_a_second_run_on_the_same_course_refuses(course):
    from autograder.course_dir import CourseBusy

    other, line = _holder("course", str(course.root))
    try:
        assert line == "held"
        with pytest.raises(CourseBusy, match="another autograder run is using the course"):
            grade(course, ASSIGNMENT, ["nobody"], workers=1, sandbox="none")
    finally:
        other.communicate("\n")


@needs_bwrap
def test_two_runs_at_once_grade_with_different_uids(tmp_path):
    """Two `autograder grade` processes at once, on two courses: each kernel runs as a uid of its own."""
    import os
    import subprocess
    import sys

    courses = [tiny_course(tmp_path / f"course{n}") for n in range(2)]
    for course_n in courses:
        submit(course_n, "good", CORRECT)
    env = {**os.environ, "AUTOGRADER_LOCK_DIR": str(tmp_path / "locks")}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "autograder.cli", "--root", str(c.root), "grade", ASSIGNMENT, "--workers", "1"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for c in courses
    ]
    outputs = [run.communicate(timeout=900)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    records = [c.load_result(ASSIGNMENT, "good") for c in courses]
    uids = {record["uid"] for record in records}
    assert len(uids) == 2 and all(uid >= SANDBOX_UID_BASE for uid in uids), uids
    assert all(record["grades"][NAME]["ex1_1_add"]["auto_score"] == 1.0 for record in records)


@needs_bwrap
def test_a_virtual_environment_reached_through_a_symlink_runs_in_the_sandbox(tmp_path, monkeypatch):
    """A venv shared by course copies through a link: the interpreter starts by the link's path inside."""
    import subprocess
    import sys

    from autograder.sandbox import _bwrap_command, _clean_env

    link = tmp_path / "shared-venv"
    link.symlink_to(Path(sys.prefix).resolve(), target_is_directory=True)
    monkeypatch.setattr(sys, "prefix", str(link))
    monkeypatch.setattr(sys, "executable", str(link / "bin" / Path(sys.executable).name))
    job = tmp_path / "job"
    for folder in (job / "in", job / "out"):
        folder.mkdir(parents=True)
    command = _bwrap_command(job, Limits()) + [sys.executable, "-c", "import autograder.kernel, nbgrader; print('ok')"]
    done = subprocess.run(command, env=_clean_env(Limits(threads=1)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another uid needs root")
def test_stray_processes_are_counted_once_even_before_they_are_reaped():
    # The kernel's restart reports "N process(es) the notebook had started were stopped". A killed process stays in
    # /proc as a zombie until its parent reaps it; counting it in every round of the kill loop reported 50 for one
    # sleeping child (and spent the loop's whole second on it).
    import subprocess

    from autograder.execution import kill_processes_of

    uid = 54_321  # no account: nothing else on the machine runs as it
    children = [subprocess.Popen(["sleep", "60"], user=uid, group=uid) for _ in range(2)]
    try:
        assert kill_processes_of(uid) == 2
        assert kill_processes_of(uid) == 0, "dead children waiting to be reaped are not killed again"
        assert all(child.wait(timeout=5) == -9 for child in children)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
