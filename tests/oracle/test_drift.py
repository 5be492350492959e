"""Drift tests: every vLLM fact the course states, against what the installed vLLM's own code returns.

Each test calls vLLM's functions and classes (never a copy of them) with the inputs the course's fact
is about, and compares. A vLLM upgrade that moves a fact fails the test named after it. Device-specific
code is given a stand-in for ``current_platform`` that answers the questions vLLM asks (memory, name,
supported dtypes), so GPU facts are checked on a CPU machine.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace as NS

import pytest
import torch
from vllm.exceptions import VLLMValidationError

from course import hardware, kv
from course import vllm_release as release
from course.geometry import CHUNKED, FULL, SLIDING, STATE, WITH_STATE
from course.hardware import GiB
from course.kv import vllm as facts
from course.kv.catalogue import _catalogue

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
CATALOGUE_GPUS = tuple(hardware.GPUS)


def test_the_installed_vllm_is_the_release_the_course_names(installed_vllm):
    assert installed_vllm.__version__ == release.VLLM_VERSION, (
        f"the oracle environment has vLLM {installed_vllm.__version__}, the course names {release.VLLM_VERSION}"
    )


# --- defaults (vllm/config/cache.py) ---------------------------------------------------------------


def test_cache_config_defaults():
    from vllm.config import CacheConfig

    cache = CacheConfig()
    assert cache.gpu_memory_utilization == facts.GPU_MEMORY_UTILIZATION
    assert CacheConfig.DEFAULT_BLOCK_SIZE == facts.BLOCK_SIZE
    assert cache.enable_prefix_caching is facts.ENABLE_PREFIX_CACHING
    assert cache.mamba_cache_mode == "none"  # resolved to "align" for hybrids with prefix caching (budget default)


# --- scheduler budgets (vllm/engine/arg_utils.py) ----------------------------------------------------


def _platform(memory: float, name: str, *, cpu: bool = False) -> NS:
    return NS(
        get_device_total_memory=lambda device_id=0: int(memory),
        get_device_name=lambda device_id=0: name,
        is_tpu=lambda: False,
        is_cpu=lambda: cpu,
    )


def _vllm_batch_defaults(monkeypatch, device: hardware.HardwareSpec, world_size: int = 1):
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    monkeypatch.setattr(
        arg_utils, "current_platform", _platform(device.total_memory, device.name, cpu=device.platform == "cpu")
    )
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(world_size)
    server, llm = UsageContext.OPENAI_API_SERVER, UsageContext.LLM_CLASS
    return tokens[server], seqs[server], tokens[llm], seqs[llm]


B200 = hardware.HardwareSpec("B200", 192e9, 8e12, 2.25e15, "a >= 160 GiB stand-in", 178.35 * GiB)


@pytest.mark.parametrize("name", [*CATALOGUE_GPUS, "B200", "CPU"])
def test_batch_defaults_per_device(monkeypatch, name):
    device = B200 if name == "B200" else hardware.gpu(name)
    d = facts.batch_defaults(device)
    ours = (d.max_num_batched_tokens, d.max_num_seqs, d.llm_max_num_batched_tokens, d.llm_max_num_seqs)
    assert ours == _vllm_batch_defaults(monkeypatch, device), f"get_batch_defaults on {name} ({d.reason})"


def test_batch_defaults_scale_with_world_size_on_the_cpu(monkeypatch):
    d = facts.batch_defaults(hardware.vllm_cpu(), world_size=2)
    ours = (d.max_num_batched_tokens, d.max_num_seqs, d.llm_max_num_batched_tokens, d.llm_max_num_seqs)
    assert ours == _vllm_batch_defaults(monkeypatch, hardware.vllm_cpu(), world_size=2)


@pytest.mark.parametrize("name", ["H100-SXM", "A100-40GB", "B200", "CPU"])
@pytest.mark.parametrize("max_model_len", [4, 96, 2048, 131072])
@pytest.mark.parametrize("chunked_prefill", [True, False])
@pytest.mark.parametrize("mode", ["balanced", "throughput"])
def test_scheduler_defaults_as_vllm_serve_sets_them(monkeypatch, name, max_model_len, chunked_prefill, mode):
    """_set_default_max_num_seqs_and_batched_tokens_args: throughput doubling, the chunked-prefill floor,
    the max_num_seqs x max_model_len cap and max_num_seqs <= max_num_batched_tokens."""
    from vllm.engine import arg_utils
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    device = B200 if name == "B200" else hardware.gpu(name)
    monkeypatch.setattr(
        arg_utils, "current_platform", _platform(device.total_memory, device.name, cpu=device.platform == "cpu")
    )
    args = NS(
        pipeline_parallel_size=1,
        tensor_parallel_size=1,
        get_batch_defaults=EngineArgs.get_batch_defaults,
        max_num_batched_tokens=None,
        max_num_seqs=None,
        performance_mode=mode,
        enable_chunked_prefill=chunked_prefill,
    )
    model = NS(max_model_len=max_model_len, is_multimodal_model=False)
    EngineArgs._set_default_max_num_seqs_and_batched_tokens_args(
        args, UsageContext.OPENAI_API_SERVER, model, NS(use_batched_dp_moe=False)
    )
    ours = facts.scheduler_defaults(device, max_model_len, chunked_prefill=chunked_prefill, performance_mode=mode)
    assert (ours.max_num_batched_tokens, ours.max_num_seqs) == (args.max_num_batched_tokens, args.max_num_seqs)


# --- batches in flight (vllm/config/vllm.py) ----------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("budget", [2048, 8192])
def test_max_in_flight_tokens(async_scheduling, budget):
    from vllm.config import VllmConfig

    config = NS(
        parallel_config=NS(pipeline_parallel_size=1),
        scheduler_config=NS(async_scheduling=async_scheduling, max_num_batched_tokens=budget),
        use_v2_model_runner=False,
    )
    config.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(config)
    assert facts.max_concurrent_batches(async_scheduling) == config.max_concurrent_batches
    assert facts.max_in_flight_tokens(budget, async_scheduling) == VllmConfig.max_in_flight_tokens.fget(config)


# --- the dtype a checkpoint is served in (vllm/config/model.py) ----------------------------------------


@pytest.mark.parametrize("name", ["T4", "A100-80GB", "H100-SXM", "CPU"])
@pytest.mark.parametrize("config_dtype", ["fp32", "bf16", "fp16"])
def test_served_dtype_for_dtype_auto(monkeypatch, name, config_dtype):
    from vllm.config import model as model_config

    device = hardware.gpu(name)
    supported = (
        [torch.bfloat16, torch.float16, torch.float32] if device.supports_bf16 else [torch.float16, torch.float32]
    )
    monkeypatch.setattr(
        model_config,
        "current_platform",
        NS(supported_dtypes=supported, get_device_name=lambda: name, get_device_capability=lambda: None),
    )
    served = model_config._resolve_auto_dtype("llama", TORCH_DTYPES[config_dtype], is_pooling_model=False)
    assert TORCH_DTYPES[facts.served_dtype(config_dtype, device)] == served


# --- the startup memory check (vllm/v1/worker/utils.py) -----------------------------------------------


@pytest.mark.parametrize(("free_gib", "utilization"), [(70.0, 0.92), (79.0, 0.92), (60.0, 0.7), (10.0, 0.5)])
def test_free_memory_check(free_gib, utilization):
    from vllm.config import CacheConfig
    from vllm.v1.worker.utils import request_memory

    total = 79.14 * GiB
    snapshot = NS(total_memory=int(total), free_memory=int(free_gib * GiB), device_="cuda:0")
    ours = facts.free_memory_error(int(total), int(free_gib * GiB), utilization)
    try:
        requested = request_memory(snapshot, CacheConfig(gpu_memory_utilization=utilization))
    except ValueError as refused:
        assert ours == str(refused)
    else:
        assert ours is None and requested == math.ceil(int(total) * utilization)


# --- the OpenAI server's output cap (vllm/entrypoints/serve/utils/api_utils.py, renderers/params.py) -----


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "max_model_len"),
    [(5, 10, 4096), (5, 4095, 4096), (5, 4096, 4096), (100, None, 512), (511, 1, 512), (512, 7, 512)],
)
def test_max_tokens_is_clamped_to_the_room_left(prompt, max_tokens, max_model_len):
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    assert release.clamp_max_tokens(prompt, max_tokens, max_model_len) == get_max_tokens(
        max_model_len, max_tokens, prompt, {}
    )


@pytest.mark.parametrize(("max_tokens", "max_model_len"), [(9000, 4096), (4097, 4096), (4096, 4096), (1, 16)])
def test_max_tokens_over_the_context_is_refused(max_tokens, max_model_len):
    from vllm.renderers.params import TokenizeParams

    ours = release.max_tokens_error(max_tokens, max_model_len)
    try:
        TokenizeParams(
            max_total_tokens=max_model_len,
            max_output_tokens=max_tokens,
            max_total_tokens_param="max_model_len",
            max_output_tokens_param="max_tokens",
        )
    except VLLMValidationError as refused:
        assert ours is not None and str(refused).startswith(ours)
    else:
        assert ours is None


@pytest.mark.parametrize(("prompt", "max_model_len"), [(4096, 4096), (4097, 4096), (4100, 4096), (10, 4096)])
def test_a_prompt_longer_than_the_context_is_refused(prompt, max_model_len):
    from vllm.renderers.params import TokenizeParams

    ours = release.prompt_too_long_error(prompt, max_model_len)
    params = TokenizeParams(max_total_tokens=max_model_len, max_output_tokens=1)
    try:
        params._token_len_check(None, list(range(prompt)))
    except VLLMValidationError as refused:
        assert ours is not None and str(refused).startswith(ours)
    else:
        assert ours is None


# --- metrics (vllm/v1/metrics/) -------------------------------------------------------------------------


def test_histogram_buckets():
    from vllm.v1.metrics import buckets

    assert tuple(buckets.TIME_TO_FIRST_TOKEN_BUCKETS) == release.TTFT_BUCKETS
    assert tuple(buckets.INTER_TOKEN_LATENCY_BUCKETS) == release.ITL_BUCKETS
    assert tuple(buckets.REQUEST_LATENCY_BUCKETS) == release.REQUEST_LATENCY_BUCKETS


def test_finish_reasons():
    from vllm.v1.engine import FinishReason

    assert tuple(reason.name.lower() for reason in FinishReason) == release.FINISH_REASONS


# --- KV-cache planning (vllm/v1/kv_cache_interface.py, vllm/v1/core/kv_cache_utils.py) --------------------


def _vllm_config(b: kv.KVBudget, mamba_cache_mode: str = "align"):
    """The parts of a VllmConfig that vLLM's planning functions read, for the deployment ``b`` describes."""
    from vllm.config import CacheConfig, VllmConfig

    cache = CacheConfig(block_size=b.block_size)
    cache.mamba_cache_mode = mamba_cache_mode
    cache.kv_cache_layout = "LBNHC"  # FlashAttention's (layer-outermost); the CPU backend's LBHNC is too
    config = NS(
        scheduler_config=NS(
            disable_hybrid_kv_cache_manager=False,
            max_num_batched_tokens=b.max_num_batched_tokens,
            async_scheduling=b.async_scheduling,
        ),
        cache_config=cache,
        model_config=NS(max_model_len=b.max_model_len),
        parallel_config=NS(decode_context_parallel_size=1, pipeline_parallel_size=1, tensor_parallel_size=b.tp),
        attention_config=NS(hisparse_config=None),
        speculative_config=None,
        use_v2_model_runner=False,
    )
    config.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(config)
    config.max_in_flight_tokens = VllmConfig.max_in_flight_tokens.fget(config)
    return config


