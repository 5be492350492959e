"""course.sim.cost's serving terms (issues 28 and 29) and course.sim.calibration: the per-prompt front-end cost,
the front end's own timing (course.sim.frontend), the seeded step-time spread, and the calibration samples they are
fitted from."""

import sys
from pathlib import Path

import numpy as np
import pytest

from course.capacity import decode_sample, prefill_sample, server_sim_config
from course.metrics import summarize
from course.sim import FrontEnd, LinearCost, ServerCost, SimConfig, StepSample, simulate
from course.sim.calibration import SPREAD_PROBABILITIES, fit, fit_spread
from course.sim.cost import prefill_pairs, prompts_started, spread_draw
from course.trace import RequestTrace
from course.workload import RequestSpec, Workload, fixed, poisson

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import sim_fidelity  # noqa: E402  (benchmarks/ is not a package)

# A server like module 2's on this CPU: 2 ms per step, 40 us per prompt token, 300 us per decode token,
# and 6 ms of front-end work per request (parsing, tokenizing, the hand-off, the first chunk's way out).
TRUTH = LinearCost(a=2e-3, b=4e-5, c=3e-4, d=2e-8, e=6e-3)
PROMPTS = (16, 64, 128, 256, 512)
WAVES = [(batch, context) for context in (32, 256) for batch in (1, 4, 16)]
STEP_10MS = LinearCost(a=0.010, b=0, c=0, d=0)  # the steps of the front-end tests below


def calibration(truth: LinearCost, noise: float = 0.0, seed: int = 0, latency: float = 0.0) -> list[StepSample]:
    """What the microbenchmarks would measure on a server whose steps cost ``truth`` (and whose front end, in
    another process, takes ``latency`` s per request)."""
    rng = np.random.default_rng(seed)
    samples = [StepSample(n, 0, 0, truth.expected_seconds(n, 0, 0) + latency) for n in PROMPTS]
    samples += [StepSample(0, b, b * (c + 48), truth.expected_seconds(0, b, b * (c + 48))) for b, c in WAVES]
    return [
        StepSample(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read, s.seconds * rng.normal(1, noise))
        for s in samples
    ]


def test_prompts_started_reads_the_request_count_off_the_attention_pairs():
    assert prompts_started(0, 8, 800, 808) == 0  # decodes only
    assert prompts_started(128, 0, 0, 128 * 129 / 2) == pytest.approx(1)
    assert prompts_started(3 * 100, 0, 0, 3 * 100 * 101 / 2) == pytest.approx(3)  # three prompts of one length
    # two prompts beside 8 decodes of 100 cached tokens each: the decodes' pairs are taken out
    assert prompts_started(2 * 64, 8, 800, 808 + 2 * 64 * 65 / 2) == pytest.approx(2)
    uneven = prompts_started(10 + 100, 0, 0, 10 * 11 / 2 + 100 * 101 / 2)  # (sum n)^2 / sum n^2
    assert uneven == pytest.approx(110**2 / (10**2 + 100**2))
    assert prompts_started(64, 0, 0) == 1  # no pairs given: one prompt
    assert prompts_started(64, 0, 512, 64 * 512 + 64 * 65 / 2) == 1  # a chunk after cached tokens


def test_the_per_prompt_cost_lands_on_prefill_steps_only():
    assert TRUTH.step_seconds(0, 4, 400, 404) == pytest.approx(2e-3 + 4 * 3e-4 + 400 * 2e-8)
    assert TRUTH.step_seconds(128, 0, 0, 128 * 129 / 2) == pytest.approx(2e-3 + 128 * 4e-5 + 6e-3)
    two = TRUTH.step_seconds(256, 0, 0, 2 * 128 * 129 / 2)
    assert two == pytest.approx(2e-3 + 256 * 4e-5 + 2 * 6e-3)  # each prompt pays its own front end
    # a lone request in the course server's loop: its first token ends the prefill step that started it
    alone = simulate(Workload([RequestSpec("r", 0.0, 128, 4)]), server_sim_config(16, 512), TRUTH)
    assert alone.traces[0].chunk_times[0] == pytest.approx(2e-3 + 128 * 4e-5 + 6e-3)


def test_the_four_term_interface_is_unchanged():
    plain = LinearCost(2e-3, 4e-5, 3e-4, 2e-8)
    assert plain.coefficients == (2e-3, 4e-5, 3e-4, 2e-8)
    assert plain.step_seconds(128, 4, 400) == pytest.approx(2e-3 + 128 * 4e-5 + 4 * 3e-4 + 400 * 2e-8)
    assert "prompt started" not in plain.describe() and "spread" not in plain.describe()


def test_fit_recovers_the_front_end_and_the_plain_line_cannot():
    samples = calibration(TRUTH)
    fitted = fit(samples)
    line = fitted.step
    truth = (TRUTH.a, TRUTH.b, TRUTH.c, TRUTH.d, TRUTH.e)
    assert (line.a, line.b, line.c, line.d, line.e) == pytest.approx(truth, rel=1e-6)
    assert fitted.front_end == FrontEnd()
    line = fit(samples, front_end="none", shape=False).step
    assert line.e == 0
    # The line spreads the front end over every step's intercept: decodes too slow, prefills too fast.
    decode_error = line.expected_seconds(0, 1, 80) / TRUTH.expected_seconds(0, 1, 80) - 1
    prefill_error = line.expected_seconds(16, 0, 0) / TRUTH.expected_seconds(16, 0, 0) - 1
    assert decode_error > 0.05 and prefill_error < -0.3, (decode_error, prefill_error)
    noisy = fit(calibration(TRUTH, noise=0.03, seed=1)).step
    assert noisy.e == pytest.approx(TRUTH.e, rel=0.3)


# The course's server on this CPU prefills 16, 64, 128, 256 and 512 tokens in about 5, 9, 14, 27 and 62 ms
# (benchmarks/RESULTS.md): longer than one slope, as the prompt's attention grows with its square.
CURVED = LinearCost(a=2e-3, b=6e-5, c=3e-4, d=2e-8, e=3e-3, f=1.8e-7)


