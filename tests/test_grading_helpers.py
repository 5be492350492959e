"""course.grading: the helpers that the notebooks' test cells use."""

import numpy as np
import pytest

from course import metrics
from course.grading import assert_close, forbid_reference, quiet


def test_forbid_reference_sees_calls_on_threads_started_inside_the_block():
    import threading

    def answer():
        worker = threading.Thread(target=metrics.percentile, args=([1.0, 2.0], 50))
        worker.start()
        worker.join()

    with pytest.raises(AssertionError, match="course.metrics.percentile"), forbid_reference(metrics):
        answer()
    with forbid_reference(metrics):  # computing it yourself is fine
        assert float(np.percentile([1.0, 2.0], 50)) == 1.5


def test_forbid_reference_catches_aliased_imports():
    from course.metrics import ttft as renamed
    from course.trace import RequestTrace

    trace = RequestTrace("r", 0.0, [1.0], [1], output_tokens=1)
    with pytest.raises(AssertionError, match="course.metrics.ttft"), forbid_reference(metrics):
        renamed(trace)


def test_assert_close_hides_the_answer_when_asked():
    with pytest.raises(AssertionError, match="expected 2.0"):
        assert_close(1.0, 2.0, "x")
    with pytest.raises(AssertionError) as err:
        assert_close(1.0, 2.0, "x", reveal=False)
    assert "2.0" not in str(err.value)
    with pytest.raises(AssertionError, match="expected a number"):
        assert_close("1", 1.0, "x")


def test_quiet_swallows_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with quiet():
            warnings.warn("would go to stderr", UserWarning, stacklevel=1)