def _layer_specs(g, b: kv.KVBudget) -> dict:
    """One vLLM KV-cache spec per layer, for the geometry the course read from the model's config."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    dtype = TORCH_DTYPES[b.kv_dtype]
    if g.is_mla:
        common = dict(block_size=b.block_size, num_kv_heads=1, head_size=g.kv_lora_rank + g.qk_rope_head_dim)
    else:
        common = dict(block_size=b.block_size, num_kv_heads=b.kv_heads_per_gpu, head_size=g.head_dim)
    specs = {}
    for layer in range(g.num_layers):
        attention = g.attention_kind(layer)
        if attention == FULL:
            spec_class = MLAAttentionSpec if g.is_mla else FullAttentionSpec
            specs[f"layers.{layer}.attn"] = spec_class(dtype=dtype, **common)
        elif attention == SLIDING:
            specs[f"layers.{layer}.attn"] = SlidingWindowSpec(dtype=dtype, sliding_window=g.sliding_window, **common)
        elif attention == CHUNKED:
            specs[f"layers.{layer}.attn"] = ChunkedLocalAttentionSpec(
                dtype=dtype, attention_chunk_size=g.attention_chunk_size, **common
            )
        if g.layer_kind(layer) in WITH_STATE:
            # the state page as the course sizes it, padded to the attention page as vLLM pads it
            specs[f"layers.{layer}.state"] = MambaSpec(
                block_size=b.block_size,
                shapes=((int(kv.state_bytes(g, b.kv_dtype)) // dtype.itemsize,),),
                dtypes=(dtype,),
                page_size_padded=int(b.layer_page_bytes),
                mamba_cache_mode="align" if b.state_pages == 2 else "none",
            )
    return specs


def _vllm_plan(g, b: kv.KVBudget):
    from vllm.v1.core import kv_cache_utils

    config = _vllm_config(b, "align" if b.state_pages == 2 else "none")
    specs = _layer_specs(g, b)
    groups = kv_cache_utils.get_kv_cache_groups(config, specs)
    plan = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, int(b.kv_memory))
    tokens, concurrency = kv_cache_utils.get_kv_cache_capacity(config, plan)
    return specs, groups, plan, tokens, concurrency


def _deployments():
    """Every catalogue model on the cards the course plans for, at a context where one request fits."""
    for name, entry in _catalogue().items():
        g = entry.geometry
        for gpu in ("H100-SXM", "A100-40GB", "H200-SXM"):
            for max_model_len in (4096, 32768, g.max_position_embeddings):
                if max_model_len is not None and max_model_len <= (g.max_position_embeddings or max_model_len):
                    yield pytest.param(name, gpu, max_model_len, id=f"{name}-{gpu}-{max_model_len}")


@pytest.mark.parametrize(("model", "gpu", "max_model_len"), sorted(set(_deployments()), key=lambda p: p.id))
def test_kv_capacity_as_vllm_plans_it(model, gpu, max_model_len):
    """Blocks, the logged "KV cache size" tokens and "Maximum concurrency", for the same KV memory."""
    b = kv.budget(model, gpu, max_model_len=max_model_len, kv_cache_memory_bytes=24 * GiB)
    g = kv.get_model(model)
    specs, groups, plan, tokens, concurrency = _vllm_plan(g, b)
    attention_pages = {spec.page_size_bytes for spec in specs.values()}
    assert b.layer_page_bytes in attention_pages, "page size of one layer's block"
    assert len(groups) == len(b.groups), "number of KV-cache groups"
    assert sorted(len(group.layer_names) for group in groups) == sorted(group.layers for group in b.groups)
    assert plan.num_blocks == b.num_blocks, "blocks"
    assert (tokens, round(concurrency, 6)) == (b.num_tokens, round(b.max_concurrency, 6)), b.log_line


@pytest.mark.parametrize(
    ("model", "gpu", "max_model_len", "tp"),
    [("Gemma-3-27B", "H200-SXM", 131072, 1), ("Mistral-7B-v0.1", "H100-SXM", 32768, 1),
     ("Llama-4-Scout", "H100-SXM", 131072, 4), ("Llama-3.1-70B", "H100-SXM", 131072, 8)],
)  # fmt: skip
def test_sliding_and_chunked_layers_reserve_for_two_batches_in_flight(model, gpu, max_model_len, tp):
    """The issue's examples, at each card's default budget and vLLM's default (async) scheduling."""
    b = kv.budget(model, gpu, max_model_len=max_model_len, tp=tp, kv_cache_memory_bytes=40 * GiB)
    assert b.async_scheduling and b.in_flight_tokens == 2 * b.max_num_batched_tokens
    _, _, plan, tokens, concurrency = _vllm_plan(kv.get_model(model), b)
    assert (plan.num_blocks, tokens, round(concurrency, 6)) == (b.num_blocks, b.num_tokens, round(b.max_concurrency, 6))


