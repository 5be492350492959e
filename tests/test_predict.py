"""course.predict: a prediction cell, its comparison line and the session's summary."""

from __future__ import annotations

import pytest

from course import predict

pytestmark = pytest.mark.fast


@pytest.fixture(autouse=True)
def fresh_book():
    predict.reset()
    yield
    predict.reset()


def test_number_recorded_and_compared(capsys):
    guess = predict.number("batch-8 / batch-1", 4, low=0.1, high=100, unit="x")
    assert guess.value == 4.0 and guess.kind == predict.NUMBER
    assert "Prediction recorded: 4 x" in capsys.readouterr().out
    predict.compare(guess, 1.25)
    line = capsys.readouterr().out
    assert "Predicted 4 x, measured 1.25 x" in line and "3.2 times too high" in line


def test_close_and_too_low():
    guess = predict.Prediction("q", predict.NUMBER, 1.1, "x")
    assert "close (within 10%)" in predict.comparison_line(guess, 1.0)
    low = predict.Prediction("q", predict.NUMBER, 2.0, "ms")
    assert "4 times too low" in predict.comparison_line(low, 8.0)
    exact = predict.Prediction("q", predict.NUMBER, 3.0)
    assert "exactly right" in predict.comparison_line(exact, 3.0)
    signs = predict.Prediction("q", predict.NUMBER, -1.0)
    assert "too low by 3" in predict.comparison_line(signs, 2.0)


def test_missing_prediction_is_never_silent(capsys):
    guess = predict.number("prefill x16 tokens", None, low=1, high=1000, unit="x")
    assert guess.value is None
    assert "Write your prediction first" in capsys.readouterr().out
    predict.compare(guess, 14.2)
    out = capsys.readouterr().out
    assert "No prediction was written" in out and "14.2 x" in out


@pytest.mark.parametrize("value", ["four", True, float("nan"), 500.0])
def test_unusable_number_counts_as_none(capsys, value):
    guess = predict.number("q", value, low=0, high=100)
    assert guess.value is None
    assert capsys.readouterr().out.startswith("✗")


def test_choice(capsys):
    options = {"a": "memory bandwidth", "b": "compute"}
    guess = predict.choice("long prefill bound by", " B ", options=options)
    assert guess.value == "b"
    predict.compare(guess, "b")
    assert "as you predicted" in capsys.readouterr().out
    wrong = predict.choice("long prefill bound by", "a", options=options)
    predict.compare(wrong, "b")
    out = capsys.readouterr().out
    assert "(a) memory bandwidth" in out and "(b) compute" in out and "not what you predicted" in out
    bad = predict.choice("other", "z", options=options)
    assert bad.value is None and "not one of the letters" in capsys.readouterr().out


def test_not_measured(capsys):
    guess = predict.number("int8 speed-up", 3, low=0.01, high=100, unit="x")
    predict.compare(guess, None)
    assert "Not measured on this runtime" in capsys.readouterr().out


def test_prediction_changed_after_the_run_is_marked(capsys):
    predict.compare(predict.number("q", 2, low=0, high=10), 5.0)
    late = predict.number("q", 5, low=0, high=10)
    predict.compare(late, 5.0)
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].count("[written after the run]") == 1
    predict.summary()
    assert "[written after the run]" in capsys.readouterr().out
    # Rerunning the same prediction unchanged is not a late rewrite.
    predict.reset()
    predict.compare(predict.number("r", 2, low=0, high=10), 5.0)
    predict.compare(predict.number("r", 2, low=0, high=10), 5.0)
    assert "[written after" not in capsys.readouterr().out


def test_summary_lists_every_prediction_in_order(capsys):
    predict.summary()
    assert "No predictions" in capsys.readouterr().out
    a = predict.number("first", 1, low=0, high=10, unit="ms")
    predict.choice("second", None, options={"a": "yes", "b": "no"})
    predict.compare(a, 2.0)
    capsys.readouterr()
    predict.summary()
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].strip() == "first: predicted 1 ms; measured 2 ms"
    assert lines[2].strip() == "second: no prediction; not measured"


def test_numbers_are_printed_plainly():
    assert predict.comparison_line(predict.Prediction("q", predict.NUMBER, 1000.0, "x"), 1234.5).startswith(
        "Predicted 1,000 x, measured 1,234 x"
    )
    assert "0.125" in predict.comparison_line(predict.Prediction("q", predict.NUMBER, 0.125), 0.5)


def test_bad_calls_raise():
    with pytest.raises(ValueError, match="low"):
        predict.number("q", 1, low=5, high=1)
    with pytest.raises(ValueError, match="option"):
        predict.choice("q", "a", options={})
