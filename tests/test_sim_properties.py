"""Property-based tests of course.sim: invariants on random workloads and settings, and the fast engine
agreeing exactly with the readable reference (harness + step functions)."""

from __future__ import annotations

import pytest
from helpers import reference
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from course import metrics
from course.sim import BlockManager, FrontEnd, LinearCost, ServerCost, SimConfig, prompt_block_hashes, rules, simulate
from course.units import cdiv
from course.workload import RequestSpec, Workload

COST = LinearCost(a=0.01, b=0.001, c=0.002, d=1e-5)
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def workloads(draw) -> Workload:
    n = draw(st.integers(1, 24))
    shared = draw(st.sampled_from([0, 8, 24, 40]))  # tokens of a system prompt all requests share
    front = draw(st.sampled_from([0, 0, 2]))  # unique tokens before it (a timestamp)
    arrivals = sorted(draw(st.lists(st.floats(0, 2.0, allow_nan=False), min_size=n, max_size=n)))
    requests = []
    for i, t in enumerate(arrivals):
        own = draw(st.integers(1, 48))
        segments = [(f"front {i}", front)] if front else []
        segments += [("system", shared)] if shared else []
        segments.append((f"own {i}", own))
        requests.append(RequestSpec(str(i), t, own + shared + front, draw(st.integers(1, 32)), tuple(segments)))
    return Workload(requests)


@st.composite
def configs(draw) -> SimConfig:
    scheduler = draw(st.sampled_from(["continuous", "continuous", "prefill-first", "static"]))
    chunked = draw(st.booleans()) if scheduler == "continuous" else True
    return SimConfig(
        scheduler=scheduler,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=draw(st.sampled_from([None, 16, 64])) if scheduler == "continuous" and chunked else None,
        chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 7])) if scheduler == "continuous" else 0,
        long_prefill_token_threshold_adaptive=scheduler == "continuous" and draw(st.booleans()),
        # vLLM 0.32's whole-sequence reservation, or 0.11's first-chunk rule
        reserve_full_isl=draw(st.booleans()),
        max_num_queued_reqs=draw(st.sampled_from([None, None, 3, 12])) if scheduler != "static" else None,
        block_size=(block_size := draw(st.sampled_from([1, 4, 16]))),
        num_blocks=cdiv(draw(st.integers(24, 600)), block_size),  # small caches force preemptions
        enable_prefix_caching=draw(st.booleans()) and scheduler != "static",
        # a free-block watermark: 0, V0's 1 %, or enough to hold back admissions in a small cache (V1's optional one)
        watermark=draw(st.sampled_from([0.0, 0.01, 0.2])) if scheduler != "static" else 0.0,
        # None, or short enough that some prompt + output of workloads() exceed it (at most 90 + 32)
        max_model_len=draw(st.sampled_from([None, None, 24, 64])),
        decode_after_prefill=scheduler == "prefill-first" and draw(st.booleans()),
        # vLLM's async scheduling: a finished request holds its blocks and slot while the next step is scheduled
        async_scheduling=scheduler == "continuous" and draw(st.booleans()),
    )


def reference_traces(work: Workload, config: SimConfig):
    return reference(work, config, COST, check_blocks=True)


