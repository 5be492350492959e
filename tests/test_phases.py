"""The realistic model profile, the kernel paths, the phase figures and the noise check."""

import math

import pytest
import torch

from course import kernels, measure, models, noise, phases
from course.hardware import MeasuredRoofs
from course.measure import Timing


@pytest.fixture(scope="module")
def realistic():
    return models.build_realistic_model(seed=0)


def test_realistic_model_is_a_170m_llama_far_larger_than_a_cpu_cache(realistic):
    config = realistic.model.config
    assert config.model_type == "llama" and realistic.geometry.attention == "GQA"
    assert 100e6 <= realistic.num_params <= 200e6
    assert realistic.weight_bytes > 512 * 2**20  # far beyond laptop caches (8-36 MiB) and 2x this CI's 260 MiB
    assert realistic.model.lm_head.weight is realistic.model.model.embed_tokens.weight  # tied, counted once


def test_realistic_model_is_deterministic_and_leaves_the_callers_seed(realistic):
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    again = models.build_realistic_model(seed=0, dtype=torch.bfloat16)
    assert torch.equal(torch.rand(2), expected)
    pairs = zip(realistic.model.parameters(), again.model.parameters())
    assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in pairs)
    norms = [p for n, p in realistic.model.named_parameters() if "norm" in n]
    assert all(torch.all(p == 1) for p in norms)


def test_realistic_model_round_trips_through_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = models.build_tiny_model(seed=0)  # same code path as the realistic profile, quicker to save
    folder = models.save_model(lm, tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder).decode(lm.encode("abc")[0]) == "abc"
    ids = lm.random_ids(1, 6)
    with torch.inference_mode():
        assert torch.allclose(loaded(ids).logits, lm.model(ids).logits, atol=1e-5)


def test_random_hub_geometry_has_the_real_models_size():
    lm = models.build_random_hub_geometry(models.HUB_MODEL, device="meta")
    assert lm.model.config.model_type == "qwen2"
    assert round(lm.num_params / 1e6) == 494  # Qwen2.5-0.5B: 494 M parameters with tied embeddings
    assert "random weights" in lm.source and "no Hub" in lm.source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_kernel_path_computes_the_same_logits_and_switches_back(dtype):
    lm = models.build_tiny_model(seed=0, dtype=dtype)
    ids = lm.random_ids(3, 7)
    with torch.inference_mode():
        stock = lm.model(ids).logits.float()
        assert kernels.use_kernel_path(lm.model, kernels.PACKED) == 29  # 4 layers x 7 linears + lm_head
        packed = lm.model(ids).logits.float()
        kernels.use_kernel_path(lm.model, kernels.WEIGHT_MAJOR)
        weight_major = lm.model(ids).logits.float()
        kernels.use_kernel_path(lm.model, kernels.STOCK)
        again = lm.model(ids).logits.float()
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(stock, packed, atol=tolerance) and torch.allclose(stock, weight_major, atol=tolerance)
    assert torch.equal(stock, again) and kernels.kernel_path(lm.model) == kernels.STOCK


def test_unknown_kernel_path_names_the_known_ones():
    lm = models.build_tiny_model(seed=0)
    with pytest.raises(ValueError, match="choose one of stock, onednn-packed, weight-major"):
        kernels.use_kernel_path(lm.model, "fast")


def test_filled_cache_has_the_shape_of_a_prefilled_one():
    lm = models.build_tiny_model(seed=0)
    cache = measure.filled_cache(lm, batch=3, context=17)
    assert cache.get_seq_length() == 17
    assert models.cache_nbytes(cache) == 3 * 17 * lm.geometry.kv_bytes_per_token(4)
    timing = measure.decode_step_seconds(lm, 3, 17, steps=3, prefill=False)
    assert timing.n == 3 and timing.low <= timing.median <= timing.high


def _roofs(bandwidth=10e9, flops=100e9):
    return MeasuredRoofs("cpu", "toy", "float32", bandwidth, flops, 2**30, 2048, (0.1,) * 3, (0.1,) * 3, None, 1e10)