def test_the_prefills_attention_term_charges_each_prompts_pairs():
    pairs = 128 * 129 / 2
    assert CURVED.expected_seconds(128, 0, 0) == pytest.approx(2e-3 + 128 * 6e-5 + 3e-3 + 1.8e-7 * pairs)
    # two prompts of 128 tokens in one pass: two prompts' pairs (and fronts), not one 256-token prompt's
    two = CURVED.expected_seconds(256, 0, 0, 2 * pairs)
    assert two == pytest.approx(2e-3 + 256 * 6e-5 + 2 * 3e-3 + 1.8e-7 * 2 * pairs)
    # a lone 256-token prompt attends to about twice the pairs of two 128-token prompts
    assert prefill_pairs(256, 0, 0) == 256 * 257 / 2 and prefill_pairs(256, 0, 0, 2 * pairs) == 2 * pairs
    # a 64-token chunk after 512 cached tokens: d reads the cache once, f the pairs beyond that read
    chunk_pairs = 64 * 512 + 64 * 65 / 2
    chunk = CURVED.expected_seconds(64, 0, 512, chunk_pairs)
    assert chunk == pytest.approx(2e-3 + 64 * 6e-5 + 512 * 2e-8 + 3e-3 + 1.8e-7 * (chunk_pairs - 512))
    # decodes attend one pair per cached token and one to themselves: no prefill pairs
    assert CURVED.expected_seconds(0, 4, 400, 404) == pytest.approx(2e-3 + 4 * 3e-4 + 400 * 2e-8)
    assert prefill_pairs(0, 4, 400, 404) == 0 and prefill_pairs(128, 0, 0) == pairs
    assert "180 ns/prefill attention pair" in CURVED.describe()
    with pytest.raises(ValueError, match="f must be >= 0"):
        LinearCost(1e-3, 0, 0, 0, f=-1e-9)


def test_fit_recovers_the_prefills_attention_term_where_one_slope_misses_the_middle():
    samples = calibration(CURVED)
    line = fit(samples).step
    assert (line.a, line.b, line.c, line.d, line.e, line.f) == pytest.approx(
        (CURVED.a, CURVED.b, CURVED.c, CURVED.d, CURVED.e, CURVED.f), rel=1e-6
    )
    # One slope through 16 to 512 tokens (the fit before the term, or shape=False) misses a 128-token
    # prompt long: the long prompts' pairs steepen the slope, the short ones' intercept lifts the line.
    line = fit(samples, shape=False).step
    assert line.f == 0
    miss = line.expected_seconds(128, 0, 0) / CURVED.expected_seconds(128, 0, 0) - 1
    assert miss > 0.04, miss
    # With the term, a noisy calibration still lands near 128 tokens
    noisy = fit(calibration(CURVED, noise=0.03, seed=1)).step
    assert noisy.expected_seconds(128, 0, 0) == pytest.approx(CURVED.expected_seconds(128, 0, 0), rel=0.05)
    # Three prompt lengths: the prefill's three terms go through any three points, noise and all; no f
    three = [s for s in samples if s.prefill_tokens in (0, 16, 128, 512)]
    assert fit(three).step.f == 0
    # A straight calibration (the server without the term) fits none
    assert fit(calibration(TRUTH)).step.f == 0


# The course's server on this CPU: a lone decode row goes through a matrix-vector product, two or more rows
# through oneDNN's packed-weight kernel, 0.9 ms slower for the tiny model's matrices (benchmarks/RESULTS.md).
MATRIX = LinearCost(a=1.8e-3, b=6e-5, c=1.3e-4, d=4e-7, e=1e-3, g=0.85e-3)


def test_a_step_of_two_or_more_token_rows_pays_the_matrix_kernels_cost():
    assert MATRIX.expected_seconds(0, 1, 80, 81) == pytest.approx(1.8e-3 + 1.3e-4 + 80 * 4e-7)
    assert MATRIX.expected_seconds(0, 2, 160, 162) == pytest.approx(1.8e-3 + 0.85e-3 + 2 * 1.3e-4 + 160 * 4e-7)
    assert MATRIX.expected_seconds(128, 0, 0) == pytest.approx(1.8e-3 + 0.85e-3 + 128 * 6e-5 + 1e-3)
    # one token of prefill (a preempted request recomputing one token) is one row too
    assert MATRIX.expected_seconds(1, 0, 40, 41) == pytest.approx(1.8e-3 + 6e-5 + 40 * 4e-7 + 1e-3)
    assert "0.85 ms/step of 2+ token rows" in MATRIX.describe()
    with pytest.raises(ValueError, match="g must be >= 0"):
        LinearCost(1e-3, 0, 0, 0, g=-1e-3)


def test_fit_recovers_the_matrix_kernels_step_where_the_line_misses_both_sides_of_it():
    samples = calibration(MATRIX)
    line = fit(samples).step
    assert (line.a, line.c, line.d, line.e, line.g) == pytest.approx((MATRIX.a, MATRIX.c, MATRIX.d, MATRIX.e, MATRIX.g))
    # One line through batches 1, 4 and 16 puts batch 1 long and batch 2 short: the run's gaps at low load
    # are mostly steps of one to three rows, on both sides of the line.
    line = fit(samples, shape=False).step
    one = line.expected_seconds(0, 1, 160) / MATRIX.expected_seconds(0, 1, 160) - 1
    two = line.expected_seconds(0, 2, 320) / MATRIX.expected_seconds(0, 2, 320) - 1
    assert one > 0.05 and two < -0.15, (one, two)
    # Without decode steps of one row the data cannot tell g from the intercept: none is fitted
    batched = [s for s in samples if s.decode_tokens != 1]
    assert fit(batched).step.g == 0


def test_fit_puts_a_front_end_in_another_process_off_the_steps():
    vllm_like = LinearCost(a=3e-3, b=3e-5, c=2e-4, d=1e-8)
    samples = calibration(vllm_like, latency=0.03)
    fitted = fit(samples, front_end="latency")
    assert fitted.front_end.latency == pytest.approx(0.03, rel=1e-6) and fitted.step.e == 0
    assert fitted.step.a == pytest.approx(3e-3, rel=1e-6)
    assert fitted.predict(samples) == pytest.approx([s.seconds for s in samples], rel=1e-6)
    # the latency delays every chunk alike: TTFT and E2E move, the gaps do not
    run = simulate(poisson(5, 40, fixed(128), fixed(16), seed=3), SimConfig(max_num_seqs=16, num_blocks=10**5), fitted)
    seen, raw = summarize(fitted.delivered(run.traces)), summarize(run.traces)
    assert seen.ttft["mean"] == pytest.approx(raw.ttft["mean"] + 0.03)
    assert seen.itl["p50"] == pytest.approx(raw.itl["p50"]) and seen.itl["p95"] == pytest.approx(raw.itl["p95"])
    assert FrontEnd().delivered(run.traces) == run.traces