@SETTINGS
@given(workloads(), configs())
def test_every_request_gets_exactly_its_tokens_and_no_invariant_breaks(work, config):
    result = simulate(work, config, COST)
    by_id = {spec.request_id: spec for spec in work}
    for trace in result.traces:
        spec = by_id[trace.request_id]
        if trace.error == rules.QUEUE_FULL:  # shed on arrival (max_num_queued_reqs), the API server's 503
            assert config.max_num_queued_reqs is not None
            continue
        total = spec.prompt_tokens + spec.output_tokens
        too_long = config.max_model_len is not None and total > config.max_model_len
        never_fits = cdiv(total, config.block_size) > config.num_blocks
        # V0 keeps watermark_blocks free when admitting: a recompute of prompt + output - 1 tokens must fit the rest
        reserved = config.watermark_blocks if config.scheduler == "prefill-first" else 0
        held_back = reserved > 0 and cdiv(total - 1, config.block_size) > config.num_blocks - reserved
        assert bool(trace.error) == (too_long or never_fits or held_back), (
            "exactly the requests that could never run are rejected"
        )
        if trace.error:
            continue
        assert len(trace.chunk_times) == trace.output_tokens == spec.output_tokens
        assert trace.chunk_times[0] > spec.arrival_time, "no token before (or at) the arrival"
        assert all(a < b for a, b in zip(trace.chunk_times, trace.chunk_times[1:])), "one token per step"
        assert trace.chunk_times[0] - trace.send_time <= trace.chunk_times[-1] - trace.send_time  # TTFT <= E2E
    log = result.steps
    assert (log.used_blocks <= config.num_blocks).all(), "blocks never exceed the cache"
    assert (log.end > log.start).all() and (log.start[1:] >= log.end[:-1]).all()
    assert (log.num_seqs <= config.max_num_seqs).all()
    if config.scheduler != "static":
        assert (log.prefill_tokens + log.decode_tokens <= config.token_budget).all()
    if config.scheduler == "prefill-first":
        assert ((log.prefill_tokens == 0) | (log.decode_tokens == 0)).all(), "V0 never mixes prefill and decode"
    for record in result.requests:  # preempted requests restarted and still finished
        if record.preempted:
            assert len(record.token_times) == record.output_tokens
            # async scheduling can preempt a request whose last token is in flight: it finishes, never resumes
            after_last = record.preempted[-1] >= record.token_times[-1]
            assert not after_last or config.async_scheduling
            assert len(record.scheduled) == len(record.preempted) + 1 - after_last


def test_v0_with_prefix_caching_does_not_count_a_readmitted_prompt_as_a_decode():
    # The example hypothesis found: request 15's prompt (24 + 40 tokens) is exactly 4 blocks; it is
    # preempted after its first token, and when it is re-admitted its own prompt blocks are still
    # cached, so it computes 1 token. That is a prefill (V0 re-admits it through _schedule_prefills),
    # not a decode in the same step as other prompts.
    sizes = [(1, 1)] * 11 + [(30, 12), (1, 11), (1, 1), (1, 12), (40, 2), (1, 1)]  # (own tokens, output)
    work = Workload(
        [
            RequestSpec(str(i), 0.0, 24 + own, out, (("system", 24), (f"own {i}", own)))
            for i, (own, out) in enumerate(sizes)
        ]
    )
    config = SimConfig(
        scheduler="prefill-first", max_num_seqs=3, block_size=16, num_blocks=10, enable_prefix_caching=True
    )
    result = simulate(work, config, COST)
    log = result.steps
    assert result.preemptions == 1 and result.requests[15].preempted
    assert result.requests[15].prefix_hit_tokens == 16 + 64  # the system block, then its whole prompt
    assert ((log.prefill_tokens == 0) | (log.decode_tokens == 0)).all(), "V0 never mixes prefill and decode"
    expected, run = reference_traces(work, config)
    assert [t.chunk_times for t in result.traces] == [t.chunk_times for t in expected]
    assert run.result("reference", config.num_blocks, config.block_size).steps.decode_tokens.tolist() == (
        log.decode_tokens.tolist()
    )
    assert ((run.steps.prefill_tokens == 0) | (run.steps.decode_tokens == 0)).all()


# Found by hypothesis: the running request preempts itself while the last step's finished request still
# holds its blocks (async scheduling), so the step schedules nothing; the fast engine kept the preempted
# request in its decode fast path and asked for its blocks the next step (a KeyError before the fix).
SELF_PREEMPTION_IN_AN_EMPTY_PASS = (
    Workload([RequestSpec(str(i), 0.0, 41, 1, (("system", 40), (f"own {i}", 1))) for i in range(13)]),
    SimConfig(scheduler="continuous", max_num_seqs=2, chunked_prefill=True, long_prefill_token_threshold=7,
              long_prefill_token_threshold_adaptive=False, reserve_full_isl=False, block_size=1, num_blocks=76,
              watermark=0.0, async_scheduling=True),
)  # fmt: skip


