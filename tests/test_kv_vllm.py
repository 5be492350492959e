"""The calculator against today's vLLM (course.kv.vllm names the version and files) and today's configs.

Where transformers can build a model offline (random small configs) the bytes are checked against its
real caches; where it cannot (vLLM's allocator), against vLLM's formulas, written out here by hand from
vllm/v1/kv_cache_interface.py and vllm/v1/core/kv_cache_utils.py.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from course import geometry, hardware, kv
from course.cli import main as course_main
from course.kv import vllm

GIB = 2**30
LOG_COMMAND = [
    "kv",
    "Llama-3-8B",
    "--gpu-memory-gib",
    "79.14",
    "--utilization",
    "0.9",
    "--weights-gib",
    "14.99",
    "--activation-gib",
    "1.19",
    "--non-torch-gib",
    "0.12",
    "--json",
]

# google/gemma-3-27b-it config.json as published (text_config; no sliding_window_pattern key: the
# layout comes from Gemma3TextConfig's default pattern of 6).
GEMMA3_27B = {
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "head_dim": 128,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "sliding_window": 1024,
        "max_position_embeddings": 131072,
    },
    "torch_dtype": "bfloat16",
}
# Qwen/Qwen3-Next-80B-A3B config.json keys that set its caches: 3 gated-DeltaNet layers per full one.
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "hidden_size": 2048,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "max_position_embeddings": 262144,
    "torch_dtype": "bfloat16",
}
# meta-llama/Llama-4-Scout-17B-16E text_config keys: chunked local attention, every 4th layer global.
LLAMA4_SCOUT = {
    "model_type": "llama4",
    "text_config": {
        "model_type": "llama4_text",
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_size": 5120,
        "attention_chunk_size": 8192,
        "max_position_embeddings": 10485760,
    },
    "torch_dtype": "bfloat16",
}


# --- 1. the memory the driver reports ---------------------------------------------------------------------


def test_the_public_startup_log_is_reproduced(capsys):
    """total_gpu_memory (79.14GiB) x 0.90 = 71.22GiB; 14.99 + 0.12 + 1.19 GiB taken; 54.93 GiB for the KV cache."""
    assert course_main(LOG_COMMAND) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_memory"] / GIB == pytest.approx(54.93, rel=1e-3)
    assert data["requested"] / GIB == pytest.approx(71.22, abs=0.01)
    # the catalogue's H100 is the same card as the log's: no flag needed
    b = kv.budget("Llama-3-8B", "H100-SXM", utilization=0.9, weight_bytes=14.99 * GIB, activation_bytes=1.19 * GIB,
                  non_torch_bytes=0.12 * GIB)  # fmt: skip
    assert b.kv_memory / GIB == pytest.approx(54.93, rel=1e-3)
    assert b.total_memory != hardware.gpu("H100-SXM").memory_bytes  # not the datasheet's 80 x 10^9 bytes


def test_every_gpu_has_the_total_its_driver_reports_with_a_source():
    for spec in hardware.GPUS.values():
        assert spec.driver_memory_bytes is not None and spec.driver_memory_source
        # datasheets round: an "80 GB" HBM card holds 80 GiB, of which the driver reports a little less
        assert 0.85 * spec.memory_bytes < spec.total_memory < spec.memory_bytes / 1e9 * GIB, spec.name
    assert hardware.gpu("H100").total_memory == 79.14 * GIB
    assert hardware.HardwareSpec("x", 1e9, 1, 1, "s").total_memory == 1e9  # measured specs fall back


# --- 2. vLLM's budget today ----------------------------------------------------------------------------------


def test_defaults_are_the_named_releases_with_the_old_utilization_named():
    assert vllm.VLLM_VERSION == "0.32.0" and vllm.VLLM_RELEASE == "vLLM 0.32.0"
    assert vllm.GPU_MEMORY_UTILIZATION == 0.92 and vllm.OLD_GPU_MEMORY_UTILIZATION == 0.90
    assert kv.budget("Llama-3-8B", "H100").utilization == 0.92
    assert vllm.ENABLE_PREFIX_CACHING and "vllm/config/cache.py" in vllm.SOURCE_FILES


@pytest.mark.parametrize(
    ("gpu", "tokens", "seqs"),
    [
        ("H100-SXM", 8192, 1024),
        ("H200-SXM", 8192, 1024),  # 139.81 GiB: under the 160 GiB tier
        ("A100-80GB", 2048, 256),
        ("L4", 2048, 256),
        ("T4", 2048, 256),
    ],
)
def test_scheduler_defaults_per_gpu_as_get_batch_defaults(gpu, tokens, seqs):
    d = vllm.batch_defaults(hardware.gpu(gpu))
    assert (d.max_num_batched_tokens, d.max_num_seqs) == (tokens, seqs)
    assert kv.budget("Llama-3-8B", gpu, max_model_len=8192).max_num_batched_tokens == tokens
    assert vllm.max_num_batched_tokens_default(hardware.gpu(gpu), 32768, chunked_prefill=False) == max(32768, tokens)


def test_cuda_graphs_and_kv_cache_memory_bytes():
    base = dict(utilization=0.9, weight_bytes=15 * GIB, activation_bytes=GIB, max_model_len=8192)
    plain = kv.budget("Llama-3-8B", "H100", **base)
    graphs = kv.budget("Llama-3-8B", "H100", cuda_graph_bytes=0.5 * GIB, **base)
    assert plain.kv_memory - graphs.kv_memory == 0.5 * GIB
    fixed = kv.budget("Llama-3-8B", "H100", kv_cache_memory_bytes=10 * GIB, **{**base, "utilization": 0.3})
    assert fixed.kv_memory == 10 * GIB and fixed.num_blocks == 10 * GIB // (16 * 4096) // 32  # utilization ignored


def test_a_co_located_process_makes_vllm_refuse_to_start(capsys):
    b = kv.budget("Llama-3-8B", "H100", utilization=0.9, other_process_bytes=10 * GIB, max_model_len=8192)
    assert b.startup_error.startswith(
        "Free memory on device cuda:0 (69.14/79.14 GiB) on startup is less than desired GPU memory utilization"
    )
    assert b.num_blocks == 0 and not b.fits_one_request and "DOES NOT START" in b.table()
    assert kv.budget("Llama-3-8B", "H100", utilization=0.85, other_process_bytes=10 * GIB).startup_error is None
    assert course_main(["kv", "Llama-3-8B", "--other-process-gib", "10", "--utilization", "0.9", "--vllm", "0.32"]) == 0
    assert "DOES NOT START: Free memory on device" in capsys.readouterr().out
    # 0.34's extensible KV cache: the share is only a cap, nothing refuses; the other process's memory is not free
    assert course_main(["kv", "Llama-3-8B", "--other-process-gib", "10", "--utilization", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT START" not in out and "as vLLM 0.34.0 sizes it: measured after warm-up" in out


# --- 3. layer kinds from config.json ------------------------------------------------------------------------


def test_gemma3_published_config_is_52_sliding_and_10_full():
    g = geometry.from_hf_config(GEMMA3_27B)
    assert (g.num_sliding_layers, g.count(geometry.FULL)) == (52, 10)
    assert [i for i in range(62) if g.attention_kind(i) == geometry.FULL] == list(range(5, 62, 6))
    per_layer = 2 * 16 * 128 * 2
    assert kv.sequence_bytes(g, 131072, "bf16") == (10 * 131072 + 52 * 1023) * per_layer
    explicit = geometry.from_hf_config({**GEMMA3_27B["text_config"], "_sliding_window_pattern": 2})
    assert explicit.num_sliding_layers == 31  # _sliding_window_pattern is read
    gemma2 = geometry.from_hf_config({**GEMMA3_27B["text_config"], "model_type": "gemma2", "num_hidden_layers": 42})
    assert gemma2.num_sliding_layers == 21  # Gemma 2's default: alternating


def test_every_layer_types_value_transformers_allows_is_understood():
    from transformers.configuration_utils import _LEGACY_LAYER_TYPE_REMAP, ALLOWED_LAYER_TYPES

    known = set(geometry.LAYER_KINDS)
    assert set(ALLOWED_LAYER_TYPES) <= known and set(_LEGACY_LAYER_TYPE_REMAP) <= known
    with pytest.raises(ValueError, match="config field 'layer_types' holds unknown kinds"):
        geometry.from_hf_config({**QWEN3_NEXT, "layer_types": ["full_attention"] * 47 + ["dragon"]})


def test_nested_text_config_takes_the_familys_defaults():
    llava = {
        "model_type": "llava",
        "text_config": {"model_type": "llama", "vocab_size": 32064, "max_position_embeddings": 4096},
    }
    g = geometry.from_hf_config(llava)  # LlamaConfig's defaults: 32 layers, 32 heads, hidden 4096
    assert (g.num_layers, g.num_query_heads, g.num_kv_heads, g.head_dim) == (32, 32, 32, 128)
    assert geometry.from_hf_config({"model_type": "llava"}).num_layers == 32  # LlavaConfig's default text model


def test_chunked_attention_is_not_counted_as_full():
    g = geometry.from_hf_config(LLAMA4_SCOUT)
    assert (g.count(geometry.CHUNKED), g.count(geometry.FULL), g.attention_chunk_size) == (36, 12, 8192)
    per_layer = 2 * 8 * 128 * 2
    assert kv.sequence_bytes(g, 131072, "bf16") == (12 * 131072 + 36 * 8191) * per_layer


def test_linear_attention_and_mamba_layers_hold_a_constant_state_sized_from_the_config():
    g = geometry.from_hf_config(QWEN3_NEXT)
    assert (g.num_state_layers, g.count(geometry.FULL)) == (36, 12)
    # vLLM's gated_delta_net_state_shape: conv (kernel - 1, 2 x 16 x 128 + 32 x 128), recurrent (32, 128, 128)
    assert g.state_shapes == ((3, 8192), (32, 128, 128))
    assert kv.state_bytes(g, "bf16") == (3 * 8192 + 32 * 128 * 128) * 2
    short, long = kv.sequence_bytes(g, 1000, "bf16"), kv.sequence_bytes(g, 2000, "bf16")
    assert long - short == 1000 * 12 * 2 * 2 * 256 * 2  # only the 12 attention layers grow
    jamba = geometry.from_hf_config(
        {"model_type": "jamba", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2}
    )  # fmt: skip
    assert (jamba.count(geometry.FULL), jamba.num_state_layers) == (4, 28)  # attention at i % 8 == 4
    assert jamba.state_shapes == ((3, 8192), (8192, 16))  # vLLM's mamba1_state_shape


def _tiny(config_class, model_class, **config):
    torch.manual_seed(0)
    return model_class(config_class(vocab_size=128, **config)).eval()


def _real_cache(model, batch=2, tokens=30):
    from course.models import forward, new_cache

    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cache = forward(model, torch.randint(4, 100, (batch, tokens)), new_cache(model))
    return cache


def _attention_bytes(cache) -> int:
    return sum(t.nelement() * t.element_size() for layer in cache.layers for t in (getattr(layer, "keys", None),
               getattr(layer, "values", None)) if isinstance(t, torch.Tensor))  # fmt: skip


@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_sliding_and_chunked_layers_against_transformers_caches(family):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Llama4ForCausalLM, Llama4TextConfig

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    if family == "gemma3":  # the default pattern: layers 0-4 slide, 5 is global, 6 slides
        model = _tiny(Gemma3TextConfig, Gemma3ForCausalLM, num_hidden_layers=7, sliding_window=8, **small)
    else:  # chunks of 8 on layers 0-2, layer 3 global
        model = _tiny(Llama4TextConfig, Llama4ForCausalLM, num_hidden_layers=4, attention_chunk_size=8,
                      intermediate_size_mlp=128, num_local_experts=2, **small)  # fmt: skip
    g = geometry.from_hf_config(model.config.to_dict())
    for tokens in (5, 30):
        assert _attention_bytes(_real_cache(model, 2, tokens)) == kv.batch_bytes(g, tokens, 2, "fp32"), tokens


def test_state_layers_against_transformers_caches():
    """transformers keeps the recurrent state vLLM keeps and a convolution state one column wider (the kernel)."""
    from transformers import JambaConfig, JambaForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    models = {
        "qwen3_next": _tiny(Qwen3NextConfig, Qwen3NextForCausalLM, num_hidden_layers=4, head_dim=16,
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, **small),
        "jamba": _tiny(JambaConfig, JambaForCausalLM, num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1,
                       num_experts=2, num_experts_per_tok=1, mamba_d_state=4, mamba_expand=2, mamba_d_conv=4,
                       use_mamba_kernels=False, **small),
    }  # fmt: skip
    for name, model in models.items():
        g = geometry.from_hf_config(model.config.to_dict())
        cache = _real_cache(model, batch=1, tokens=12)
        conv_shape, recurrent_shape = g.state_shapes
        for i, layer in enumerate(cache.layers):
            if g.layer_kind(i) == geometry.STATE:
                conv, recurrent = layer.conv_states[0], layer.recurrent_states[0]
                assert recurrent.nelement() == torch.Size(recurrent_shape).numel(), name
                assert conv.nelement() == (conv_shape[0] + 1) * conv_shape[1], name  # kernel vs kernel - 1
            else:
                assert g.attention_kind(i) == geometry.FULL and layer.keys.shape[2] == 12, name


# --- vLLM's allocator: sliding windows, KV-cache groups, concurrency -------------------------------------------


def test_sliding_window_allocation_groups_and_concurrency_of_gemma3():
    b = kv.budget(GEMMA3_27B, "H100", utilization=0.9, weight_bytes=54 * GIB, max_model_len=131072)
    page = 16 * 2 * 16 * 128 * 2  # one block of one layer (AttentionSpec.page_size_bytes)
    # 52 sliding + 10 full: groups of min(52, 10) = 10 layers; sliding dealt round-robin into 6 groups
    assert b.layers_per_group == 10 and len(b.groups) == 7
    assert sorted(group.layers for group in b.groups) == [8, 8, 9, 9, 9, 9, 10]
    assert b.num_blocks == int(b.kv_memory // page // 10)
    # SlidingWindowSpec.max_memory_usage_bytes, in blocks: the window plus two batches in flight (async)
    sliding = -(-min(1024 - 1 + 2 * 8192, 131072) // 16) + 1
    assert b.in_flight_tokens == 2 * 8192 and b.blocks_per_request == 131072 // 16 + 6 * sliding
    assert b.max_concurrency == pytest.approx(b.num_blocks / (8192 + 6 * sliding))
    assert b.num_tokens == int(b.max_concurrency * 131072)  # "GPU KV cache size" (get_kv_cache_capacity)
    assert b.log_line == (
        f"GPU KV cache size: {b.num_tokens:,} tokens, Maximum concurrency for 131,072 tokens per request: "
        f"{b.max_concurrency:.2f}x"
    )
    synchronous = kv.budget(GEMMA3_27B, "H100", utilization=0.9, weight_bytes=54 * GIB, max_model_len=131072,
                            async_scheduling=False)  # fmt: skip
    assert synchronous.max_concurrency > b.max_concurrency  # one batch in flight reserves less


def test_hybrid_state_models_get_vllms_larger_attention_block():
    b = kv.budget(QWEN3_NEXT, "H200", weight_bytes=150 * GIB, max_model_len=32768)
    # the state page (1,097,728 B) needs 536 tokens of one attention layer (2,048 B); aligned to 16: 544
    assert b.block_size == 544 and b.layer_page_bytes == 544 * 2048
    assert (len(b.groups), b.layers_per_group) == (4, 12)  # 12 full + 36 state layers in groups of 12
    # "align" (prefix caching on): two state pages per request in each state group
    assert b.state_pages == 2 and b.blocks_per_request == -(-32768 // 544) + 3 * 2
    plain = kv.budget(QWEN3_NEXT, "H200", weight_bytes=150 * GIB, max_model_len=32768, mamba_cache_mode="none")
    assert plain.blocks_per_request == -(-32768 // 544) + 3


def test_uniform_models_keep_one_group_of_every_layer():
    b = kv.budget("Llama-3-8B", "H100", max_model_len=8192, weight_bytes=15 * GIB)
    assert len(b.groups) == 1 and b.layers_per_group == 32 and b.blocks_per_request == 512
    mistral = kv.budget("Mistral-7B-v0.1", "L4", max_model_len=32768, weight_bytes=13.5 * GIB, utilization=0.95)
    assert mistral.blocks_per_request == -(-min(4095 + 2 * 2048, 32768) // 16) + 1  # every layer slides


# --- 6. bad configs: a message naming the file and the field, exit 2 -------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            '{"num_hidden_layers": 2, "num_attention_heads": 0, "hidden_size": 64}',
            "'num_attention_heads' must be a positive",
        ),
        ("[1, 2, 3]", "must be one JSON object"),
        ('{"num_hidden_layers": 2,', "not valid JSON"),
        ('{"num_hidden_layers": "two", "num_attention_heads": 4, "hidden_size": 64}', "'num_hidden_layers' must be"),
        ('{"num_hidden_layers": 2, "hidden_size": 64}', "lacks 'num_attention_heads'"),
        (
            '{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "layer_types": "full"}',
            "'layer_types'",
        ),
        (
            '{"model_type": "qwen3_next", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 64, '
            '"full_attention_interval": 2}',
            "state layers",
        ),
        ('{"model_type": "llava", "text_config": {"model_type": "no-such-family"}}', "text_config"),
    ],
)
def test_bad_configs_are_reported_with_file_and_field(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    path.write_text(content)
    assert course_main(["kv", str(path), "--max-model-len", "128"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and message in err and "Traceback" not in err


def test_a_missing_folder_is_not_called_an_unknown_model(tmp_path, capsys):
    assert course_main(["kv", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert "no such config.json" in err and "folder does not exist" in err and "catalogue models" not in err


def test_a_folder_without_config_json_is_not_called_missing(tmp_path, capsys):
    assert course_main(["kv", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no such config.json {str(tmp_path / 'config.json')!r} (the folder has no config.json)" in err
    assert "does not exist" not in err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[1, 2, 3]", "{path}: a config.json must be one JSON object of config keys, this one is a list"),
        ('{"num_hidden_layers": 2,', "{path}: not valid JSON: Expecting property name enclosed in double quotes"),
        (None, "config: no such config.json '{path}' (the file does not exist); give a dict of config keys or"),
    ],
)
def test_geometry_reads_a_config_file_with_the_calculators_messages(tmp_path, content, expected):
    """from_hf_config(path) and `course kv PATH` read a config.json through one reader, with one set of messages."""
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as raised:
        geometry.from_hf_config(path)
    assert str(raised.value).startswith(expected.format(path=path))


# --- one catalogue for every command ---------------------------------------------------------------------


def test_course_simulate_reads_the_same_catalogue_and_the_gpus_vllm_defaults(capsys):
    from course.sim import SimConfig
    from course.sim.cli import MODELS

    assert set(MODELS) == set(kv.catalogue())
    args = ["simulate", "--model", "Qwen2.5-7B", "--requests", "20", "--rate", "5", "--json"]
    assert course_main([*args, "--gpu", "H100-SXM"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["max_num_batched_tokens"], config["max_num_seqs"], config["enable_prefix_caching"]) == (
        8192,
        1024,
        True,
    )
    log = dict(activation_bytes=vllm.REFERENCE_LOG.activation_bytes, non_torch_bytes=vllm.REFERENCE_LOG.non_torch_bytes)
    expected = kv.budget("Qwen2.5-7B", "H100-SXM", release="0.34", **log)  # the newest release by default
    assert (config["num_blocks"], config["block_size"]) == (expected.num_blocks, 64)
    assert course_main([*args, "--gpu", "H100-SXM", "--vllm", "0.32"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["num_blocks"], config["block_size"]) == (kv.budget("Qwen2.5-7B", "H100-SXM", **log).num_blocks, 16)
    assert course_main([*args, "--gpu", "L4", "--no-prefix-caching", "--num-blocks", "900"]) == 0
    config = json.loads(capsys.readouterr().out)["config"]
    assert (config["max_num_batched_tokens"], config["max_num_seqs"]) == (2048, 256)
    assert not config["enable_prefix_caching"] and config["num_blocks"] == 900
    assert SimConfig.vllm_defaults("A100-80GB").max_num_batched_tokens == 2048  # the A100 exception


def test_the_kv_package_is_still_a_forbidden_reference_in_exercises():
    """course.kv is a package now: calls into any of its modules count as using the reference."""
    from course.grading import forbid_reference

    with pytest.raises(AssertionError, match="course.kv.paging.paged_blocks"), forbid_reference(kv):
        kv.paged_blocks(17, 16)
    with pytest.raises(AssertionError, match="reference implementation"), forbid_reference(kv):
        kv.budget("Llama-3-8B", "H100")


def test_attention_sinks_add_no_cached_tokens():
    """gpt-oss: a learned sink logit per head, 128-token windows on every other layer; the real cache agrees."""
    from transformers import GptOssConfig, GptOssForCausalLM

    model = _tiny(GptOssConfig, GptOssForCausalLM, hidden_size=64, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_hidden_layers=4, sliding_window=8, num_local_experts=4,
                  num_experts_per_tok=2)  # fmt: skip
    assert any(name.endswith("self_attn.sinks") for name, _ in model.named_parameters())
    g = geometry.from_hf_config(model.config.to_dict())
    assert (g.num_sliding_layers, g.count(geometry.FULL)) == (2, 2)
    assert _attention_bytes(_real_cache(model, 2, 30)) == kv.batch_bytes(g, 30, 2, "fp32")


def test_weights_default_to_the_dtype_vllm_serves_the_checkpoint_in():
    """One served-dtype rule (0.32's ``_resolve_auto_dtype``) for weights and KV; the old table served every
    float32 checkpoint in fp16, so a CPU or an fp32 --dtype never changed the weight bytes."""
    fp32 = geometry.ModelGeometry(
        name="fp32-checkpoint",
        num_layers=2,
        num_query_heads=2,
        num_kv_heads=2,
        head_dim=8,
        hidden_size=16,
        num_params=1_000,
        weight_dtype="fp32",
    )
    assert vllm.served_dtype("fp32", hardware.gpu("H100-SXM")) == "bf16"
    assert vllm.served_dtype("fp32", hardware.gpu("T4")) == "fp16"
    assert kv.total_weight_bytes(fp32) == kv.total_weight_bytes(fp32, "bf16") == 2_000
    assert kv.total_weight_bytes(fp32, device="CPU") == 2_000
    report = kv.budget(fp32, gpu="CPU", dtype="float32", kv_cache_memory_bytes=2**30, max_model_len=64)
    assert report.weights == 4_000, "an explicit --dtype float32 serves (and counts) the weights in fp32"


NEMOTRON_H = {
    "model_type": "nemotron_h", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32, "hybrid_override_pattern": "M*M-", "mamba_num_heads": 8,
    "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 2, "conv_kernel": 4, "expand": 2,
    "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_nemotron_h_keeps_its_ssm_state_in_float32():
    """vLLM 0.32 sets --mamba-ssm-cache-dtype to float32 for NemotronH unless its config names one."""
    g = geometry.from_hf_config(NEMOTRON_H)
    conv, ssm = g.state_shapes
    assert g.ssm_state_dtype == "fp32"
    assert kv.state_bytes(g, "bf16") == math.prod(conv) * 2 + math.prod(ssm) * 4
    named = geometry.from_hf_config({**NEMOTRON_H, "mamba_ssm_cache_dtype": "bfloat16"})
    assert named.ssm_state_dtype == "bf16" and kv.state_bytes(named, "bf16") == named.state_values * 2
    other = geometry.from_hf_config({**NEMOTRON_H, "model_type": "bamba"})  # another Mamba-2 hybrid: auto
    assert other.ssm_state_dtype is None and kv.state_bytes(other, "bf16") == other.state_values * 2