def test_fit_splits_the_front_end_into_the_work_before_the_engine_and_the_steps_share():
    samples = calibration(TRUTH)
    whole = fit(samples)
    split = fit(samples, before_engine_share=0.6)
    assert split.front_end.before_engine == pytest.approx(0.6 * TRUTH.e)
    assert split.step.e == pytest.approx(0.4 * TRUTH.e)
    # a lone request's TTFT is the same either way: the microbenchmarks cannot tell the two apart
    assert split.predict(samples) == pytest.approx(whole.predict(samples))
    assert "ms of front-end work before the engine sees a request" in split.describe()
    with pytest.raises(ValueError, match="fraction from 0 to 1"):
        fit(samples, before_engine_share=1.5)
    with pytest.raises(ValueError, match="no.* to split|none to split"):
        fit(samples, front_end="latency", before_engine_share=0.5)
    with pytest.raises(ValueError, match="before_engine must be >= 0"):
        FrontEnd(before_engine=-1e-3)


def test_a_request_reaches_the_scheduler_after_the_front_ends_work_which_shares_the_core_with_a_step():
    # Steps of 10 ms; 4 ms of front-end work per request. The first request arrives at an idle engine and
    # is prefilled at 4 ms (a lone request's TTFT: 4 + 10 ms).
    cost = ServerCost(STEP_10MS, FrontEnd(before_engine=0.004))
    config = SimConfig(max_num_seqs=4, num_blocks=100)
    lone = simulate(Workload([RequestSpec("idle", 0.0, 8, 2)]), config, cost).traces[0]
    assert lone.chunk_times == pytest.approx([0.014, 0.024])
    # The second arrives at 7 ms, during that step: the two share the core, so the step loses the 4 ms of
    # work (it ends at 18 ms) and the work takes 8 ms (done at 15 ms): it joins the next step.
    work = Workload([RequestSpec("idle", 0.0, 8, 4), RequestSpec("busy", 0.007, 8, 4)])
    first, second = simulate(work, config, cost).traces
    assert first.chunk_times == pytest.approx([0.018, 0.028, 0.038, 0.048])
    assert second.chunk_times[0] == pytest.approx(0.028)
    # Arriving at 13 ms, 1 ms before the step's end: the step loses 1 ms, the next one the other 3 ms, and
    # the work is done at 13 + 8 = 21 ms, after the next step began (at 15 ms): it waits for the one after.
    late = Workload([RequestSpec("idle", 0.0, 8, 4), RequestSpec("busy", 0.013, 8, 4)])
    first, second = simulate(late, config, cost).traces
    assert first.chunk_times == pytest.approx([0.015, 0.028, 0.038, 0.048])
    assert second.chunk_times[0] == pytest.approx(0.038)
    # without the front end's work the request arriving at 7 ms joins the second step at once
    plain = simulate(work, config, STEP_10MS).traces
    assert plain[0].chunk_times[0] == pytest.approx(0.010) and plain[1].chunk_times[0] == pytest.approx(0.020)


def test_a_request_that_finds_the_server_idle_waits_for_it_to_wake():
    # Steps of 10 ms, 4 ms of front-end work, 2 ms to wake an idle server. The first request finds it idle:
    # 2 + 4 ms before its prefill. The second arrives during that step: no wake-up, the shared-core rule only.
    cost = ServerCost(STEP_10MS, FrontEnd(before_engine=0.004, idle_wake=0.002))
    config = SimConfig(max_num_seqs=4, num_blocks=100)
    work = Workload([RequestSpec("idle", 0.0, 8, 4), RequestSpec("busy", 0.009, 8, 4)])
    first, second = simulate(work, config, cost).traces
    assert first.chunk_times[0] == pytest.approx(0.016 + 0.004)  # its step also lost the second's 4 ms of work
    assert second.chunk_times[0] == pytest.approx(0.030)  # work done at 9 + 8 = 17 ms: the step after
    # One second later the server idles again: the third request wakes it too.
    later = Workload([*work, RequestSpec("again", 1.0, 8, 2)])
    assert simulate(later, config, cost).traces[2].chunk_times[0] == pytest.approx(1.016)
    # a wake-up alone (no front-end work) passes requests through the front door too, in both engines
    wake_only = ServerCost(STEP_10MS, FrontEnd(idle_wake=0.002))
    from helpers import reference

    for config in (SimConfig(max_num_seqs=4, num_blocks=100), server_sim_config(4, 512)):
        fast = simulate(later, config, wake_only).traces
        assert fast[0].chunk_times[0] == pytest.approx(0.012) and fast[2].chunk_times[0] == pytest.approx(1.012)
        assert [t.chunk_times for t in fast] == [t.chunk_times for t in reference(later, config, wake_only)[0]]
    assert "2 ms to wake an idle server" in cost.describe()
    with pytest.raises(ValueError, match="idle_wake must be >= 0"):
        FrontEnd(idle_wake=-1e-3)


def test_the_front_ends_work_beside_a_step_takes_the_measured_slowdown_in_both_engines():
    # Steps of 10 ms, 4 ms of front-end work. The second request arrives at 7 ms, during the first one's prefill.
    # Sharing the core evenly (2x) its work is done at 7 + 8 = 15 ms and it joins the step at 18 ms; at 3x it is
    # done at 7 + 12 = 19 ms, after that step began, and waits for the one after (28 ms). The step loses the
    # 4 ms of work either way: the front end got that much of the core, whatever it took in wall time.
    from helpers import reference

    work = Workload([RequestSpec("idle", 0.0, 8, 4), RequestSpec("busy", 0.007, 8, 4)])
    even = ServerCost(STEP_10MS, FrontEnd(before_engine=0.004))
    slow = ServerCost(STEP_10MS, FrontEnd(before_engine=0.004, slowdown=3.0))
    continuous = SimConfig(max_num_seqs=4, num_blocks=100)
    first, second = simulate(work, continuous, slow).traces
    assert first.chunk_times == pytest.approx([0.018, 0.028, 0.038, 0.048])
    assert second.chunk_times[0] == pytest.approx(0.038)
    assert simulate(work, continuous, even).traces[1].chunk_times[0] == pytest.approx(0.028)
    # the course's server's iterations (a prefill, then a decode step) and the readable reference agree
    for config in (continuous, server_sim_config(4, 512)):
        for cost in (even, slow):
            assert [t.chunk_times for t in simulate(work, config, cost).traces] == [
                t.chunk_times for t in reference(work, config, cost)[0]
            ]
    assert "that work 3x as long beside a step" in slow.describe() and "beside a step" not in even.describe()
    with pytest.raises(ValueError, match="slowdown must be >= 1"):
        FrontEnd(before_engine=1e-3, slowdown=0.5)