@SETTINGS
@given(workloads(), configs())
@example(*SELF_PREEMPTION_IN_AN_EMPTY_PASS)
def test_fast_engine_matches_the_reference_exactly(work, config):
    result = simulate(work, config, COST)
    expected, run = reference_traces(work, config)
    assert [t.chunk_times for t in result.traces] == [t.chunk_times for t in expected]
    assert [bool(t.error) for t in result.traces] == [bool(t.error) for t in expected]
    if run is not None:
        assert result.preemptions == run.preemptions
        assert result.steps.used_blocks.tolist() == run.steps.used_blocks.tolist()
        assert [r.prefix_hit_tokens for r in result.requests] == [r.prefix_hit_tokens for r in run.requests]
        as_result = run.result("reference", config.num_blocks, config.block_size)
        assert [r.scheduled for r in as_result.requests] == [r.scheduled for r in result.requests]
        assert [r.preempted for r in as_result.requests] == [r.preempted for r in result.requests]
        for column in ("start", "end", "prefill_tokens", "decode_tokens", "kv_tokens_read", "attention_pairs",
                       "num_seqs", "used_blocks", "waiting"):  # fmt: skip
            assert getattr(as_result.steps, column).tolist() == getattr(result.steps, column).tolist(), column
        assert [r.queried_tokens for r in as_result.requests] == [r.queried_tokens for r in result.requests]


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 40),
    st.sampled_from([1, 2, 4, 16]),
    st.booleans(),
    st.lists(
        st.tuples(st.sampled_from(["allocate", "append", "free", "lookup"]), st.integers(0, 5), st.integers(0, 40))
    ),
)
def test_block_manager_invariants_under_random_operations(num_blocks, block_size, caching, operations):
    blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
    prompts = {
        rid: prompt_block_hashes(str(rid), 40, block_size, [("shared", 20), (f"own {rid}", 20)]) for rid in range(6)
    }
    for op, rid, tokens in operations:
        key = str(rid)
        before = blocks.num_free_blocks
        if op == "allocate" and key not in blocks:
            hits = blocks.lookup(prompts[rid], tokens // block_size)
            if blocks.allocate(key, max(tokens, len(hits) * block_size), hits):
                blocks.cache_full_blocks(key, prompts[rid], tokens)
            else:
                assert key not in blocks and blocks.num_free_blocks == before, "a failed allocation changes nothing"
        elif op == "append" and key in blocks:
            table = blocks.block_table(key)
            if not blocks.append(key, tokens):
                assert blocks.block_table(key) == table and blocks.num_free_blocks == before
        elif op == "free" and key in blocks:
            blocks.free(key)
        elif op == "lookup":
            assert len(blocks.lookup(prompts[rid])) <= len(prompts[rid])
        blocks.check()
        assert 0 <= blocks.num_used_blocks <= num_blocks
        assert 0.0 <= blocks.utilisation() <= 1.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(2, 40)), min_size=4, max_size=16),
    st.sampled_from(["continuous", "prefill-first", "prefill-then-decode"]),
    st.sampled_from([1, 4, 8]),
    st.integers(0, 3),
    st.booleans(),
)
def test_under_kv_pressure_preempted_requests_restart_and_still_finish(sizes, scheduler, block_size, spare, caching):
    work = Workload([RequestSpec(str(i), 0.001 * i, p, o) for i, (p, o) in enumerate(sizes)])
    # room for the largest request plus a few blocks: everyone else has to squeeze in, and out
    num_blocks = max(cdiv(p + o, block_size) for p, o in sizes) + spare
    interleave = scheduler == "prefill-then-decode"
    config = SimConfig(
        scheduler="prefill-first" if interleave else scheduler,
        block_size=block_size,
        num_blocks=num_blocks,
        enable_prefix_caching=caching,
        decode_after_prefill=interleave,
    )
    result = simulate(work, config, COST)
    assert all(len(r.token_times) == r.output_tokens and not r.error for r in result.requests)
    assert (result.steps.used_blocks <= num_blocks).all()
    expected, run = reference_traces(work, config)
    assert [t.chunk_times for t in result.traces] == [t.chunk_times for t in expected]
    assert result.preemptions == run.preemptions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), configs(), st.sampled_from([0.05, 0.2, 1.0]), st.sampled_from([0.005, 0.02, 0.1]))
