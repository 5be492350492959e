"""Capacity planning (course.capacity): SLO checks, the rate search, replicas, cost, KV quantization."""

import math

import numpy as np
import pytest
import torch

from course import capacity, noise
from course.trace import RequestTrace


def trace(rid, send, ttft, gap, tokens, error=None):
    """A request that sends at ``send``, gets its first token after ``ttft`` and one more every ``gap``."""
    chunks = [send + ttft + i * gap for i in range(tokens)] if error is None else []
    return RequestTrace(rid, send, chunks, [1] * len(chunks), prompt_tokens=10, output_tokens=len(chunks), error=error)


SLO = capacity.SLO("chat", ttft=0.2, tpot=0.05, percentile=95, source="test")


def test_slo_holds_when_the_percentiles_are_within_the_targets():
    runs = [trace(str(i), i, 0.1, 0.02, 10) for i in range(20)]
    check = SLO.check(runs)
    assert check.holds and check.attainment == 1.0
    assert check.ttft == pytest.approx(0.1) and check.tpot == pytest.approx(0.02)


def test_slo_misses_on_the_tail_not_the_median():
    runs = [trace(str(i), i, 0.1, 0.02, 10) for i in range(18)] + [
        trace(f"s{i}", 30 + i, 0.5, 0.02, 10) for i in range(2)
    ]
    check = SLO.check(runs)
    assert not check.holds  # 2 of 20 slow: p95 TTFT is in the slow tail
    assert check.attainment == pytest.approx(0.9)
    one_slow = [trace(str(i), i, 0.1, 0.02, 10) for i in range(39)] + [trace("s", 50, 0.5, 0.02, 10)]
    assert SLO.holds(one_slow)  # 1 of 40 slow: p95 stays below the outlier


def test_slo_checks_tpot_and_counts_failures_against_it():
    slow_decode = [trace(str(i), i, 0.1, 0.08, 10) for i in range(20)]
    assert not SLO.holds(slow_decode)
    with_failure = [trace(str(i), i, 0.1, 0.02, 10) for i in range(19)] + [trace("x", 0, 0, 0, 0, error="HTTP 500")]
    check = SLO.check(with_failure)
    assert not check.holds and check.failed == 1 and check.attainment == pytest.approx(0.95)


@pytest.mark.parametrize("bad", [dict(ttft=0), dict(tpot=-1), dict(percentile=0), dict(percentile=101), dict(ttft="1")])
def test_slo_rejects_bad_targets(bad):
    args = dict(name="x", ttft=0.2, tpot=0.05) | bad
    with pytest.raises(ValueError, match="SLO 'x'"):
        capacity.SLO(**args)


def test_slo_check_needs_requests():
    with pytest.raises(ValueError, match="no requests"):
        SLO.check([])


def test_reading_speed():
    # 238 words per minute, 4/3 tokens per word: 5.3 tokens/s, about 189 ms per token
    assert capacity.reading_speed_tpot() == pytest.approx(60 / (238 * 4 / 3))
    assert 0.18 < capacity.reading_speed_tpot() < 0.2


@pytest.mark.parametrize("capacity_rate", [0.7, 3.3, 17.0, 99.0])
def test_highest_rate_finds_the_threshold(capacity_rate):
    calls = []

    def holds(rate):
        calls.append(rate)
        return rate <= capacity_rate

    found = capacity.highest_rate(holds, 0.5, 100.0, rel_tol=0.01)
    assert found.rate <= capacity_rate < found.rate * 1.01 + 1e-12
    assert len(calls) < 20 and found.tried[0] == (100.0, False)


def test_highest_rate_edges():
    assert capacity.highest_rate(lambda r: True, 1, 10).rate == 10
    assert capacity.highest_rate(lambda r: False, 1, 10).rate == 0.0
    with pytest.raises(ValueError, match="0 < low < high"):
        capacity.highest_rate(lambda r: True, 5, 5)