def test_the_fidelity_benchmark_measures_the_wake_up_from_the_first_request_after_a_pause(tmp_path):
    # Each prefill microbenchmark: its first request (after the client process started) 2 ms slower than the rest.
    from course.trace import save_traces

    for round_folder in ("before", "after1"):
        folder = tmp_path / round_folder
        folder.mkdir()
        for prompt in sim_fidelity.PREFILL_LENGTHS:
            ttfts = [0.012 + 0.002] + [0.012 + 0.0001 * (i % 3) for i in range(7)]
            traces = [trace(str(i), float(i), [i + t, i + t + 0.002]) for i, t in enumerate(ttfts)]
            save_traces(sim_fidelity.prefill_file(folder, prompt), traces)
    folders = [tmp_path / "before", tmp_path / "after1"]
    assert sim_fidelity.idle_wake(folders) == pytest.approx(0.002 - 0.0001)
    assert sim_fidelity.wake_facts(folders) == {"idle_wake": pytest.approx(0.0019)}
    assert sim_fidelity.wake_facts([tmp_path / "missing"]) == {}  # a folder without prefill traces


def test_linear_cost_fit_is_the_calibrations_fit_and_names_the_front_end_between_the_line_and_the_spread():
    # notebooks and module 5 call LinearCost.fit: the same fit, a step cost with its front end beside it
    samples = calibration(TRUTH) + spread_samples(np.random.default_rng(0))
    fitted = fit(samples, before_engine_share=0.5)
    assert LinearCost.fit(samples, before_engine_share=0.5) == fitted
    text = fitted.describe()
    assert text.startswith(fitted.step.describe_line()) and text.endswith(fitted.step.describe_spread())
    assert text.index("ms/prompt started") < text.index("before the engine sees") < text.index("spread p5")


def test_fit_without_decode_samples_leaves_the_front_end_out():
    prefills = [StepSample(n, 0, 0, 0.008 + 4e-5 * n) for n in PROMPTS]
    line = fit(prefills).step
    assert line.e == 0 and line.a == pytest.approx(0.008) and line.b == pytest.approx(4e-5)


def test_bad_terms_and_options_are_refused():
    with pytest.raises(ValueError, match="e must be >= 0"):
        LinearCost(1e-3, 0, 0, 0, e=-1e-3)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        FrontEnd(latency=float("nan"))
    with pytest.raises(ValueError, match="increasing order"):
        LinearCost(1e-3, 0, 0, 0, spread=(1e-3, -1e-3))
    with pytest.raises(ValueError, match="at least 2"):
        LinearCost(1e-3, 0, 0, 0, spread=(1e-3,))
    with pytest.raises(ValueError, match="prefill_spread needs .* >= -1"):
        LinearCost(1e-3, 0, 0, 0, prefill_spread=(-2.0, 0.0))  # a step cannot be more than 100 % shorter
    with pytest.raises(ValueError, match="front_end must be one of"):
        fit(calibration(TRUTH), front_end="api")


def spread_samples(rng, scales=(1e-3, 1e-3)) -> list[StepSample]:
    """Two decode waves whose single steps scatter like a busy server's: a right-skewed exponential tail."""
    samples = []
    for batch, scale in zip((1, 4), scales):
        steps = rng.exponential(scale, 4000)
        samples.append(StepSample(0, batch, 100 * batch, 0.004, deviations=tuple(steps - steps.mean())))
    return samples


def test_fit_spread_keeps_the_measured_deviations_quantiles_relative_with_mean_zero():
    rng = np.random.default_rng(0)
    samples = spread_samples(rng)
    spread = fit_spread(samples)
    assert len(spread) == len(SPREAD_PROBABILITIES)
    probabilities = np.array(SPREAD_PROBABILITIES)
    mean = np.sum(np.diff(probabilities) * (np.array(spread[1:]) + np.array(spread[:-1])) / 2)
    assert abs(mean) < 1e-12
    # exponential(1 ms) minus its mean on a 4 ms step: p95 = (ln 20 - 1) / 4 = +50 %, p50 = (ln 2 - 1) / 4 = -7.7 %
    assert np.interp(0.95, probabilities, spread) == pytest.approx((np.log(20) - 1) / 4, abs=0.04)
    assert np.interp(0.50, probabilities, spread) == pytest.approx((np.log(2) - 1) / 4, abs=0.025)
    # every sample counts alike: a wave of 4 gaps moves the spread as much as a wave of 4000
    few = [samples[0], StepSample(0, 8, 800, 0.01, deviations=(-4e-3, -4e-3, 4e-3, 4e-3))]
    assert fit_spread(few)[0] < fit_spread(samples[:1])[0] - 0.05
    assert fit_spread([StepSample(0, 1, 10, 0.004)]) == ()  # nothing measured, no spread
    # decode and prefill steps scatter apart: each spread comes from its own samples
    prefill = StepSample(128, 0, 0, 0.02, deviations=(-2e-3, 0.0, 2e-3))
    line = fit([*samples, prefill, StepSample(512, 0, 0, 0.05)]).step
    assert line.spread == pytest.approx(spread) and line.prefill_spread == pytest.approx(fit_spread([prefill]))
    assert line.prefill_spread[-1] == pytest.approx(0.1) and line.spread[-1] > 1.0
    assert fit([*samples, prefill], spread=False).step.spread == ()