@pytest.mark.parametrize("mode", ["align", "none"])
def test_state_pages_per_request(mode):
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(block_size=16, shapes=((4, 64),), dtypes=(torch.float16,), mamba_cache_mode=mode)
    config = NS(cache_config=NS(mamba_cache_mode=mode))
    assert spec.max_memory_usage_bytes(config) == kv.state_pages_per_request(mode) * spec.page_size_bytes


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp32", "fp8"])
def test_page_size_of_one_block(kv_dtype):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    b = kv.budget("Llama-3-8B", "H100-SXM", max_model_len=8192, kv_dtype=kv_dtype, kv_cache_memory_bytes=GiB)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=TORCH_DTYPES[kv_dtype])
    assert spec.page_size_bytes == b.layer_page_bytes


def test_the_cpu_build_budget():
    """vLLM's CPU build: block size 128, no async scheduling, "CPU KV cache size" (the live test reads the log)."""
    b = kv.budget("Llama-3-8B", "CPU", max_model_len=4096, kv_cache_memory_bytes=4 * GiB)
    assert (b.block_size, b.async_scheduling, b.device_label) == (facts.CPU_BLOCK_SIZE, False, "CPU")
    assert b.log_line.startswith("CPU KV cache size:")
    _, _, plan, tokens, concurrency = _vllm_plan(kv.get_model("Llama-3-8B"), b)
    assert (plan.num_blocks, tokens) == (b.num_blocks, b.num_tokens)


