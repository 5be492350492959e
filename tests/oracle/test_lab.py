"""The final lab's live path (module 7) against a real ``vllm serve``: one server start for the module.

``course.vllm_lab.lab_run`` is what the notebook runs when vLLM is installed: it starts the CPU build on the
course's tiny model with a 16-block KV cache and a queue cap, records the quick plan's phases, then the
course's own server under the same ``vllm bench serve`` load. These tests check that the live run shows
what the recorded one shipped with the course shows, through the same code (a few minutes on 2 cores).
"""

from __future__ import annotations

import math

import pytest

from course import metrics, vllm_lab


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> vllm_lab.RecordedRun:
    run = vllm_lab.lab_run(live=True, out=tmp_path_factory.mktemp("lab"), log=lambda line: None)
    assert run.root != vllm_lab.DATA_DIR, "lab_run fell back to the recorded run: vLLM did not start"
    return run


def test_the_live_log_line_is_what_the_course_calculator_predicts(live):
    budget = live.predicted_budget()
    assert live.meta["max_model_len"] == live.startup.max_model_len
    assert live.startup.line == budget.log_line
    assert int(vllm_lab.cache_config(live.snapshots["start"])["num_gpu_blocks"]) == budget.num_blocks == 16


def test_the_live_engine_counts_prefix_hits_preemptions_and_rejections(live):
    plan = live.meta["plan"]
    assert live.counters("prefix_shared").prefix_hits == (plan["prefix_requests"] - 1) * plan["prefix_tokens"]
    assert live.counters("prefix_timestamp").prefix_hits == 0
    assert live.counters("preemption").preemptions > 0
    refused = live.counters("admission").admission_rejections
    assert refused > 0 and refused == sum(not t.succeeded for t in live.traces["admission"])
    assert max(s[vllm_lab.KV_USAGE] for s in live.gauges["preemption"]) > 0.9


def test_vllm_bench_serve_and_course_metrics_agree_on_the_live_chunk_times(live):
    for name in ("serve", "heldout", "reference"):
        result = live.benches[name]
        ours = metrics.summarize(vllm_lab.bench_traces(result), percentiles=(50, 90, 99))
        for metric in ("ttft", "tpot", "itl"):
            for q in (50, 90, 99):
                got, expected = getattr(ours, metric).percentiles[q] * 1e3, result[f"p{q}_{metric}_ms"]
                assert got == pytest.approx(expected, abs=1e-6), (name, metric, q)


def test_the_simulator_calibrated_on_vllms_own_steps_predicts_the_held_out_run(live):
    steps = vllm_lab.calibration_steps(live)
    prefill = {s.prefill_tokens: s.seconds for s in steps if s.prefill_tokens}
    assert prefill[256] > prefill[16] > 0 and all(0 < s.seconds < 1 for s in steps)
    prediction = vllm_lab.predict_heldout(live)
    assert all(math.isfinite(error) for error in prediction.errors.values())
    assert prediction.simulated.completed == prediction.measured.completed == live.meta["plan"]["heldout"]["n"]
    rows = vllm_lab.server_comparison(live)
    assert all(row["output_tokens_per_s"] > 0 for row in rows.values())
