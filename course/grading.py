"""Helpers that the notebooks' graded test cells use.

* :func:`quiet` silences warnings: under nbgrader any stderr output in a test cell would cost
  the learner the points, and a numpy ``RuntimeWarning`` is not a wrong answer.
* :func:`forbid_reference` fails an answer that calls the course's own reference
  implementation instead of computing the result.
* :func:`assert_close` compares numbers and says which quantity was off and by how much.
* :func:`announce_passing_tests` makes every test cell that passes say so in one line.
* :class:`DecodeProbe` watches and steers a model's decode steps while a test drives a learner's
  server: it holds one step (does the server still answer meanwhile?), paces the later ones and
  makes the model emit end-of-sequence at a chosen length.

And one helper that the demo cells use:

* :func:`written` tells a demo cell whether the exercise it needs has been written yet; when it
  has not, it prints one line (which exercise, what the cell will show) so the cell can move on
  instead of failing with the stub's ``NotImplementedError``.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import math
import re
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

# The marker comment that starts every answer cell (`# EXERCISE: ex1_3`) and every test cell.
MARKER = re.compile(r"^#\s*(EXERCISE|TEST):\s*([A-Za-z0-9_\-]+)\s*$")


@contextmanager
def quiet() -> Iterator[None]:
    """Ignore warnings raised inside the block (they would go to stderr)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@contextmanager
def forbid_reference(*modules: ModuleType) -> Iterator[None]:
    """Raise AssertionError if code in the block calls any function defined in ``modules``.

    Works however the function was reached (``course.metrics.ttft``, ``from course.metrics
    import ttft as t``, a wrapper): it watches which source files the calls run in, on this
    thread and on threads started inside the block (a server or a worker pool started by the
    answer). Threads that were already running before the block are not watched. A module whose reference
    lives partly in other modules names them in ``REFERENCE_MODULES`` (``course.vllm_lab``'s /metrics
    readers are ``course.metrics_text``'s); those are watched with it.
    """
    modules = (*modules, *(part for module in modules for part in getattr(module, "REFERENCE_MODULES", ())))
    files = {str(Path(module.__file__).resolve()) for module in modules}
    files |= {module.__file__ for module in modules}
    for module in modules:  # a package (course.kv): every module in it
        for directory in getattr(module, "__path__", ()):
            for path in Path(directory).rglob("*.py"):
                files |= {str(path), str(path.resolve())}
    called: list[str] = []

    def watch(frame, event, arg):  # sys.setprofile hook
        if event == "call" and frame.f_code.co_filename in files and not called:
            module = frame.f_globals.get("__name__") or Path(frame.f_code.co_filename).stem
            called.append(f"{module}.{frame.f_code.co_name}")

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(watch)
    threading.setprofile(watch)
    try:
        yield
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)
    if called:
        raise AssertionError(
            f"Your answer calls the course's reference implementation ({called[0]}). "
            "Compute the result in your own code; the library's version is there for later modules."
        )


def assert_close(
    actual: object, expected: float, what: str, rel: float = 1e-9, abs_tol: float = 1e-12, reveal: bool = True
) -> None:
    """Assert that ``actual`` is a number close to ``expected``, naming ``what`` on failure.

    Hidden tests pass ``reveal=False`` so their failure message never gives the answer away.
    """
    if isinstance(actual, bool) or not isinstance(actual, (int, float)) and not hasattr(actual, "__float__"):
        raise AssertionError(f"{what}: expected a number, got {type(actual).__name__} {actual!r}")
    value = float(actual)
    if not math.isclose(value, expected, rel_tol=rel, abs_tol=abs_tol):
        hint = f"expected {expected!r}" if reveal else "that is not the right value"
        raise AssertionError(f"{what}: got {value!r}; {hint}")