def test_phase_figures_divide_bytes_and_flops_by_the_measured_roofs():
    lm = models.build_tiny_model(seed=0)
    step1 = phases.decode_bytes_per_step(lm, 1, 256) / 5e9  # reads at 5 GB/s: half the 10 GB/s roof
    decode = [Timing(1, step1, step1, step1, 3), Timing(8, 1.2 * step1, 1.1 * step1, 1.3 * step1, 3)]
    t512 = phases.prefill_flops(lm, 512) / 60e9  # 60 % of the 100 GFLOP/s roof
    prefill = [Timing(64, 1.0, 1.0, 1.0, 3), Timing(512, t512, t512, t512, 3)]
    figures = phases.PhaseFigures(lm, _roofs(), "stock", 256, decode, prefill, threads=2, load=0.1)
    assert math.isclose(figures.decode_bandwidth_fraction, 0.5)
    assert math.isclose(figures.decode_step_ratio(8), 1.2)
    assert math.isclose(figures.prefill_flops_fraction, 0.6)
    assert figures.observed_free_batch is None  # 1.2x at batch 8: still free within the sweep
    d = figures.to_dict()
    for key in ("decode_bandwidth_fraction", "decode_step_ratio_batch8", "prefill_flops_fraction"):
        assert isinstance(d[key], float)
    assert d["measured_bandwidth_gbs"] == 10 and d["measured_flops_gflops"] == 100
    assert d["model_params"] == lm.num_params and d["device"] == "toy" and d["noise_check_passed"]


def test_reading_explains_the_figures_against_the_physics_never_a_target():
    lm = models.build_tiny_model(seed=0)
    step1 = phases.decode_bytes_per_step(lm, 1, 256) / 4e9  # 40 % of the 10 GB/s roof
    t512 = phases.prefill_flops(lm, 512) / 90e9  # 90 % of the 100 GFLOP/s roof

    def figures(ratio8: float, step: float, prefill: float) -> list[str]:
        decode = [Timing(1, step, step, step, 3), Timing(8, ratio8 * step, ratio8 * step, ratio8 * step, 3)]
        timings = [Timing(64, 1.0, 1.0, 1.0, 3), Timing(512, prefill, prefill, prefill, 3)]
        return phases.reading(phases.PhaseFigures(lm, _roofs(), "stock", 256, decode, timings, threads=1, load=0.1))

    free, slow_read, fast_prefill = figures(1.2, step1, t512)
    assert "Batch 8 cost 1.20x batch 1" in free and "signature of a bandwidth-bound step" in free
    assert "40% of the memory roof" in slow_read and "about half of `sum`'s rate" in slow_read
    assert "90% of the compute roof" in fast_prefill
    costly, fast_read, slow_prefill = figures(2.5, step1 / 2, 3 * t512)
    assert "more than the roofline's" in costly and "kernel that re-reads" in costly
    assert "80% of the memory roof: the step is the read" in fast_read
    assert "30% of the compute roof" in slow_prefill and "up to 512 tokens" in slow_prefill
    assert not any("target" in line for line in [free, costly, slow_read, fast_read, fast_prefill, slow_prefill])
    # Measured above a roof: the roof was slowed, and the line says so instead of reading it.
    _, above_read, above_prefill = figures(1.2, step1 / 3, t512 / 2)
    assert "120% of the memory roof: above the roof" in above_read
    assert "180% of the compute roof: above the roof" in above_prefill
    # The roofline's own batch-8 ratio on a low compute roof is not a kernel's fault.
    low_compute = phases.PhaseFigures(lm, _roofs(flops=1e8), "stock", 256, [], [], threads=1)
    physics = phases.roofline_step_seconds(lm, low_compute.roofs, 8, 256) / phases.roofline_step_seconds(
        lm, low_compute.roofs, 1, 256
    )
    assert physics > phases.FREE_RATIO
    step = phases.roofline_step_seconds(lm, low_compute.roofs, 1, 256)
    low_compute.decode = [Timing(1, step, step, step, 3), Timing(8, physics * step, physics * step, physics * step, 3)]
    low_compute.prefill = [Timing(512, t512, t512, t512, 3)]
    as_predicted, read_line, _ = phases.reading(low_compute)
    assert "as the roofline predicts" in as_predicted and "batch 8 costs about batch 1" not in read_line


def test_observed_free_batch_interpolates_where_the_ratio_crosses_1_5():
    sweep = [Timing(1, 1.0, 1.0, 1.0, 3), Timing(2, 1.0, 1.0, 1.0, 3), Timing(8, 2.0, 2.0, 2.0, 3)]
    assert math.isclose(phases.observed_free_batch(sweep), 4.0)  # halfway from 2 to 8 in log space


def test_predicted_free_batch_is_where_compute_time_reaches_1_5x_the_weight_read():
    lm = models.build_tiny_model(seed=0)
    roofs = _roofs(bandwidth=10e9, flops=100e9)
    batch = phases.predicted_free_batch(lm, roofs, context=0)
    one = phases.roofline_step_seconds(lm, roofs, 1, 0)
    assert math.isclose(phases.roofline_step_seconds(lm, roofs, batch, 0), 1.5 * one, rel_tol=1e-9)


