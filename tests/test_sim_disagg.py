"""Prefill/decode disaggregation (course.sim.disagg): the two pools, the KV transfer, the stitched traces."""

import pytest

from course import hardware, kv, metrics, workload
from course.sim import RooflineCost, SimConfig, simulate
from course.sim import disagg as D
from course.sim.fleet import simulate_fleet
from course.workload import RequestSpec, Workload

LLAMA = kv.get_model("Llama-3.1-8B")
COST = RooflineCost(LLAMA, hardware.gpu("H100-SXM"))
CONFIG = SimConfig.vllm_defaults("H100-SXM", num_blocks=20_000)
NVLINK = hardware.interconnect("H100-SXM", "nvlink")
KV_BYTES = kv.bytes_per_token(LLAMA)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    link = hardware.interconnect("H100-SXM", "network")
    assert D.transfer_seconds(1000, KV_BYTES, link) == pytest.approx(link.latency + 1000 * KV_BYTES / link.bandwidth)
    assert D.transfer_seconds(0, KV_BYTES, link) == link.latency
    with pytest.raises(ValueError):
        D.transfer_seconds(10, 0, link)


def test_one_request_gets_its_first_token_from_prefill_and_the_rest_after_the_transfer():
    one = Workload([RequestSpec("r", 0.0, 2000, 5)])
    run = D.simulate_disaggregated(one, (CONFIG, COST, 1), (CONFIG, COST, 1), KV_BYTES, NVLINK)
    alone = simulate(Workload([RequestSpec("r", 0.0, 2000, 1)]), CONFIG, COST)
    (trace,) = run.traces
    assert trace.output_tokens == 5 and trace.error is None
    assert trace.chunk_times[0] == pytest.approx(float(alone.requests[0].token_times[0]))
    handed_over = trace.chunk_times[0] + run.transfers[0]
    assert trace.chunk_times[1] > handed_over  # the decode pool's first step starts after the KV arrived
    step = COST.step_seconds(0, 1, 2002, 2003)  # one request decoding after its 2,000-token prompt
    gaps = [b - a for a, b in zip(trace.chunk_times[1:], trace.chunk_times[2:])]
    assert gaps == pytest.approx([step] * len(gaps), rel=0.05)


def test_every_request_is_served_with_all_its_tokens():
    traffic = workload.poisson(
        4.0, 60, workload.lognormal(3000, 0.3, high=6000), workload.lognormal(150, 0.5, high=400)
    )
    run = D.simulate_disaggregated(traffic, (CONFIG, COST, 1), (CONFIG, COST, 1), KV_BYTES, NVLINK)
    assert [t.request_id for t in run.traces] == [s.request_id for s in traffic]
    assert all(t.error is None for t in run.traces)
    assert [t.output_tokens for t in run.traces] == [s.output_tokens for s in traffic]


def test_disaggregation_takes_prefill_out_of_the_decode_steps():
    """Long prompts on the same two GPUs: colocated, every prefill stretches everyone's decode step;
    disaggregated, the decode pool's steps hold decodes only, so ITL's tail drops."""
    traffic = workload.poisson(
        10.0, 240, workload.lognormal(4000, 0.3, high=7000), workload.lognormal(200, 0.5, high=600), seed=3
    )
    run = D.simulate_disaggregated(traffic, (CONFIG, COST, 1), (CONFIG, COST, 1), KV_BYTES, NVLINK)
    split = run.summary(percentiles=(50, 99))
    together = metrics.summarize(simulate_fleet(traffic, 2, CONFIG, COST).traces, percentiles=(50, 99))
    assert split.itl["p99"] < 0.5 * together.itl["p99"]
    # and the other side of the trade: one GPU prefills what two shared
    assert split.ttft["p50"] > together.ttft["p50"]
