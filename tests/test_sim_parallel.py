"""course.sim.parallel: tensor and pipeline parallelism, memory per GPU, the all-reduce cost, the CLI's --tp."""

from __future__ import annotations

import json
import math

import pytest

from course import hardware, roofline
from course.cli import main
from course.kv import budget, vllm
from course.kv.catalogue import catalogue, get_model
from course.kv.sizes import kv_heads_per_gpu
from course.sim import RooflineCost, SimConfig
from course.sim import parallel as P

OVERHEADS = {
    "activation_bytes": vllm.REFERENCE_LOG.activation_bytes,
    "non_torch_bytes": vllm.REFERENCE_LOG.non_torch_bytes,
}
H100 = hardware.gpu("H100-SXM")
LLAMA2_70B = get_model("Llama-2-70B")  # 80 layers, 64 query heads, 8 KV heads, hidden 8192


# --- layers and heads ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layers, pp, expected",
    [
        (80, 1, (80,)),
        (80, 4, (20, 20, 20, 20)),
        (80, 3, (27, 27, 26)),  # vLLM: the remainder goes to the stages before the last
        (32, 5, (6, 6, 7, 7, 6)),
        (61, 2, (31, 30)),
    ],
)
def test_pipeline_stages_split_the_layers_as_vllm_does(layers, pp, expected):
    assert P.pp_layer_partition(layers, pp) == expected


def test_pipeline_sizes_that_leave_a_stage_empty_are_refused():
    with pytest.raises(ValueError, match="without a layer"):
        P.pp_layer_partition(4, 5)
    with pytest.raises(ValueError, match="positive integer"):
        P.pp_layer_partition(4, 0)


def test_a_tp_shard_holds_its_share_of_heads_and_weights():
    shard = P.shard_geometry(LLAMA2_70B, 4)
    assert (shard.num_query_heads, shard.num_kv_heads) == (16, 2)
    assert shard.num_params == round(LLAMA2_70B.num_params / 4)
    assert shard.kv_bytes_per_token(2) == LLAMA2_70B.kv_bytes_per_token(2) / 4
    assert shard.hidden_size == LLAMA2_70B.hidden_size  # the all-reduces carry the whole width


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    tp8, tp16 = P.shard_geometry(LLAMA2_70B, 8), P.shard_geometry(LLAMA2_70B, 16)
    assert tp8.num_kv_heads == tp16.num_kv_heads == 1
    # one KV head per GPU either way: doubling TP past the KV heads does not shrink the cache per GPU
    assert tp16.kv_bytes_per_token(2) == tp8.kv_bytes_per_token(2)


def test_mla_keeps_its_whole_latent_on_every_gpu():
    g = get_model("DeepSeek-V2-Lite")
    for tp in (2, 4, 8):
        assert P.shard_geometry(g, tp).kv_bytes_per_token(2) == g.kv_bytes_per_token(2)


def test_tp_sizes_vllm_refuses_are_refused():
    with pytest.raises(ValueError, match="does not divide the 64 query heads"):
        P.shard_geometry(LLAMA2_70B, 3)
    assert P.valid_tp_sizes(LLAMA2_70B) == [1, 2, 4, 8, 16, 32, 64]
    assert all(kv_heads_per_gpu(LLAMA2_70B, tp) for tp in P.valid_tp_sizes(LLAMA2_70B))


def test_stages_carry_the_embedding_first_and_the_lm_head_last():
    g = LLAMA2_70B
    first, last = P.stage_geometry(g, 2, 0), P.stage_geometry(g, 2, 1)
    assert first.num_layers == last.num_layers == 40
    assert first.num_params + last.num_params == pytest.approx(g.num_params, abs=2)
    body_half = g.body_params / 2
    assert first.num_params == pytest.approx(body_half + g.lm_head_params, abs=1)


# --- memory: course.kv's budget per GPU ----------------------------------------------------------------


def test_tp1_is_course_kv_budget_itself():
    ours = P.parallel_budget(LLAMA2_70B, H100, tp=2, max_model_len=4096, **OVERHEADS)
    theirs = budget(LLAMA2_70B, H100, tp=2, max_model_len=4096, **OVERHEADS)
    assert ours == theirs
    assert ours.weights == pytest.approx(budget(LLAMA2_70B, H100, max_model_len=4096).weights / 2)


