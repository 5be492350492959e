"""The engine core's counters on their own (course.serving.counters): what /health shows of them."""

from __future__ import annotations

import json

import pytest

from course.serving.counters import RECENT_ITERATIONS, StepCounters


def test_no_steps_yet_gives_zero_means_not_a_division_by_zero():
    stats = StepCounters().as_stats()
    assert stats["mean_batch_size"] == 0.0 and stats["mean_decode_step_ms"] == 0.0
    assert stats["decode_steps_by_batch"] == {} and stats["prefill_steps_by_tokens"] == {}


def test_steps_are_counted_per_batch_and_prefills_per_prompt_tokens():
    counters = StepCounters()
    for batch, seconds, read in [(2, 0.004, 24), (1, 0.002, 8), (2, 0.006, 26)]:
        counters.steps += 1
        counters.batch_size_sum += batch
        counters.count_decode(batch, seconds, read)
    counters.count_prefill(17, 0.010)
    counters.count_prefill(17, 0.012)
    stats = json.loads(json.dumps(counters.as_stats()))  # what travels to /health
    assert stats["decode_steps_by_batch"] == {"1": [1, 0.002, 8], "2": [2, pytest.approx(0.010), 50]}
    assert stats["prefill_steps_by_tokens"] == {"17": [2, pytest.approx(0.022)]}
    assert stats["mean_batch_size"] == pytest.approx(5 / 3)
    assert stats["mean_decode_step_ms"] == pytest.approx(1e3 * 0.012 / 3)
    assert stats["prefill_seconds"] == pytest.approx(0.022)


def test_only_the_recent_iterations_are_kept():
    counters = StepCounters()
    for i in range(RECENT_ITERATIONS + 5):
        counters.count_iteration(float(i), 0.001, 1, 0)
    assert len(counters.iterations) == len(counters.budget_used) == RECENT_ITERATIONS
    assert counters.iterations[0] == (5.0, 0.001)
