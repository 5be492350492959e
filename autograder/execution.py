"""Running graded notebooks so that no cell can stop the rest: scoring, resilient execution, safe feedback.

Used inside the grading sandbox (through nbgrader, see :mod:`autograder.nbgrader_ext`) and by
``autograder check`` (plain nbclient, no nbgrader). Nothing here imports nbgrader.

* :class:`ResilientExecution` is a mixin for nbclient's ``NotebookClient`` (and so for nbgrader's
  ``Execute`` preprocessor). A cell whose kernel dies (``os._exit``, a segfault, a memory or CPU
  limit) or that will not stop when interrupted (a loop that swallows ``KeyboardInterrupt``) gets an
  error output saying so; the kernel is restarted, the cells that had run cleanly before it are run
  again silently to rebuild the learner's state, and grading goes on with the next cell. After
  ``max_kernel_restarts`` restarts the remaining cells are marked as not run, so one notebook's
  grading time stays bounded. Each cell's outputs are capped in size on the receiving side, where
  student code cannot lift the cap.
* :func:`cell_score` is the course's scoring rule: a test cell earns its points when it ran without
  an error output. Unlike nbgrader's rule it ignores the value of a cell's last expression (partial
  credit), which student code could forge; the course's test cells end with statements.
* :func:`hidden_test_summary` and :func:`hidden_region` let feedback name a failing test without
  showing hidden test code or its traceback; :class:`HiddenText` finds hidden test code in anything
  student code printed or raised (the kernel's input history ``In``, a traceback's source lines, an
  exception carrying its caller's frame), so feedback can drop it whatever the student's code did.
"""

from __future__ import annotations

import ast
import io
import re
import signal
import tokenize
from typing import Any

from jupyter_core.utils import ensure_async, run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from traitlets import Bool, Integer
from traitlets.config import LoggingConfigurable

HIDDEN_BEGIN = "BEGIN HIDDEN TESTS"
HIDDEN_END = "END HIDDEN TESTS"
# Error names this module writes into outputs; feedback explains them in plain words.
TIMEOUT_ENAME = "CellTimeoutError"
DIED_ENAME = "KernelDied"
STUCK_ENAME = "KernelUnresponsive"
NOT_RUN_ENAME = "NotRun"
TRUNCATED_NOTE = "[output truncated by the grader: this cell printed more than {limit:,} characters]\n"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_FRAME = re.compile(r"(?:Cell In\s*\[(\d+)\]|<ipython-input-(\d+)-[0-9a-f]+>),?\s*(?:line\s*)?(\d+)")