def test_replicas_needed():
    assert capacity.replicas_needed(10, 4) == 3
    assert capacity.replicas_needed(12, 4) == 3  # exactly full replicas, no extra one
    assert capacity.replicas_needed(0.3 * 10, 0.1 * 10) == 3  # float noise does not add a replica
    assert capacity.replicas_needed(12, 4, headroom=0.25) == 4
    assert capacity.replicas_needed(0, 4) == 0
    with pytest.raises(ValueError, match="per_replica_rate"):
        capacity.replicas_needed(10, 0)
    with pytest.raises(ValueError, match="headroom"):
        capacity.replicas_needed(10, 4, headroom=1)


def test_dollars_per_million_tokens():
    # 1,000 tokens/s is 3.6 M tokens an hour: $3.60/h -> $1 per million
    assert capacity.dollars_per_million_tokens(3.6, 1000) == pytest.approx(1.0)
    assert capacity.dollars_per_million_tokens(3.6, 1000, gpus=2) == pytest.approx(2.0)
    assert capacity.dollars_per_million_tokens(3.6, 500) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="tokens_per_second"):
        capacity.dollars_per_million_tokens(3.6, 0)
    with pytest.raises(ValueError, match="gpus"):
        capacity.dollars_per_million_tokens(3.6, 10, gpus=0)


def test_server_sim_config_mirrors_the_reference_server():
    config = capacity.server_sim_config(16, 512)
    assert config.scheduler == "prefill-first" and config.decode_after_prefill
    assert config.max_num_seqs == 16 and config.token_budget == 512
    assert capacity.server_sim_config(4, 256, num_blocks=100).num_blocks == 100


def test_quantize_kv_int8_is_per_vector():
    x = torch.tensor([[[[1.0, -0.5, 0.25, 0.0], [100.0, 1.0, -3.0, 50.0]]]])  # (1, 1, 2 tokens, 4)
    q = capacity.quantize_kv(x, "int8")
    assert q.shape == x.shape and q.dtype == x.dtype
    # each token has its own scale: the small token keeps its precision next to the large one
    assert torch.allclose(q[0, 0, 0], x[0, 0, 0], atol=1 / 127)
    assert torch.allclose(q[0, 0, 1], x[0, 0, 1], atol=100 / 127)
    assert q[0, 0, 0, 0] == 1.0 and q[0, 0, 1, 0] == 100.0  # the extreme value is exact


def test_quantize_kv_zero_vector_and_int4_and_fp8():
    zeros = torch.zeros(1, 2, 3, 8)
    for scheme in capacity.KV_SCHEMES:
        assert torch.equal(capacity.quantize_kv(zeros, scheme).abs(), zeros), scheme
    x = torch.linspace(-1, 1, 16).reshape(1, 1, 1, 16)
    q8 = capacity.quantize_kv(x, "fp8")
    assert (q8 - x).abs().max() < 0.07  # e4m3 keeps 3 mantissa bits
    assert capacity.quantize_kv(torch.tensor([1000.0]), "fp8").item() == 448.0  # saturates at the e4m3 max
    big = torch.tensor([[[[1000.0, -500.0, 1.0, 0.0]]]])  # per token-head fp8 scales instead of saturating
    assert torch.allclose(capacity.quantize_kv(big, "fp8_per_token_head"), big, rtol=0.07, atol=1000 / 448)
    with pytest.raises(ValueError, match="scheme"):
        capacity.quantize_kv(x, "int2")


