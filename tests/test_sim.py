"""course.sim: small scenarios computed by hand, the block manager, cost models, goodput, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import reference

from course import limits, metrics, workload
from course.cli import main
from course.geometry import ModelGeometry
from course.hardware import HardwareSpec, gpu
from course.kv import get_model
from course.sim import (
    BlockManager,
    LinearCost,
    RooflineCost,
    SimConfig,
    StepSample,
    cap_output,
    kv_blocks,
    prompt_block_hashes,
    rules,
    samples_from_timings,
    simulate,
    steps,
    with_system_prompt,
)
from course.trace import load_traces
from course.workload import RequestSpec, Workload

LLAMA3_8B = get_model("Llama-3-8B")
ONE_SECOND_PER_STEP = LinearCost(a=1.0, b=0.0, c=0.0, d=0.0)


def specs(*rows: tuple[float, int, int], segments=None) -> Workload:
    """A workload from (arrival s, prompt tokens, output tokens) rows; ids are "A", "B", ..."""
    return Workload(
        [RequestSpec(chr(65 + i), t, p, o, tuple(segments[i]) if segments else ()) for i, (t, p, o) in enumerate(rows)]
    )


def times(result, request_id: str) -> list[float]:
    return next(t for t in result.traces if t.request_id == request_id).chunk_times


# --- scenarios computed by hand (every step takes 1 s, so times count steps) ------------------------


def test_two_requests_prefill_together_then_decode_together():
    result = simulate(specs((0.0, 4, 3), (0.0, 4, 3)), SimConfig(), ONE_SECOND_PER_STEP)
    for rid in "AB":
        assert times(result, rid) == [1.0, 2.0, 3.0]
    assert result.steps.prefill_tokens.tolist() == [8, 0, 0]
    assert result.steps.decode_tokens.tolist() == [0, 2, 2]
    assert result.steps.kv_tokens_read.tolist() == [0, 8, 10]  # contexts 4+4, then 5+5
    s = result.summary()
    assert s.ttft.mean == 1.0 and s.e2e.mean == 3.0 and s.itl.mean == 1.0 and s.tpot.mean == 1.0


def test_chunked_prefill_spreads_a_long_prompt_over_steps():
    result = simulate(specs((0.0, 10, 2)), SimConfig(max_num_batched_tokens=4), ONE_SECOND_PER_STEP)
    assert result.steps.prefill_tokens.tolist() == [4, 4, 2, 0]  # 10 prompt tokens in chunks of 4
    assert times(result, "A") == [3.0, 4.0]
    # without chunking a prompt larger than the budget can never be scheduled: it is rejected, not stuck
    no_chunks = simulate(
        specs((0.0, 10, 2)), SimConfig(max_num_batched_tokens=4, chunked_prefill=False), ONE_SECOND_PER_STEP
    )
    assert no_chunks.traces[0].error and "budget" in no_chunks.traces[0].error


def test_static_batching_makes_a_late_request_wait_for_the_whole_batch():
    # A arrives at 0 with 4 tokens to write; B arrives at 0.5 and wants 1 token.
    work = specs((0.0, 1, 4), (0.5, 1, 1))
    static = simulate(work, SimConfig(scheduler="static", max_num_seqs=2), ONE_SECOND_PER_STEP)
    assert times(static, "A") == [1.0, 2.0, 3.0, 4.0]
    assert times(static, "B") == [5.0]  # waits for A's batch (ends at 4), then its own prefill
    continuous = simulate(work, SimConfig(max_num_seqs=2), ONE_SECOND_PER_STEP)
    assert times(continuous, "A") == [1.0, 2.0, 3.0, 4.0]
    assert times(continuous, "B") == [2.0]  # joins the running batch at the next step
    assert metrics.ttft(static.traces[1]) == 4.5 and metrics.ttft(continuous.traces[1]) == 1.5


def test_static_batch_is_a_padded_rectangle():
    cost = LinearCost(a=0.0, b=1.0, c=1.0, d=0.0)  # 1 s per prefill or decode token
    result = simulate(specs((0.0, 2, 1), (0.0, 6, 3)), SimConfig(scheduler="static"), cost)
    # prefill 2 slots x 6 tokens = 12 s; then 2 decode steps of 2 slots each = 2 s each
    assert result.steps.prefill_tokens.tolist() == [12, 0, 0]
    assert result.steps.kv_tokens_read.tolist() == [0, 12, 14]
    assert times(result, "A") == [12.0]
    assert times(result, "B") == [12.0, 14.0, 16.0]
    assert steps.run_static(specs((0.0, 2, 1), (0.0, 6, 3)), 2, cost)[1].chunk_times == [12.0, 14.0, 16.0]


def test_preemption_by_recompute_victim_is_the_latest_and_it_resumes():
    # 4 blocks of 2 tokens. A and B (prompt 3, output 4) fill the cache; at step 3 A needs a fifth
    # block, so B (admitted last) is preempted, recomputes its 5 tokens when A is done, and finishes.
    config = SimConfig(block_size=2, num_blocks=4)
    result = simulate(specs((0.0, 3, 4), (0.0, 3, 4)), config, ONE_SECOND_PER_STEP)
    assert times(result, "A") == [1.0, 2.0, 3.0, 4.0]
    assert times(result, "B") == [1.0, 2.0, 5.0, 6.0]
    assert result.preemptions == 1 and result.requests[1].preempted == [2.0]
    assert result.steps.prefill_tokens.tolist() == [6, 0, 0, 0, 5, 0]  # B recomputes prompt + 2 tokens
    assert result.steps.used_blocks.tolist() == [4, 4, 3, 3, 3, 3]
    assert metrics.itl(result.traces[1]) == [1.0, 3.0, 1.0]
    traces, ref = reference(specs((0.0, 3, 4), (0.0, 3, 4)), config, ONE_SECOND_PER_STEP)
    assert [t.chunk_times for t in traces] == [t.chunk_times for t in result.traces]
    assert ref.preemptions == 1


def test_prefill_first_stalls_running_streams_and_continuous_does_not():
    work = specs((0.0, 2, 4), (1.5, 2, 2))
    v0 = simulate(work, SimConfig(scheduler="prefill-first"), ONE_SECOND_PER_STEP)
    assert times(v0, "A") == [1.0, 2.0, 4.0, 5.0]  # step 3 is B's prefill alone: A stalls
    assert times(v0, "B") == [3.0, 4.0]
    v1 = simulate(work, SimConfig(), ONE_SECOND_PER_STEP)
    assert times(v1, "A") == [1.0, 2.0, 3.0, 4.0]  # B's prefill rides along with A's decode
    assert times(v1, "B") == [3.0, 4.0]
    assert max(metrics.itl(v0.traces[0])) == 2.0 and max(metrics.itl(v1.traces[0])) == 1.0


def test_decode_after_prefill_interleaves_like_the_module2_server():
    # B arrives during A's prefill step, C during B's: V0 keeps prefilling while A stalls; the
    # module-2 loop decodes once after every prefill step, then admits everyone who arrived
    work = specs((0.0, 2, 3), (0.5, 2, 2), (1.5, 2, 2))
    v0 = simulate(work, SimConfig(scheduler="prefill-first"), ONE_SECOND_PER_STEP)
    assert [times(v0, rid) for rid in "ABC"] == [[1.0, 4.0, 5.0], [2.0, 4.0], [3.0, 4.0]]
    assert v0.steps.prefill_tokens.tolist() == [2, 2, 2, 0, 0]
    loop = simulate(work, SimConfig(scheduler="prefill-first", decode_after_prefill=True), ONE_SECOND_PER_STEP)
    assert [times(loop, rid) for rid in "ABC"] == [[1.0, 2.0, 4.0], [3.0, 4.0], [3.0, 4.0]]
    assert loop.steps.prefill_tokens.tolist() == [2, 0, 4, 0]


def test_prefill_first_keeps_the_watermark_free_and_rejects_what_it_could_never_admit():
    # 10 blocks of 1 token, 2 kept free: B's 5-token prompt waits while A holds 4 and then 5 blocks
    work = specs((0.0, 4, 3), (0.0, 5, 1))
    held = SimConfig(scheduler="prefill-first", block_size=1, num_blocks=10, watermark=0.2)
    result = simulate(work, held, ONE_SECOND_PER_STEP)
    assert [times(result, rid) for rid in "AB"] == [[1.0, 2.0, 3.0], [4.0]]
    assert [t.chunk_times for t in reference(work, held, ONE_SECOND_PER_STEP)[0]] == [[1.0, 2.0, 3.0], [4.0]]
    free = simulate(work, SimConfig(scheduler="prefill-first", block_size=1, num_blocks=10), ONE_SECOND_PER_STEP)
    assert times(free, "B") == [1.0]  # without the watermark B prefills beside A
    # 9 prompt tokens fit the cache, never the 8 blocks admission may use: rejected, not stuck
    never = simulate(specs((0.0, 9, 1), (0.0, 2, 1)), held, ONE_SECOND_PER_STEP)
    assert "watermark" in never.traces[0].error and times(never, "B") == [1.0]
    assert [bool(t.error) for t in reference(specs((0.0, 9, 1), (0.0, 2, 1)), held, ONE_SECOND_PER_STEP)[0]] == [
        True,
        False,
    ]


def test_a_readmitted_request_is_a_prefill_even_when_the_cache_leaves_it_one_token():
    # 3 blocks of 2 tokens. At step 2 A takes the last block and B is preempted after its first
    # token; its freed prompt block stays cached. At step 3 B is re-admitted with C: the cache
    # leaves B only its generated token to compute, but a request joining from the queue is a
    # prefill in V0 (_schedule_prefills), and a prefill step schedules no decode.
    work = specs((0.0, 2, 2), (0.0, 2, 2), (1.5, 2, 1))
    config = SimConfig(scheduler="prefill-first", block_size=2, num_blocks=3, enable_prefix_caching=True)
    result = simulate(work, config, ONE_SECOND_PER_STEP)
    assert [times(result, rid) for rid in "ABC"] == [[1.0, 2.0], [1.0, 3.0], [3.0]]
    assert result.requests[1].preempted == [1.0] and result.requests[1].prefix_hit_tokens == 2
    assert result.steps.prefill_tokens.tolist() == [4, 0, 3]  # step 3: B's 1 token + C's prompt
    assert result.steps.decode_tokens.tolist() == [0, 1, 0]
    traces, run = reference(work, config, ONE_SECOND_PER_STEP)
    assert [t.chunk_times for t in traces] == [t.chunk_times for t in result.traces]
    log = run.steps
    loads = zip(log.prefill_tokens, log.decode_tokens, log.kv_tokens_read, log.attention_pairs)
    assert [tuple(int(x) for x in load) for load in loads] == [(4, 0, 0, 6), (0, 1, 2, 3), (3, 0, 2, 6)]


def test_max_num_seqs_keeps_the_rest_waiting():
    result = simulate(specs((0.0, 1, 2), (0.0, 1, 2), (0.0, 1, 2)), SimConfig(max_num_seqs=2), ONE_SECOND_PER_STEP)
    assert times(result, "C") == [3.0, 4.0]  # admitted once A and B finished at t=2
    assert result.steps.num_seqs.tolist() == [2, 2, 1, 1]


def test_prefix_cache_hit_skips_the_shared_system_prompt():
    cost = LinearCost(a=0.0, b=1.0, c=1.0, d=0.0)
    shared = with_system_prompt(specs((0.0, 4, 1), (100.0, 4, 1)), 8)
    config = SimConfig(block_size=4, enable_prefix_caching=True)
    result = simulate(shared, config, cost)
    assert metrics.ttft(result.traces[0]) == 12.0  # 8 system + 4 own tokens
    assert metrics.ttft(result.traces[1]) == 4.0  # the system prompt's 2 blocks were cached
    assert result.prefix_hit_rate == pytest.approx(8 / 24)
    front = simulate(with_system_prompt(specs((0.0, 4, 1), (100.0, 4, 1)), 8, front_tokens=1), config, cost)
    assert metrics.ttft(front.traces[1]) == 13.0 and front.prefix_hit_rate == 0.0
    off = simulate(shared, SimConfig(block_size=4), cost)
    assert metrics.ttft(off.traces[1]) == 12.0


def test_prefix_cache_never_serves_the_last_token():
    cost = LinearCost(a=0.0, b=1.0, c=1.0, d=0.0)
    same = specs((0.0, 8, 1), (50.0, 8, 1), segments=[[("doc", 8)], [("doc", 8)]])
    result = simulate(same, SimConfig(block_size=4, enable_prefix_caching=True), cost)
    assert metrics.ttft(result.traces[1]) == 4.0  # one block hit; the last block is recomputed


def test_requests_that_cannot_fit_are_rejected_not_stuck():
    result = simulate(specs((0.0, 100, 10), (0.0, 2, 2)), SimConfig(block_size=4, num_blocks=8), ONE_SECOND_PER_STEP)
    assert result.traces[0].error and "KV blocks" in result.traces[0].error
    assert times(result, "B") == [1.0, 2.0]
    too_long = simulate(specs((0.0, 100, 10)), SimConfig(max_model_len=64), ONE_SECOND_PER_STEP)
    assert "maximum context length is 64 tokens" in too_long.traces[0].error


def test_idle_engine_jumps_to_the_next_arrival():
    result = simulate(specs((0.0, 1, 1), (10.0, 1, 2)), SimConfig(), ONE_SECOND_PER_STEP)
    assert times(result, "B") == [11.0, 12.0]
    assert result.steps.start.tolist() == [0.0, 10.0, 11.0]


def test_results_report_usage_batch_goodput_and_json():
    result = simulate(specs((0.0, 4, 3), (0.0, 4, 3)), SimConfig(block_size=4, num_blocks=10), ONE_SECOND_PER_STEP)
    assert result.peak_kv_usage == pytest.approx(4 / 10)
    assert result.mean_batch_size == 2.0
    good = result.goodput(ttft_slo=1.0, tpot_slo=1.0)
    assert good.good == 2 and good.rate == pytest.approx(2 / 3)
    data = json.loads(result.to_json(ttft_slo=1.0))
    assert data["ttft"]["p50_s"] == 1.0 and data["goodput"]["good"] == 2
    assert data.items() >= result.summary().to_dict().items(), "the keys of course bench --json, and more"
    assert "preemptions 0" in result.table()


def test_too_long_requests_get_one_message_wherever_they_are_rejected():
    work = specs(
        (0.0, 100, 10), (0.0, 30, 10), (0.0, 2, 2)
    )  # A needs 28 blocks of 4; B fits them, not the 32-token context
    config = SimConfig(block_size=4, num_blocks=12, max_model_len=32)
    fast = simulate(work, config, ONE_SECOND_PER_STEP).traces
    expected = [
        "rejected: prompt + output (110 tokens) need 28 KV blocks of 4 tokens, more than the cache has (12); "
        "give the cache more blocks or cap the output",
        "rejected: 'max_tokens' or 'max_completion_tokens' is too large: 10. This model's maximum context length "
        "is 32 tokens and your request has 30 input tokens (10 > 32 - 30).",
        None,
    ]
    assert [t.error for t in fast] == expected
    assert [t.error for t in reference(work, config, ONE_SECOND_PER_STEP)[0]] == expected
    static = SimConfig(scheduler="static", block_size=4, num_blocks=12, max_model_len=32)
    assert [t.error for t in reference(work, static, ONE_SECOND_PER_STEP)[0]] == expected
    assert [t.error for t in simulate(work, static, ONE_SECOND_PER_STEP).traces] == expected
    assert all(t.finish_reason is None and not t.chunk_times for t in fast[:2])
    # the server's rule and wording are vLLM's: a prompt that fills the context names the prompt
    assert limits.context_length_error(32, 1, 32)[0] == "prompt"
    assert limits.context_length_error(31, 1, 32) is None
    assert limits.context_length_error(31, 2, 32, "max_completion_tokens")[0] == "max_completion_tokens"


# --- the block manager ------------------------------------------------------------------------------


def test_block_manager_allocates_appends_and_frees():
    blocks = BlockManager(num_blocks=4, block_size=4)
    assert blocks.allocate("a", 5)  # 2 blocks
    assert blocks.num_free_blocks == 2 and blocks.utilisation() == 0.5
    assert blocks.append("a", 3) and len(blocks.block_table("a")) == 2  # 8 tokens still fit in 2 blocks
    assert blocks.append("a", 1) and len(blocks.block_table("a")) == 3  # the 9th takes a block
    assert not blocks.allocate("b", 8)  # needs 2, only 1 free: nothing changes
    assert "b" not in blocks and blocks.num_free_blocks == 1
    blocks.free("a")
    assert blocks.num_free_blocks == 4
    blocks.check()
    with pytest.raises(KeyError, match="freed twice"):
        blocks.free("a")
    with pytest.raises(ValueError, match="positive"):
        BlockManager(0, 16)


def test_prefix_cache_lru_evicts_the_oldest_and_the_tail_of_a_chain_first():
    blocks = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    old = prompt_block_hashes("x", 4, 2, [("old", 4)])
    new = prompt_block_hashes("y", 4, 2, [("new", 4)])
    for rid, hashes in (("x", old), ("y", new)):
        assert blocks.allocate(rid, 4)
        blocks.cache_full_blocks(rid, hashes, 4)
        blocks.free(rid)
    assert blocks.num_cached_blocks == 4 and blocks.num_free_blocks == 4
    assert len(blocks.lookup(old)) == 2 and len(blocks.lookup(new)) == 2
    assert blocks.allocate("z", 2)  # takes the LRU block: the tail of the older chain
    assert len(blocks.lookup(old)) == 1 and len(blocks.lookup(new)) == 2
    hit = blocks.lookup(new)
    assert blocks.allocate("w", 6, hit)  # a hit is touched, and 1 new block is taken
    assert blocks.num_free_blocks == 0
    blocks.check()


def test_an_evictable_hit_counts_against_the_free_blocks():
    blocks = BlockManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    hashes = prompt_block_hashes("x", 2, 2, [("p", 2)])
    blocks.allocate("x", 2)
    blocks.cache_full_blocks("x", hashes, 2)
    blocks.free("x")
    hit = blocks.lookup(hashes)
    assert len(hit) == 1
    assert not blocks.allocate("y", 6, hit)  # 2 new + 1 evictable hit > 2 free
    assert blocks.allocate("y", 4, hit)


def test_block_hashes_chain_the_prefix():
    a = prompt_block_hashes("a", 12, 4, [("sys", 8), ("qa", 4)])
    b = prompt_block_hashes("b", 12, 4, [("sys", 8), ("qb", 4)])
    assert a[:2] == b[:2] and a[2] != b[2]
    shifted = prompt_block_hashes("c", 13, 4, [("ts", 1), ("sys", 8), ("qa", 4)])
    assert not set(shifted) & set(a)  # one token in front changes every block
    assert len(prompt_block_hashes("d", 7, 4)) == 1  # only full blocks are hashed
    assert prompt_block_hashes("d", 8, 4) != prompt_block_hashes("e", 8, 4)  # no segments: unique


# --- cost models ----------------------------------------------------------------------------------------


def toy_roofline(**kwargs) -> RooflineCost:
    geometry = ModelGeometry("toy", 1, 1, 1, 1, 1, num_params=1000)  # KV: 2 x 1 x 1 x 1 x 2 B = 4 B/token
    spec = HardwareSpec("toy", memory_bytes=1e9, bandwidth=1e3, flops=1e4, source="test")
    return RooflineCost(geometry, spec, flops_efficiency=1.0, bandwidth_efficiency=1.0, **kwargs)


def test_roofline_cost_takes_the_slower_roof():
    cost = toy_roofline(attention_flops=False)
    # decode of 10 tokens reading 100 cached ones: 20,000 FLOPs = 2 s; 2000 + 4 x 100 bytes = 2.4 s
    assert cost.step_seconds(0, 10, 100) == pytest.approx(2.4)
    # prefill of 100 tokens: 200,000 FLOPs = 20 s beats 2000 bytes of weights = 2 s
    assert cost.step_seconds(100, 0, 0) == pytest.approx(20.0)
    with_attention = toy_roofline(attention_flops=True)
    assert with_attention.step_seconds(100, 0, 0, attention_pairs=5050) == pytest.approx(20.0 + 4 * 5050 / 1e4)
    assert toy_roofline(step_overhead=0.5).step_seconds(0, 10, 100) == pytest.approx(2.9)


def test_roofline_defaults_for_a_real_model_are_memory_bound_for_decode():
    cost = RooflineCost(LLAMA3_8B, gpu("H100-SXM"))
    decode = cost.step_seconds(0, 1, 1000)
    weights = LLAMA3_8B.num_params * 2 / (gpu("H100-SXM").bandwidth * 0.77)
    assert decode == pytest.approx(weights, rel=0.02)
    assert cost.step_seconds(0, 64, 64 * 1000) < 2 * decode  # batching decode is nearly free at short context
    with pytest.raises(ValueError, match="num_params"):
        RooflineCost(ModelGeometry("no params", 1, 1, 1, 1, 1), gpu("T4"))


def test_linear_fit_recovers_known_coefficients_and_stays_non_negative():
    truth = LinearCost(a=2e-3, b=5e-5, c=4e-4, d=2e-7)
    rng = np.random.default_rng(0)
    loads = [(int(rng.integers(0, 2048)), int(rng.integers(0, 64))) for _ in range(40)]
    samples = [StepSample(p, d, d * 1000, truth.step_seconds(p, d, d * 1000)) for p, d in loads[:20]]
    samples += [StepSample(0, d, d * 4000, truth.step_seconds(0, d, d * 4000)) for _, d in loads[20:]]
    fitted = LinearCost.fit(samples).step
    assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-6)  # exact data: exact fit
    noisy = [
        StepSample(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read, s.seconds * rng.normal(1, 0.02))
        for s in samples
    ]
    errors = LinearCost.fit(noisy).predict(samples) / np.array([s.seconds for s in samples]) - 1
    assert np.max(np.abs(errors)) < 0.05  # 2 % noise: predictions within 5 %
    # decode-only data that gets faster with batch would want c < 0: the fit clamps it at 0
    clamped = LinearCost.fit([StepSample(0, b, 0, 1.0 - 0.001 * b) for b in (1, 2, 4, 8)])
    assert min(clamped.step.coefficients) >= 0
    with pytest.raises(ValueError, match="at least 2"):
        LinearCost.fit(samples[:1])


def test_samples_from_measured_timings():
    from course.measure import Timing

    got = samples_from_timings([Timing(128, 0.01, 0.009, 0.011)], [Timing(8, 0.002, 0.002, 0.002)], decode_context=256)
    assert got == [StepSample(128, 0, 0, 0.01), StepSample(0, 8, 8 * 256, 0.002)]


def test_kv_blocks_from_a_memory_budget():
    # Llama-3-8B in bf16: 128 KiB per token, 2 MiB per 16-token block
    assert kv_blocks(10 * 2**30, LLAMA3_8B) == 5120
    with pytest.raises(ValueError, match="no whole block"):
        kv_blocks(1000, LLAMA3_8B)


# --- goodput (course.metrics) ------------------------------------------------------------------------


def test_goodput_counts_requests_meeting_every_slo():
    from course.trace import RequestTrace

    traces = [
        RequestTrace("fast", 0.0, [0.1, 0.2, 0.3], [1, 1, 1], output_tokens=3),  # TTFT 0.1, TPOT 0.1
        RequestTrace("slow start", 0.0, [0.5, 0.6], [1, 1], output_tokens=2),  # TTFT 0.5
        RequestTrace("one token", 0.0, [0.2], [1], output_tokens=1),  # TPOT counts as 0
        RequestTrace("failed", 0.0, error="HTTP 500"),
    ]
    g = metrics.goodput(traces, ttft_slo=0.2, tpot_slo=0.1)
    assert g.good == 2 and g.total == 4 and g.attainment == 0.5
    assert g.rate == pytest.approx(2 / 0.6)
    assert metrics.goodput(traces, e2e_slo=1.0, duration=10.0).rate == pytest.approx(0.3)
    with pytest.raises(ValueError, match="at least one SLO"):
        metrics.goodput(traces)


# --- workload helpers, replay, CLI ----------------------------------------------------------------------


def test_output_cap_and_segment_validation():
    capped = cap_output(specs((0.0, 3, 10), (0.0, 3, 2)), 4)
    assert [r.output_tokens for r in capped] == [4, 2]
    with pytest.raises(ValueError, match="add up"):
        RequestSpec("x", 0.0, 10, 1, (("a", 3),))


def test_cli_prints_the_table_and_json(capsys):
    args = ["simulate", "--requests", "40", "--rate", "20", "--num-blocks", "2000", "--slo-ttft-ms", "200"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "TTFT" in out and "goodput" in out and "preemptions" in out
    assert main([*args, "--json", "--scheduler", "static"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["completed"] == 40 and data["config"]["scheduler"] == "static"


def test_cli_config_file_flags_win_and_traces_replay(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        'scheduler = "prefill-first"\nnum_blocks = 3000\n'
        "[workload]\nrequests = 30\nrate = 5\noutput_tokens = 50\n"
        '[cost]\nkind = "linear"\nlinear = [0.01, 1e-5, 1e-4, 1e-8]\n'
    )
    saved = tmp_path / "sim.json"
    assert main(["simulate", "--config", str(config), "--json", "--save-traces", str(saved)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["scheduler"] == "prefill-first" and data["completed"] == 30
    assert main(["simulate", "--config", str(config), "--scheduler", "continuous", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["scheduler"] == "continuous"
    traces = load_traces(saved)
    assert len(traces) == 30 and all(len(t.chunk_times) == 50 for t in traces)
    # replaying the saved run gives the simulator the same arrivals and token counts
    replay = workload.from_traces(traces)
    assert [r.arrival_time for r in replay] == pytest.approx([t.send_time - traces[0].send_time for t in traces])
    assert main(["simulate", "--trace", str(saved), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 30


def test_cli_linear_cost_takes_the_prefills_attention_term_and_the_matrix_step(capsys):
    base = ["simulate", "--requests", "20", "--rate", "0.5", "--prompt-tokens", "512", "--output-tokens", "4",
            "--num-blocks", "2000", "--cost", "linear", "--json"]  # fmt: skip
    ttft = {}
    for name, values in (("line", "0.002,5e-5,3e-4,2e-8"), ("curve", "0.002,5e-5,3e-4,2e-8,2e-7")):
        assert main([*base, "--linear", values]) == 0
        ttft[name] = json.loads(capsys.readouterr().out)["ttft"]["p50_s"]
    # a lone 512-token prompt attends to 512 x 513 / 2 pairs: 26 ms more at 0.2 us per pair
    assert ttft["curve"] - ttft["line"] == pytest.approx(2e-7 * 512 * 513 / 2, rel=0.05)
    # G: a prefill is a step of many token rows, so it pays G too
    assert main([*base, "--linear", "0.002,5e-5,3e-4,2e-8,0,1e-3"]) == 0
    matrix = json.loads(capsys.readouterr().out)["ttft"]["p50_s"]
    assert matrix - ttft["line"] == pytest.approx(1e-3, rel=0.05)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-tokens", "gaussian:3"], "use N, uniform"),
        (["--cost", "linear"], "needs --linear"),
        (["--cost", "linear", "--linear", "0.01,1e-5,1e-4"], "four to six numbers"),
        (["--cost", "linear", "--linear", "0.01,1e-5,fast,1e-8"], "takes numbers in seconds"),
        (["--model", "gpt-9"], "unknown model"),
        (["--scheduler", "continuous", "--num-blocks", "0"], "positive integer"),
    ],
)
def test_cli_bad_input_names_the_problem(args, message, capsys):
    assert main(["simulate", "--requests", "5", *args]) == 2
    assert message in capsys.readouterr().err


def test_plots_draw_every_kind_of_run():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course.sim import plots

    work = specs((0.0, 3, 4), (0.0, 3, 4), (0.5, 2, 3))
    tight = simulate(work, SimConfig(block_size=2, num_blocks=4), ONE_SECOND_PER_STEP)
    static = simulate(work, SimConfig(scheduler="static"), ONE_SECOND_PER_STEP)
    assert tight.preemptions > 0  # the Gantt chart draws a preemption too
    for ax in (
        plots.gantt(tight),
        plots.kv_usage({"tight": tight, "static": static}),
        plots.latency_cdfs({"tight": tight, "static": static}, "itl", logx=True),
        plots.step_load(tight, start=0.0, end=4.0),
        plots.step_times(tight, start=0.0, end=4.0),
    ):
        assert ax.get_title(), "every plot has a title"
    plt.close("all")
    with pytest.raises(ValueError, match="metric"):
        plots.latency_cdfs(tight, "speed")


# --- vLLM 0.32's V1 admission rules (course/sim/rules.py), in the fast engine and the readable steps ------


def both(work, config):
    """Token times per request from the fast engine and from the readable reference (they must agree)."""
    fast = simulate(work, config, ONE_SECOND_PER_STEP)
    readable = reference(work, config, ONE_SECOND_PER_STEP)[0]
    got = {t.request_id: t.chunk_times for t in fast.traces}
    assert got == {t.request_id: t.chunk_times for t in readable}
    return got, fast


def test_a_waiting_request_is_admitted_only_when_its_whole_prompt_fits():
    # 12 blocks of 1 token, budget 4: A runs (4 prompt + 6 output tokens); in step 2 B's first 3-token chunk
    # fits the 7 free blocks but its 8-token prompt does not: vLLM 0.32 reserves the whole prompt
    # (scheduler_reserve_full_isl) and B waits; 0.11's first-chunk rule admits B, and A then preempts it
    work = specs((0.0, 4, 6), (0.0, 8, 2))
    base = dict(block_size=1, num_blocks=12, max_num_batched_tokens=4, max_num_seqs=4)
    whole, whole_run = both(work, SimConfig(**base))
    first_chunk, chunk_run = both(work, SimConfig(**base, reserve_full_isl=False))
    assert whole["A"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] and whole["B"][0] > 6.0
    assert whole_run.preemptions == 0, "whole-prompt admission never over-admits into a preemption here"
    assert chunk_run.preemptions > 0, "vLLM 0.11's first-chunk rule admits B and must preempt"


def test_the_v1_watermark_holds_blocks_back_only_while_others_run():
    # 10 blocks of 1 token, 2 kept free while A runs: B (5 tokens) waits for A; alone it is admitted at once
    work = specs((0.0, 4, 3), (0.0, 5, 1))
    config = SimConfig(block_size=1, num_blocks=10, watermark=0.2, max_num_batched_tokens=64)
    held, _ = both(work, config)
    free, _ = both(work, SimConfig(block_size=1, num_blocks=10, max_num_batched_tokens=64))
    assert free["B"] == [1.0] and held["B"][0] > 1.0
    alone, _ = both(specs((0.0, 9, 1)), config)  # 9 of 10 blocks: no watermark with nobody running
    assert alone["A"] == [1.0]


def test_the_long_prefill_cap_spares_a_lone_request_and_has_an_adaptive_floor():
    lone, _ = both(specs((0.0, 40, 1)), SimConfig(long_prefill_token_threshold=8, max_num_batched_tokens=64))
    assert lone["A"] == [1.0], "a lone request takes the whole budget (nobody to starve)"
    work = specs((0.0, 40, 1), (0.0, 40, 1))
    capped, _ = both(work, SimConfig(long_prefill_token_threshold=8, max_num_batched_tokens=64))
    assert capped["A"] == [5.0], "two requests: 8 tokens each per step"
    adaptive, _ = both(
        work,
        SimConfig(
            long_prefill_token_threshold=8, long_prefill_token_threshold_adaptive=True, max_num_batched_tokens=64
        ),
    )
    assert adaptive["A"] == [2.0], "the floor is 64 // 2 = 32 tokens a step"


def test_load_shedding_refuses_arrivals_beyond_max_num_queued_reqs():
    work = specs(*[(0.0, 4, 2)] * 5)
    got, result = both(work, SimConfig(max_num_queued_reqs=3))
    shed = [t.request_id for t in result.traces if t.error]
    assert shed == ["D", "E"] and all(t.error == rules.QUEUE_FULL for t in result.traces if t.error)
    assert len(got["A"]) == 2 and "HTTP 503" in rules.QUEUE_FULL


def test_async_scheduling_holds_a_finished_requests_slot_for_one_more_step(capsys):
    # max_num_seqs 2: A finishes in step 2; C takes its slot in step 3, or, with async scheduling (vLLM
    # 0.32's GPU default), in step 4, because A is still running when step 3 is scheduled.
    work = specs((0.0, 4, 2), (0.0, 4, 5), (0.0, 4, 1))
    sync = simulate(work, SimConfig(max_num_seqs=2), ONE_SECOND_PER_STEP)
    overlapped = simulate(work, SimConfig(max_num_seqs=2, async_scheduling=True), ONE_SECOND_PER_STEP)
    assert times(sync, "C") == [3.0] and times(overlapped, "C") == [4.0]
    assert times(sync, "B") == times(overlapped, "B") == [1.0, 2.0, 3.0, 4.0, 5.0]  # decodes are not delayed
    assert overlapped.steps.num_seqs.tolist() == [2, 2, 1, 2, 1]
    expected, _ = reference(work, SimConfig(max_num_seqs=2, async_scheduling=True), ONE_SECOND_PER_STEP)
    assert [t.chunk_times for t in expected] == [t.chunk_times for t in overlapped.traces]
    # vllm serve's settings turn it on; course simulate --no-async-scheduling turns it off
    assert SimConfig.vllm_defaults("H100-SXM").async_scheduling
    assert "async scheduling" in SimConfig.vllm_defaults("H100-SXM").describe()
    args = ["simulate", "--requests", "20", "--rate", "20", "--num-blocks", "2000", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["config"]["async_scheduling"] is True
    assert main([*args, "--no-async-scheduling"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["async_scheduling"] is False


def test_held_blocks_count_as_used_and_come_back_by_name():
    blocks = BlockManager(6, 4)
    assert blocks.allocate("a", 5) and blocks.hold(3) and blocks.num_free_blocks == 1
    assert not blocks.hold(2) and blocks.num_free_blocks == 1, "a hold that does not fit changes nothing"
    blocks.release(2)
    assert blocks.reserve("a", 16) and len(blocks.block_table("a")) == 4 and blocks.num_free_blocks == 1
    blocks.check()
    with pytest.raises(ValueError, match="held"):
        blocks.release(2)
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(6, 4, enable_prefix_caching=True).hold(1)


# --- where a learner's scheduler first departs from the simulator (module 3, Exercise 3.4's messages) ---------


def _harness_run(step_function, requests, num_blocks: int = 4096, block_size: int = 16):
    from course.sim import harness

    return harness.run(
        requests, step_function, BlockManager(num_blocks, block_size), LinearCost(0.004, 2e-5, 3e-4, 1e-7)
    )


def test_first_difference_is_none_for_the_reference_step_and_names_the_step_a_wrong_one_changes():
    import functools

    from course.sim import harness

    cost = LinearCost(0.004, 2e-5, 3e-4, 1e-7)
    requests = workload.all_at_once(6, 40, 5)
    expected = simulate(requests, SimConfig(max_num_batched_tokens=256, max_num_seqs=2, num_blocks=4096), cost)
    right = _harness_run(functools.partial(steps.continuous_step, token_budget=256, max_num_seqs=2), requests)
    assert harness.first_difference(right, expected) is None
    uncapped = _harness_run(functools.partial(steps.continuous_step, token_budget=256, max_num_seqs=6), requests)
    message = harness.first_difference(uncapped, expected)
    assert message is not None and message.startswith("step 0 ")
    assert "requests in the batch 6, expected 2" in message  # what came, and what was expected


def test_first_token_difference_names_the_earliest_token_that_differs():
    from course.sim import harness
    from course.trace import RequestTrace

    def trace(rid: str, times: list[float]) -> RequestTrace:
        return RequestTrace(rid, 0.0, chunk_times=times, chunk_tokens=[1] * len(times), prompt_tokens=4,
                            output_tokens=len(times))  # fmt: skip

    want = [trace("a", [1.0, 2.0, 3.0]), trace("b", [1.0, 4.0])]
    assert harness.first_token_difference([trace("a", [1.0, 2.0, 3.0]), trace("b", [1.0, 4.0])], want) is None
    message = harness.first_token_difference([trace("a", [1.0, 2.0, 3.5]), trace("b", [1.0, 2.5])], want)
    assert message.startswith("request b's token 2") and "t = 2.500000 s, expected t = 4.000000 s" in message
    missing = harness.first_token_difference([trace("a", [1.0, 2.0]), trace("b", [1.0, 4.0])], want)
    assert "request a's token 3" in missing and "no token" in missing