def error_output(ename: str, evalue: str) -> NotebookNode:
    """An nbformat error output (it makes a test cell score 0, and feedback shows its message)."""
    return NotebookNode(output_type="error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def has_error(cell) -> bool:
    return any(output.get("output_type") == "error" for output in cell.get("outputs", []))


def cell_score(cell, points: float) -> float:
    """Points a test cell earns: all of them when it raised nothing, else 0 (stderr never counts)."""
    return 0.0 if has_error(cell) else float(points)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def hidden_region(source: str) -> set[int]:
    """1-based line numbers of ``source`` inside hidden-test regions, delimiter lines included."""
    lines, inside, hidden = source.split("\n"), False, set()
    for number, line in enumerate(lines, start=1):
        if HIDDEN_BEGIN in line:
            inside = True
        if inside:
            hidden.add(number)
        if HIDDEN_END in line:
            inside = False
    return hidden


def without_hidden_tests(source: str) -> str:
    """``source`` with its hidden-test regions removed (what the learner's copy of the cell shows)."""
    hidden = hidden_region(source)
    return "\n".join(line for number, line in enumerate(source.split("\n"), 1) if number not in hidden)


_SPACE = re.compile(r"\s+")
LEAK_NOTE = "[hidden by the grader: this output contained hidden test code]"


def _squash(text: str) -> str:
    return _SPACE.sub("", strip_ansi(text))


def _string_mask(source: str) -> list[list[bool]]:
    """Per line of ``source``, per character: True inside a string literal (by Python's tokenizer)."""
    lines = source.split("\n")
    mask = [[False] * len(line) for line in lines]
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type != tokenize.STRING:
                continue
            (row, col), (end_row, end_col) = token.start, token.end
            for number in range(row, end_row + 1):
                line = mask[number - 1]
                first = col if number == row else 0
                last = end_col if number == end_row else len(line)
                for index in range(first, min(last, len(line))):
                    line[index] = True
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # not Python: every character counts as code
    return mask


class HiddenText:
    """The hidden test code of a notebook, and a check for it in text that student code produced.

    A leak is any run of ``window`` non-blank characters of a hidden-test line (whitespace ignored,
    so re-indented or re-wrapped code still counts), or a whole shorter line of at least
    ``min_chars``, that is not shown to the learner anyway (it occurs in a visible part of a test
    cell) and is not just a string literal (a test's message, which feedback shows on purpose).
    """

    def __init__(self, test_sources: list[str], window: int = 24, min_chars: int = 10, min_code: int = 6):
        self.window = window
        visible = "\n".join(_squash(without_hidden_tests(source)) for source in test_sources)
        self.windows: set[str] = set()
        self.short: dict[int, set[str]] = {}
        for source in test_sources:
            hidden = hidden_region(source)
            if not hidden:
                continue
            lines = source.split("\n")
            mask = _string_mask(source)
            for number in sorted(hidden):
                line = lines[number - 1]
                if HIDDEN_BEGIN in line or HIDDEN_END in line:
                    continue
                chars = [(ch, mask[number - 1][i]) for i, ch in enumerate(line) if not ch.isspace()]
                text = "".join(ch for ch, _ in chars)
                code = [not in_string for _, in_string in chars]
                if len(text) >= window:
                    for start in range(len(text) - window + 1):
                        piece = text[start : start + window]
                        if sum(code[start : start + window]) >= min_code and piece not in visible:
                            self.windows.add(piece)
                elif len(text) >= min_chars and sum(code) >= min_code and text not in visible:
                    self.short.setdefault(len(text), set()).add(text)

    def __bool__(self) -> bool:
        return bool(self.windows or self.short)

    def leaks(self, text: str) -> bool:
        """Whether ``text`` contains hidden test code."""
        if not self or not text:
            return False
        squashed = _squash(text)
        if self.windows and any(
            squashed[i : i + self.window] in self.windows for i in range(len(squashed) - self.window + 1)
        ):
            return True
        return any(
            squashed[i : i + size] in pieces
            for size, pieces in self.short.items()
            for i in range(len(squashed) - size + 1)
        )

    def scrub_output(self, output) -> Any:
        """``output`` itself, or a replacement saying it was hidden when it contains hidden test code."""
        kind = output.get("output_type")
        if kind == "error":
            parts = [str(output.get("ename", "")), str(output.get("evalue", "")), *output.get("traceback", [])]
            if self.leaks("\n".join(parts)):
                ename = str(output.get("ename", "Error"))
                ename = ename if not self.leaks(ename) else "Error"
                return NotebookNode(
                    output_type="error", ename=ename, evalue=LEAK_NOTE, traceback=[f"{ename}: {LEAK_NOTE}"]
                )
            return output
        if kind == "stream":
            text = output.get("text", "")
            text = "".join(text) if isinstance(text, list) else str(text)
        else:
            text = "\n".join(
                "".join(value) if isinstance(value, list) else str(value) for value in output.get("data", {}).values()
            )
        if self.leaks(text):
            return NotebookNode(output_type="stream", name="stdout", text=LEAK_NOTE + "\n")
        return output

    def scrub_text(self, text: str) -> str:
        return LEAK_NOTE if self.leaks(text) else text


def failing_line(output, source: str, execution_count: int | None) -> int | None:
    """The line of ``source`` where an error output's traceback left the cell, when it can be told."""
    text = strip_ansi("\n".join(output.get("traceback", [])))
    for match in _CELL_FRAME.finditer(text):
        count = int(match.group(1) or match.group(2))
        if execution_count is None or count == execution_count:
            return int(match.group(3))
    return None


def hidden_test_summary(output, source: str, execution_count: int | None, limit: int = 300) -> str:
    """One line about a test cell's error that reveals neither hidden test code nor a traceback."""
    ename = output.get("ename", "Error")
    evalue = strip_ansi(str(output.get("evalue", ""))).strip()
    if len(evalue) > limit:
        evalue = evalue[:limit] + "..."
    message = f"{ename}: {evalue}" if evalue else ename
    if ename in {TIMEOUT_ENAME, DIED_ENAME, STUCK_ENAME, NOT_RUN_ENAME}:
        return message
    line = failing_line(output, source, execution_count)
    if line is not None and line in hidden_region(source):
        return f"A hidden test failed: {message}"
    if line is not None:
        shown = source.split("\n")[line - 1].strip() if 0 < line <= len(source.split("\n")) else ""
        return f"A visible test failed at `{shown}`: {message}" if shown else f"A visible test failed: {message}"
    return f"A test failed: {message}"


def _output_size(output) -> int:
    kind = output.get("output_type")
    if kind == "stream":
        return len(output.get("text", ""))
    if kind == "error":
        return len(output.get("evalue", "")) + sum(len(line) for line in output.get("traceback", []))
    return sum(len(value) if isinstance(value, str) else len(str(value)) for value in output.get("data", {}).values())


def _shorten_error(output, limit: int) -> None:
    output["evalue"] = str(output.get("evalue", ""))[:limit]
    output["traceback"] = [line[:limit] for line in output.get("traceback", [])[-20:]]


class ResilientExecution(LoggingConfigurable):
    """Mixin for an nbclient ``NotebookClient`` subclass: survive dead and stuck kernels, cap outputs.

    Put it first in the bases: ``class X(ResilientExecution, NotebookClient)``.
    """

    max_kernel_restarts = Integer(
        4, help="Kernel restarts allowed per notebook before the remaining cells are marked as not run."
    ).tag(config=True)
    max_output_chars = Integer(
        200_000, help="Characters of output kept per cell; the rest is dropped with a note."
    ).tag(config=True)
    max_message_bytes = Integer(
        64 * 2**20, help="Largest message accepted from the kernel (bytes); a bigger one disconnects it."
    ).tag(config=True)
    check_integrity = Bool(
        False,
        help="After every test cell, ask the kernel (autograder.guard, installed by autograder.kernel) whether "
        "the test machinery was replaced and whether the cell ran as sent; record the reasons in "
        "integrity_problems. Also: a test cell whose execute reply says it failed fails, even when the "
        "notebook silenced the error output.",
    ).tag(config=True)
    kernel_uid = Integer(
        0,
        help="The uid the kernel runs as when it has one of its own (the grading sandbox): every process of it "
        "is killed before a restart, so children the notebook forked (even in a session of their own) neither "
        "hold the kernel's ports nor use up its process limit. 0: only the kernel's process group is killed.",
    ).tag(config=True)

    def reset_execution_trackers(self) -> None:
        super().reset_execution_trackers()
        self._clean_cells: list[int] = []  # cells that ran without error, in order: replayed after a restart
        self._restarts = 0
        self._gave_up = False
        self._output_chars: dict[int, int] = {}
        self._truncated: set[int] = set()
        self.grading_events: list[dict[str, Any]] = []
        self.integrity_problems: list[str] = []
        self._replies: dict[int, dict] = {}

    def create_kernel_manager(self):
        km = super().create_kernel_manager()
        # A kernel can send one giant message (print of a gigabyte string); zmq drops such peers
        # instead of making this process hold the message in memory.
        import zmq

        km.context.setsockopt(zmq.MAXMSGSIZE, int(self.max_message_bytes))
        return km

    def output(self, outs, msg, display_id, cell_index):
        out = super().output(outs, msg, display_id, cell_index)
        if out is None:
            return out
        used = self._output_chars.get(cell_index, 0) + _output_size(out)
        self._output_chars[cell_index] = used
        if used > self.max_output_chars:
            if out.get("output_type") == "error":
                _shorten_error(out, 2000)  # never drop an error: it decides the grade
                return out
            if outs and outs[-1] is out:
                outs.pop()
            if cell_index not in self._truncated:
                self._truncated.add(cell_index)
                outs.append(
                    NotebookNode(
                        output_type="stream", name="stdout", text=TRUNCATED_NOTE.format(limit=self.max_output_chars)
                    )
                )
                self._event(cell_index, "truncated", f"output over {self.max_output_chars:,} characters was cut")
            return None
        return out

    def _event(self, index: int, kind: str, detail: str) -> None:
        self.grading_events.append({"cell": index, "event": kind, "detail": detail})

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        if cell.cell_type != "code" or not cell.source.strip():
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        if self._gave_up:
            cell.outputs = [
                error_output(
                    NOT_RUN_ENAME,
                    f"not run: the kernel had to be restarted {self._restarts} times, the most allowed per notebook",
                )
            ]
            self._event(cell_index, "not-run", "after too many kernel restarts")
            return cell
        try:
            cell = await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        except DeadKernelError:
            code = await self._kernel_exit_code()
            cell.outputs = list(cell.get("outputs", [])) + [error_output(DIED_ENAME, _death_message(code))]
            self._event(cell_index, "kernel-died", _death_message(code))
            await self._restart_and_replay()
            return cell
        except CellTimeoutError:
            message = (
                f"the cell ran longer than {self.timeout} s and did not stop when interrupted "
                "(does it catch KeyboardInterrupt?); the kernel was restarted"
            )
            cell.outputs = list(cell.get("outputs", [])) + [error_output(STUCK_ENAME, message)]
            self._event(cell_index, "unresponsive", message)
            await self._restart_and_replay()
            return cell
        if self.check_integrity and _is_test_cell(cell):
            await self._check_test_cell(cell, cell_index)
        if has_error(cell):
            if any(o.get("ename") == TIMEOUT_ENAME for o in cell.outputs if o.get("output_type") == "error"):
                self._event(cell_index, "timeout", f"interrupted after {self.timeout} s")
        else:
            self._clean_cells.append(cell_index)
        return cell

    async def _check_raise_for_error(self, cell, cell_index, exec_reply):
        self._replies[cell_index] = exec_reply
        return await super()._check_raise_for_error(cell, cell_index, exec_reply)

    async def _check_test_cell(self, cell, cell_index: int) -> None:
        """A test cell's reply and the kernel's guard: fail a silenced error, record replaced machinery."""
        from autograder import guard

        reply = self._replies.pop(cell_index, None)
        content = (reply or {}).get("content", {})
        if content.get("status") == "error" and not has_error(cell):
            ename = str(content.get("ename") or "Error")
            cell.outputs = list(cell.get("outputs", [])) + [
                error_output(ename, f"{content.get('evalue', '')} (the test failed; its error output was silenced)")
            ]
            self._tampered(cell_index, "a failing test's error output was silenced")
        expression = guard.EXPRESSION.format(sha=guard.sha256(cell.source))
        try:
            msg_id = self.kc.execute(
                "", silent=True, store_history=False, user_expressions={"guard": expression}, stop_on_error=False
            )
            answer = await self.async_wait_for_reply(msg_id)
        except Exception as err:  # noqa: BLE001 (a kernel that does not answer is itself the finding)
            self._tampered(cell_index, f"the grader's check got no answer ({type(err).__name__})")
            return
        result = ((answer or {}).get("content", {}).get("user_expressions") or {}).get("guard") or {}
        text = result.get("data", {}).get("text/plain", "") if result.get("status") == "ok" else ""
        try:
            verdict = ast.literal_eval(text) if text else None
        except (ValueError, SyntaxError):
            verdict = None
        if verdict == guard.OK:
            return
        if not isinstance(verdict, str) or not verdict:
            verdict = "the grader's check did not answer as the grading kernel does"
        self._tampered(cell_index, verdict)

    def _tampered(self, cell_index: int, reason: str) -> None:
        if reason not in self.integrity_problems:
            self.integrity_problems.append(reason)
        self._event(cell_index, "tampered", f"score not trusted: {reason}")

    execute_cell = run_sync(async_execute_cell)

    async def _kernel_exit_code(self) -> int | None:
        provisioner = getattr(self.km, "provisioner", None)
        process = getattr(provisioner, "process", None)
        return process.poll() if process is not None else None

    async def _restart_and_replay(self) -> None:
        """Kill and restart the kernel, then rerun the cells that had run cleanly (outputs discarded)."""
        self._restarts += 1
        if self._restarts > self.max_kernel_restarts:
            self._gave_up = True
            await self._stop_kernel()
            return
        try:
            if self.kc is not None:
                self.kc.stop_channels()
                self.kc = None
            strays = kill_processes_of(self.kernel_uid) if self.kernel_uid else 0
            if strays:
                self._event(-1, "killed-processes", f"{strays} process(es) the notebook had started were stopped")
            # New ports: a child the notebook forked (and that escaped the kill) may still hold the old ones.
            await ensure_async(self.km.restart_kernel(now=True, newports=True))
            await self.async_start_new_kernel_client()
            for index in list(self._clean_cells):
                msg_id = self.kc.execute(self.nb.cells[index].source, store_history=False, stop_on_error=False)
                reply = await self.async_wait_for_reply(msg_id)
                if reply is None or reply["content"].get("status") != "ok":
                    self._event(index, "replay-failed", "a cell that had run cleanly failed when run again")
        except Exception as err:  # a kernel that cannot be brought back: give up on the rest, keep grading
            self._event(-1, "restart-failed", f"{type(err).__name__}: {err}")
            self._gave_up = True
            await self._stop_kernel()

    async def _stop_kernel(self) -> None:
        try:
            if self.km is not None and await ensure_async(self.km.is_alive()):
                await ensure_async(self.km.shutdown_kernel(now=True))
        except Exception:  # already gone
            pass


def _is_test_cell(cell) -> bool:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return cell.get("cell_type") == "code" and bool(meta.get("grade")) and not meta.get("solution")


def kill_processes_of(uid: int, rounds: int = 50) -> int:
    """SIGKILL every process of ``uid`` this process can see (its PID namespace); returns how many.

    Repeated until none is left, so that a process forking while the others die is caught too.
    Never used for uid 0 or this process's own uid.
    """
    import os
    import time

    if uid <= 0 or uid in (os.getuid(), os.geteuid()):
        return 0
    killed = 0
    for _ in range(rounds):
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as status:
                    for line in status:
                        if line.startswith("Uid:"):
                            if int(line.split()[1]) == uid or int(line.split()[2]) == uid:
                                found.append(int(entry))
                            break
            except (OSError, ValueError):
                continue
        if not found:
            return killed
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        time.sleep(0.02)
    return killed


def _death_message(code: int | None) -> str:
    """Why the kernel died, in words a learner can act on."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        reason = {
            "SIGSEGV": "a segmentation fault (crash in native code)",
            "SIGKILL": "it was killed (usually: memory limit exceeded)",
            "SIGXCPU": "it used up its CPU-time limit",
            "SIGABRT": "it aborted",
            "SIGBUS": "a bus error (crash in native code)",
        }.get(name, name)
        return f"the kernel died while running this cell: {reason}; it was restarted"
    if code is not None:
        return f"the kernel died while running this cell (it exited with code {code}); it was restarted"
    return "the kernel died while running this cell; it was restarted"