def test_pipeline_stages_split_weights_and_kv_and_take_the_fewest_blocks():
    tp2 = P.parallel_budget(LLAMA2_70B, H100, tp=2, max_model_len=4096, **OVERHEADS)
    pp2 = P.parallel_budget(LLAMA2_70B, H100, tp=1, pp=2, max_model_len=4096, **OVERHEADS)
    # the same bytes per token on each GPU (half the layers x all 8 heads = all layers x 4 heads), and
    # the same weights: each of two stages holds half the layers and one vocabulary table
    assert pp2.bytes_per_token == tp2.bytes_per_token
    assert pp2.weights == pytest.approx(tp2.weights, rel=1e-9)
    # three stages of 27, 27 and 26 layers: the first holds the embedding on top of 27 layers, so it has
    # the fewest blocks, and vLLM gives every stage that many
    stages = [
        budget(P.stage_geometry(LLAMA2_70B, 3, s), H100, max_model_len=4096, **OVERHEADS).num_blocks for s in range(3)
    ]
    pp3 = P.parallel_budget(LLAMA2_70B, H100, tp=1, pp=3, max_model_len=4096, **OVERHEADS)
    assert pp3.num_blocks == stages[0] == min(stages) < stages[1]


# --- interconnects -------------------------------------------------------------------------------------


def test_the_fastest_link_that_holds_the_group_is_chosen():
    assert hardware.interconnect("H100", gpus=8).kind == "nvlink"
    assert hardware.interconnect("H100", gpus=16).kind == "network"  # past one 8-GPU server
    assert hardware.interconnect("L4", gpus=4).kind == "pcie"  # no NVLink on an L4
    assert hardware.interconnect("H100", "pcie").bandwidth == 64e9  # 128 GB/s both ways
    with pytest.raises(ValueError, match="has no nvlink link"):
        hardware.interconnect("L4", "nvlink")
    for links in hardware.INTERCONNECTS.values():
        for link in links:
            assert link.source and link.latency_source and link.bandwidth > 0


# --- the cost model ------------------------------------------------------------------------------------


def test_a_ring_allreduce_moves_two_times_tp_minus_one_over_tp_of_the_message():
    link = hardware.interconnect("H100", "nvlink")
    assert P.allreduce_seconds(1e6, 1, link) == 0.0
    assert P.allreduce_seconds(1e6, 4, link) == pytest.approx(link.latency + 1.5e6 / link.bandwidth)
    assert P.allreduce_seconds(1e6, 8, link) == pytest.approx(link.latency + 1.75e6 / link.bandwidth)


def test_one_gpu_is_the_plain_roofline():
    plain = RooflineCost(LLAMA2_70B, H100)
    one = P.parallel_cost(LLAMA2_70B, H100, 1, 1)
    for work in [(512, 0, 0, 512 * 513 / 2), (0, 32, 32 * 900, 32 * 900), (100, 10, 5000, 9000)]:
        assert one.step_seconds(*work) == plain.step_seconds(*work)


def test_tp_divides_the_work_and_adds_two_allreduces_per_layer():
    cost = P.parallel_cost(LLAMA2_70B, H100, 4)
    shard = RooflineCost(P.shard_geometry(LLAMA2_70B, 4), H100)
    link = hardware.interconnect(H100, gpus=4)
    decode = (0, 16, 16 * 1000, 16 * 1000)
    allreduce = P.allreduce_seconds(16 * 8192 * 2, 4, link)
    assert cost.step_seconds(*decode) == pytest.approx(shard.step_seconds(*decode) + 2 * 80 * allreduce)
    # memory-bound decode: a quarter of the weights per GPU, so much faster than one GPU
    assert cost.step_seconds(*decode) < RooflineCost(LLAMA2_70B, H100).step_seconds(*decode) / 3


def test_pcie_allreduces_cost_more_than_nvlink():
    nvlink = P.parallel_cost(LLAMA2_70B, H100, 8, interconnect="nvlink").breakdown(2048, 0, 0)
    pcie = P.parallel_cost(LLAMA2_70B, H100, 8, interconnect="pcie").breakdown(2048, 0, 0)
    assert pcie.allreduce > 5 * nvlink.allreduce
    assert pcie.stage_compute == nvlink.stage_compute


