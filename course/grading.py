"""Helpers that the notebooks' graded test cells use.

* :func:`quiet` silences warnings: under nbgrader any stderr output in a test cell would cost
  the learner the points, and a numpy ``RuntimeWarning`` is not a wrong answer.
* :func:`forbid_reference` fails an answer that calls the course's own reference
  implementation instead of computing the result.
* :func:`assert_close` compares numbers and says which quantity was off and by how much.
"""

from __future__ import annotations

import math
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType


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
    answer). Threads that were already running before the block are not watched.
    """
    files = {str(Path(module.__file__).resolve()) for module in modules}
    files |= {module.__file__ for module in modules}
    for module in modules:  # a package (course.kv): every module in it
        for directory in getattr(module, "__path__", ()):
            for path in Path(directory).rglob("*.py"):
                files |= {str(path), str(path.resolve())}
    called: list[str] = []

    def watch(frame, event, arg):  # sys.setprofile hook
        if event == "call" and frame.f_code.co_filename in files and not called:
            called.append(f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}")

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
            f"Your answer calls the course's reference implementation (course.{called[0]}). "
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
