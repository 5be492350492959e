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


def test_decode_probe_holds_one_pass_and_counts_them_all():
    import threading

    from course.grading import DecodeProbe
    from course.serving.testing import greedy_reference, shared_chatty_model

    lm = shared_chatty_model(1)
    with DecodeProbe(lm, hold_pass=2) as probe:
        worker = threading.Thread(target=greedy_reference, args=(lm, [5, 6, 7], 4))
        worker.start()
        assert probe.held.wait(30), "pass 2 (the first decode step) should begin and wait"
        assert worker.is_alive() and probe.passes == 2, "the held pass waits until release()"
        probe.release()
        worker.join(30)
    assert probe.passes == 5 and not worker.is_alive()  # greedy_reference: a prefill, then a pass per token
    greedy_reference(lm, [5, 6, 7], 2)
    assert probe.passes == 5, "the hooks are gone after the block"


def test_decode_probe_makes_the_model_emit_eos_at_a_length():
    from course.grading import DecodeProbe
    from course.serving.testing import greedy_reference, shared_chatty_model

    lm = shared_chatty_model(1)
    plain = greedy_reference(lm, [5, 6, 7], 8)
    eos = next(token for token in range(lm.model.config.vocab_size) if token not in plain)
    # Token j comes from the pass that brings the sequence to prompt + j - 1 tokens: 5 tokens -> token 3.
    with DecodeProbe(lm, eos_at=3 + 2, eos_id=eos):
        steered = greedy_reference(lm, [5, 6, 7], 8)
    assert steered[:2] == plain[:2] and steered[2] == eos, (plain, steered)
    assert greedy_reference(lm, [5, 6, 7], 8) == plain


# --- demo cells: course.grading.written -----------------------------------------------------------


def _stub(x: int) -> int:
    """What nbgrader's release leaves in an answer cell."""
    # YOUR CODE HERE
    raise NotImplementedError()


async def _async_generator_stub(events):
    """Exercise 2.3's stub: an async generator that raises on first use."""
    raise NotImplementedError()
    if False:
        yield


class _ClassStub:
    def __init__(self, n: int) -> None:
        self.n = n
        raise NotImplementedError()

    @property
    def size(self) -> int:
        raise NotImplementedError()


def _written(x: int) -> int:
    if x < 0:
        raise NotImplementedError("negative inputs are a later exercise")
    return x


def test_written_tells_stubs_from_answers(capsys):
    from course.grading import is_stub, written

    assert is_stub(_stub) and is_stub(_async_generator_stub) and is_stub(_ClassStub)
    assert not is_stub(_written), "raising NotImplementedError in one branch is an answer, not the stub"
    assert written(_written, shows="x") is True
    assert capsys.readouterr().out == ""
    assert written(_written, _stub, shows="the demo") is False
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and "_stub" in line and "the demo" in line and "_written" not in line


def test_written_names_the_exercise_of_the_answer_cell(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell(
        "# EXERCISE: ex3_2\nclass BlockManager:\n    def free(self, r):\n        raise NotImplementedError()"
    )
    shell.run_cell(
        "import course.grading\nif course.grading.written(BlockManager, shows='the block tables'):\n    1 / 0"
    )
    out = capsys.readouterr().out
    assert "Exercise 3.2 (BlockManager): this cell then shows the block tables." in out


def test_passing_test_cells_say_so_and_failing_ones_do_not(capsys):
    from IPython.core.interactiveshell import InteractiveShell

    from course.grading import announce_passing_tests

    shell = InteractiveShell.instance()
    assert announce_passing_tests(shell) and announce_passing_tests(shell)  # registering twice is harmless
    shell.run_cell('# TEST: ex9_9_ok\n"""docstring"""\nassert 1 + 1 == 2\n')
    assert capsys.readouterr().out.strip() == "✓ ex9_9_ok passed"
    shell.run_cell('# TEST: ex9_9_bad\nassert 1 + 1 == 3, "arithmetic"\n')
    assert "passed" not in capsys.readouterr().out
    shell.run_cell("x = 1  # not a test cell\n")
    assert capsys.readouterr().out == ""
    shell.run_cell("# TEST: ex9_9_noisy\nimport sys\nprint('warning', file=sys.stderr)\n")
    assert capsys.readouterr().out.strip() == "✓ ex9_9_noisy passed", "stderr does not fail a test in this course"
    shell.run_cell("# TEST: ex9_9_stub\nraise NotImplementedError()\n")
    assert "passed" not in capsys.readouterr().out


def test_forbid_reference_names_a_subpackage_module_by_its_full_name():
    from course.sim import blocks

    with pytest.raises(AssertionError, match=r"\(course\.sim\.blocks\.prompt_block_hashes\)"), forbid_reference(blocks):
        blocks.prompt_block_hashes("r", 8, 4)


def test_forbid_reference_watches_the_parts_a_module_names_as_its_reference():
    """course.vllm_lab's /metrics readers live in course.metrics_text (course.capacity reads pages too): calling
    them through the lab, or by their own module, is still calling module 7's reference."""
    from course import metrics_text, vllm_lab

    page = 'vllm:num_preemptions_total{engine="0"} 3.0\n'
    with pytest.raises(AssertionError, match=r"\(course\.metrics_text\.parse_metrics\)"), forbid_reference(vllm_lab):
        vllm_lab.parse_metrics(page)
    snapshot = metrics_text.parse_metrics(page)
    with pytest.raises(AssertionError, match=r"\(course\.metrics_text\.metric_value\)"), forbid_reference(vllm_lab):
        metrics_text.metric_value(snapshot, "vllm:num_preemptions_total")
