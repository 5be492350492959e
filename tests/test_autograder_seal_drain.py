"""What the grader reads from a kernel's seal when it stops that kernel: an interpreter's own reset of the profile
function, caused by the grader's interrupt, is not the student's tampering; everything else still is."""

import asyncio
import os
import socket

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

from autograder import seal
from autograder.execution import ResilientExecution


class Client(ResilientExecution, NotebookClient):
    """The grader's execution as a client runs it (no kernel is started here)."""


def drained(lines: list[str], interrupted: bool) -> Client:
    """A grader whose kernel's seal sent ``lines`` (signed ALERT payloads), drained as it stops that kernel."""
    execution = Client(nb=nbformat.v4.new_notebook())
    key = os.urandom(32)
    grader, kernel = socket.socketpair()
    grader.setblocking(False)
    kernel.sendall(b"".join(f"{line}|{seal.sign(key, line)}\n".encode() for line in lines))
    kernel.close()
    execution._seal = {"key": key, "connection": grader, "buffer": b""}
    try:
        asyncio.run(execution._seal_drain(-1, interrupted))
    finally:
        grader.close()
    return execution


RESET = "ALERT 1 the notebook called sys.setprofile"
PLANTED = "ALERT 2 the notebook rewrote the library function percentile"


def test_a_profile_reset_from_a_kernel_stopped_for_ignoring_its_interrupt_is_set_aside_and_logged():
    # CPython turns off a profile function that raised, and raises sys.setprofile with the notebook's frame on top:
    # the grader's KeyboardInterrupt landing in forbid_reference's watcher does that (Python/sysmodule.c).
    execution = drained([RESET, PLANTED], interrupted=True)
    assert execution.integrity_problems == ["the notebook rewrote the library function percentile"]
    assert [e["event"] for e in execution.grading_events] == ["set-aside", "tampered"]
    assert (
        "the notebook called sys.setprofile, while the kernel was being interrupted"
        in (execution.grading_events[0]["detail"])
    )


def test_the_same_report_from_a_kernel_that_died_or_answered_is_tampering():
    execution = drained([RESET], interrupted=False)
    assert execution.integrity_problems == ["the notebook called sys.setprofile"]


def test_a_line_the_kernel_did_not_sign_is_tampering_even_from_an_interrupted_kernel():
    execution = Client(nb=nbformat.v4.new_notebook())
    grader, kernel = socket.socketpair()
    grader.setblocking(False)
    kernel.sendall(f"{RESET}|{'0' * 64}\n".encode())
    kernel.close()
    execution._seal = {"key": os.urandom(32), "connection": grader, "buffer": b""}
    asyncio.run(execution._seal_drain(-1, interrupted=True))
    grader.close()
    assert execution.integrity_problems == ["a message on the grading kernel's seal was not signed by it"]


class Stuck(NotebookClient):
    """A kernel whose cell runs past the timeout and ignores the interrupt (nbclient raises CellTimeoutError)."""

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        raise CellTimeoutError("the cell did not stop")


class StuckClient(ResilientExecution, Stuck):
    drains: list

    async def _seal_drain(self, cell_index: int, interrupted: bool = False) -> None:
        self.drains.append(interrupted)


def test_a_kernel_stopped_for_ignoring_its_interrupt_is_drained_as_interrupted():
    # The wiring the fix needs: the unresponsive cell's restart tells the drain why the kernel is stopped.
    execution = StuckClient(nb=nbformat.v4.new_notebook(), check_integrity=True, max_kernel_restarts=0)
    execution.drains = []
    cell = nbformat.v4.new_code_cell("while True:\n    pass")
    asyncio.run(execution.async_execute_cell(cell, 0))
    assert execution.drains == [True]
    assert [e["event"] for e in execution.grading_events] == ["unresponsive"]


def test_cpython_reports_turning_off_a_profile_function_that_raised_as_sys_setprofile_from_the_callers_frame():
    # Why the reset is set aside: no code called sys.setprofile, yet the event comes with the profiled frame on top.
    # In a subprocess: an audit hook cannot be removed.
    import subprocess
    import sys

    program = (
        "import sys\n"
        "seen = []\n"
        "def hook(event, args):\n"
        "    if event == 'sys.setprofile':\n"
        "        seen.append(sys._getframe(1).f_code.co_name)\n"
        "sys.addaudithook(hook)\n"
        "def watcher(frame, event, arg):\n"
        "    if event == 'c_call':\n"
        "        raise KeyboardInterrupt\n"
        "def answer():\n"
        "    try:\n"
        "        len([])\n"
        "    except KeyboardInterrupt:\n"
        "        pass\n"
        "sys.setprofile(watcher)\n"
        "answer()\n"
        "print(seen, sys.getprofile())\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "['<module>', 'answer'] None", result.stderr
