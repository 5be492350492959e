"""benchmarks/turnover_steps.py: decode steps in a closed wave, a closed loop that turns over, and a Poisson run."""

import sys
from pathlib import Path

import pytest

from course.trace import RequestTrace

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import turnover_steps  # noqa: E402
from _processes import CoreTime  # noqa: E402


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


def test_the_shapes_send_the_same_prompts_four_ways_and_bad_options_are_refused():
    shapes = dict(turnover_steps.shapes(16, 30))
    assert shapes["wave"] == ["--concurrency", "16", "--num-requests", "32"]
    assert shapes["turnover"] == ["--concurrency", "16", "--num-requests", "160"]
    assert shapes["queue"] == ["--concurrency", "32", "--num-requests", "160"], "16 running, 16 waiting"
    assert shapes["poisson"] == ["--request-rate", "30", "--num-requests", "160"]
    with pytest.raises(SystemExit):
        turnover_steps.parse_args(["--rate", "0"])


def test_the_core_line_gives_each_process_its_share_per_request_busiest_first():
    before = {"python": CoreTime(1.0, 0.5, 100), "VLLM::Worker": CoreTime(10.0, 2.0, 1000)}
    after = {"python": CoreTime(1.2, 0.6, 300), "VLLM::Worker": CoreTime(10.8, 2.4, 1400),
             "VLLM::EngineCore": CoreTime(0.1, 0.5, 600)}  # fmt: skip
    line = turnover_steps.core_line(before, after, 100)
    assert line.index("VLLM::Worker 8.00 ran, 4.00 waited, 4 slices") < line.index(
        "python 2.00 ran, 1.00 waited, 2 slices"
    )
    assert "VLLM::EngineCore 1.00 ran, 5.00 waited, 6 slices" in line, "a process first read after: all of it counts"
    assert "unread" in turnover_steps.core_line({}, {}, 0), "a server whose /proc could not be read"
