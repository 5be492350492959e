"""Predict, then run: the learner writes down what an experiment will show, then sees how far off it was.

A prediction is worth something only when it is written *before* the run. Modules use three calls:

1. a **prediction cell**, just before the experiment; the learner replaces ``None`` with a number or a
   letter and runs the cell::

       # PREDICT, then run: a batch-8 decode step takes how many times as long as a batch-1 step?
       batch8_guess = predict.number("batch-8 step / batch-1 step", None, low=0.1, high=100, unit="x")

       # PREDICT, then run: what limits a 1,024-token prefill on this runtime?
       prefill_guess = predict.choice("what limits a long prefill", None,
                                      options={"a": "memory bandwidth", "b": "compute"})

2. the experiment itself, in ordinary cells;

3. a **comparison line**, right after the run, with the measured value (a number, or the option's
   letter)::

       predict.compare(batch8_guess, measured_ratio)
       # Predicted 8 x, measured 1.31 x: 6.1 times too high.   (batch-8 step / batch-1 step)

:func:`summary` prints every prediction of the session beside its measurement (a module's closing
table). Nothing here is graded: the comparison is for the learner. A prediction left at ``None`` is
never skipped in silence: its cell and its comparison each say, in one line, that no prediction was
written. An unusable prediction (not a number, outside ``low``-``high``, not one of the options)
prints what was wrong and counts as none, so *Run All* keeps going. A prediction changed after its
measurement was shown is marked "written after the run" in the comparison and the summary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

NUMBER, CHOICE = "number", "choice"
# A numeric prediction within this relative distance of the measurement counts as "close".
CLOSE = 0.25


@dataclass(frozen=True)
class Prediction:
    """One prediction, as the learner wrote it.

    Attributes:
        question: what is predicted, short ("batch-8 step / batch-1 step"); also the key under which
            :func:`summary` lists it.
        kind: ``"number"`` or ``"choice"``.
        value: the number (float) or the option's letter (lower case); None when none was written or
            it was unusable.
        unit: printed after numbers ("x", "ms", "%").
        options: for a choice, letter -> what it means.
        written_at: ``time.monotonic()`` when the cell ran.
    """

    question: str
    kind: str
    value: float | str | None
    unit: str = ""
    options: dict[str, str] = field(default_factory=dict)
    written_at: float = 0.0


@dataclass
class _Entry:
    prediction: Prediction
    measured: float | str | None = None
    measured_at: float | None = None
    written_after: bool = False


_BOOK: dict[str, _Entry] = {}


def number(question: str, value: float | None, *, low: float, high: float, unit: str = "") -> Prediction:
    """Record a numeric prediction (``value``, between ``low`` and ``high``) for ``question``.

    Prints one line: the prediction recorded, or what to write (``value`` None), or why the value
    cannot be used (then it counts as no prediction).
    """
    if low >= high:
        raise ValueError(f"number(): low ({low}) must be below high ({high})")
    usable: float | None = None
    if value is None:
        print(
            f"✎ Write your prediction first: replace None with a number between {_fmt(low)} and {_fmt(high)} "
            f"{unit}".rstrip()
            + f" ({question}), then run this cell."
        )
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        print(f"✗ {value!r} is not a number: write one between {_fmt(low)} and {_fmt(high)} ({question}).")
    elif not low <= value <= high:
        print(
            f"✗ {_fmt(value)} is outside {_fmt(low)}-{_fmt(high)} {unit}".rstrip()
            + f" ({question}): check the unit and write a number in that range."
        )
    else:
        usable = float(value)
        print(f"✎ Prediction recorded: {_fmt(usable)} {unit}".rstrip() + f" ({question}).")
    return _record(Prediction(question, NUMBER, usable, unit, {}, time.monotonic()))


def choice(question: str, value: str | None, *, options: dict[str, str]) -> Prediction:
    """Record a multiple-choice prediction: ``value`` is one of the letters of ``options``.

    Prints one line, as :func:`number` does.
    """
    if not options:
        raise ValueError("choice(): give at least one option, e.g. {'a': 'memory', 'b': 'compute'}")
    letters = ", ".join(f"({k}) {v}" for k, v in options.items())
    usable: str | None = None
    if value is None:
        print(f"✎ Write your prediction first: replace None with one of {letters} ({question}), then run this cell.")
    elif not isinstance(value, str) or value.strip().lower() not in options:
        print(f"✗ {value!r} is not one of the letters {', '.join(options)}: pick one of {letters} ({question}).")
    else:
        usable = value.strip().lower()
        print(f"✎ Prediction recorded: ({usable}) {options[usable]} ({question}).")
    return _record(Prediction(question, CHOICE, usable, "", dict(options), time.monotonic()))


def compare(prediction: Prediction, measured: float | str | None, *, detail: str = "") -> None:
    """Print one line setting ``prediction`` against ``measured`` (a number, or an option's letter).

    ``measured`` None means the run did not produce the figure on this runtime (the line says so).
    ``detail`` is added in brackets (e.g. the measurement's n and spread).
    """
    entry = _BOOK.get(prediction.question)
    if entry is None or entry.prediction is not prediction:  # a prediction made outside number()/choice()
        entry = _BOOK[prediction.question] = _Entry(prediction)
    if measured is not None:
        entry.measured, entry.measured_at = measured, time.monotonic()
    print(comparison_line(prediction, measured, detail=detail, written_after=entry.written_after))


def comparison_line(
    prediction: Prediction, measured: float | str | None, *, detail: str = "", written_after: bool = False
) -> str:
    """The line :func:`compare` prints (no side effects)."""
    where = f" ({prediction.question}" + (f"; {detail})" if detail else ")")
    late = " [written after the run]" if written_after else ""
    if measured is None:
        return f"– Not measured on this runtime{where}; your prediction stays open."
    shown = _show(prediction, measured)
    if prediction.value is None:
        return (
            f"✎ No prediction was written; measured {shown}{where}. Next time write yours first: the surprise "
            "is the lesson."
        )
    guess = _show(prediction, prediction.value)
    if prediction.kind == CHOICE:
        verdict = "as you predicted." if prediction.value == measured else "not what you predicted: find out why below."
        return f"Predicted {guess}, measured {shown}: {verdict}{late}{where}"
    return f"Predicted {guess}, measured {shown}: {_closeness(float(prediction.value), float(measured))}.{late}{where}"


def summary() -> None:
    """Print every prediction of this session beside its measurement, in the order they were written."""
    if not _BOOK:
        print("No predictions were made in this session.")
        return
    print("Your predictions and what this runtime measured:")
    for question, entry in _BOOK.items():
        p = entry.prediction
        guess = "no prediction" if p.value is None else f"predicted {_show(p, p.value)}"
        got = "not measured" if entry.measured is None else f"measured {_show(p, entry.measured)}"
        late = " [written after the run]" if entry.written_after else ""
        print(f"  {question}: {guess}; {got}{late}")


def reset() -> None:
    """Forget every prediction of the session (tests; a learner starting over)."""
    _BOOK.clear()


def _record(prediction: Prediction) -> Prediction:
    previous = _BOOK.get(prediction.question)
    entry = _Entry(prediction)
    if previous is not None:
        entry.measured, entry.measured_at = previous.measured, previous.measured_at
        # Rewritten once the measurement had been shown: say so wherever it is compared.
        changed = previous.prediction.value != prediction.value
        entry.written_after = previous.written_after or (previous.measured_at is not None and changed)
    _BOOK[prediction.question] = entry
    return prediction


def _closeness(guess: float, measured: float) -> str:
    if guess == measured:
        return "exactly right"
    if guess > 0 and measured > 0:
        ratio = guess / measured
        if abs(ratio - 1) <= CLOSE:
            return f"close (within {abs(ratio - 1):.0%})"
        return f"{ratio:.3g} times too high" if ratio > 1 else f"{1 / ratio:.3g} times too low"
    return f"{'too high' if guess > measured else 'too low'} by {_fmt(abs(guess - measured))}"


def _show(prediction: Prediction, value: float | str) -> str:
    if prediction.kind == CHOICE:
        text = prediction.options.get(str(value))
        return f"({value}) {text}" if text else repr(value)
    return f"{_fmt(float(value))} {prediction.unit}".rstrip()


def _fmt(x: float) -> str:
    if float(x).is_integer() and abs(x) < 1e9:
        return f"{int(x):,}"
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:,.0f}"
