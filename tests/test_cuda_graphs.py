"""course.cuda_graphs: the static-cache decode step behind the CUDA-graph path, and its place in the phase figures.

The graph capture itself needs CUDA (benchmarks/gpu_runtime.py runs it on a GPU machine); everything
the capture records runs here on a CPU: the static cache, the in-place step, the timing, the skip.
"""

import math

import pytest
import torch

from course import cuda_graphs, measure, models, phases
from course.hardware import MeasuredRoofs
from course.measure import Timing


@pytest.fixture(scope="module")
def tiny():
    return models.build_tiny_model(seed=0)


def test_static_cache_steps_compute_the_dynamic_cache_logits(tiny):
    # Positions, the mask over the unfilled slots and the in-place token feedback must all be right.
    assert cuda_graphs.max_logit_difference(tiny, prompt_tokens=12, steps=6, graph=False) < 1e-4


def test_static_steps_generate_the_greedy_tokens_of_the_dynamic_cache(tiny):
    prompt = tiny.random_ids(2, 9, seed=3)
    static = cuda_graphs.StaticDecodeStep.from_prompt(tiny, prompt, capacity=20)
    produced = [static.ids.clone()]
    for _ in range(5):
        static()
        produced.append(static.ids.clone())
    with torch.inference_mode():
        logits, cache = models.forward(tiny.model, prompt, models.new_cache(tiny.model))
        expected = [logits[:, -1:].argmax(-1)]
        for _ in range(5):
            logits, cache = models.forward(tiny.model, expected[-1], cache)
            expected.append(logits[:, -1:].argmax(-1))
    assert all(torch.equal(a, b) for a, b in zip(produced, expected))
    assert static.length == 9 + 5 and int(static.cache.get_seq_length()) == 14


def test_filled_static_cache_holds_the_context_and_refuses_to_overflow(tiny):
    step = cuda_graphs.StaticDecodeStep.filled(tiny, batch=3, context=10, capacity=12)
    assert int(step.cache.get_seq_length()) == 10
    assert step.cache.layers[0].keys.shape == (3, tiny.geometry.num_kv_heads, 12, tiny.geometry.head_dim)
    assert step().shape == (3, 1, tiny.vocab_size)
    step()
    with pytest.raises(ValueError, match="static cache is full"):
        step()
    with pytest.raises(ValueError, match="leaves no room"):
        cuda_graphs.StaticDecodeStep.filled(tiny, batch=1, context=10, capacity=10)


def test_on_a_cpu_the_graph_path_says_it_needs_cuda_and_the_eager_static_sweep_runs(tiny):
    reason = cuda_graphs.graph_unavailable(tiny)
    assert reason is not None and "CUDA" in reason and "eagerly" in reason
    with pytest.raises(ValueError, match="CUDA"):
        cuda_graphs.decode_step_seconds(tiny, 1, 16, steps=2, graph=True)
    with pytest.raises(ValueError, match="cannot capture a CUDA graph"):
        cuda_graphs.StaticDecodeStep.filled(tiny, 1, 8, 16).capture()
    sweep = cuda_graphs.decode_sweep(tiny, [1, 4], context=16, steps=3, graph=False)
    assert [t.size for t in sweep] == [1, 4] and all(t.n == 3 and t.median > 0 for t in sweep)


def test_measure_phases_on_a_cpu_skips_the_graph_sweep_and_says_why(tiny):
    roofs = MeasuredRoofs("cpu", "toy", "float32", 10e9, 100e9, 2**30, 2048, (0.1,) * 3, (0.1,) * 3, None, 1e10)
    f = phases.measure_phases(tiny, quick=True, roofs=roofs, batch_sizes=[1, 8], prompt_lengths=[16], steps=2)
    assert f.decode_graph is None and f.decode_headline == "eager" and "CUDA" in f.graph_note
    d = f.to_dict()
    assert d["decode_bandwidth_fraction_graph"] is None and d["decode_steps_graph"] is None
    assert d["decode_bandwidth_fraction"] == d["decode_bandwidth_fraction_eager"]
    with pytest.raises(ValueError, match="CUDA"):
        phases.measure_phases(tiny, quick=True, roofs=roofs, batch_sizes=[1], prompt_lengths=[16], graph=True)


def test_the_graph_sweep_is_the_headline_and_the_eager_one_stays_beside_it(tiny):
    roofs = MeasuredRoofs("cuda", "toy GPU", "bfloat16", 10e9, 100e9, 2**30, 2048, (0.1,) * 3, (0.1,) * 3, None, 1e10)
    one = phases.decode_bytes_per_step(tiny, 1, 256) / 1e9  # 1 GB/s: 10 % of the roof, launch-bound
    eager = [Timing(1, one, one, one, 8), Timing(8, 1.1 * one, one, 1.2 * one, 8)]
    fast = one / 6  # the graph replay reads at 6 GB/s: 60 %
    graph = [Timing(1, fast, fast, fast, 8), Timing(8, 2 * fast, 2 * fast, 2 * fast, 8)]
    prefill = [Timing(512, 1.0, 1.0, 1.0, 3)]
    f = phases.PhaseFigures(tiny, roofs, "stock", 256, eager, prefill, 1, 0.1, graph, cuda_graphs.WHAT_WAS_DONE)
    assert f.decode_headline == "cuda-graph"
    assert math.isclose(f.decode_bandwidth_fraction, 0.6) and math.isclose(f.bandwidth_fraction(False), 0.1)
    assert math.isclose(f.decode_step_ratio(8), 2.0) and math.isclose(f.decode_step_ratio(8, graph=False), 1.1)
    assert f.observed_free_batch is not None  # the graph sweep passes 1.5x; the eager one never does
    d = f.to_dict()
    assert d["decode_headline"] == "cuda-graph" and math.isclose(d["decode_bandwidth_fraction_graph"], 0.6)
    assert math.isclose(d["decode_step_ratio_batch8_eager"], 1.1) and set(d["decode_steps_graph"]) == {"1", "8"}
    assert "CUDA graph" in d["graph_note"]
    assert [line.split(":")[0] for line in f.decode_lines(graph=False)] == ["batch   1", "batch   8"]


def test_filled_cache_fills_a_static_cache_it_is_given(tiny):
    cache = measure.filled_cache(tiny, batch=2, context=5, cache=cuda_graphs.static_cache(tiny, capacity=9))
    assert type(cache).__name__ == "StaticCache" and int(cache.get_seq_length()) == 5
