"""Inside the grading kernel: notice when a notebook replaced the machinery that runs the tests.

Student code and the tests share one Python process, so a notebook can rewrite the test cells before
they run (IPython input transformers, AST transformers), replace the shell's cell-running and
transform methods, wrap the kernel's execute handler, or silence the errors a failing test raises
(a custom exception handler, a replaced traceback display, a trace function that jumps over lines).
Each is a few lines and, unnoticed, gives full marks with no working answer.

:func:`install` is called by the sandbox's kernel launcher (:mod:`autograder.kernel`) after the
kernel is built and before any student code runs: it records what the machinery is. After every
test cell the grader asks :func:`report` (through an execute request's ``user_expressions``, which
the kernel evaluates without running a cell) whether anything differs from that record and whether
the cell the shell ran is the source the grader sent, unrewritten. Any difference is a reason to
distrust the score: the grader marks the student for manual grading with the reason.

This is a tripwire, not a wall: code that reads this module can defeat it, as the README says of the
shared process. It makes the known techniques, and their obvious variants, visible.
"""

from __future__ import annotations

import builtins
import hashlib
import sys
from typing import Any

OK = "ok"
# Methods the tests run through (or that show their errors), on the shell and on the kernel.
SHELL_METHODS = (
    "run_cell",
    "run_cell_async",
    "_run_cell",
    "should_run_async",
    "transform_cell",
    "transform_ast",
    "run_ast_nodes",
    "run_code",
    "showtraceback",
    "_showtraceback",
    "showsyntaxerror",
    "user_expressions",
)
KERNEL_METHODS = (
    "execute_request",
    "do_execute",
    "dispatch_shell",
    "process_one",
    "_publish_execute_input",
    "_publish_status",
    "send_response",
)
TRANSFORMER_LISTS = ("cleanup_transforms", "line_transforms", "token_transformers")

_record: dict[str, Any] | None = None


def _same(a, b) -> bool:
    return a is b or (
        getattr(a, "__func__", a) is getattr(b, "__func__", b)
        and getattr(a, "__self__", None) is getattr(b, "__self__", None)
    )


def _state(kernel) -> dict[str, Any]:
    """Everything :func:`report` compares, as object references."""
    shell = kernel.shell
    manager = shell.input_transformer_manager
    state: dict[str, Any] = {
        "shell class": type(shell),
        "kernel class": type(kernel),
        "shell": shell,
        "input transformer manager": manager,
        "input_transformers_post": (shell.input_transformers_post, list(shell.input_transformers_post)),
        "ast_transformers": (shell.ast_transformers, list(shell.ast_transformers)),
        "custom exception handler": tuple(shell.custom_exceptions),
        "shell.compile": shell.compile,
        "traceback formatter": shell.InteractiveTB,
        "execute handler": kernel.shell_handlers.get("execute_request"),
        "session.send": getattr(type(kernel.session), "send", None),
        "trace function": sys.gettrace(),
        "compile": builtins.compile,
        "exec": builtins.exec,
    }
    for name in TRANSFORMER_LISTS:
        value = getattr(manager, name)
        state[f"input transformers ({name})"] = (value, list(value))
    for name in SHELL_METHODS:
        state[f"shell.{name}"] = (getattr(type(shell), name, None), name in vars(shell))
    for name in KERNEL_METHODS:
        state[f"kernel.{name}"] = (getattr(type(kernel), name, None), name in vars(kernel))
    state["session.send (instance)"] = "send" in vars(kernel.session)
    return state


def _differs(before, now) -> bool:
    if isinstance(before, tuple) and isinstance(now, tuple):
        return len(before) != len(now) or any(_differs(a, b) for a, b in zip(before, now))
    if isinstance(before, list) and isinstance(now, list):
        return len(before) != len(now) or any(not _same(a, b) for a, b in zip(before, now))
    if isinstance(before, bool | str | int | type(None)):
        return before != now
    return not _same(before, now)


def install(kernel) -> None:
    """Record the test machinery of ``kernel`` (an ipykernel ``IPythonKernel``) as it starts."""
    from IPython.core.inputtransformer2 import TransformerManager

    global _record
    _record = {"kernel": kernel, "state": _state(kernel), "transformer": TransformerManager()}


def changed() -> list[str]:
    """What differs from the record (names of the parts), empty when nothing does."""
    if _record is None:
        return ["the grading kernel's record of its test machinery is missing"]
    before, now = _record["state"], _state(_record["kernel"])
    return [name for name in before if _differs(before[name], now.get(name))]


def report(expected_sha256: str) -> str:
    """``"ok"``, or why the last cell's result cannot be trusted (called by the grader after a test cell)."""
    problems = []
    parts = changed()
    if parts:
        problems.append("the notebook replaced the machinery that runs the tests: " + ", ".join(parts))
    if _record is not None:
        shell = _record["kernel"].shell
        history = shell.history_manager
        raw = history.input_hist_raw[-1] if history.input_hist_raw else ""
        parsed = history.input_hist_parsed[-1] if history.input_hist_parsed else ""
        if sha256(raw) != expected_sha256:
            problems.append("the test cell the kernel ran is not the test the grader sent")
        elif len(raw.splitlines()) > 1:  # one-line cells also go through IPython's prefilter; tests are longer
            try:
                pristine = _record["transformer"].transform_cell(raw).rstrip("\n")
            except Exception:  # the test itself is valid Python: this does not happen
                pristine = parsed
            if parsed.rstrip("\n") != pristine:
                problems.append("the test cell was rewritten before it ran (an input transformer)")
    return "; ".join(problems) or OK


def sha256(source: str) -> str:
    """The digest :func:`report` compares: of the source as IPython's history keeps it."""
    return hashlib.sha256(source.rstrip("\n").encode()).hexdigest()


EXPRESSION = "__import__('autograder.guard', fromlist=['report']).report({sha!r})"