def test_noise_check_passes_steady_timings_and_flags_noisy_or_busy_ones():
    steady = [Timing(1, 1.0, 0.95, 1.05, 5)]
    assert noise.check(steady, "x", load=0.2).ok
    jumpy = noise.check([Timing(1, 1.0, 0.5, 16.0, 5)], "the batch ratio", load=0.2)
    assert not jumpy.ok and "too noisy to support the batch ratio" in jumpy.message and "rerun" in jumpy.message
    busy = noise.check(steady, "x", load=3.0)
    assert not busy.ok and "other programs are using the CPU" in busy.message
    assert not noise.check([Timing(1, 1.0, 1.0, 1.0, 2)], "x", load=None).ok  # two repeats: spread unknown
    assert "unknown" in noise.check(steady, "x", load=None).message


def test_percentile_label_warns_when_no_sample_lies_above_it():
    assert noise.percentile_label(50, 7) == "p50 (n=7)"
    assert "too few for a p95" in noise.percentile_label(95, 10)
    assert "too few" not in noise.percentile_label(95, 40)


def test_phases_benchmark_prints_one_json_object_with_the_issue_keys():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "phases.py"
    command = [sys.executable, str(script), "--tiny", "--quick", "--json", "--paths", "stock"]  # default threads
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    figures = json.loads(out)
    for key in ("decode_bandwidth_fraction", "decode_step_ratio_batch8", "prefill_flops_fraction",
                "measured_bandwidth_gbs", "measured_flops_gflops", "model_params", "device"):  # fmt: skip
        assert key in figures, key
    assert figures["model"] == models.TINY_NAME and len(figures["runs"]) == 1
    assert figures["threads"] == phases.CPU_THREADS  # module 1's setting, not torch's default
    assert figures["decode_headline"] == "eager" and "CUDA" in figures["graph_note"]