def test_the_spread_is_drawn_per_step_without_state_and_reproduces_its_quantiles():
    spread = fit_spread(spread_samples(np.random.default_rng(1)))
    cost = LinearCost(4e-3, 0, 0, 0, spread=spread, seed=7)
    draw = spread_draw(cost)
    drawn = np.array([draw(step, False) for step in range(20000)]) - 1  # relative deviations, one per step
    assert abs(drawn.mean()) < 0.01
    assert np.quantile(drawn, 0.95) == pytest.approx(np.interp(0.95, np.linspace(0, 1, len(spread)), spread), rel=0.05)
    # a pure function of the step's index and the seed: the same draws in any order, whatever ran before
    assert [draw(step, False) for step in reversed(range(100))][::-1] == [draw(step, False) for step in range(100)]
    other = spread_draw(LinearCost(4e-3, 0, 0, 0, spread=spread, seed=8))
    assert [other(step, False) for step in range(100)] != [draw(step, False) for step in range(100)]
    assert cost.step_seconds(0, 8, 1000, 1008) == 4e-3  # the cost itself gives the expected time
    assert spread_draw(LinearCost(4e-3, 0, 0, 0)) is None  # no spread: nothing to draw
    assert spread_draw(TRUTH) is None and spread_draw(object()) is None
    # prefill steps draw from their own spread; a cost with only one kind leaves the other at its mean
    prefill_only = spread_draw(LinearCost(4e-3, 0, 0, 0, prefill_spread=(0.5, 0.5), seed=7))
    assert (prefill_only(3, True), prefill_only(3, False)) == (1.5, 1.0)
    # a huge negative draw cannot make a step take no time
    floor = spread_draw(LinearCost(1e-3, 0, 0, 0, spread=(-1.0, -1.0), seed=0))
    assert floor(0, False) == pytest.approx(0.05)


def test_steps_of_the_same_load_draw_apart():
    """The draw is keyed by the step's index, not its load: lone requests of one prompt size each get their
    own prefill deviation. Keyed by the load (before 2026-12-04), every one of them drew the same one, so
    the seed alone moved a replayed run's TTFT p50 by up to 43 points (benchmarks/RESULTS.md)."""
    spread = tuple(np.linspace(-0.2, 0.2, 41))
    cost = LinearCost(2e-3, 4e-5, 3e-4, 0.0, spread=spread, prefill_spread=spread, seed=0)
    lone = Workload([RequestSpec(str(i), float(i), 128, 4) for i in range(40)], "one at a time")
    traces = simulate(lone, server_sim_config(16, 512), cost).traces
    ttfts = np.array([t.chunk_times[0] - t.send_time for t in traces])
    expected = cost.expected_seconds(128, 0, 0)
    assert len(set(np.round(ttfts, 12))) > 30  # each lone prefill draws its own deviation
    assert ttfts.min() < 0.9 * expected and ttfts.max() > 1.1 * expected
    # the same holds for the k-th decode step of every lone request
    second_gaps = np.array([t.chunk_times[1] - t.chunk_times[0] for t in traces])
    assert len(set(np.round(second_gaps, 12))) > 30


@pytest.mark.parametrize("scheduler", ["prefill-first", "continuous", "static"])
def test_both_engines_draw_the_same_spread(scheduler):
    """The readable reference and the fast engine index their steps alike, so a cost with a spread gives
    them the same token times."""
    from helpers import reference

    spread = fit_spread(spread_samples(np.random.default_rng(3)))
    cost = LinearCost(2e-3, 4e-5, 3e-4, 2e-8, spread=spread, prefill_spread=tuple(np.linspace(-0.1, 0.1, 41)), seed=5)
    load = poisson(8, 60, fixed(96), fixed(24), seed=11)
    if scheduler == "prefill-first":
        config = server_sim_config(8, 512)
    else:
        config = SimConfig(scheduler=scheduler, max_num_seqs=8, num_blocks=4096, max_num_batched_tokens=512)
    fast = simulate(load, config, cost).traces
    readable = reference(load, config, cost)[0]
    assert {t.request_id: t.chunk_times for t in fast} == {t.request_id: t.chunk_times for t in readable}
    assert [t.chunk_times for t in fast] != [t.chunk_times for t in simulate(load, config, TRUTH).traces]


def test_wrapped_costs_forward_their_spread():
    from course.sim.disagg import TransferredPrompts

    spread = tuple(np.linspace(-0.3, 0.3, 41))
    cost = LinearCost(2e-3, 4e-5, 3e-4, 0.0, spread=spread, prefill_spread=(0.5, 0.5), seed=1)
    decode_only = spread_draw(TransferredPrompts(cost))
    assert [decode_only(step, True) for step in range(5)] == [spread_draw(cost)(step, False) for step in range(5)]
    assert spread_draw(TransferredPrompts(TRUTH)) is None
    from course.sim.parallel import ParallelCost

    one_gpu = ParallelCost(cost, tp=1, pp=1, hidden_size=64, stage_layers=2)
    assert spread_draw(one_gpu) == spread_draw(cost)  # the whole step draws the stage cost's deviation


def test_a_simulation_with_a_spread_is_deterministic_and_wider_in_the_tail():
    rng = np.random.default_rng(2)
    steady = LinearCost(2e-3, 4e-5, 3e-4, 2e-8, e=6e-3)
    jittered = LinearCost(2e-3, 4e-5, 3e-4, 2e-8, e=6e-3, spread=fit_spread(spread_samples(rng, (3e-3, 3e-3))))
    load = poisson(5, 150, fixed(128), fixed(64), seed=303)
    config = server_sim_config(16, 512)
    first, second = simulate(load, config, jittered), simulate(load, config, jittered)
    assert [t.chunk_times for t in first.traces] == [t.chunk_times for t in second.traces]
    flat, wide = summarize(simulate(load, config, steady).traces), summarize(first.traces)
    assert wide.itl["p95"] > 1.3 * flat.itl["p95"]  # the deterministic cost's tail is too short
    assert wide.itl["mean"] == pytest.approx(flat.itl["mean"], rel=0.1)  # the mean step stays the fitted line


def trace(rid: str, send: float, times: list[float]) -> RequestTrace:
    return RequestTrace(rid, send, chunk_times=times, chunk_tokens=[1] * len(times), output_tokens=len(times))