def test_state_and_window_kinds_are_covered():
    """The catalogue exercises every layer kind the planning tests claim to check."""
    kinds = set()
    for entry in _catalogue().values():
        g = entry.geometry
        kinds |= {g.attention_kind(i) for i in range(g.num_layers)} | {
            STATE for i in range(g.num_layers) if g.layer_kind(i) in WITH_STATE
        }
        kinds |= {"mla"} if g.is_mla else set()
    assert {FULL, SLIDING, CHUNKED, STATE, "mla"} <= kinds


def _source_function(path: str, name: str, cls: str | None = None, namespace: dict | None = None):
    """A function (or a class's method, decorators dropped) compiled from the installed vLLM's own source.

    For code whose module does not import without CUDA (``vllm/platforms/cuda.py``, the FlashAttention
    and FlashInfer MLA backends), so that the test still runs vLLM's code, not a copy of it.
    """
    import ast
    import textwrap
    from pathlib import Path

    import vllm

    source = (Path(vllm.__file__).parent.parent / path).read_text()
    body = ast.parse(source).body
    if cls is not None:
        body = next(node for node in body if isinstance(node, ast.ClassDef) and node.name == cls).body
    node = next(node for node in body if isinstance(node, ast.FunctionDef) and node.name == name)
    text = textwrap.dedent(ast.get_source_segment(source, node))
    scope = dict(namespace or {})
    exec(compile("from __future__ import annotations\n" + text, path, "exec"), scope)  # noqa: S102
    return scope[name]


