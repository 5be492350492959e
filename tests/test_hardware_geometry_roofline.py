"""Hardware specs, model geometry and the roofline helpers."""

import json

import pytest

from course import geometry, hardware, kv, roofline


def test_every_gpu_has_a_source_and_a_sane_ridge_point():
    for spec in hardware.GPUS.values():
        assert spec.source.startswith("NVIDIA") and "https://www.nvidia.com/" in spec.source
        assert 100 < spec.ridge_point < 500, spec  # dense bf16/fp16 ridges of datacenter GPUs
    assert hardware.gpu("h100-sxm").ridge_point == pytest.approx(989e12 / 3.35e12)


def test_datasheet_memory_is_gib_and_only_gddr_loses_capacity_to_ecc():
    """An H100's "80 GB" is 80 GiB of HBM3; its driver total (79.14 GiB) is more than 80 x 10^9 bytes.

    HBM keeps ECC bits beside the data: the driver's total stays within 2 % of the capacity. GDDR6
    with ECC on gives up 1/16 of it, so the driver reports less than 15/16 of the datasheet's GiB.
    """
    h100 = hardware.gpu("H100")
    assert h100.memory_bytes == 80 * 2**30 and h100.datasheet_memory == "80 GB HBM3"
    assert h100.total_memory == pytest.approx(84.98e9, rel=1e-3) and h100.total_memory > 80e9
    for spec in hardware.GPUS.values():
        label = spec.datasheet_memory
        assert float(label.split()[0]) * 2**30 == spec.memory_bytes, spec.name
        if "HBM" in label:
            assert 0.98 * spec.memory_bytes < spec.total_memory < spec.memory_bytes, spec.name
        else:
            assert "GDDR" in label and spec.total_memory < spec.memory_bytes * 15 / 16, spec.name
    measured = hardware.HardwareSpec("toy", memory_bytes=3 * 2**30, bandwidth=1.0, flops=1.0, source="test")
    assert measured.datasheet_memory == "3 GiB"


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown GPU 'H300'.*H100-SXM"):
        hardware.gpu("H300")


def test_measured_runtime_spec_is_plausible():
    spec = hardware.measure_runtime("cpu", quick=True)
    assert spec.flops > 1e8 and spec.bandwidth > 1e8 and spec.memory_bytes > 1e9
    assert spec.source.startswith("measured on this runtime")


def test_geometry_reads_mha_gqa_and_explicit_head_dim(tmp_path):
    mha = geometry.from_hf_config({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096})
    assert (mha.num_kv_heads, mha.head_dim, mha.attention) == (32, 128, "MHA")
    gqa = geometry.from_hf_config(
        {
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "hidden_size": 1024,
            "head_dim": 128,
        }
    )
    assert (gqa.head_dim, gqa.attention) == (128, "GQA")  # explicit head_dim, not 1024 // 16
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 64})
    )
    assert geometry.from_hf_config(tmp_path).attention == "MQA"


def test_geometry_errors_name_the_field():
    with pytest.raises(ValueError, match="'num_attention_heads'"):
        geometry.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64})
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        geometry.ModelGeometry("x", 2, num_query_heads=6, num_kv_heads=4, head_dim=8, hidden_size=48)
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        geometry.ModelGeometry("x", 0, 4, 4, 8, 32)


def test_seed_kv_numbers_and_their_gqa_counterpart():
    gib = 2**30
    per_token = kv.get_model("Llama-2-7B").kv_bytes_per_token(2)
    assert per_token == 2**19  # 0.5 MiB
    assert per_token * 4096 == 2 * gib
    assert per_token * 131072 == 64 * gib
    assert per_token * 131072 * 8 == 512 * gib
    assert kv.get_model("Llama-3-8B").kv_bytes_per_token(2) * 131072 == 16 * gib


def test_linear_layer_intensity_and_bounds():
    flops, moved = roofline.linear_layer_flops_bytes(1, 4096, 4096, 2)
    assert roofline.arithmetic_intensity(flops, moved) == pytest.approx(1.0, rel=1e-3)
    h100 = hardware.gpu("H100-SXM")
    assert roofline.bound(1.0, h100) == "memory" and roofline.bound(1000.0, h100) == "compute"
    assert roofline.roofline_seconds(1.0, h100.bandwidth, h100) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        roofline.arithmetic_intensity(1.0, 0)


def test_decode_batches_for_free_at_short_context_but_not_at_long():
    h100, llama = hardware.gpu("H100-SXM"), kv.get_model("Llama-3-8B")

    def step(batch, context):
        return roofline.roofline_seconds(*roofline.decode_step_flops_bytes(llama, batch, context), h100)

    assert step(32, 1024) / step(1, 1024) < 1.5
    assert step(32, 32768) / step(1, 32768) > 5
    assert roofline.bound(roofline.arithmetic_intensity(*roofline.prefill_flops_bytes(llama, 4096)), h100) == "compute"