def test_calibration_samples_from_traces():
    ttfts = [0.010, 0.012, 0.011, 0.030]
    sample = prefill_sample([trace(str(i), 1.0, [1.0 + t, 1.0 + t + 0.003]) for i, t in enumerate(ttfts)], 64)
    assert (sample.prefill_tokens, sample.seconds) == (64, pytest.approx(0.0115))
    assert sample.deviations == pytest.approx([t - np.mean(ttfts) for t in ttfts])
    # a decode wave whose first half waited for the next prompts' prefill chunks (20 ms gaps), then 5 ms
    # steps: only the second half is the decode step
    times = list(np.cumsum([0.02] * 4 + [0.005] * 4))
    wave = [trace(str(i), 0.0, [t + 0.0001 * i for t in times]) for i in range(4)]
    sample = decode_sample(wave, batch=4, context=32, output=8)
    assert sample.seconds == pytest.approx(0.005)
    assert sample.kv_tokens_read == 4 * (32 + 6)
    assert sample.deviations == pytest.approx([0.0] * 12, abs=1e-12)
    with pytest.raises(ValueError, match="no request succeeded"):
        prefill_sample([RequestTrace("x", 0.0, error="boom")], 16)
    with pytest.raises(ValueError, match="3 chunks or more"):
        decode_sample([trace("a", 0.0, [0.01, 0.02])], batch=1, context=32, output=2)