def test_metrics_from_the_columns_equal_the_metrics_of_the_traces(work, config, ttft_slo, tpot_slo):
    """The engine keeps no time per token: its summary and goodput come from runs of steps and must
    equal course.metrics over the traces (the ITL mean may differ in the last bits: a weighted sum)."""
    result = simulate(work, config, COST)
    percentiles = (0, 25, 50, 90, 95, 99, 99.9, 100)
    got, want = result.summary(percentiles), metrics.summarize(result.traces, percentiles)
    assert (got.completed, got.failed, got.output_tokens, got.duration) == (
        want.completed, want.failed, want.output_tokens, want.duration
    )  # fmt: skip
    for name in ("ttft", "itl", "tpot", "e2e"):
        mine, theirs = getattr(got, name), getattr(want, name)
        assert mine.n == theirs.n and mine.percentiles == theirs.percentiles, name
        assert mine.mean == (pytest.approx(theirs.mean, rel=1e-12, abs=1e-15) if name == "itl" else theirs.mean)
    g = result.goodput(ttft_slo=ttft_slo, tpot_slo=tpot_slo)
    expected = metrics.goodput(result.traces, ttft_slo=ttft_slo, tpot_slo=tpot_slo)
    assert (g.good, g.total, g.duration, g.slos) == (expected.good, expected.total, expected.duration, expected.slos)
    assert result.preemptions == sum(len(r.preempted) for r in result.requests)
    assert result.preempted_requests == sum(1 for r in result.requests if r.preempted)
    assert result.failed == sum(1 for r in result.requests if r.error)


# Module 2's server: 3 ms of every request's front-end work on the step that prefills it, 20 ms before
# the engine sees it, sharing the core with the steps it overlaps (frontend.FrontDoor): long enough to
# reorder who is admitted when and to stretch steps.
FRONT_END_COST = ServerCost(LinearCost(a=0.01, b=0.001, c=0.002, d=1e-5, e=0.003), FrontEnd(before_engine=0.02))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(), configs())
def test_with_the_front_ends_work_before_the_engine_the_fast_engine_still_matches_the_reference(work, config):
    result = simulate(work, config, FRONT_END_COST)
    expected, run = reference(work, config, FRONT_END_COST, check_blocks=True)
    assert [t.chunk_times for t in result.traces] == [t.chunk_times for t in expected]
    assert [bool(t.error) for t in result.traces] == [bool(t.error) for t in expected]
    if run is not None:
        as_result = run.result("reference", config.num_blocks, config.block_size)
        for column in ("start", "end", "prefill_tokens", "decode_tokens", "num_seqs", "waiting"):
            assert getattr(as_result.steps, column).tolist() == getattr(result.steps, column).tolist(), column


@pytest.mark.parametrize(
    "settings",
    [
        {"num_blocks": 4000},  # room to spare: every decode takes the fast path
        {"num_blocks": 200},  # KV pressure: blocks run short, the exact path preempts
        {"num_blocks": 200, "async_scheduling": True, "long_prefill_token_threshold": 96},
        {"num_blocks": 4000, "max_num_batched_tokens": 40},  # the budget binds: decodes wait their turn
    ],
)
def test_long_decodes_match_the_reference_where_the_fast_path_takes_them_in_bulk(settings):
    """Hundreds of requests decoding for up to 120 steps: long stretches in which the engine advances
    decodes without touching them, broken by arrivals, block boundaries, preemptions and finishes."""
    import random

    rng = random.Random(7)
    work = Workload([RequestSpec(str(i), 0.02 * i, rng.randint(1, 200), rng.randint(1, 120)) for i in range(200)])
    config = SimConfig(max_num_seqs=48, max_num_batched_tokens=settings.pop("max_num_batched_tokens", 256), **settings)
    result = simulate(work, config, COST)
    expected, run = reference(work, config, COST)  # without the block checks after every call: too slow here
    assert [t.chunk_times for t in result.traces] == [t.chunk_times for t in expected]
    assert result.steps.used_blocks.tolist() == run.steps.used_blocks.tolist()
    assert result.preemptions == run.preemptions
    assert (result.preemptions > 0) == (config.num_blocks == 200)
