"""The KV-cache calculator (course.kv): exact against real cache tensors, the catalogues, the budget, errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from course import geometry, hardware, kv
from course.cli import main as course_main
from course.models import build_tiny_model, cache_nbytes, forward, new_cache

GIB = 2**30


# --- exact bytes against real cache tensors ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models():
    return {dtype: build_tiny_model(seed=0, dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}


def _cache_after(model, batch: int, prompt: int, decode_steps: int = 0):
    high = min(200, model.config.vocab_size)
    ids = torch.randint(4, high, (batch, prompt), generator=torch.Generator().manual_seed(batch * 1000 + prompt))
    with torch.inference_mode():
        logits, cache = forward(model, ids, new_cache(model))
        for _ in range(decode_steps):
            logits, cache = forward(model, logits[:, -1:].argmax(-1), cache)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_tiny_model_cache_bytes_equal_the_formula_exactly(tiny_models, dtype, batch):
    lm = tiny_models[dtype]
    for prompt, steps in ((16, 0), (37, 0), (100, 5)):
        cache = _cache_after(lm.model, batch, prompt, steps)
        tokens = prompt + steps
        assert cache_nbytes(cache) == kv.batch_bytes(lm.geometry, tokens, batch, dtype)
        assert cache_nbytes(cache) == kv.sequence_bytes(lm.geometry, tokens, dtype) * batch
        assert kv.bytes_per_token(lm.geometry, dtype) == lm.geometry.kv_bytes_per_token(dtype.itemsize)


def test_tiny_model_figures_from_the_environment_reference(tiny_models):
    # environment.md section 4: bf16 B=2 seq 37 -> 151,552 B; fp16 B=3 seq 37 -> 227,328 B
    assert kv.batch_bytes(tiny_models[torch.bfloat16].geometry, 37, 2, "bf16") == 151_552
    assert kv.batch_bytes(tiny_models[torch.float16].geometry, 37, 3, "fp16") == 227_328


def _tiny(config_class, model_class, **config):
    torch.manual_seed(0)
    return model_class(config_class(vocab_size=128, **config)).eval()


def _other_architectures():
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        FalconConfig,
        FalconForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        MistralConfig,
        MistralForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    small = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2)
    gqa = dict(small, num_key_value_heads=2)
    return {
        # every layer slides (window 8: the cache keeps the last 7 tokens)
        "mistral-sliding": lambda: _tiny(MistralConfig, MistralForCausalLM, **gqa, sliding_window=8),
        # alternating sliding and global layers, explicit head_dim (32, not 64 // 4)
        "gemma2-alternating": lambda: _tiny(
            Gemma2Config, Gemma2ForCausalLM, **dict(gqa, num_hidden_layers=4), head_dim=32, sliding_window=8
        ),
        # explicit head_dim larger than hidden / heads
        "qwen3-head-dim": lambda: _tiny(Qwen3Config, Qwen3ForCausalLM, **gqa, head_dim=32),
        # MLA: transformers caches the latent (kv_lora_rank) and the rope key, as vLLM does
        "deepseek-v3-mla": lambda: _tiny(
            DeepseekV3Config,
            DeepseekV3ForCausalLM,
            **small,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        ),
        # MQA spelled the Falcon way (multi_query, no num_key_value_heads)
        "falcon-mqa": lambda: _tiny(
            FalconConfig,
            FalconForCausalLM,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
        ),
        # MHA with GPT-2's key names (n_layer, n_head, n_embd)
        "gpt2-mha": lambda: _tiny(GPT2Config, GPT2LMHeadModel, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    }


@pytest.mark.parametrize("arch", list(_other_architectures()))
def test_other_architectures_cache_bytes_equal_the_calculator(arch):
    model = _other_architectures()[arch]()
    g = geometry.from_hf_config(model.config.to_dict())
    for batch, prompt, steps in ((1, 5, 0), (2, 20, 3), (3, 7, 4)):
        cache = _cache_after(model, batch, prompt, steps)
        assert cache_nbytes(cache) == kv.batch_bytes(g, prompt + steps, batch, "fp32"), (arch, batch, prompt, steps)


def test_mla_and_windows_change_the_bytes_the_way_the_configs_say():
    mla = geometry.from_hf_config(kv.catalogue_entry("DeepSeek-V3").config)
    assert mla.attention == "MLA" and kv.bytes_per_token(mla, "bf16") == 61 * (512 + 64) * 2  # no factor 2 for K/V
    gemma = kv.MODELS["Gemma-2-9B"]
    assert gemma.num_sliding_layers == 21 and gemma.head_dim == 256
    long = kv.sequence_bytes(gemma, 32_768, "bf16")
    assert long == (21 * 32_768 + 21 * 4095) * kv.layer_bytes_per_token(gemma, "bf16")
    assert kv.sequence_bytes("Mistral-7B-v0.1", 100_000) == kv.sequence_bytes("Mistral-7B-v0.1", 4095)


# --- dtypes -----------------------------------------------------------------------------------------------------


def test_kv_dtypes_and_their_overheads():
    g = kv.get_model("Llama-3-8B")
    assert kv.bytes_per_token(g, "fp32") == 262_144
    assert kv.bytes_per_token(g, "bf16") == kv.bytes_per_token(g, "fp16") == 131_072
    assert kv.bytes_per_token(g, "fp8") == 65_536
    # vLLM's per-token-head dtypes: one fp32 scale per token and head, for K and for V
    # (vllm/v1/kv_cache_interface.py, AttentionSpec.page_size_bytes adds 2 x block x heads x 4 bytes)
    assert kv.bytes_per_token(g, "int8_per_token_head") == 32 * 2 * 8 * (128 + 4)
    assert kv.bytes_per_token(g, "int8") == kv.bytes_per_token(g, "int8_per_token_head")  # the old short name
    assert kv.bytes_per_token(g, "fp8_per_token_head") == 32 * 2 * 8 * (128 + 4)
    assert kv.bytes_per_token(g, "int4") == 32 * 2 * 8 * (64 + 4)
    # nvfp4: head_dim // 2 bytes of packed values + head_dim // 16 fp8 block scales per head vector
    assert kv.bytes_per_token(g, "nvfp4") == 32 * 2 * 8 * (64 + 8)
    assert kv.bytes_per_token(g, "fp8_e5m2") == kv.bytes_per_token(g, "fp8_e4m3") == 65_536
    assert kv.get_kv_dtype(torch.bfloat16).name == "bf16" and kv.get_kv_dtype("float8_e4m3fn").name == "fp8_e4m3"
    # DeepSeek-V3.2's fp8_ds_mla: 656 bytes per token and layer (MLAAttentionSpec.real_page_size_bytes)
    assert kv.bytes_per_token("DeepSeek-V3", "fp8_ds_mla") == 61 * 656
    with pytest.raises(ValueError, match="fp8_ds_mla is an MLA layout"):
        kv.bytes_per_token(g, "fp8_ds_mla")
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_ds_mla", "int8_per_token_head", "fp8_per_token_head", "nvfp4"):
        assert name in kv.KV_DTYPES and "vllm" in kv.KV_DTYPES[name].note.lower()
    for d in kv.KV_DTYPES.values():
        assert d.note


# --- seed numbers ---------------------------------------------------------------------------------------------------


def test_seed_table_and_its_gqa_counterpart():
    seven_b = kv.MODELS["Llama-2-7B"]
    assert kv.sequence_bytes(seven_b, 4096, "fp16") == 2 * GIB
    assert kv.sequence_bytes(seven_b, 131_072, "fp16") == 64 * GIB
    assert kv.batch_bytes(seven_b, 131_072, 8, "fp16") == 512 * GIB
    assert kv.sequence_bytes("Llama-3-8B", 131_072, "fp16") == 16 * GIB


# --- paged blocks and the budget -------------------------------------------------------------------------------------


def test_paged_blocks_round_up_and_waste_only_the_last_block():
    p = kv.paged_blocks(17, 16)
    assert (p.blocks, p.slots, p.waste_tokens) == (2, 32, 15) and p.waste_fraction == 15 / 32
    assert kv.paged_blocks(32, 16).waste_tokens == 0
    assert kv.paged_blocks(0, 16).blocks == 0 and kv.paged_blocks(0, 16).waste_fraction == 0.0
    assert kv.page_bytes("Llama-3-8B", 16, "bf16") == 16 * 131_072


def test_budget_follows_vllm_arithmetic():
    # 80 GiB, utilization 0.9 of the total, 14 GiB weights, 2 GiB activations -> 56 GiB = 28 sequences of 4K
    gpu = hardware.HardwareSpec("80 GiB card", 80 * GIB, 2e12, 300e12, "test")
    b = kv.budget(
        "Llama-2-7B",
        gpu,
        utilization=0.9,  # the seed's (and vLLM <= 0.11's) default; vLLM's own is 0.92 today
        max_model_len=4096,
        kv_dtype="fp16",
        weight_bytes=14 * GIB,
        activation_bytes=2 * GIB,
    )
    assert b.kv_memory == 56 * GIB and b.num_blocks == 56 * GIB // (16 * 2**19)
    assert b.max_batch(4096) == 28 and b.max_concurrency == 28.0 and b.num_tokens == 28 * 4096
    assert b.max_context(28) == 4096 and b.fits_one_request
    # vLLM: num_blocks = available // page_size // num_layers, page size per layer = 2 * block * heads * dim * bytes
    h100 = kv.budget("Llama-3-8B", "H100-SXM", max_model_len=8192, utilization=0.9)
    per_layer_page = 2 * 16 * 8 * 128 * 2
    assert h100.num_blocks == int(h100.kv_memory // per_layer_page // 32)
    assert h100.weights == 8_030_261_248 * 2
    assert h100.max_concurrency == h100.num_blocks / 512


def test_budget_that_does_not_fit_says_so():
    b = kv.budget("Llama-3.1-70B", "L4", max_model_len=4096)
    assert b.kv_memory < 0 and b.num_blocks == 0 and not b.fits_one_request
    assert "DOES NOT FIT" in b.table()


def test_tensor_parallel_splits_weights_and_replicates_kv_heads():
    one = kv.budget("Llama-3.1-70B", "H100-SXM", tp=8, max_model_len=8192)
    sixteen = kv.budget("Llama-3.1-70B", "H100-SXM", tp=16, max_model_len=8192)
    assert one.kv_heads_per_gpu == 1 and sixteen.kv_heads_per_gpu == 1  # 8 KV heads: replicated beyond tp 8
    assert sixteen.bytes_per_token == one.bytes_per_token and sixteen.weights == one.weights / 2
    assert any("replica" in note for note in sixteen.notes)
    assert kv.kv_heads_per_gpu(kv.MODELS["Llama-3.1-70B"], 2) == 4
    assert kv.bytes_per_token("DeepSeek-V3", "bf16", tp=8) == kv.bytes_per_token("DeepSeek-V3", "bf16")  # MLA
    fp8_weights = kv.budget("DeepSeek-V3", "H200-SXM", tp=8, max_model_len=32768)
    assert fp8_weights.weights == 671e9 / 8 and fp8_weights.kv_dtype == "bf16"


def test_auto_kv_dtype_follows_the_model():
    assert kv.budget("Llama-2-7B", "A100-80GB").kv_dtype == "fp16"
    assert kv.budget("Llama-3-8B", "A100-80GB").kv_dtype == "bf16"
    assert kv.budget("GPT-2", "T4").kv_dtype == "fp16"  # fp32 checkpoint, served in fp16


# --- catalogues ---------------------------------------------------------------------------------------------------


def test_catalogue_has_the_popular_families_with_sources():
    names = set(kv.MODELS)
    assert len(names) >= 12
    for family in ("Llama-2", "Llama-3-", "Llama-3.1", "Mistral", "Mixtral", "Qwen2.5", "Gemma-2", "Phi-3"):
        assert any(name.startswith(family) for name in names), family
    for family in ("DeepSeek-V2", "DeepSeek-V3", "GPT-2", "Falcon"):
        assert any(name.startswith(family) for name in names), family
    kinds = {g.attention for g in kv.MODELS.values()}
    assert kinds == {"MHA", "GQA", "MQA", "MLA"}


@pytest.mark.parametrize("name", list(kv.catalogue()))
def test_every_catalogue_model_parses_and_answers_on_the_command_line(name, capsys):
    entry = kv.catalogue_entry(name)
    g = entry.geometry
    assert "https://" in entry.source and entry.params_source
    assert g.num_params and g.num_params > 1e8 and g.max_position_embeddings
    assert kv.bytes_per_token(g, "bf16") > 0
    assert kv.catalogue_entry(entry.hf_id) is entry  # the Hub id finds it too
    assert course_main(["kv", name, "--gpu", "H200-SXM", "--max-model-len", "4096"]) == 0
    assert f"KV-cache budget: {name} on H200-SXM" in capsys.readouterr().out
    assert course_main(["kv", name, "--json", "--kv-dtype", "fp8", "--batch", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_dtype"] == "fp8" and data["max_context_at_batch"]["4"] >= 0 and "https://" in data["source"]


def test_every_gpu_has_memory_bandwidth_flops_and_a_source():
    assert {"T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100-SXM", "H200-SXM"} <= set(hardware.GPUS)
    for spec in hardware.GPUS.values():
        assert spec.memory_bytes >= 16e9 and spec.bandwidth >= 300e9 and spec.flops >= 65e12
        assert "https://" in spec.source
    assert "UNVERIFIED" in hardware.gpu("A10G").source
    assert hardware.gpu("h100") is hardware.gpu("H100-SXM")


def test_count_params_matches_published_counts():
    assert kv.count_params(kv.catalogue_entry("Llama-2-7B").config) == 6_738_415_616
    assert kv.count_params(kv.catalogue_entry("Llama-3-8B").config) == 8_030_261_248
    assert kv.count_params(kv.catalogue_entry("GPT-2").config) == 124_439_808
    assert round(kv.count_params(kv.catalogue_entry("Qwen2.5-0.5B-Instruct").config) / 1e9, 2) == 0.49
    assert round(kv.count_params(kv.catalogue_entry("Mixtral-8x7B").config) / 1e9, 1) == 46.7
    assert kv.count_params(kv.catalogue_entry("DeepSeek-V3").config) is None  # MLA/MoE: published count instead


def _count_torch(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_count_params_is_exact_on_instantiated_architectures(tiny_models):
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    assert kv.count_params(tiny_models[torch.float32].model.config.to_dict()) == tiny_models[torch.float32].num_params
    small = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        pad_token_id=0,
    )  # fmt: skip
    cases = [
        (Gemma2Config, Gemma2ForCausalLM, dict(head_dim=32)),
        (MixtralConfig, MixtralForCausalLM, dict(num_local_experts=4, tie_word_embeddings=False)),
        (Phi3Config, Phi3ForCausalLM, dict(tie_word_embeddings=False)),
        (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    ]
    for config_class, model_class, extra in cases:
        model = _tiny(config_class, model_class, **small, **extra)
        assert kv.count_params(model.config.to_dict()) == _count_torch(model), config_class.__name__
    for arch in ("falcon-mqa", "gpt2-mha", "qwen3-head-dim"):
        model = _other_architectures()[arch]()
        assert kv.count_params(model.config.to_dict()) == _count_torch(model), arch


# --- config reading -------------------------------------------------------------------------------------------------


def test_config_readers_for_other_layouts(tmp_path):
    base = {"num_hidden_layers": 6, "num_attention_heads": 8, "hidden_size": 512}
    qwen = geometry.from_hf_config(
        {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 4}
    )
    assert qwen.num_sliding_layers == 2 and qwen.layer_is_sliding(5) and not qwen.layer_is_sliding(3)
    off = geometry.from_hf_config({**base, "use_sliding_window": False, "sliding_window": 64})
    assert off.sliding_window is None
    alternate = ["sliding_attention", "full_attention"] * 3
    listed = geometry.from_hf_config({**base, "sliding_window": 16, "layer_types": alternate})
    assert listed.num_sliding_layers == 3
    gemma3 = geometry.from_hf_config({**base, "sliding_window": 32, "sliding_window_pattern": 6})
    assert gemma3.num_sliding_layers == 5
    nested = geometry.from_hf_config({"model_type": "llava", "text_config": {**base, "num_key_value_heads": 2}})
    assert nested.attention == "GQA" and nested.num_layers == 6
    glm = geometry.from_hf_config(
        {"num_layers": 4, "num_attention_heads": 32, "hidden_size": 4096, "kv_channels": 128,
         "multi_query_attention": True, "multi_query_group_num": 2}
    )  # fmt: skip
    assert (glm.num_kv_heads, glm.head_dim) == (2, 128)
    falcon40 = geometry.from_hf_config(
        {"model_type": "RefinedWeb", "n_layer": 60, "n_head": 128, "n_head_kv": 8, "hidden_size": 8192}
    )
    assert falcon40.num_kv_heads == 8
    starcoder = geometry.from_hf_config({"n_layer": 2, "n_head": 16, "n_embd": 2048, "multi_query": True})
    assert starcoder.attention == "MQA"
    (tmp_path / "config.json").write_text(json.dumps(kv.catalogue_entry("Gemma-2-9B").config))
    from_path = kv.get_model(tmp_path)
    assert from_path.num_sliding_layers == 21 and from_path.num_params == kv.MODELS["Gemma-2-9B"].num_params
    assert course_main(["kv", str(tmp_path / "config.json"), "--gpu", "A100-80GB"]) == 0


# --- errors -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kv.sequence_bytes("Llama-3-8B", -1), "tokens: must be an integer >= 0"),
        (lambda: kv.batch_bytes("Llama-3-8B", 10, 0), "batch: must be a positive integer"),
        (lambda: kv.paged_blocks(10, 0), "block_size: must be a positive integer"),
        (lambda: kv.bytes_per_token("Llama-3-8B", "fp12"), "kv_dtype: unknown 'fp12'; allowed: fp32, bf16"),
        (lambda: kv.budget("Llama-3-8B", "H300"), "unknown GPU 'H300'; known: T4"),
        (lambda: kv.budget("Llama-3-8B", "H100", utilization=1.5), r"utilization: must be a number in \(0, 1\]"),
        (lambda: kv.budget("Llama-3-8B", "H100", max_model_len=0), "max_model_len: must be a positive integer"),
        (lambda: kv.budget("Llama-3-8B", "H100", tp=3), "tp: 3 does not divide the 32 query heads"),
        (lambda: kv.budget("Llama-3-8B", "H100", tp=0), "tp: must be a positive integer"),
        (lambda: kv.budget("Llama-3-8B", "H100", weight_dtype="fp6"), "weight_dtype: unknown 'fp6'"),
        (lambda: kv.get_model("Llama-9"), "model: unknown 'Llama-9'; catalogue models: Llama-2-7B"),
        (lambda: kv.get_model("/nonexistent/config.json"), "model: no such config.json"),
        (lambda: kv.get_model(Path(__file__).parent), "model: no such config.json"),
        (lambda: geometry.from_hf_config({"num_hidden_layers": 2, "hidden_size": 64}), "'num_attention_heads'"),
        (lambda: geometry.from_hf_config({"n_layer": 2, "n_head": 3, "n_embd": 64}), "not a multiple of"),
        (
            lambda: geometry.from_hf_config(
                {"num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 4, "hidden_size": 48}
            ),
            "multiple of num_kv_heads",
        ),
        (
            lambda: geometry.from_hf_config(
                {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64, "kv_lora_rank": 16}
            ),
            "lacks 'qk_rope_head_dim'",
        ),
        (lambda: kv.budget({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}), "max_model_len"),
        (lambda: kv.explorer("Llama-3-8B", gpus=("B300",), interactive=False), "gpus: unknown"),
    ],
)
def test_invalid_input_is_a_value_error_naming_the_field(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_cli_errors_are_reported_not_raised(capsys):
    assert course_main(["kv", "Llama-9"]) == 2
    assert "unknown 'Llama-9'" in capsys.readouterr().err
    assert course_main(["kv"]) == 2
    assert course_main(["kv", "--list"]) == 0
    assert "H200-SXM" in capsys.readouterr().out


# --- the widget -----------------------------------------------------------------------------------------------------


def test_explorer_is_a_widget_or_a_static_chart(monkeypatch, capsys):
    import matplotlib

    matplotlib.use("Agg")
    static = kv.explorer("Llama-3-8B", interactive=False, context=8192, batch=64, gpu="L4")
    assert isinstance(static, kv.KVBudget) and static.gpu == "L4"
    widget = kv.explorer("Qwen2.5-7B", interactive=True)
    assert type(widget).__name__ == "interactive"
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # as if not installed
    assert isinstance(kv.explorer("Llama-3-8B"), kv.KVBudget)
    assert "ipywidgets is not installed" in capsys.readouterr().out
    parts = kv.memory_breakdown(static, 8192, 64)
    assert parts["overflow"] > 0 and parts["kv free"] < static.page_bytes  # 64 x 8K does not fit on an L4
    assert sum(parts.values()) - parts["overflow"] == pytest.approx(static.total_memory)


# --- course kv on hostile configs: a clear error (exit 2) or a budget, never a traceback or a hang ---------

_HOSTILE_BASE = {
    "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "hidden_size": 64, "vocab_size": 100, "intermediate_size": 128, "max_position_embeddings": 256,
}  # fmt: skip
# fields that size the cache: a stated 0 or negative value is an error naming the field, never "absent"
# (sliding_window 0 means no window, as transformers reads it)
_POSITIVE_ONLY = {"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                  "kv_lora_rank", "qk_rope_head_dim", "full_attention_interval"}  # fmt: skip
_HOSTILE_VALUES = (0, -1, "x", None, 1.5, True, [], {}, 10**30)
_HOSTILE_FIELDS = (
    *_HOSTILE_BASE, "head_dim", "sliding_window", "attention_chunk_size", "layer_types", "full_attention_interval",
    "sliding_window_pattern", "kv_lora_rank", "qk_rope_head_dim", "num_local_experts", "torch_dtype",
)  # fmt: skip


@pytest.mark.parametrize("field", _HOSTILE_FIELDS)
def test_course_kv_answers_every_hostile_config_field_without_a_traceback(field, tmp_path, capsys):
    model_type = {
        "full_attention_interval": "qwen3_next",
        "sliding_window_pattern": "gemma3",
        "kv_lora_rank": "deepseek_v3",
        "qk_rope_head_dim": "deepseek_v3",
        "num_local_experts": "mixtral",
    }
    for value in _HOSTILE_VALUES:
        config = {**_HOSTILE_BASE, "model_type": model_type.get(field, "llama"), field: value}
        if config["model_type"] == "deepseek_v3":
            config = {"kv_lora_rank": 16, "qk_rope_head_dim": 8, **config}
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        for extra in ([], ["--kv-cache-memory-bytes", "1000000"]):
            code = course_main(["kv", str(path), "--max-model-len", "128", *extra])
            out, err = capsys.readouterr()
            assert code in (0, 2) and "Traceback" not in err, (field, value, extra, err[-300:])
            assert code == 0 or err.startswith("course kv: error: "), (field, value, err)
            if field in _POSITIVE_ONLY and value in (0, -1):
                assert code == 2 and field in err, (field, value, "a zero or negative size is refused by name")