def test_roofline_leaves_out_the_embedding_and_runs_the_lm_head_only_where_logits_are_computed():
    llama = kv.get_model("Llama-3-8B")  # vocab 128,256 x hidden 4,096, untied: two 525M-parameter tables
    table = 128_256 * 4096
    assert llama.lm_head_params == table and llama.body_params == 8_030_261_248 - 2 * table
    n = 4096
    attention = 4.0 * 32 * 32 * 128 * n * n / 2
    flops, moved = roofline.prefill_flops_bytes(llama, n)
    assert flops == 2.0 * llama.body_params * n + 2.0 * table + attention  # logits at the last position only
    assert (2.0 * llama.num_params * n + attention) / flops > 1.1  # counting every parameter: >10 % high
    assert moved == (llama.body_params + table) * 2 + n * 4096 * 2 + n * 131072  # one embedding row per token
    flops, moved = roofline.decode_step_flops_bytes(llama, 8, 1000)
    assert flops == 8 * (2.0 * (llama.body_params + table) + 4.0 * 1000 * 32 * 128 * 32)  # every decode token sampled
    assert moved == (llama.body_params + table) * 2 + 8 * 4096 * 2 + 8 * 1000 * 131072
    toy = geometry.ModelGeometry("toy", 2, 4, 2, 8, 32, num_params=10_000)  # no vocabulary: all parameters count
    assert roofline.prefill_flops_bytes(toy, 10)[0] == 2.0 * 10_000 * 10 + 4.0 * 2 * 4 * 8 * 10 * 10 / 2


def test_moe_layouts_add_up_to_their_published_totals():
    for name, layout in roofline.MOE_MODELS.items():
        assert kv.get_model(name).num_params is not None, name  # every MoE model is in the catalogue
        implied = layout.dense_params + layout.moe_layers * layout.experts * layout.expert_params
        assert implied == pytest.approx(layout.total_params, rel=0.02), name
        assert 0 < layout.dense_params < layout.active_params < layout.total_params, name
    mixtral = roofline.MOE_MODELS["Mixtral-8x7B"]  # count_params counts Mixtral exactly: 46.70B
    assert mixtral.total_params == pytest.approx(kv.get_model("Mixtral-8x7B").num_params, rel=0.001)


@pytest.mark.parametrize(
    "name, active, total",
    [
        ("DeepSeek-V3", 37e9, 671e9),  # the technical report's abstract, arXiv:2412.19437
        ("Mixtral-8x7B", 12.9e9, 46.7e9),  # mistral.ai/news/mixtral-of-experts (arXiv:2401.04088: 13 B of 47 B)
    ],
)
def test_the_active_parameter_count_agrees_with_the_catalogue_and_the_published_figure(name, active, total):
    """The one active count (what a token computes through and a one-token step reads) is the published one,
    and the catalogue's parameter count less the routed experts a token skips lands within 2 % of it."""
    from course.sim import RooflineCost

    layout, g = roofline.MOE_MODELS[name], kv.get_model(name)
    assert (layout.active_params, layout.total_params) == (active, total)
    skipped = layout.moe_layers * (layout.experts - layout.experts_per_token) * layout.expert_params
    assert g.num_params - skipped == pytest.approx(active, rel=0.02)  # measured 1.4 % and 0.2 % off
    cost = RooflineCost(g, hardware.gpu("H100-SXM"))
    assert cost.active_params == pytest.approx(active) == layout.params_read(1)
    assert cost.flops(0, 1) / 2 == pytest.approx(active)


def test_experts_read_grows_from_top_k_at_one_token_to_all_experts():
    v3 = roofline.MOE_MODELS["DeepSeek-V3"]
    assert v3.experts_read(0) == 0 and v3.experts_read(1) == pytest.approx(8)
    assert v3.experts_read(4) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 4))
    assert v3.experts_read(4) < 4 * 8  # four tokens share some experts: fewer than 32 distinct
    assert v3.experts_read(10_000) == pytest.approx(256)
    assert v3.params_read(1) == pytest.approx(v3.active_params)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        v3.experts_read(-1)


def test_a_moe_decode_step_reads_its_active_weights_at_batch_1_and_more_experts_as_the_batch_grows():
    v3 = kv.get_model("DeepSeek-V3")
    assert v3.weight_dtype == "fp8"  # its config's quantization_config: one byte per weight
    at1 = roofline.moe_decode_bytes(v3, 1, "fp8")
    assert 35e9 < at1 < 37e9  # 37 B active, less the input embedding (a lookup, 0.93 B)
    assert roofline.moe_decode_bytes(v3, 1, "bf16") == pytest.approx(2 * at1)
    assert at1 < roofline.moe_decode_bytes(v3, 8, "fp8") < roofline.moe_decode_bytes(v3, 64, "fp8") < 671e9
    flops, moved = roofline.decode_step_flops_bytes(v3, 1, 0, weight_bytes_per_value=1.0)
    assert flops == pytest.approx(2 * at1)  # 2 FLOPs per active parameter, not per one of the 671 B
    assert moved == pytest.approx(at1 + v3.hidden_size * 2)  # the weights, plus one embedding row in bf16
    prefill_flops, prefill_bytes = roofline.prefill_flops_bytes(v3, 4096, weight_bytes_per_value=1.0)
    assert prefill_bytes > 0.95 * 671e9  # a long prompt reads (nearly) every expert
    assert prefill_flops < 2 * 40e9 * 4096 + 4.0 * 61 * 128 * 192 * 4096 * 4096 / 2  # active parameters only
    llama = kv.get_model("Llama-3-8B")  # dense: the same bytes at every batch
    assert (
        roofline.moe_decode_bytes(llama, 1)
        == roofline.moe_decode_bytes(llama, 64)
        == 2 * (llama.body_params + llama.lm_head_params)
    )


def test_weight_bytes_per_param_knows_the_served_formats():
    assert [roofline.weight_bytes_per_param(d) for d in ("fp32", "bf16", "fp8", "int8", "int4")] == [4, 2, 1, 1, 0.5]
    with pytest.raises(ValueError, match="choose one of fp32"):
        roofline.weight_bytes_per_param("int3")