class DecodeProbe:
    """Watch and steer the forward passes of ``lm.model`` inside a ``with`` block (hooks removed on exit).

    Made for tests that send one request at a time to a server generating one sequence at a time
    (batch 1), so that forward pass 1 is the request's prefill and every later pass one decode step,
    however the learner feeds the model:

    * ``hold_pass``: the forward pass (1-based, counted from entering the block) that waits inside
      the model until :meth:`release` (``hold_limit`` s at most, so a test never hangs). ``held`` is
      set when that pass begins. While it waits, a server that runs its steps off the event loop
      still answers other requests; one that runs them on the loop cannot.
    * ``pace``: seconds each pass after the held one sleeps first, so that a server that goes on
      decoding for a client that left is still at it when the test looks.
    * ``eos_at`` and ``eos_id``: a forward pass that brings a sequence to ``eos_at`` tokens (prompt
      plus the tokens fed back so far) gets its last logits raised at ``eos_id``, so the next greedy
      token is end-of-sequence.

    ``passes`` counts the forward passes started, from any thread.

    >>> with DecodeProbe(lm, hold_pass=3) as probe:   # doctest: +SKIP
    ...     ...start a request...
    ...     assert probe.held.wait(30)
    ...     ...is /health still answered?...
    ...     probe.release()
    """

    def __init__(
        self,
        lm,
        hold_pass: int | None = None,
        pace: float = 0.0,
        eos_at: int | None = None,
        eos_id: int | None = None,
        hold_limit: float = 60.0,
    ) -> None:
        self.model = lm.model
        self.hold_pass, self.pace, self.hold_limit = hold_pass, pace, hold_limit
        self.eos_at, self.eos_id = eos_at, eos_id
        self.passes = 0
        self.held = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._undo: list = []

    def release(self) -> None:
        """Let the held pass (and every later one) go on."""
        self._released.set()

    def _before(self, module, args, kwargs) -> None:
        with self._lock:
            self.passes += 1
            number = self.passes
        if number == self.hold_pass:
            self.held.set()
            self._released.wait(self.hold_limit)
        elif self.hold_pass is not None and number > self.hold_pass and self.pace:
            time.sleep(self.pace)

    def _after(self, module, args, kwargs, output) -> None:
        if self.eos_at is None:
            return
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is not None and cache.get_seq_length() == self.eos_at:
            logits = output.logits
            logits[:, -1, self.eos_id] = logits[:, -1].max() + 1.0

    def __enter__(self) -> DecodeProbe:
        from course.forward_observers import observe_forward

        before = self.model.register_forward_pre_hook(self._before, with_kwargs=True)
        after = self.model.register_forward_hook(self._after, with_kwargs=True)
        # the course engine's lean runner makes its passes without model.forward(): observed apart
        stop_observing = observe_forward(self.model, lambda input_ids: self._before(self.model, (input_ids,), {}))
        self._undo = [before.remove, after.remove, stop_observing]
        return self

    def __exit__(self, *exc) -> None:
        self.release()
        for undo in self._undo:
            undo()
        self._undo = []


# --- demo cells: is the exercise written yet? ---------------------------------------------------


def _raises_not_implemented(statement: ast.stmt) -> bool:
    if not isinstance(statement, ast.Raise) or statement.exc is None:
        return False
    exc = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def is_stub(function: object) -> bool:
    """True when ``function`` unconditionally raises NotImplementedError: nbgrader's blank stub.

    A function counts as a stub when one of the top-level statements of its body is
    ``raise NotImplementedError(...)`` (what the student notebook's ``# YOUR CODE HERE`` leaves).
    A class is a stub when any of its own methods (or property getters) is. Where the source
    cannot be read (a function built at run time), the function counts as written: the demo then
    runs it and shows whatever it raises.
    """
    if inspect.isclass(function):
        members = [m.fget if isinstance(m, property) else m for m in vars(function).values()]
        return any(is_stub(m) for m in members if inspect.isfunction(m))
    function = inspect.unwrap(function) if callable(function) else function
    if not inspect.isfunction(function):
        return False
    try:
        source = textwrap.dedent(inspect.getsource(function))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return False
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return any(_raises_not_implemented(statement) for statement in definition.body)


