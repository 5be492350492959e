"""Workload generators: arrivals, length distributions and replay of measured traces."""

import numpy as np
import pytest

from course import workload
from course.trace import RequestTrace


def test_poisson_arrivals_have_the_requested_rate_and_are_reproducible():
    run = workload.poisson(rate=4.0, n=4000, prompt_tokens=128, output_tokens=64, seed=1)
    gaps = np.diff([r.arrival_time for r in run])
    assert run.requests[0].arrival_time == 0.0
    assert np.mean(gaps) == pytest.approx(0.25, rel=0.05)
    assert np.std(gaps) == pytest.approx(0.25, rel=0.1)  # exponential: std = mean
    again = workload.poisson(rate=4.0, n=4000, prompt_tokens=128, output_tokens=64, seed=1)
    assert again.requests == run.requests
    assert run.total_prompt_tokens == 4000 * 128 and run.total_output_tokens == 4000 * 64


def test_burstier_arrivals_keep_the_mean_rate_but_spread_more():
    even = workload.bursty(2.0, 3000, 16, 16, burstiness=4.0, seed=2)
    bursty = workload.bursty(2.0, 3000, 16, 16, burstiness=0.25, seed=2)
    gaps_even = np.diff([r.arrival_time for r in even])
    gaps_bursty = np.diff([r.arrival_time for r in bursty])
    assert np.mean(gaps_even) == pytest.approx(0.5, rel=0.1) and np.mean(gaps_bursty) == pytest.approx(0.5, rel=0.1)
    assert np.std(gaps_bursty) > 3 * np.std(gaps_even)


def test_length_samplers():
    rng = np.random.default_rng(0)
    assert set(workload.uniform(10, 12)(rng, 500)) == {10, 11, 12}
    long_tail = workload.lognormal(median=200, sigma=1.0, high=4096)(rng, 5000)
    assert np.median(long_tail) == pytest.approx(200, rel=0.1) and long_tail.max() <= 4096 and long_tail.min() >= 1
    with pytest.raises(ValueError, match="low <= high"):
        workload.uniform(5, 4)
    with pytest.raises(ValueError, match="rate must be positive"):
        workload.poisson(0, 10, 1, 1)


def test_all_at_once_and_validation():
    burst = workload.all_at_once(5, workload.uniform(1, 100), 8)
    assert len(burst) == 5 and burst.duration == 0.0
    with pytest.raises(ValueError, match="output_tokens must be >= 1"):
        workload.RequestSpec("x", 0.0, 10, 0)


def test_replaying_measured_traces_keeps_arrivals_and_lengths():
    traces = [
        RequestTrace("a", 100.5, [100.9], [1], prompt_tokens=300, output_tokens=1),
        RequestTrace("b", 100.0, [100.4, 100.5], [1, 1], prompt_tokens=20, output_tokens=2),
        RequestTrace("c", 101.0, [], [], prompt_tokens=50, output_tokens=0, error="HTTP 500"),
    ]
    replay = workload.from_traces(traces)
    assert [(r.request_id, r.arrival_time, r.prompt_tokens, r.output_tokens) for r in replay] == [
        ("b", 0.0, 20, 2),
        ("a", 0.5, 300, 1),
        ("c", 1.0, 50, 1),
    ]
    assert len(workload.from_traces([])) == 0