def test_the_fidelity_benchmark_checks_its_arguments(capsys):
    args = sim_fidelity.parse_args(["--engine", "vllm"])
    assert args.load == 0.7 and args.rate is None and args.rounds == 2
    assert sim_fidelity.parse_args([]).rate == 5.0
    config = sim_fidelity.sim_config(args)
    assert config.scheduler == "continuous" and config.max_num_seqs == 16 and not config.enable_prefix_caching
    command = sim_fidelity.vllm_server_command(8000, Path("/m"), 16, 512)
    assert "--no-enable-prefix-caching" in command and command[command.index("--max-num-batched-tokens") + 1] == "512"
    for bad, message in [
        (["--load", "1.5"], "fraction of capacity"),
        (["--rate", "0"], "must be positive"),
        (["--rate", "5", "--load", "0.5"], "not allowed with"),
        (["--output-tokens", "2"], "ITL needs gaps"),
        (["--engine", "vllm", "--prompt-tokens", "1000"], "max-model-len"),
        (["--before-engine-share", "1.5"], "fraction from 0 to 1"),
        (["--engine", "vllm", "--before-engine-share", "0.5"], "vLLM's front end is another process"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            sim_fidelity.parse_args(bad)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err, bad
    assert sim_fidelity.main(["--engine", "vllm", "--dry-run"]) == 0
    assert "vllm.entrypoints.cli.main serve" in capsys.readouterr().out


def test_the_vllm_breakdown_names_the_part_the_simulator_misses(capsys):
    before = {"vllm:time_to_first_token_seconds_sum": 1.0, "vllm:time_to_first_token_seconds_count": 10}
    after = {
        "vllm:time_to_first_token_seconds_sum": 1.0 + 20 * 0.050,
        "vllm:time_to_first_token_seconds_count": 30,
        "vllm:request_queue_time_seconds_sum": 20 * 0.010,
        "vllm:request_queue_time_seconds_count": 20,
        "vllm:request_prefill_time_seconds_sum": 20 * 0.015,
        "vllm:request_prefill_time_seconds_count": 20,
        "vllm:inter_token_latency_seconds_sum": 100 * 0.012,
        "vllm:inter_token_latency_seconds_count": 100,
    }
    breakdown = sim_fidelity.vllm_breakdown(before, after)
    assert breakdown["time_to_first_token_seconds"] == pytest.approx(0.050)  # the run's requests only
    real = summarize([trace("a", 0.0, [0.060, 0.072, 0.084]), trace("b", 1.0, [1.060, 1.072, 1.084])])
    model = summarize([trace("a", 0.0, [0.030, 0.040, 0.050]), trace("b", 1.0, [1.030, 1.040, 1.050])])
    fitted = ServerCost(LinearCost(5e-3, 1e-4, 2e-4, 0), FrontEnd(latency=0.010))
    sim_fidelity.explain_vllm(breakdown, real, model, fitted, ["ttft p50", "itl p50"])
    out = capsys.readouterr().out
    assert "queue 10.00 + prefill 15.00 + the rest 25.00 ms" in out and "before vLLM's clock 10.00 ms" in out
    assert "took 35.00 ms per request in the run against 10.00 ms fitted" in out and "it queues under load" in out
    assert "vLLM's own ITL is +20% off the simulated steps" in out and "vllm/platforms/cpu.py" in out
    same = ServerCost(LinearCost(5e-3, 1e-4, 2e-4, 0), FrontEnd(latency=0.030))
    sim_fidelity.explain_vllm(breakdown, real, real, same, ["ttft p95", "itl p95"])
    out = capsys.readouterr().out
    assert "that part is as fitted" in out and "the means agree" in out and "shape of the step-time spread" in out


def test_the_fidelity_benchmark_says_when_the_noise_decides():
    quiet = [[StepSample(16, 0, 0, 0.010), StepSample(0, 4, 400, 0.004)]] * 3
    assert "quiet enough" in sim_fidelity.noise_verdict(quiet, 0.2)
    assert "measure the machine" in sim_fidelity.noise_verdict(quiet, 3.0)  # other programs on the cores
    scattered = [quiet[0], [StepSample(16, 0, 0, 0.015), StepSample(0, 4, 400, 0.004)]]
    verdict = sim_fidelity.noise_verdict(scattered, 0.2)
    assert "differ by up to 40%" in verdict and "measure the machine" in verdict
    assert "the prefill of 16 tokens (10.00, 15.00 ms)" in verdict  # which microbenchmark, and each round's median
    decode = [[StepSample(0, 4, 400, 0.004)], [StepSample(0, 4, 400, 0.006)]]
    assert "the decode step of 4 sequences reading 400 cached tokens (4.00, 6.00 ms)" in sim_fidelity.noise_verdict(
        decode, 0.2
    )
    # the hypervisor's share of the server's core during the run's parts (steal time), where it was read
    stolen = sim_fidelity.noise_verdict(quiet, 0.2, [0.01, 0.165])
    assert "took up to 16.5% of the server core's busy time" in stolen and "measure the machine" in stolen
    assert "quiet enough" in sim_fidelity.noise_verdict(quiet, 0.2, [0.01, None])
    assert "hypervisor" not in sim_fidelity.noise_verdict(quiet, 0.2, [None, None])  # not counted: nothing said


def test_steal_time_is_read_per_core_from_proc_stat(tmp_path):
    from course import noise

    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  300 0 30 600 10 0 5 55 0 0\ncpu0 100 0 10 200 5 0 2 50 0 0\ncpu1 200 0 20 400 5 0 3 5 0 0\n")
    before = noise.core_ticks(0, stat)
    assert before == noise.CoreTicks(total=367, idle=205, steal=50)
    stat.write_text("cpu0 180 0 20 300 5 0 2 60 0 0\n")  # 100 busy ticks more (90 user+system, 10 stolen), 100 idle
    assert noise.steal_share(before, noise.core_ticks(0, stat)) == pytest.approx(0.10)
    assert noise.core_ticks(7, stat) is None and noise.core_ticks(0, tmp_path / "missing") is None
    assert noise.steal_share(before, None) is None and noise.steal_share(before, before) is None  # idle: no share
    # over a tenth of a second one stolen tick would be 10 %: too short to tell
    stat.write_text("cpu0 105 0 10 300 5 0 2 51 0 0\n")
    assert noise.steal_share(before, noise.core_ticks(0, stat)) is None


def test_a_calibration_microbenchmark_that_lost_its_core_is_measured_again(monkeypatch, tmp_path, capsys):
    shares = iter([0.30, 0.12, 0.01] + [0.0] * 100)  # the first wave loses 30 %, then 12 %, then 1 %
    calls = []
    monkeypatch.setattr(
        sim_fidelity, "bench_stolen", lambda port, out, *options: (calls.append(out), ([], next(shares)))[1]
    )
    monkeypatch.setattr(sim_fidelity, "read_calibration", lambda work: [])
    sim_fidelity.calibrate(8000, tmp_path, counters=False)
    waves = len(sim_fidelity.PREFILL_LENGTHS) + len(sim_fidelity.DECODE_CONTEXTS) * len(sim_fidelity.DECODE_BATCHES)
    assert len(calls) == waves + 2 and calls[0] == calls[1] == calls[2]  # the first one three times
    out = capsys.readouterr().out
    assert "took 30% of the server's core during the prefill of 16 tokens: measuring it again" in out
    # at most STEAL_RETRIES more times: a host that steals all along still gets a calibration
    shares = iter([0.5] * 1000)
    calls.clear()
    sim_fidelity.calibrate(8000, tmp_path, counters=False)
    assert len(calls) == waves * (1 + sim_fidelity.STEAL_RETRIES)


def test_the_prefills_beside_a_stream_are_measured_again_when_they_lost_the_core(monkeypatch, tmp_path, capsys):
    # The course's server (counters): after the waves, the prefills beside a decoding request, sent by the
    # benchmarks' own client; 25 % stolen the first time, 1 % the second.
    sent, shares = [], iter([0.25, 0.01])
    monkeypatch.setattr(sim_fidelity, "bench_stolen", lambda port, out, *options: ([], 0.0))
    monkeypatch.setattr(sim_fidelity, "server_prefill_counters", lambda url: None)
    monkeypatch.setattr(sim_fidelity, "settled_prefill_counters", lambda url, before, n: None)
    monkeypatch.setattr(sim_fidelity, "send_workload", lambda port, rows, out: sent.append((rows, out)))
    monkeypatch.setattr(sim_fidelity.noise, "steal_share", lambda before, after: next(shares))
    monkeypatch.setattr(sim_fidelity, "read_calibration", lambda work: [])
    sim_fidelity.calibrate(8000, tmp_path, counters=True)
    assert [out for _, out in sent] == [tmp_path / sim_fidelity.BESIDE_FILE] * 2
    rows = sent[0][0]
    assert rows[0][0] == sim_fidelity.BESIDE_STREAM_ID and len(rows) == 1 + sim_fidelity.BESIDE_PREFILLS
    arrivals = [arrival for _, arrival, _, _ in rows[1:]]
    assert arrivals == sorted(arrivals) and min(b - a for a, b in zip(arrivals, arrivals[1:])) > 0.05
    assert "took 25% of the server's core during the prefills beside a decoding request" in capsys.readouterr().out
    # vLLM's front end is another process: no such microbenchmark
    sent.clear()
    sim_fidelity.calibrate(8000, tmp_path, counters=False)
    assert sent == []


def test_the_roofline_cost_reads_a_moes_active_experts_and_fp8_weights_at_one_byte():
    from course import hardware, kv
    from course.sim import RooflineCost

    h100 = hardware.gpu("H100-SXM")
    v3 = RooflineCost(kv.get_model("DeepSeek-V3"), h100)
    assert v3.bytes_per_weight == 1.0  # published in fp8 (quantization_config), KV still 2 bytes
    assert v3.weight_bytes_read(1) == pytest.approx(37e9, rel=1e-6)  # its active parameters, not 671 B x 2
    assert v3.weight_bytes_read(1) < v3.weight_bytes_read(16) < v3.weight_bytes_read(2048) <= v3.weight_bytes
    assert v3.weight_bytes_read(2048) > 0.99 * v3.weight_bytes  # a long prefill touches every expert
    decode_1, decode_64 = v3.step_seconds(0, 1, 1000), v3.step_seconds(0, 64, 64000)
    assert decode_1 == pytest.approx((37e9 + 1000 * v3.kv_bytes_per_token) / (h100.bandwidth * v3.bandwidth_efficiency))
    assert decode_64 / decode_1 > 5  # a MoE decode batch is far from free: more experts every step
    llama = RooflineCost(kv.get_model("Llama-3-8B"), h100)
    assert (
        llama.weight_bytes_read(1) == llama.weight_bytes_read(64) == llama.weight_bytes == 2 * llama.geometry.num_params
    )
    int4 = RooflineCost(kv.get_model("Llama-3-8B"), h100, weight_bytes_per_param=0.5)
    assert int4.weight_bytes == llama.weight_bytes / 4 and int4.kv_bytes_per_token == llama.kv_bytes_per_token
    assert "0.5 B/weight" in int4.describe()


def test_the_roofline_cost_computes_two_flops_per_active_parameter_of_a_moe_token():
    """A token runs its own top-k experts and the dense part, however many experts the step reads: FLOPs per
    token and weight bytes at one token are the same active count (DeepSeek-V3's 37 B, Mixtral's 12.9 B)."""
    from course import hardware, kv, roofline
    from course.sim import RooflineCost

    h100 = hardware.gpu("H100-SXM")
    for name, active in (("DeepSeek-V3", 37e9), ("Mixtral-8x7B", 12.9e9)):
        cost = RooflineCost(kv.get_model(name), h100, attention_flops=False)
        assert cost.moe == roofline.MOE_MODELS[name] and cost.active_params == pytest.approx(active, rel=1e-9)
        assert cost.flops(0, 1) == pytest.approx(2 * active, rel=1e-9)  # not 2 x every expert's parameters
        assert cost.flops(4096, 64) == pytest.approx(2 * active * (4096 + 64), rel=1e-9)
        assert cost.weight_bytes_read(1) == pytest.approx(active * cost.bytes_per_weight, rel=1e-9)
    # A long prefill is compute-bound: its time follows the active parameters (0.8 s on an H100, not 15 s).
    v3 = RooflineCost(kv.get_model("DeepSeek-V3"), h100, attention_flops=False)
    flops_time = 2 * 37e9 * 8192 / (h100.flops * v3.flops_efficiency)
    assert v3.step_seconds(8192, 0, 0) == pytest.approx(flops_time, rel=1e-9)
    assert v3.bytes_moved(0, 8192) / (h100.bandwidth * v3.bandwidth_efficiency) < flops_time
    llama = RooflineCost(kv.get_model("Llama-3-8B"), h100, attention_flops=False)  # dense: every parameter
    assert llama.moe is None and llama.active_params == llama.geometry.num_params
    assert llama.flops(0, 1) == 2.0 * llama.geometry.num_params


def test_the_roofline_cost_counts_attention_flops_only_in_the_layers_that_attend():
    """Qwen3-Next attends over the cache in one layer of four (the others are linear attention with a
    constant-size state): its attention FLOPs per (query, key) pair are a quarter of 48 layers' worth."""
    from course import hardware, kv
    from course.sim import RooflineCost

    h100 = hardware.gpu("H100-SXM")
    hybrid = kv.get_model("Qwen3-Next-80B-A3B")
    assert hybrid.num_attention_layers * 4 == hybrid.num_layers
    with_pairs = RooflineCost(hybrid, h100)
    without = RooflineCost(hybrid, h100, attention_flops=False)
    per_pair = 4.0 * hybrid.num_attention_layers * hybrid.num_query_heads * hybrid.head_dim
    pairs = 4096 * 4097 / 2  # one 4,096-token prompt, causal
    assert with_pairs.flops(4096, 0, pairs) - without.flops(4096, 0, pairs) == pytest.approx(per_pair * pairs)
    dense = kv.get_model("Llama-3-8B")  # every layer attends: the same count as before
    dense_cost = RooflineCost(dense, h100)
    assert dense_cost.attention_flops_per_pair == 4.0 * dense.num_layers * dense.num_query_heads * dense.head_dim


def test_a_serial_front_end_takes_one_request_at_a_time_in_both_engines():
    # 10 ms steps, 4 ms of front-end work per request; three requests arrive at once at an idle server.
    # A front end per request readies all three at 4 ms; one thread (vLLM's API server) readies them at 4, 8 and 12 ms.
    from helpers import reference

    work = Workload([RequestSpec(name, 0.0, 8, 2) for name in "abc"])
    config = SimConfig(max_num_seqs=4, num_blocks=100)
    parallel = ServerCost(STEP_10MS, FrontEnd(before_engine=0.004))
    serial = parallel.replace(serial=True)
    assert [t.chunk_times[0] for t in simulate(work, config, parallel).traces] == pytest.approx([0.014] * 3)
    queued = simulate(work, config, serial).traces
    # a is prefilled alone from 4 ms; b and c were ready (8, 12 ms) before its step ended and join the next one
    assert [t.chunk_times[0] for t in queued] == pytest.approx([0.014, 0.024, 0.024])
    assert [t.chunk_times for t in queued] == [t.chunk_times for t in reference(work, config, serial)[0]]
    assert "one request at a time" in serial.describe() and "one request at a time" not in parallel.describe()


def test_a_line_fitted_where_the_run_lives_predicts_the_runs_steps():
    # A server whose decode step grows faster than a line in the batch: the line through waves of 1 to 16 rows
    # misses the 4-row steps a run spends its time in; weighted by that run's steps, it does not.
    from course.sim.calibration import run_weights
    from course.sim.results import StepLog

    def truth(prefill: int, rows: int, kv: int) -> float:
        return 2e-3 + 4e-5 * prefill + 1e-4 * rows + 3e-5 * rows * rows + 2e-8 * kv

    waves = [(rows, context) for rows in (1, 2, 4, 16) for context in (32, 256)]
    samples = [StepSample(n, 0, 0, truth(n, 0, 0)) for n in PROMPTS]
    samples += [StepSample(0, rows, rows * context, truth(0, rows, rows * context)) for rows, context in waves]
    n = 200  # the run: 190 decode steps of 4 rows reading 100 tokens each, 10 prefills of 128 tokens
    prefill, rows, kv = [128] * 10 + [0] * (n - 10), [0] * 10 + [4] * (n - 10), [0] * 10 + [400] * (n - 10)
    ends = np.cumsum([truth(p, d, k) for p, d, k in zip(prefill, rows, kv)])
    run = StepLog.from_columns(np.r_[0.0, ends[:-1]], ends, prefill, rows, kv, [0] * n, [4] * n, [0] * n, [0] * n)
    weights = run_weights(samples, run)
    assert weights[samples.index(StepSample(0, 4, 4 * 256, truth(0, 4, 4 * 256)))] > 5, "the run's nearest wave"
    assert min(weights) == pytest.approx(0.1), "the waves the run never visits keep the floor"
    everywhere = fit(samples).step.expected_seconds(0, 4, 400) / truth(0, 4, 400) - 1
    where = fit(samples, weights=weights).step.expected_seconds(0, 4, 400) / truth(0, 4, 400) - 1
    assert abs(where) < abs(everywhere) / 3, (everywhere, where)
    with pytest.raises(ValueError, match="one positive number per sample"):
        fit(samples, weights=[1.0])