@pytest.mark.parametrize("major", [8, 9, 10])
def test_mla_block_size_is_the_first_usable_mla_backends(major):
    """``--block-size`` unset: the first MLA backend in CudaPlatform's priority list that runs on the card
    picks the block size (``update_block_size_for_backend``, ``get_preferred_block_size``)."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import AttentionBackend, MultipleOf
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = {"AttentionBackendEnum": AttentionBackendEnum, "DeviceCapability": DeviceCapability,
             "MultipleOf": MultipleOf}  # fmt: skip
    priorities = _source_function("vllm/platforms/cuda.py", "_get_backend_priorities", namespace=names)
    capability = DeviceCapability(major, 0)
    for backend in priorities(True, capability):
        module, cls = backend.value.rsplit(".", 1)
        path = module.replace(".", "/") + ".py"
        runs_on = _source_function(path, "supports_compute_capability", cls, names)
        if runs_on(None, capability):
            sizes = _source_function(path, "get_supported_kernel_block_sizes", cls, names)()
            break
    # AttentionBackend.get_preferred_block_size, with this backend's sizes
    stand_in = type("Backend", (AttentionBackend,), {"get_supported_kernel_block_sizes": staticmethod(lambda: sizes)})
    expected = stand_in.get_preferred_block_size(facts.BLOCK_SIZE)
    card = dataclasses.replace(hardware.gpu("H100-SXM"), compute_capability=(major, 0))
    assert facts.mla_block_size(card) == expected, f"{backend.name} on compute capability {major}.0"
    assert kv.budget("DeepSeek-V2-Lite", card, max_model_len=4096).block_size == expected


@pytest.mark.parametrize("config_ssm_dtype", [None, "bfloat16"])
def test_nemotron_h_ssm_state_dtype_and_page(config_ssm_dtype):
    """NemotronH's config hook sets the SSM state's dtype (float32 unless its config names one), and the
    state page is each shape at its own dtype (MambaStateDtypeCalculator, MambaStateShapeCalculator)."""
    from vllm.config import CacheConfig
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator, MambaStateShapeCalculator
    from vllm.model_executor.models.config import NemotronHForCausalLMConfig

    from course import geometry

    config = {
        "model_type": "nemotron_h", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 32, "hybrid_override_pattern": "M*M-", "mamba_num_heads": 8,
        "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 2, "conv_kernel": 4, "expand": 2,
        "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
    }  # fmt: skip
    if config_ssm_dtype:
        config["mamba_ssm_cache_dtype"] = config_ssm_dtype
    cache = CacheConfig()
    hf_config = NS(**{k: v for k, v in config.items() if k == "mamba_ssm_cache_dtype"})
    NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype(cache_config=cache, hf_config=hf_config)
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, cache.mamba_cache_dtype,
                                                          cache.mamba_ssm_cache_dtype)  # fmt: skip
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=2 * 256, n_groups=2, num_heads=8, head_dim=64, state_size=128, conv_kernel=4
    )
    page = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, dtypes, strict=True))
    g = geometry.from_hf_config(config)
    assert kv.state_bytes(g, "bf16") == page
    assert sorted(map(math.prod, g.state_shapes)) == sorted(map(math.prod, shapes))
