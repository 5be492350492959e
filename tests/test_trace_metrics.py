"""The request trace record and the reference metrics (vLLM's definitions)."""

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from course import metrics
from course.trace import RequestTrace, load_traces, save_traces


def trace(send, chunks, tokens=None, output_tokens=None, **kwargs):
    tokens = tokens if tokens is not None else [1] * len(chunks)
    out = output_tokens if output_tokens is not None else sum(tokens)
    return RequestTrace("r", send_time=send, chunk_times=chunks, chunk_tokens=tokens, output_tokens=out, **kwargs)


def test_single_request_metrics():
    t = trace(10.0, [10.5, 10.6, 10.8])
    assert metrics.ttft(t) == pytest.approx(0.5)
    assert metrics.e2e(t) == pytest.approx(0.8)
    assert metrics.itl(t) == pytest.approx([0.1, 0.2])
    assert metrics.tpot(t) == pytest.approx(0.15)


def test_empty_first_chunk_counts_for_ttft_and_itl():
    t = trace(0.0, [0.2, 0.25, 0.3], tokens=[0, 1, 1])
    assert metrics.ttft(t) == pytest.approx(0.2)
    assert metrics.itl(t) == pytest.approx([0.05, 0.05])


def test_tpot_divides_by_tokens_not_chunks():
    t = trace(0.0, [0.5, 0.9, 1.3], tokens=[1, 2, 2])
    assert metrics.tpot(t) == pytest.approx(0.8 / 4)


def test_one_token_output_has_no_tpot():
    assert metrics.tpot(trace(0.0, [0.5])) is None


def test_failed_request_has_no_ttft():
    failed = trace(0.0, [], error="boom")
    assert not failed.succeeded
    with pytest.raises(ValueError, match="no chunks"):
        metrics.ttft(failed)


def test_summary_pools_itl_and_excludes_failures():
    short = trace(0.0, [0.1, 1.1])
    long = trace(0.0, [0.1 + 0.1 * i for i in range(10)])
    failed = trace(0.0, [], error="HTTP 500")
    errored = trace(0.0, [5.0], error="stream broke")
    summary = metrics.summarize([short, long, failed, errored])
    assert summary.completed == 2 and summary.failed == 2
    assert summary.itl.n == 10
    assert summary.itl.mean == pytest.approx((1.0 + 9 * 0.1) / 10)
    assert summary.ttft["p50"] == pytest.approx(0.1)
    assert summary.output_tokens == 12


def test_summary_of_nothing_reports_zeros_like_vllm():
    summary = metrics.summarize([])
    for stats in (summary.ttft, summary.itl, summary.tpot, summary.e2e):
        assert stats.n == 0 and stats.mean == 0.0 and all(v == 0.0 for v in stats.percentiles.values())
    assert summary.output_throughput == 0.0
    assert "completed 0" in summary.table()


def test_percentile_is_linear_interpolation():
    values = [0.2, 0.9, 0.1, 0.5, 3.0, 0.4, 0.7]
    for q in (50, 90, 95, 99):
        assert metrics.percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert metrics.percentile([1, 2, 3, 4], 50) == 2.5  # nearest rank would say 2 or 3
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


def test_stats_lookup_names_what_was_computed():
    stats = metrics.stats_of([1.0, 2.0, 3.0], percentiles=(50, 90))
    assert stats["median"] == 2.0 and stats["mean"] == 2.0 and stats["p90"] == pytest.approx(2.8)
    with pytest.raises(KeyError, match="p99"):
        stats["p99"]


def test_naive_average_moves_with_output_length_while_itl_does_not():
    # Same TTFT (1 s) and same gaps (10 ms): only the output length differs.
    short = [trace(0.0, [1.0 + 0.01 * i for i in range(4)]) for _ in range(3)]
    long = [trace(0.0, [1.0 + 0.01 * i for i in range(200)]) for _ in range(3)]
    assert metrics.summarize(short).itl.mean == pytest.approx(metrics.summarize(long).itl.mean)
    # (1.03 s / 4 tokens) vs (2.99 s / 200 tokens): 0.2575 vs 0.01495 s per token
    assert metrics.naive_latency_per_token(short) == pytest.approx(1.03 / 4)
    assert metrics.naive_latency_per_token(long) == pytest.approx(2.99 / 200)
    with pytest.raises(ValueError):
        metrics.naive_latency_per_token([])


@st.composite
def traces(draw):
    send = draw(st.floats(0, 100))
    gaps = draw(st.lists(st.floats(0, 2), min_size=1, max_size=30))
    times = list(np.cumsum([send + draw(st.floats(0, 5))] + gaps[1:]))
    tokens = draw(st.lists(st.integers(0, 4), min_size=len(times), max_size=len(times)))
    return RequestTrace("h", send, times, tokens, prompt_tokens=5, output_tokens=max(sum(tokens), 0))


@given(st.lists(traces(), max_size=12))
def test_summary_matches_a_direct_vllm_style_computation(run):
    # vLLM's calculate_metrics, restated: pooled chunk gaps, per-request TPOT for N > 1, np.percentile(x or 0).
    ttfts = [t.chunk_times[0] - t.send_time for t in run]
    itls = [b - a for t in run for a, b in zip(t.chunk_times, t.chunk_times[1:])]
    tpots = [(t.chunk_times[-1] - t.chunk_times[0]) / (t.output_tokens - 1) for t in run if t.output_tokens > 1]
    summary = metrics.summarize(run)
    for stats, values in ((summary.ttft, ttfts), (summary.itl, itls), (summary.tpot, tpots)):
        assert stats.n == len(values)
        for q in (50, 95, 99):
            assert math.isclose(stats.percentiles[q], np.percentile(values or 0, q), rel_tol=1e-9, abs_tol=1e-12)
        assert summary.ttft["p50"] <= summary.e2e["p99"] + 1e-9 or not run