def test_phases_benchmark_refuses_contradicting_thread_flags(capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import phases as benchmark  # benchmarks/ is not a package

    with pytest.raises(SystemExit):
        benchmark.main(["--tiny", "--threads", "2", "--torch-threads"])
    assert "contradict" in capsys.readouterr().err


def test_torch_threads_sets_the_count_and_restores_it_even_on_error():
    before = torch.get_num_threads()
    with kernels.torch_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    with pytest.raises(RuntimeError), kernels.torch_threads(1):
        raise RuntimeError("measurement failed")
    assert torch.get_num_threads() == before
    with kernels.torch_threads(None) as n:
        assert n == before
    with pytest.raises(ValueError, match="positive"), kernels.torch_threads(0):
        pass
    assert phases.phase_threads(models.build_tiny_model()) == phases.CPU_THREADS == 1


def test_load_check_flags_a_busy_machine():
    assert noise.check_load("x", load=0.3).ok
    busy = noise.check_load("the TTFT percentiles", load=2.5)
    assert not busy.ok and "too noisy to support the TTFT percentiles" in busy.message


def test_runner_decode_steps_times_one_step_per_token_after_an_untimed_prefill():
    from course.serving.runner import runner_for

    lm = models.build_tiny_model()
    runner = runner_for(lm.model, "auto")
    calls = []

    def counting(ids, cache, **kwargs):
        calls.append(tuple(ids.shape))
        return runner(ids, cache, **kwargs)

    counting.new_cache = runner.new_cache
    times = measure.runner_decode_steps(lm, counting, batch=3, prompt_tokens=7, steps=5, seed=1)
    assert len(times) == 5 and all(t > 0 for t in times)
    assert calls == [(3, 7)] + [(3, 1)] * 5  # the prefill, then one token per row per step


def _paired_rounds(bandwidths, lm, flops=100e9):
    """Rounds on a machine whose speed swings: every phase is slower exactly when its round's roofs are."""
    read_bytes, n = 2**30, 2048
    rounds = []
    for bw in bandwidths:
        step1 = phases.decode_bytes_per_step(lm, 1, 256) / (0.5 * bw)  # always half of this round's read
        f = flops * bw / bandwidths[0]  # the matmul roof swings with it
        t512 = phases.prefill_flops(lm, 512) / (0.6 * f)
        rounds.append(
            phases.PhaseRound(read_bytes / bw, 2 * n**3 / f, {1: step1, 8: 1.2 * step1}, {64: 1.0, 512: t512})
        )
    return rounds


def test_interleaved_figures_pair_each_phase_with_its_own_rounds_roofs():
    lm = models.build_tiny_model(seed=0)
    bandwidths = [10e9, 14e9, 21e9, 12e9, 18e9]  # the issue's roofs moved by half between runs
    rounds = _paired_rounds(bandwidths, lm)
    roofs = MeasuredRoofs(
        "cpu", "toy", "float32", 21e9, 210e9, 2**30, 2048, tuple(r.read_seconds for r in rounds),
        tuple(r.matmul_seconds for r in rounds), None, 1e10,
    )  # fmt: skip
    decode = [Timing.of(b, [r.decode[b] for r in rounds]) for b in (1, 8)]
    prefill = [Timing.of(n, [r.prefill[n] for r in rounds]) for n in (64, 512)]
    paired = phases.PhaseFigures(lm, roofs, "stock", 256, decode, prefill, 1, load=0.1, rounds=rounds)
    assert math.isclose(paired.decode_bandwidth_fraction, 0.5)
    assert math.isclose(paired.decode_step_ratio(8), 1.2)
    assert math.isclose(paired.prefill_flops_fraction, 0.6)
    assert paired.noise_check().ok  # the rounds agree although the raw timings spread by 2x
    unpaired = phases.PhaseFigures(lm, roofs, "stock", 256, decode, prefill, 1, load=0.1)
    assert unpaired.decode_bandwidth_fraction < 0.4 and not unpaired.noise_check().ok  # median step vs best roof
    d = paired.to_dict()
    assert d["rounds"] == 5 and math.isclose(d["paired_figures"]["batch-8 step over batch 1"]["median"], 1.2)


def test_the_interleaved_noise_check_drops_one_outlying_round_each_way_from_five_on():
    assert phases.central([5.0, 1.0, 1.1, 0.2, 1.05]) == [1.0, 1.05, 1.1]
    assert phases.central([5.0, 1.0, 1.1]) == [1.0, 1.1, 5.0]  # too few rounds to drop any
    lm = models.build_tiny_model(seed=0)
    rounds = _paired_rounds([10e9] * 5, lm)
    hit = rounds[2]  # one round in which batch 8 was hit by other work
    rounds[2] = phases.PhaseRound(
        hit.read_seconds, hit.matmul_seconds, {1: hit.decode[1], 8: 3 * hit.decode[1]}, hit.prefill
    )
    roofs = MeasuredRoofs("cpu", "toy", "float32", 10e9, 100e9, 2**30, 2048, (0.1,) * 5, (0.1,) * 5, None, 1e10)
    decode = [Timing.of(b, [r.decode[b] for r in rounds]) for b in (1, 8)]
    prefill = [Timing.of(n, [r.prefill[n] for r in rounds]) for n in (64, 512)]
    figures = phases.PhaseFigures(lm, roofs, "stock", 256, decode, prefill, 1, load=0.1, rounds=rounds)
    assert math.isclose(figures.decode_step_ratio(8), 1.2) and figures.noise_check().ok
    rounds[3] = rounds[2]  # two disturbed rounds: no longer an outlier
    figures = phases.PhaseFigures(lm, roofs, "stock", 256, decode, prefill, 1, load=0.1, rounds=rounds)
    assert not figures.noise_check().ok


def test_measure_phases_interleaves_roofs_and_phases_in_rounds():
    lm = models.build_tiny_model(seed=0)
    f = phases.measure_phases(lm, quick=True, batch_sizes=[1, 8], prompt_lengths=[16, 32], steps=2, rounds=3)
    assert len(f.rounds) == 3 and all(set(r.decode) == {1, 8} and set(r.prefill) == {16, 32} for r in f.rounds)
    assert len(f.roofs.read_times) == 9 and f.roofs.bandwidth == f.roofs.read_bytes / min(f.roofs.read_times)
    assert all(t.n == 3 for t in (*f.decode, *f.prefill))  # one value per round
    assert [t.low for t in f.decode] == [min(r.decode[b] for r in f.rounds) for b in (1, 8)]
    assert f.to_dict()["rounds"] == 3 and set(f.to_dict()["paired_figures"]) == {
        "decode share of the memory roof",
        "batch-8 step over batch 1",
        "prefill share of the compute roof",
    }
    with pytest.raises(ValueError, match="rounds and steps must be >= 1"):
        phases.measure_phases(lm, quick=True, rounds=0)


def test_quick_phase_model_is_a_smaller_llama_still_far_larger_than_a_cpu_cache():
    lm = phases.phase_model(quick=True, device="cpu", verbose=False)
    assert lm.name == phases.QUICK_PHASE_NAME and lm.geometry.attention == "GQA"
    assert 30e6 < lm.num_params < 50e6 and lm.weight_bytes > 4 * 32 * 2**20  # 4x a large laptop cache
    again = phases.phase_model(quick=True, device="cpu", verbose=False)
    assert all(torch.equal(a, b) for a, b in zip(lm.model.parameters(), again.model.parameters()))


def test_the_prefill_prediction_names_the_roof_that_sets_it():
    lm = models.build_tiny_model(seed=0)
    seconds, roof = phases.predicted_prefill_seconds(lm, _roofs(bandwidth=10e9, flops=100e9), 512)
    assert roof == "compute" and math.isclose(seconds, phases.prefill_flops(lm, 512) / 100e9)
    _, roof = phases.predicted_prefill_seconds(lm, _roofs(bandwidth=10e9, flops=1e15), 1)
    assert roof == "memory"