def test_a_lone_request_leaves_the_pipeline_mostly_empty():
    cost = P.parallel_cost(LLAMA2_70B, H100, 2, 2)
    one = cost.breakdown(0, 1, 500)
    assert (one.micro_batches, one.bubble) == (1, 0.5)
    stage = cost.stage.step_seconds(0, 1, 500)
    allreduce = 2 * 40 * P.allreduce_seconds(8192 * 2, 2, cost.tp_link)
    hop = P.p2p_seconds(8192 * 2, cost.pp_link)
    assert one.seconds == pytest.approx(2 * (stage + allreduce) + hop)
    full = cost.breakdown(0, 8, 4000)
    assert (full.micro_batches, full.bubble) == (2, 0.0)


def test_for_the_same_gpus_tp_decodes_faster_than_pp():
    tp4 = P.parallel_cost(LLAMA2_70B, H100, 4)
    tp2pp2 = P.parallel_cost(LLAMA2_70B, H100, 2, 2)
    for batch in (1, 8, 64):
        work = (0, batch, batch * 1000, batch * 1000)
        # each PP stage reads its weights once per micro-batch: a round reads them twice over
        assert tp4.step_seconds(*work) < tp2pp2.step_seconds(*work)


def test_pipeline_rounds_get_one_token_budget_per_batch_in_flight():
    config = SimConfig.vllm_defaults(H100)
    assert P.pipeline_config(config, 1) is config
    assert P.pipeline_config(config, 3).token_budget == 3 * config.token_budget


# --- fitting -------------------------------------------------------------------------------------------


def test_the_smallest_tp_that_fits_is_named():
    assert P.smallest_tp(LLAMA2_70B, H100, **OVERHEADS) == 2
    assert P.smallest_tp("Llama-3.1-70B", H100, max_model_len=8192, **OVERHEADS) == 2
    # at its full 131,072-token context one request needs more KV than two H100s leave
    assert P.smallest_tp("Llama-3.1-70B", H100, **OVERHEADS) == 4
    message = P.does_not_fit_message("Llama-3.1-70B", H100, **OVERHEADS)
    assert "--tp 4" in message and "With --max-model-len 8192: --tp 2" in message
    assert P.does_not_fit_message("Llama-3.1-70B", H100, tp=4, **OVERHEADS) is None


def test_every_catalogue_model_has_a_tp_that_fits_on_an_h100():
    for name in catalogue():
        g = get_model(name)
        if g.num_params is None:
            continue
        tp = P.smallest_tp(g, H100, **OVERHEADS)
        assert tp is not None, name
        config, cost = P.deployment(g, H100, tp)
        assert config.num_blocks > 0 and cost.tp == tp


def test_deployment_refuses_with_the_smallest_tp():
    with pytest.raises(P.DoesNotFit, match="smallest tensor-parallel size that fits: --tp 2"):
        P.deployment("Llama-2-70B", "H100-SXM", 1)


# --- course simulate ------------------------------------------------------------------------------------


def test_cli_names_the_smallest_tp_for_a_70b_model(capsys):
    assert main(["simulate", "--model", "Llama-2-70B", "--requests", "5"]) == 2
    err = capsys.readouterr().err
    assert "does not fit on 1 x H100-SXM" in err and "--tp 2" in err


def test_cli_simulates_a_70b_model_on_tp_gpus(capsys):
    args = ["simulate", "--model", "Llama-2-70B", "--requests", "20", "--rate", "4", "--json"]
    assert main([*args, "--tp", "2"]) == 0
    tp2 = json.loads(capsys.readouterr().out)
    assert tp2["completed"] == 20 and "TP 2 over NVLink 4" in tp2["config"]["cost"]
    assert main([*args, "--tp", "4"]) == 0
    tp4 = json.loads(capsys.readouterr().out)
    assert tp4["config"]["num_blocks"] > tp2["config"]["num_blocks"]  # half the weights per GPU
    assert tp4["tpot"]["mean_s"] < tp2["tpot"]["mean_s"]
    assert main([*args, "--tp", "2", "--pp", "2"]) == 0
    pp = json.loads(capsys.readouterr().out)
    assert "PP 2" in pp["config"]["cost"]
    assert pp["config"]["max_num_batched_tokens"] == 2 * tp2["config"]["max_num_batched_tokens"]