def test_trace_validation_names_the_problem():
    with pytest.raises(ValueError, match="one token count per chunk"):
        RequestTrace("x", 0.0, [1.0, 2.0], [1])
    with pytest.raises(ValueError, match="arrival order"):
        RequestTrace("x", 0.0, [2.0, 1.0], [1, 1])
    with pytest.raises(ValueError, match="same clock"):
        RequestTrace("x", 5.0, [1.0], [1])


def test_traces_round_trip_through_json(tmp_path):
    original = [trace(0.0, [0.3, 0.4], prompt_tokens=7, finish_reason="length"), trace(1.0, [], error="timeout")]
    path = save_traces(tmp_path / "run.json", original, server="test", concurrency=2)
    assert json.loads(path.read_text())["metadata"] == {"server": "test", "concurrency": 2}
    assert load_traces(path) == original


def test_loading_a_wrong_file_says_what_was_expected(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_traces(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a request-trace file"):
        load_traces(tmp_path / "other.json")


def test_a_trace_from_token_times_has_one_chunk_per_token_and_one_failure_convention():
    ok = RequestTrace.from_token_times("a", 1.0, [1.5, 1.75], prompt_tokens=7)
    assert (ok.chunk_times, ok.chunk_tokens, ok.output_tokens) == ([1.5, 1.75], [1, 1], 2)
    assert (ok.prompt_tokens, ok.finish_reason, ok.error, ok.succeeded) == (7, "length", None, True)
    rejected = RequestTrace.from_token_times("b", 1.0, [], prompt_tokens=7, error="rejected: too long")
    assert (rejected.output_tokens, rejected.finish_reason, rejected.succeeded) == (0, None, False)
    cut = RequestTrace.from_token_times("c", 1.0, [1.5], error="not finished")
    assert cut.finish_reason is None and cut.output_tokens == 1  # a failure keeps the tokens it got


def test_run_duration_is_first_send_to_last_chunk_of_the_successful_requests():
    traces = [trace(1.0, [1.5, 2.0]), trace(0.5, [3.0]), RequestTrace("failed", 0.0, error="HTTP 500")]
    assert metrics.run_duration(traces) == pytest.approx(2.5)  # the failed request's send at 0 does not count
    assert metrics.run_duration([RequestTrace("failed", 0.0, error="HTTP 500")]) == 0.0
    assert metrics.summarize(traces).duration == metrics.goodput(traces, ttft_slo=1.0).duration == 2.5
    assert metrics.summarize(traces, duration=10.0).duration == 10.0


def test_summary_to_dict_has_every_number_of_the_table():
    summary = metrics.summarize([trace(0.0, [0.5, 0.75, 1.0]), trace(0.0, [0.25])], percentiles=(50, 90))
    data = summary.to_dict()
    assert json.loads(json.dumps(data)) == data, "plain JSON numbers"
    assert data["completed"] == 2 and data["failed"] == 0 and data["output_tokens"] == 4
    assert (
        data["duration_s"] == 1.0 and data["output_throughput_tok_s"] == 4.0 and data["request_throughput_req_s"] == 2.0
    )
    assert data["itl"] == {"n": 2, "mean_s": 0.25, "p50_s": 0.25, "p90_s": 0.25}
    assert set(data["ttft"]) == set(data["tpot"]) == set(data["e2e"]) == {"n", "mean_s", "p50_s", "p90_s"}


def test_itl_by_streams_counts_the_requests_streaming_at_each_gaps_midpoint():
    alone_then_joined = RequestTrace("a", 0.0, [1.0, 2.0, 3.0, 4.0], [1] * 4)
    joins = RequestTrace("b", 0.0, [2.5, 3.5], [1, 1])  # streams from 2.5 to 3.5
    gone = RequestTrace("c", 0.0, [0.1, 0.4], [1, 1])  # ended before any of a's gaps
    failed = RequestTrace("d", 0.0, [1.0, 3.0], [1, 1], error="HTTP 500")
    by_one = metrics.itl_by_streams([alone_then_joined, joins, gone, failed], width=1)
    # a's gaps at midpoints 1.5 (a alone), 2.5 (a and b: b's first chunk), 3.5 (b's last chunk still counts);
    # b's own gap at 3.0 (both); c's gap at 0.25 (c alone); the failed request is left out, gaps and streams
    assert by_one == {1: pytest.approx([1.0, 0.3]), 2: pytest.approx([1.0, 1.0, 1.0])}
    by_four = metrics.itl_by_streams([alone_then_joined, joins, gone, failed], width=4)
    assert list(by_four) == [1] and len(by_four[1]) == 5


@given(st.lists(st.tuples(st.floats(0, 10), st.lists(st.floats(0.001, 1), min_size=1, max_size=6)), max_size=8))
def test_itl_by_streams_holds_every_gap_once_and_no_more_streams_than_requests(requests):
    traces = []
    for index, (start, gaps) in enumerate(requests):
        times = [start + sum(gaps[:i]) for i in range(len(gaps) + 1)]
        traces.append(RequestTrace(str(index), 0.0, times, [1] * len(times)))
    by_two = metrics.itl_by_streams(traces, width=2)
    pooled = sorted(g for gaps in by_two.values() for g in gaps)
    assert pooled == pytest.approx(sorted(g for t in traces for g in metrics.itl(t)))
    assert all(low % 2 == 1 and low <= max(len(traces), 1) for low in by_two)


def test_itl_by_streams_rejects_a_bin_narrower_than_one_stream():
    with pytest.raises(ValueError, match="at least 1"):
        metrics.itl_by_streams([], width=0)
