"""The facts module 4's new exercises grade against, checked with vLLM's and transformers' own code.

The notebook grades Exercises 4.2, 4.4 and 4.5 against the course library (``course.kv``); these tests
check the library's answers for those inputs against the code of the vLLM release the course names:
KV heads per GPU under tensor parallelism (``ModelConfig.get_num_kv_heads``), the page size of an
``int8_per_token_head`` cache (``TritonAttentionBackend.customize_spec`` on an ``AttentionSpec``), and
the layer kinds of a config that leaves its sliding pattern to the family's default (transformers'
``Gemma3TextConfig``, which vLLM reads).
"""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from course import geometry, kv

# (model, tp) pairs the notebook's tests use: split heads, exactly one per GPU, replicated, MLA, Gemma 3.
TP_CASES = (
    [("Llama-3.1-70B", tp) for tp in (1, 2, 4, 8, 16, 32, 64)]
    + [("Qwen2.5-7B", tp) for tp in (1, 2, 4, 28)]
    + [("Llama-2-7B", tp) for tp in (1, 8, 32)]
    + [("DeepSeek-V3", tp) for tp in (1, 8, 16)]
    + [("Gemma-3-27B", tp) for tp in (1, 2, 16, 32)]
    + [("Gemma-2-9B", tp) for tp in (4, 8)]
    + [("Qwen2.5-0.5B-Instruct", tp) for tp in (1, 2)]
)


@pytest.mark.parametrize(("model", "tp"), TP_CASES, ids=[f"{m}-tp{t}" for m, t in TP_CASES])
def test_kv_heads_per_gpu_as_vllm_counts_them(model, tp):
    from vllm.config.model import ModelConfig

    g = kv.get_model(model)
    stand_in = NS(use_mla=g.is_mla, model_arch_config=NS(total_num_kv_heads=g.num_kv_heads))
    vllm_heads = ModelConfig.get_num_kv_heads(stand_in, NS(tensor_parallel_size=tp))
    assert kv.kv_heads_per_gpu(g, tp) == vllm_heads


PAGE_CASES = [
    ("Llama-3-8B", 16, 1), ("Qwen2.5-0.5B-Instruct", 16, 1), ("Gemma-2-9B", 128, 1), ("Gemma-2-9B", 16, 8),
    ("Llama-3.1-70B", 128, 4), ("Llama-3.1-70B", 16, 16), ("Gemma-3-27B", 16, 2),
]  # fmt: skip


@pytest.mark.parametrize(("model", "block_size", "tp"), PAGE_CASES, ids=[f"{m}-b{b}-tp{t}" for m, b, t in PAGE_CASES])
def test_int8_per_token_head_page_size(model, block_size, tp):
    """vLLM's page of an int8_per_token_head cache: values plus one fp32 scale per token and head, for K and V."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    g = kv.get_model(model)
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=kv.kv_heads_per_gpu(g, tp),
        head_size=g.head_dim,
        dtype=torch.int8,
        kv_quant_mode=get_kv_quant_mode("int8_per_token_head"),
    )
    page = TritonAttentionBackend.customize_spec(spec).page_size_bytes
    assert page == block_size * kv.layer_bytes_per_token(g, "int8_per_token_head", tp)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp32"])
def test_dense_page_size_under_tensor_parallelism(kv_dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    g = kv.get_model("Llama-3.1-70B")
    for tp in (2, 8, 16):
        spec = FullAttentionSpec(
            block_size=16, num_kv_heads=kv.kv_heads_per_gpu(g, tp), head_size=g.head_dim, dtype=dtypes[kv_dtype]
        )
        assert spec.page_size_bytes == 16 * kv.layer_bytes_per_token(g, kv_dtype, tp)


def test_gemma3_layer_kinds_follow_the_family_default():
    """Gemma-3-27B's published config states no pattern: transformers' Gemma3TextConfig makes every 6th layer full."""
    from transformers import Gemma3TextConfig

    text = dict(kv.catalogue_entry("Gemma-3-27B").config["text_config"])
    text.pop("model_type", None)
    expected = Gemma3TextConfig(**text).layer_types
    g = geometry.from_hf_config(kv.catalogue_entry("Gemma-3-27B").config)
    assert [g.attention_kind(i) for i in range(g.num_layers)] == expected
    assert expected.count("full_attention") == 10 and len(expected) == 62