def test_int4_per_token_head_is_vllms_rotated_asymmetric_4_bits():
    """vLLM 0.32's int4_per_token_head (vllm/v1/attention/ops/int4_per_token_head.py): rotate by a randomized
    Hadamard transform, store 16 levels from the vector's minimum to its maximum with a zero point, rotate back."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 6, 64, generator=g) + 3.0  # an offset: asymmetric levels keep it, symmetric ones waste half
    rotated = capacity.hadamard_rotation(x)
    assert torch.allclose(capacity.hadamard_rotation(rotated, inverse=True), x, atol=1e-5)
    assert torch.allclose(rotated.pow(2).sum(-1), 64 * x.pow(2).sum(-1), rtol=1e-5)  # H H = d I: norm sqrt(d)
    q = capacity.quantize_kv(x, "int4")
    levels = capacity.hadamard_rotation(q)
    step = (rotated.amax(-1, keepdim=True) - rotated.amin(-1, keepdim=True)) / 15
    assert ((levels - rotated).abs() <= step / 2 + 1e-4).all()  # within half a step in the rotated space
    assert all(len(torch.unique(torch.round((levels[i, j, t] - levels[i, j, t].min()) / step[i, j, t]))) <= 16
               for i in range(2) for j in range(2) for t in range(6))  # fmt: skip
    odd = torch.randn(1, 1, 2, 96, generator=g)  # 96 = 3 x 32: rotated in blocks of 32, as vLLM
    assert torch.allclose(capacity.hadamard_rotation(capacity.hadamard_rotation(odd), inverse=True), odd, atol=1e-5)


def test_int8_per_token_head_rounds_half_away_from_zero_like_vllms_kernel():
    x = torch.tensor([[[[127.0, 0.5, -0.5, 1.5, -2.5]]]])  # scale 1: the ties of Python's round() differ
    assert capacity.quantize_kv(x, "int8").tolist() == [[[[127.0, 1.0, -1.0, 2.0, -3.0]]]]


def test_quantization_error_grows_as_bits_shrink():
    x = torch.randn(2, 2, 32, 64, generator=torch.Generator().manual_seed(0))
    errors = {s: float((capacity.quantize_kv(x, s) - x).pow(2).mean()) for s in capacity.KV_SCHEMES}
    assert errors["int8_per_token_head"] < errors["fp8_per_token_head"] < errors["int4_per_token_head"]
    assert errors["fp8_per_token_head"] < errors["fp8"]  # a scale per vector uses e4m3's range


def test_kv_quantization_quality_on_the_tiny_model():
    from course.models import build_tiny_model

    lm = build_tiny_model()
    text = "def add(a, b):\n    return a + b\n" * 12
    scores = {q.scheme: q for q in capacity.kv_quantization_quality(lm, text, chunk=8, window=32)}
    assert set(scores) == {"none", *capacity.KV_SCHEMES}  # vLLM's names
    assert scores["none"].agreement == 1.0
    assert all(math.isfinite(q.perplexity) and q.tokens == scores["none"].tokens for q in scores.values())
    assert scores["int8_per_token_head"].agreement >= scores["int4_per_token_head"].agreement
    with pytest.raises(ValueError, match="at least"):
        capacity.kv_quantization_quality(lm, "short", chunk=8, window=32)
    mine = capacity.kv_quantization_quality(lm, text, schemes=(), chunk=8, window=32, custom={"same": lambda x: x})
    assert [q.scheme for q in mine] == ["none", "same"] and mine[1].agreement == 1.0


def test_calibration_samples_against_the_reference_server_fit_a_cost():
    from course.models import build_tiny_model
    from course.serving import BackgroundServer, create_app
    from course.sim import LinearCost

    with BackgroundServer(create_app(build_tiny_model(), max_batch_size=4)) as server:
        samples = capacity.calibration_samples(
            server.url,
            prefill_lengths=(8, 64),
            decode_batches=(1, 2),
            decode_contexts=(16,),
            decode_output=4,
            repeats=1,
        )
    assert [(s.prefill_tokens, s.decode_tokens) for s in samples] == [(8, 0), (64, 0), (0, 1), (0, 2)]
    assert [s.kv_tokens_read for s in samples[2:]] == [1 * (16 + 3), 2 * (16 + 3)]  # context + 3/4 of the output
    assert all(s.seconds > 0 for s in samples)
    assert LinearCost.fit(samples).step_seconds(64, 0, 0) > 0
    # Each sample carries the spread of the requests it is the median of, for course.noise.check.
    assert [s.spread.n for s in samples] == [1, 1, 1, 2]  # one prefill request; one wave of `batch` decodes
    assert all(s.spread.low <= s.seconds <= s.spread.high for s in samples)
    verdict = noise.check([s.spread for s in samples], "the fit", load=None)
    assert not verdict.ok and "only 1 repeat(s) per point" in verdict.message
    # The server reports its own TTFT and times its prefill passes: each prefill sample knows where its
    # time outside the pass went, before the engine saw the request and after.
    for sample in samples[:2]:
        split = sample.front_end
        assert split is not None and 0 < split.prefill_pass < split.server_ttft < split.client_ttft, split
    assert samples[2].front_end is None  # decode waves carry none
    assert 0 < capacity.before_engine_share(samples) < 1
    fitted = LinearCost.fit(samples, before_engine_share=capacity.before_engine_share(samples))
    assert fitted.front_end.before_engine > 0


def test_the_front_end_split_waits_for_the_server_to_count_the_last_request(monkeypatch):
    # The server counts a request's TTFT when its stream closes, just after the client got the last chunk:
    # the first reading after a one-request prefill run still lacks it.
    from course.models import build_tiny_model
    from course.serving import BackgroundServer, create_app

    read = capacity.server_prefill_counters
    readings = []

    def lagging(base_url):
        counters = read(base_url)
        readings.append(counters)
        if len(readings) == 2:  # the reading right after the run: the request not counted yet
            return readings[0]
        return counters

    with BackgroundServer(create_app(build_tiny_model(), max_batch_size=2)) as server:
        monkeypatch.setattr(capacity, "server_prefill_counters", lagging)
        samples = capacity.calibration_samples(
            server.url, prefill_lengths=(8,), decode_batches=(1,), decode_contexts=(8,), decode_output=4, repeats=1
        )
    assert samples[0].front_end is not None and len(readings) >= 3


def test_the_share_of_the_front_end_before_the_engine():
    # Client TTFT 20 ms, the server's own 17 ms, the pass 15 ms: 3 of the 5 ms outside it come first.
    split = capacity.FrontEndSplit(client_ttft=0.020, server_ttft=0.017, prefill_pass=0.015)
    assert split.before_engine == pytest.approx(0.003) and split.outside_pass == pytest.approx(0.005)
    other = capacity.FrontEndSplit(client_ttft=0.030, server_ttft=0.029, prefill_pass=0.025)  # 1 of 5 ms
    assert capacity.before_engine_share([split, other]) == pytest.approx(0.4)  # summed, not averaged ratios
    assert capacity.before_engine_share([]) == 0.0  # a server that reports neither: all of it on the step
    assert capacity.before_engine_share([capacity.FrontEndSplit(0.02, 0.019, 0.021)]) == 0.0  # noise below the pass
    traces = [RequestTrace("a", 1.0, [1.020, 1.021], [1, 1]), RequestTrace("b", 2.0, [2.022, 2.023], [1, 1])]
    # readings of the server's counters: TTFT seconds summed, requests, prefill passes, their seconds
    measured = capacity.front_end_split(traces, (1.0, 10, 10, 0.5), (1.036, 12, 12, 0.53))
    assert measured == capacity.FrontEndSplit(pytest.approx(0.021), pytest.approx(0.018), pytest.approx(0.015))
    assert capacity.front_end_split(traces, None, (1.036, 12, 12, 0.53)) is None  # a server without them
    assert capacity.front_end_split(traces, (1.0, 10, 10, 0.5), (1.0, 10, 10, 0.5)) is None  # nothing counted


def test_calibration_reports_failed_requests():
    with pytest.raises(RuntimeError, match="cannot reach a server at http://127.0.0.1:9"):
        capacity.calibration_samples("http://127.0.0.1:9", prefill_lengths=(8,), repeats=1)


def test_decode_sample_leaves_the_gaps_that_hold_a_prefill_out_of_the_spread():
    # Two requests decode every 4 ms; a third one's first token (after its 20 ms prefill step) lands
    # inside one gap of each: that 24 ms gap is a prefill the simulator times itself, not decode jitter.
    decoding = [0.004 * k + (0.020 if k > 15 else 0.0) for k in range(1, 21)]
    newcomer = [0.083 + 0.004 * k for k in range(8)]
    traces = [RequestTrace(rid, 0.0, times, [1] * len(times)) for rid, times in
              (("a", decoding), ("b", decoding), ("c", newcomer))]  # fmt: skip
    sample = capacity.decode_sample(traces, batch=2, context=10, output=20)
    assert len(sample.deviations) == 2 * 8 + 3  # 9 gaps each in a's and b's second half, one left out; c's 3
    assert max(sample.deviations) - min(sample.deviations) == pytest.approx(0.0, abs=1e-9)
    assert sample.seconds > 0.0045  # the step time itself still includes it (the mean gap of the wave)


def test_kv_schemes_take_vllms_names_and_the_short_ones():
    x = torch.randn(1, 2, 3, 8)
    for short, vllm_name in (("int8", "int8_per_token_head"), ("int4", "int4_per_token_head")):
        assert torch.equal(capacity.quantize_kv(x, short), capacity.quantize_kv(x, vllm_name))
        assert capacity.kv_scheme(short) == vllm_name
    with pytest.raises(ValueError, match="int8_per_token_head, fp8_per_token_head, fp8, int4_per_token_head"):
        capacity.kv_scheme("bf16")


# --- steady-state windows from simulated runs ----------------------------------------------------------


def _simulated(n=300, rate=30.0, seed=0, replicas=1):
    import course.sim as sim
    from course.sim import fleet

    config = sim.SimConfig(num_blocks=400, max_num_seqs=32, max_num_batched_tokens=512)
    cost = sim.LinearCost(0.004, 2e-5, 1e-4, 1e-7)
    work = capacity.chat_traffic(rate, n, seed=seed, prompt=64)
    if replicas == 1:
        return sim.simulate(work, config, cost)
    return fleet.simulate_fleet(work, replicas, config, cost)


@pytest.mark.parametrize("replicas", [1, 3])
def test_window_latencies_give_the_same_check_as_the_selected_traces(replicas):
    """The fast path (the runs' columns) and the traces give the same SLO check, for one run and for a fleet
    whose window starts at the fleet's first arrival; a class filter keeps only its requests."""
    run = _simulated(replicas=replicas)
    traces = run.traces
    window = capacity.SteadyWindow(2.0, 4.0, 1.0)
    slo = capacity.SLO("chat", ttft=0.5, tpot=0.02, percentile=90)
    assert slo.check_latencies(capacity.window_latencies(run, window)) == slo.check(window.select(traces))
    odd = [t for t in window.select(traces) if int(t.request_id) % 2]
    kept = capacity.window_latencies(run, window, keep=lambda rid: int(rid) % 2 == 1)
    assert slo.check_latencies(kept) == slo.check(odd)


def test_window_latencies_count_the_preempted_requests_and_pool_over_seeds():
    run = _simulated(n=400, rate=60.0)  # a 400-block cache for 60 req/s: the scheduler preempts
    everything = capacity.SteadyWindow(0.0, 1e9)
    got = capacity.window_latencies(run, everything)
    assert got.preempted == run.preempted_requests > 0 and got.requests == len(run.traces)
    twice = got + got
    assert twice.requests == 2 * got.requests and twice.preempted == 2 * got.preempted
    with pytest.raises(ValueError, match="at least one"):
        capacity.window_latencies([], everything)


def test_check_latencies_needs_requests():
    empty = capacity.WindowLatencies(np.zeros(0), np.zeros(0))
    with pytest.raises(ValueError, match="no requests"):
        SLO.check_latencies(empty)
    failed_only = capacity.WindowLatencies(np.zeros(0), np.zeros(0), failed=2)
    assert not SLO.check_latencies(failed_only).holds


def test_steady_capacity_pools_its_seeds():
    calls = []

    def run_at(rate, n, seed):
        calls.append((rate, seed))
        return _simulated(n=n, rate=rate, seed=seed)

    found = capacity.steady_capacity(
        run_at, capacity.SLO("x", ttft=1.0, tpot=0.1), 1.0, 50.0, capacity.SteadyWindow(1.0, 3.0, 0.5), seeds=(0, 1)
    )
    assert {seed for _, seed in calls} == {0, 1} and len(calls) == 2 * len(found.tried)
    assert 1.0 <= found.rate < 50.0 and "2 seeds pooled" in found.describe()
    with pytest.raises(ValueError, match="seed"):
        capacity.steady_capacity(run_at, SLO, 1.0, 2.0, capacity.SteadyWindow(1.0, 1.0), seeds=())


# --- calibration in one call, and the recorded one ------------------------------------------------------


def _fake_samples(scale: float = 1.0):
    """Microbenchmarks of a server whose step is 1 ms + 50 us/prefill token + 0.2 ms per decode row."""
    from course.noise import Spread

    def sample(prefill, batch, kv):
        seconds = scale * (0.001 + 50e-6 * prefill + 0.0002 * batch)
        spread = Spread(seconds, 0.99 * seconds, 1.01 * seconds, 4)
        return capacity.CalibrationSample(prefill, batch, kv, seconds, deviations=(0.0, 0.0), spread=spread)

    return [sample(p, 0, 0) for p in (16, 64, 192)] + [sample(0, b, b * 40) for b in (1, 4, 8)]


def test_merge_rounds_takes_the_mean_step_and_the_rounds_spread():
    merged = capacity.merge_rounds([_fake_samples(1.0), _fake_samples(1.2)])
    single = _fake_samples(1.1)
    assert [m.seconds for m in merged] == pytest.approx([s.seconds for s in single])
    assert merged[0].spread.n == 2 and merged[0].spread.high == pytest.approx(1.2 * _fake_samples()[0].seconds)
    assert len(merged[0].deviations) == 4
    with pytest.raises(ValueError):
        capacity.merge_rounds([_fake_samples(), _fake_samples()[:-1]])


def test_a_calibration_round_trips_through_its_file(tmp_path):
    """What benchmarks/record_calibration.py writes, load_calibration refits and replays: the same step cost and
    errors, the label as its source."""
    import course.sim as sim
    from course import workload

    samples = tuple(_fake_samples())
    cost = sim.LinearCost.fit(samples)
    server = {"max_batch_size": 8, "max_prefill_tokens": 256}
    run = sim.simulate(workload.poisson(5.0, 20, 64, 16, seed=1), capacity.server_sim_config(**server), cost)
    errors = capacity.held_out_errors(run.traces, capacity.server_sim_config(**server), cost)
    assert all(abs(e) < 1e-6 for e in errors.values()), errors  # the simulator against itself
    found = capacity.Calibration(cost, samples, tuple(run.traces), 5.0, errors, None, "measured on this runtime")
    path = tmp_path / "calibration.json"
    capacity.save_calibration(found, str(path), "recorded on a test machine", server)
    loaded = capacity.load_calibration(str(path))
    assert loaded.recorded and loaded.source == "recorded on a test machine" and not found.recorded
    assert loaded.cost.step_seconds(100, 2, 80) == pytest.approx(cost.step_seconds(100, 2, 80))
    assert len(loaded.held_out) == 20 and loaded.rate == 5.0 and loaded.margin < 1e-6
    assert "recorded on a test machine" in loaded.describe() and "plan with a margin" in loaded.describe()


def test_a_busy_runtime_falls_back_on_the_recorded_calibration(monkeypatch, tmp_path):
    """The noise check fails: calibrate returns the recorded calibration, its label as the source and this
    runtime's failed check beside it, without running the held-out load."""
    from course import noise

    busy = noise.NoiseCheck(False, 3.0, 4, 2.5, "NOISE CHECK FAILED (load average 2.50 per core): busy")
    monkeypatch.setattr(capacity, "calibration_samples", lambda *a, **k: _fake_samples())
    monkeypatch.setattr(noise, "check", lambda *a, **k: busy)
    shipped = capacity.load_calibration()  # the file module 5 ships
    assert shipped.recorded and shipped.source.startswith("recorded")
    got = capacity.calibrate("http://127.0.0.1:9", {"max_batch_size": 8, "max_prefill_tokens": 256}, None, None)
    assert got.source == shipped.source and got.noise is busy
    with pytest.raises(ValueError, match="rounds"):
        capacity.calibrate("http://127.0.0.1:9", {}, None, None, rounds=0)
