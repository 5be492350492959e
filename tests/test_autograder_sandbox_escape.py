"""No student code runs with more than its kernel's privileges (the grading sandbox, bubblewrap).

* A cell plants ``autograder/kernel.py`` in the notebook's folder (the kernel's working directory,
  which the kernel may write to) and crashes the kernel. The grader restarts the kernel as root from
  that folder: the planted module must never be imported. Before the fix it ran as root with every
  capability, read the gradebook with the hidden tests and remounted a read-only mount writable.
* Whatever runs as root inside the sandbox holds only the capabilities needed to start the kernel as
  its own user and to stop that user's processes: no remount, no ptrace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest
from helpers import CORRECT, TINY_ASSIGNMENT, TINY_NOTEBOOK, tiny_course
from nbformat.v4 import new_code_cell

from autograder import notebooks
from autograder.pipeline import grade
from autograder.sandbox import PYTHON_FLAGS, Limits, _bwrap_command, bwrap_problem

ASSIGNMENT, NAME = TINY_ASSIGNMENT, TINY_NOTEBOOK
pytestmark = pytest.mark.skipif(bwrap_problem() is not None, reason=f"no grading sandbox: {bwrap_problem()}")

# What a root process inside the sandbox can do: its capabilities, the gradebook, a remount.
ROOT_PROBE = r"""
import ctypes, json, os
seen = {"euid": os.geteuid()}
seen["cap_eff"] = int([l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1], 16)
try:
    seen["gradebook_bytes"] = len(open("/grading/gradebook.db", "rb").read())
except OSError as err:
    seen["gradebook_bytes"] = type(err).__name__
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
code = libc.mount(None, b"/usr", None, MS_REMOUNT | MS_BIND, None)  # writable again: no MS_RDONLY
seen["remount"] = [code, ctypes.get_errno()]
"""

# The planted launcher: records what it could do as root, then starts the real kernel so grading
# goes on (a real attack would forge the scores from here).
PLANT = (
    "import os\n"
    "os.makedirs('autograder', exist_ok=True)\n"
    "open('autograder/__init__.py', 'w').write('')\n"
    "open('autograder/kernel.py', 'w').write({probe!r} + {tail!r})\n"
    "os._exit(1)\n"
)
PLANT_TAIL = r"""
open("EVIDENCE.json", "w").write(json.dumps(seen))
os.chmod("EVIDENCE.json", 0o644)
import runpy, sys
sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
for name in [m for m in sys.modules if m.startswith("autograder")]:
    del sys.modules[name]
