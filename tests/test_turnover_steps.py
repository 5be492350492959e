"""benchmarks/turnover_steps.py: decode steps in a closed wave, a closed loop that turns over, and a Poisson run."""

import sys
from pathlib import Path

import pytest

from course.trace import RequestTrace

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import turnover_steps  # noqa: E402


def test_gaps_that_hold_another_requests_first_token_are_left_out():
    early = RequestTrace("a", 0.0, [1.0, 1.004, 1.008, 1.020, 1.024], [1] * 5)
    joins = RequestTrace("b", 1.0, [1.015, 1.019], [1, 1])  # its first token lands in a's gap 1.008..1.020
    failed = RequestTrace("c", 0.0, [1.001, 1.002], [1, 1], error="HTTP 500")  # not a first token anyone waits on
    gaps = turnover_steps.decode_only_gaps([early, joins, failed])
    assert gaps == pytest.approx([0.004, 0.004, 0.004, 0.004]), "a's 12 ms gap carried b's prefill"


def test_the_summary_names_the_decode_gaps_and_the_crowded_ones():
    lone = RequestTrace("a", 0.0, [1.0, 1.002, 1.004], [1] * 3)
    line = turnover_steps.gaps_line("wave", [lone])
    assert "median  2.00 ms, mean  2.00 (2)" in line and "never 13-16 streams" in line
    crowd = [RequestTrace(str(i), 0.0, [1.0 + 0.001 * i + 0.005 * k for k in range(4)], [1] * 4) for i in range(14)]
    assert "all gaps at 13-16 streams p50  5.00 ms" in turnover_steps.gaps_line("poisson", crowd)
    assert "no decode-only gaps" in turnover_steps.gaps_line("wave", [RequestTrace("x", 0.0, [1.0], [1])])


def test_the_three_shapes_send_the_same_prompts_three_ways_and_bad_options_are_refused():
    shapes = dict(turnover_steps.shapes(16, 30))
    assert shapes["wave"] == ["--concurrency", "16", "--num-requests", "32"]
    assert shapes["turnover"] == ["--concurrency", "16", "--num-requests", "160"]
    assert shapes["poisson"] == ["--request-rate", "30", "--num-requests", "160"]
    with pytest.raises(SystemExit):
        turnover_steps.parse_args(["--rate", "0"])