def test_cli_kv_gib_is_per_gpu_under_tp(capsys):
    args = ["simulate", "--model", "Llama-2-70B", "--requests", "5", "--json", "--kv-gib", "10"]
    assert main([*args, "--tp", "2"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    blocks = config["num_blocks"]
    per_block = config["block_size"] * P.shard_geometry(LLAMA2_70B, 2).kv_bytes_per_token(2)
    assert blocks == math.floor(10 * 2**30 / per_block)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "3"], "does not divide the 64 query heads"),
        (["--tp", "2", "--cost", "linear", "--linear", "0.01,0,0,0"], "a linear cost is fitted on one deployment"),
        (["--pp", "100"], "leaves a stage without a layer"),
    ],
)
def test_cli_bad_parallel_settings_are_named(args, message, capsys):
    assert main(["simulate", "--model", "Llama-2-70B", "--requests", "5", *args]) == 2
    assert message in capsys.readouterr().err


# --- a mixture of experts: a shard runs its share of the active parameters ---------------------------


def test_a_tp_shard_of_a_moe_computes_and_reads_a_tp_th_of_the_active_parameters():
    """vLLM's default MoE tensor parallelism: every rank holds 1/tp of every expert, so a rank runs 1/tp of
    what a token runs on the whole model (37 B of DeepSeek-V3's 671 B), not 1/tp of every parameter."""
    v3 = get_model("DeepSeek-V3")
    whole = RooflineCost(v3, H100)
    for tp in (2, 8):
        shard = P.parallel_cost(v3, H100, tp).stage
        assert shard.active_params == pytest.approx(37e9 / tp)
        assert shard.flops(0, 1, 1000) == pytest.approx(whole.flops(0, 1, 1000) / tp)
        for tokens in (1, 16, 4096):  # the experts a step reads, a tp-th of each on every rank
            assert shard.weight_bytes_read(tokens) == pytest.approx(whole.weight_bytes_read(tokens) / tp)
        assert shard.weight_bytes == pytest.approx(whole.weight_bytes / tp)
    decode = (0, 1, 1000, 1000)
    tp8 = P.parallel_cost(v3, H100, 8).breakdown(*decode)
    assert tp8.stage_compute < whole.step_seconds(*decode) / 4  # batch 1: 4.6 GB of weights per GPU, not 84 GB
    assert P.shard_moe_layout(LLAMA2_70B, 4, 2, 1) is None  # a dense model has no layout to shard


def test_pipeline_stages_of_a_moe_hold_their_own_experts_and_share_the_active_parameters():
    v3, layout = get_model("DeepSeek-V3"), roofline.MOE_MODELS["DeepSeek-V3"]
    stages = [P.stage_geometry(v3, 2, s) for s in range(2)]
    parts = [P.shard_moe_layout(v3, 1, 2, s) for s in range(2)]
    assert [p.moe_layers for p in parts] == [28, 30]  # layers 0-30 (the first three dense) and 31-60
    assert sum(s.num_params for s in stages) == pytest.approx(v3.num_params)
    for stage, part in zip(stages, parts):  # each stage holds at least its own experts
        assert stage.num_params > part.moe_layers * layout.experts * layout.expert_params
        assert part.params_read(1) == pytest.approx(part.active_params)
    assert sum(p.active_params for p in parts) == pytest.approx(layout.active_params)
    assert P.heaviest_stage_index(v3, 2) == 1 and P.heaviest_stage(v3, 2) == stages[1]  # 30 MoE layers to 28
    cost = P.parallel_cost(v3, H100, 8, 2)
    assert cost.stage.moe == P.shard_moe_layout(v3, 8, 2, 1)
    assert cost.stage.active_params == pytest.approx(parts[1].active_params / 8)
    assert P.shard_moe_layout(v3) == layout  # one GPU: the whole model