def _exercise_of(function: object) -> str | None:
    """ "Exercise 1.3" from the ``# EXERCISE: ex1_3`` marker of the cell that defined ``function``."""
    target = function
    if inspect.isclass(target):
        target = next((m for m in vars(target).values() if inspect.isfunction(m)), None)
    code = getattr(inspect.unwrap(target), "__code__", None) if callable(target) else None
    if code is None:
        return None
    lines = linecache.getlines(code.co_filename)
    match = MARKER.match(lines[0].strip()) if lines else None
    if match is None or match.group(1) != "EXERCISE":
        return None
    number = re.fullmatch(r"ex(\d+)_(\d+)", match.group(2))
    return f"Exercise {number.group(1)}.{number.group(2)}" if number else match.group(2)


def written(*functions: object, shows: str) -> bool:
    """True when every function (or class) in ``functions`` has been written.

    A demo cell that needs an exercise starts with ``if written(my_function, shows="..."):``.
    While any of them is still the blank stub, this prints one line naming the exercise and what
    the cell will show once it is written, and returns False, so the cell (and Run All) moves
    on instead of stopping at ``NotImplementedError``.

    Args:
        functions: the learner's functions or classes the cell calls.
        shows: what the cell shows once they work, e.g. "the TTFT of both workloads".
    """
    missing = [f for f in functions if is_stub(f)]
    if not missing:
        return True
    numbers = []  # "1.3" for Exercise 1.3, else the function's name
    for f in missing:
        exercise = _exercise_of(f)
        name = exercise.removeprefix("Exercise ") if exercise else getattr(f, "__name__", repr(f))
        if name not in numbers:
            numbers.append(name)
    listed = numbers[0] if len(numbers) == 1 else ", ".join(numbers[:-1]) + " and " + numbers[-1]
    names = ", ".join(getattr(f, "__name__", repr(f)) for f in missing)
    print(
        f"⏭ Skipped until you write Exercise{'s' if len(numbers) > 1 else ''} {listed} ({names}): "
        f"this cell then shows {shows}."
    )
    return False


# --- test cells: say when one passed ------------------------------------------------------------


class _TestCellReporter:
    """IPython callbacks: after a test cell (``# TEST: <id>``) runs without an error, print one line.

    A test cell passes exactly when it raises nothing: the course's autograder ignores stderr
    (autograder/config.py), so a warning printed by the learner's code does not fail it.
    """

    def __init__(self) -> None:
        self.current: str | None = None

    def pre_run_cell(self, info) -> None:
        first = (getattr(info, "raw_cell", "") or "").lstrip().split("\n", 1)[0]
        match = MARKER.match(first.strip())
        self.current = match.group(2) if match and match.group(1) == "TEST" else None

    def post_run_cell(self, result) -> None:
        test_id, self.current = self.current, None
        if test_id is not None and getattr(result, "success", False):
            print(f"✓ {test_id} passed")  # a failing test keeps its own message


_reporter: _TestCellReporter | None = None


def announce_passing_tests(shell=None) -> bool:
    """Make every test cell that passes print one line, ``✓ <test id> passed`` (IPython only).

    Registered once per kernel by :func:`course.setup`. The line names the test and nothing it
    checks, so it reveals nothing; a failing test shows its assertion message as before. Under the
    autograder the line is ordinary stdout, which does not change a score. Returns whether the
    callbacks are registered (False outside IPython).
    """
    global _reporter
    if shell is None:
        try:
            from IPython import get_ipython
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None or not hasattr(shell, "events"):
        return False
    if _reporter is None:
        _reporter = _TestCellReporter()
    for event in ("pre_run_cell", "post_run_cell"):
        callback = getattr(_reporter, event)
        if callback not in shell.events.callbacks[event]:
            shell.events.register(event, callback)
    return True
