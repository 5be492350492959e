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
* A cell with hidden tests runs without being stored in the kernel's history (``In``, ``_i``, the
  history database), and after it the kernel's seal forgets its source (the line cache that
  tracebacks read, the last exception); with ``check_integrity`` every test cell is followed by the
  seal's check (:mod:`autograder.seal`).
* :mod:`autograder.hidden` (re-exported here) finds hidden tests in a cell and in what student code
  printed, for feedback.
"""

from __future__ import annotations

import ast
import signal
from typing import Any

from jupyter_core.utils import ensure_async, run_sync
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from traitlets import Bool, Dict, Float, Integer, Unicode
from traitlets.config import LoggingConfigurable

from autograder.hidden import (  # noqa: F401 (re-exported: where the grader's callers found them)
    HIDDEN_BEGIN,
    HIDDEN_END,
    LEAK_NOTE,
    HiddenText,
    failing_line,
    hidden_region,
    hidden_test_summary,
    raised_by_test,
    strip_ansi,
    without_hidden_tests,
)

# Error names this module writes into outputs; feedback explains them in plain words.
TIMEOUT_ENAME = "CellTimeoutError"
DIED_ENAME = "KernelDied"
STUCK_ENAME = "KernelUnresponsive"
NOT_RUN_ENAME = "NotRun"
TRUNCATED_NOTE = "[output truncated by the grader: this cell printed more than {limit:,} characters]\n"


def error_output(ename: str, evalue: str) -> NotebookNode:
    """An nbformat error output (it makes a test cell score 0, and feedback shows its message)."""
    return NotebookNode(output_type="error", ename=ename, evalue=evalue, traceback=[f"{ename}: {evalue}"])


def has_error(cell) -> bool:
    return any(output.get("output_type") == "error" for output in cell.get("outputs", []))


def cell_score(cell, points: float) -> float:
    """Points a test cell earns: all of them when it raised nothing, else 0 (stderr never counts)."""
    return 0.0 if has_error(cell) else float(points)


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
        help="After every test cell, ask the kernel's seal (autograder.seal, installed by autograder.kernel) "
        "whether anything the tests run through was replaced, and record the reasons in integrity_problems. "
        "Also: a test cell whose execute reply says it failed fails, even when the notebook silenced the "
        "error output.",
    ).tag(config=True)
    seal_socket = Unicode(
        "",
        help="Path of the Unix socket the sealed kernel connects to (its folder is made root-only); empty: "
        "no seal, and check_integrity records that the kernel could not be checked.",
    ).tag(config=True)
    expected_bindings = Dict(
        help="name -> 'module' or 'module:attribute': what the released notebook's own cells import under that "
        "name (autograder.seal.expected_bindings); a test cell that reads the name must find that very object.",
    ).tag(config=True)
    seal_timeout = Float(
        30.0, help="Seconds to wait for the seal's key after a kernel starts and for each answer."
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
        self._seal: dict[str, Any] = {}  # the listening socket, the kernel's connection, its key, what was read
        self._answer_names: set[str] | None = None

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

    async def async_start_new_kernel(self, **kwargs):
        if self.check_integrity and self.seal_socket and "server" not in self._seal:
            from autograder import seal

            self._seal["server"] = seal.listen(self.seal_socket)
        return await super().async_start_new_kernel(**kwargs)

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        if self.check_integrity:
            await self._seal_accept()
        return kc

    # nbclient's synchronous wrappers (used by nbconvert's preprocess) are bound to its own coroutines.
    start_new_kernel = run_sync(async_start_new_kernel)
    start_new_kernel_client = run_sync(async_start_new_kernel_client)

    async def _seal_accept(self) -> None:
        """Take the new kernel's connection and key; a kernel that does not send them is not trusted."""
        import asyncio

        from autograder import seal

        self._seal_close_connection()
        server = self._seal.get("server")
        if server is None:
            self._tampered(-1, "the grading kernel has no seal (no socket configured)")
            return
        loop = asyncio.get_running_loop()
        try:
            connection, _ = await asyncio.wait_for(loop.sock_accept(server), self.seal_timeout)
            connection.setblocking(False)
            self._seal.update(connection=connection, buffer=b"", key=None)
            line = await self._seal_line()
        except (TimeoutError, OSError):
            line = None
        text = line.decode("ascii", "replace") if line else ""
        head, _, _ = text.partition("|")
        if not head.startswith("KEY "):
            self._seal_close_connection()
            self._tampered(-1, "the grading kernel did not open its seal")
            return
        try:
            key = bytes.fromhex(head[4:])
        except ValueError:
            key = b""
        if not key or seal.parse(key, line) != head:
            self._seal_close_connection()
            self._tampered(-1, "the grading kernel's seal sent a key it did not sign")
            return
        self._seal["key"] = key

    def _seal_close_connection(self) -> None:
        connection = self._seal.pop("connection", None)
        if connection is not None:
            connection.close()
        self._seal["key"] = None
        self._seal["buffer"] = b""

    async def _seal_line(self, timeout: float | None = None) -> bytes | None:
        """The next line the kernel's seal sent (without its newline); None at its end or after ``timeout``."""
        import asyncio

        connection = self._seal.get("connection")
        if connection is None:
            return None
        loop = asyncio.get_running_loop()
        while b"\n" not in self._seal["buffer"]:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(connection, 65536), timeout or self.seal_timeout)
            except (TimeoutError, OSError):
                return None
            if not chunk:
                return None
            self._seal["buffer"] += chunk
            if len(self._seal["buffer"]) > 4 * 2**20:  # a kernel flooding the channel
                return None
        line, self._seal["buffer"] = self._seal["buffer"].split(b"\n", 1)
        return line

    def _seal_note(self, cell_index: int, payload: str | None) -> str | None:
        """Record an ALERT; return an ANSWER's payload; a line without the kernel's signature is tampering."""
        if payload is None:
            self._tampered(cell_index, "a message on the grading kernel's seal was not signed by it")
            return None
        if payload.startswith("ALERT "):
            self._tampered(cell_index, payload.split(" ", 2)[2] if payload.count(" ") >= 2 else payload)
            return None
        return payload

    async def _seal_drain(self, cell_index: int, interrupted: bool = False) -> None:
        """Read what a kernel that just died, or is about to be stopped, still sent (an ALERT before the seal
        stopped it).

        ``interrupted``: the kernel is stopped because it did not stop when interrupted. Its reports that the
        profile or trace function was replaced (:data:`autograder.seal.PROFILE_RESETS`) are set aside, logged as
        events: CPython turns a profile function off itself, with the notebook's frame on top, when the grader's
        KeyboardInterrupt lands inside it (``forbid_reference``'s watcher runs on every call of the answer under
        test), and no verdict comes from this kernel any more (the cell fails; the next cells run in a new
        kernel, after the clean cells are run again, which raise any deliberate change again)."""
        from autograder import seal

        key = self._seal.get("key")
        while key:
            line = await self._seal_line(timeout=0.5)
            if line is None:
                break
            payload = seal.parse(key, line)
            reason = seal.alert_reason(payload)
            if interrupted and reason in seal.PROFILE_RESETS:
                self._event(cell_index, "set-aside", f"{reason}, while the kernel was being interrupted: not counted")
                continue
            self._seal_note(cell_index, payload)

    async def _seal_check(self, cell, cell_index: int) -> None:
        """Ask the seal whether what the test cell ran through is as it was recorded."""
        import secrets

        from autograder import seal

        key, connection = self._seal.get("key"), self._seal.get("connection")
        if not key or connection is None:
            self._tampered(cell_index, "the grading kernel's seal is not open (it was closed or never opened)")
            return
        names = [
            f"{name}={self.expected_bindings[name]}" if name in self.expected_bindings else name
            for name in seal.free_names(cell.source)
            if name not in self._learner_names() and self.expected_bindings.get(name) != ""
        ]
        nonce = secrets.token_hex(16)
        forget = "H" if hidden_region(cell.source) else "-"  # H: forget the cell's source afterwards
        request = f"CHECK {nonce} {forget} {','.join(names)}\n".encode()
        try:
            import asyncio

            await asyncio.get_running_loop().sock_sendall(connection, request)
        except OSError:
            self._tampered(cell_index, "the grading kernel's seal stopped answering")
            self._seal_close_connection()
            return
        while True:
            line = await self._seal_line()
            if line is None:
                self._tampered(cell_index, "the grading kernel's seal did not answer")
                self._seal_close_connection()
                return
            payload = self._seal_note(cell_index, seal.parse(key, line))
            if payload is None:
                continue
            parts = payload.split(" ", 2)
            if len(parts) == 3 and parts[0] == "ANSWER" and parts[1] == nonce:
                if parts[2] != seal.OK:
                    self._tampered(cell_index, f"the notebook {parts[2]}")
                return
            self._tampered(cell_index, "the grading kernel's seal answered out of turn")

    def _learner_names(self) -> set[str]:
        """Names the learner's answer cells define (what the tests are there to call)."""
        if self._answer_names is None:
            from autograder import seal

            names: set[str] = set()
            for cell in self.nb.cells:
                meta = cell.get("metadata", {}).get("nbgrader", {})
                if cell.get("cell_type") != "code" or not meta.get("solution"):
                    continue
                try:
                    tree = seal.parse_python(cell.source)
                except SyntaxError:
                    continue
                for node in ast.walk(tree):
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                        names.add(node.name)
                    elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                        names.add(node.id)
                    elif isinstance(node, ast.Import | ast.ImportFrom):
                        names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            self._answer_names = names
        return self._answer_names

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
        if _is_test_cell(cell) and hidden_region(cell.source):
            store_history = False  # later cells cannot read it back from In, _i or the history database
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
            await self._restart_and_replay(interrupted=True)
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
        """A test cell's reply and the kernel's seal: fail a silenced error, record replaced machinery."""
        reply = self._replies.pop(cell_index, None)
        content = (reply or {}).get("content", {})
        if content.get("status") == "error" and not has_error(cell):
            ename = str(content.get("ename") or "Error")
            cell.outputs = list(cell.get("outputs", [])) + [
                error_output(ename, f"{content.get('evalue', '')} (the test failed; its error output was silenced)")
            ]
            self._tampered(cell_index, "a failing test's error output was silenced")
        await self._seal_check(cell, cell_index)

    def _tampered(self, cell_index: int, reason: str) -> None:
        if reason not in self.integrity_problems:
            self.integrity_problems.append(reason)
        self._event(cell_index, "tampered", f"score not trusted: {reason}")

    execute_cell = run_sync(async_execute_cell)

    async def _kernel_exit_code(self) -> int | None:
        provisioner = getattr(self.km, "provisioner", None)
        process = getattr(provisioner, "process", None)
        return process.poll() if process is not None else None

    async def _restart_and_replay(self, interrupted: bool = False) -> None:
        """Kill and restart the kernel, then rerun the cells that had run cleanly (outputs discarded).
        ``interrupted``: it is stopped for not answering an interrupt (:meth:`_seal_drain`)."""
        if self.check_integrity:
            await self._seal_drain(-1, interrupted)
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
    """SIGKILL every live process of ``uid`` this process can see (its PID namespace); returns how many
    different processes it killed.

    Repeated until none is left, so that a process forking while the others die is caught too. A killed
    process that its parent has not reaped yet (a zombie) is dead: it is neither killed again nor counted
    twice. Never used for uid 0 or this process's own uid.
    """
    import os
    import time

    if uid <= 0 or uid in (os.getuid(), os.geteuid()):
        return 0
    killed: set[int] = set()
    for _ in range(rounds):
        found = _processes_of(uid)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.02)
    return len(killed)


def _processes_of(uid: int) -> list[int]:
    """The pids in /proc of live processes (not zombies) whose real or effective uid is ``uid`` (one that exits
    while it is read is left out)."""
    import os

    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as status:
                for line in status:
                    if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                        break  # dead, waiting for its parent to reap it
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) == uid or int(line.split()[2]) == uid:
                            found.append(int(entry))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return found


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