runpy.run_module("autograder.kernel", run_name="__main__", alter_sys=True)
"""
SHOW = "import os\nprint('EVIDENCE:' + (open('EVIDENCE.json').read() if os.path.exists('EVIDENCE.json') else 'none'))"
CAP_SYS_ADMIN, CAP_SYS_PTRACE = 21, 19


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    return tiny_course(tmp_path_factory.mktemp("escape") / "course")


def test_a_planted_kernel_module_is_never_imported_as_root(course):
    release = notebooks.read(course.release_dir / ASSIGNMENT / NAME)
    nb = notebooks.with_answers(release, {"ex1_1": CORRECT})
    position = next(i for i, cell in enumerate(nb.cells) if notebooks.grade_id(cell) == "ex1_1_types")
    nb.cells.insert(position, new_code_cell(PLANT.format(probe=ROOT_PROBE, tail=PLANT_TAIL)))
    nb.cells.insert(position + 1, new_code_cell(SHOW))
    target = course.submitted / "planter" / ASSIGNMENT / NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(target))

    (result,) = grade(course, ASSIGNMENT, ["planter"], workers=1, sandbox="bwrap")
    assert result.status == "graded", result.log
    graded = notebooks.read(course.autograded / "planter" / ASSIGNMENT / NAME)
    printed = "".join(
        out.get("text", "") for cell in graded.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )
    assert "EVIDENCE:none" in printed, f"the student's autograder/kernel.py ran at the kernel's restart: {printed}"
    assert {k: v["auto_score"] for k, v in result.grades[NAME].items()} == {"ex1_1_add": 1, "ex1_1_types": 1}


def test_every_python_the_grader_starts_is_isolated_from_the_working_directory():
    assert "-I" in PYTHON_FLAGS, "-I keeps the working directory (the notebook's folder) off sys.path"


def test_root_inside_the_sandbox_cannot_remount_or_trace(tmp_path):
    job = tmp_path / "job"
    for folder in (job / "in", job / "out"):
        folder.mkdir(parents=True)
    command = _bwrap_command(job, Limits()) + [
        sys.executable,
        *PYTHON_FLAGS,
        "-c",
        ROOT_PROBE + "print(json.dumps(seen))",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["euid"] == 0
    assert not seen["cap_eff"] & (1 << CAP_SYS_ADMIN), "root in the sandbox must not hold CAP_SYS_ADMIN"
    assert not seen["cap_eff"] & (1 << CAP_SYS_PTRACE), "root in the sandbox must not hold CAP_SYS_PTRACE"
    assert seen["remount"][0] != 0, "a read-only bind mount must stay read-only"


def test_the_kernel_launcher_refuses_root_without_isolation():
    if os.geteuid() != 0:
        pytest.skip("the refusal concerns a launcher started as root")
    done = subprocess.run(
        [sys.executable, "-m", "autograder.kernel", "-f", "/nonexistent.json"], capture_output=True, text=True
    )
    assert done.returncode != 0 and "python -I" in done.stderr


# What a crashed kernel can leave for the next one of the same student: IPython startup files in its
# home (run before the seal is in place), or a link at the home's path (root would chown its target).
LEFT_BEHIND = {
    "startup_file": (
        "import os\n"
        "folder = os.path.join(os.environ['IPYTHONDIR'], 'profile_default', 'startup')\n"
        "os.makedirs(folder, exist_ok=True)\n"
        "open(os.path.join(folder, '00-early.py'), 'w').write(\n"
        '    \'import math\\nmath.isclose = lambda *a, **k: True\\nopen("EARLY", "w").write("ran")\\n\')\n'
        "os._exit(1)"
    ),
    "home_link": (
        "import os\nhome = os.environ['HOME']\n"
        "os.rename(home, home + '-old')\nos.symlink('/grading', home)\nos._exit(1)"
    ),
}
LEFT_SHOW = (
    "import os\n"
    "print('EARLY:' + str(os.path.exists('EARLY')))\n"
    "print('GRADING_OWNER:' + str(os.stat('/grading').st_uid == os.getuid()))"
)


def test_a_crashed_kernel_leaves_nothing_the_next_one_runs_or_follows(course):
    release = notebooks.read(course.release_dir / ASSIGNMENT / NAME)
    for student, cell in LEFT_BEHIND.items():
        nb = notebooks.with_answers(release, {"ex1_1": CORRECT})
        position = next(i for i, c in enumerate(nb.cells) if notebooks.grade_id(c) == "ex1_1_types")
        nb.cells.insert(position, new_code_cell(cell))
        nb.cells.insert(position + 1, new_code_cell(LEFT_SHOW))
        target = course.submitted / student / ASSIGNMENT / NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, str(target))
    results = {r.student: r for r in grade(course, ASSIGNMENT, list(LEFT_BEHIND), workers=2, sandbox="bwrap")}
    for student in LEFT_BEHIND:
        assert results[student].status == "graded", results[student].log[-3000:]
        graded = notebooks.read(course.autograded / student / ASSIGNMENT / NAME)
        printed = "".join(
            out.get("text", "") for c in graded.cells if c.cell_type == "code" for out in c.get("outputs", [])
        )
        assert "EARLY:False" in printed, f"{student}: a startup file left by the crashed kernel ran: {printed}"
        assert "GRADING_OWNER:False" in printed, f"{student}: root followed the link and chowned /grading"
        assert results[student].flags == [], results[student].flags
