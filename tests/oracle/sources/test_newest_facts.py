"""The newest release's facts (``course.kv.vllm.RULES``, vLLM 0.34.0 today) against that release's own code.

Each test calls the release's functions and classes (imported from its sources, or compiled from them
where the module needs CUDA), never a copy of them, with the inputs the course's fact is about. A release
that moves a fact fails the test named after it; ``bin/vllm-bump`` lists those tests for a new release.

The expectations are the rules the course states for ``COURSE_VLLM_EXPECTED_RELEASE`` (default: its newest
release), so that ``bin/vllm-bump NEW --since 0.32.0`` asks which of 0.32's facts NEW's code moves; each
test is written for either kind of release (a rule a release does not have is checked to be absent).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import math
import os
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from release_source import source_constant, source_function

from course import hardware, kv
from course.geometry import CHUNKED, FULL, SLIDING, STATE, WITH_STATE
from course.hardware import GiB
from course.kv import vllm as facts
from course.kv.catalogue import _catalogue
from course.vllm_bump import find_symbol
from course.vllm_release import GPU_VLLM_VERSION

RELEASE = os.environ.get("COURSE_VLLM_EXPECTED_RELEASE", GPU_VLLM_VERSION)  # whose rules are expected
RULES = facts.rules(RELEASE)


def _has_extensible_kv_cache() -> bool:
    from vllm.config import CacheConfig

    return "enable_extensible_kv_cache" in CacheConfig.__dataclass_fields__


def _needs_extensible_kv_cache():
    """Skip a test of the extensible KV cache where neither the course's rules nor the code have it; fail
    where one has it and the other not."""
    assert _has_extensible_kv_cache() is RULES.extensible_kv_cache, (
        f"the extensible KV cache: the course says {RULES.release.name} has it: {RULES.extensible_kv_cache}"
    )
    if not RULES.extensible_kv_cache:
        pytest.skip(f"{RULES.release.name} and these sources have no extensible KV cache")


def _sources_root() -> Path:
    import vllm

    return Path(vllm.__file__).parent.parent


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
H100 = hardware.gpu("H100-SXM")


# --- the block size (vllm/config/cache.py; vllm/platforms/*.py; vllm/v1/attention/backend.py) -----------------


def test_default_block_size_and_utilization():
    from vllm.config import CacheConfig

    assert RULES.block_size == CacheConfig.DEFAULT_BLOCK_SIZE
    assert CacheConfig().block_size == RULES.block_size  # unset --block-size resolves to the default
    estimate = {"enable_extensible_kv_cache": False} if _has_extensible_kv_cache() else {}
    cache = CacheConfig(**estimate)
    resolved = getattr(cache, "resolved_gpu_memory_utilization", cache.gpu_memory_utilization)
    assert resolved == RULES.estimate_utilization
    assert cache.enable_prefix_caching is facts.ENABLE_PREFIX_CACHING


def _first_backend(use_mla: bool, major: int, minor: int = 0):
    """The first attention backend CudaPlatform ranks for the card that runs on it, and its kernel block sizes
    (``_get_backend_priorities``, each backend's ``supports_compute_capability`` and
    ``get_supported_kernel_block_sizes``, compiled from the release's source)."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    names = {"AttentionBackendEnum": AttentionBackendEnum, "DeviceCapability": DeviceCapability,
             "MultipleOf": MultipleOf, "get_current_vllm_config_or_none": lambda: None,
             "current_platform": NS(is_xpu=lambda: False,
             is_device_capability_family=lambda family: family == major * 10)}  # fmt: skip
    priorities = source_function("vllm/platforms/cuda.py", "_get_backend_priorities", namespace=names)
    capability = DeviceCapability(major, minor)
    for backend in priorities(use_mla, capability):
        module, cls = backend.value.rsplit(".", 1)
        path = module.replace(".", "/") + ".py"
        runs_on = source_function(path, "supports_compute_capability", cls, names)
        if runs_on(None, capability):
            sizes_of = source_function(path, "get_supported_kernel_block_sizes", cls, names)
            try:
                sizes = sizes_of()
            except TypeError:  # a classmethod: cls, then the optional spec
                stand_in = NS(_get_sm90_fa4_fp8_kv_block_size=lambda spec: None,
                              _get_fa4_hd256_block_size=lambda spec: None)  # fmt: skip
                sizes = sizes_of(stand_in)
            return backend, sizes
    raise AssertionError(f"no backend runs on compute capability {major}.{minor}")


@pytest.mark.parametrize("use_mla", [False, True], ids=["attention", "mla"])
@pytest.mark.parametrize("major", [8, 9, 10, 12])
def test_block_size_is_the_first_usable_backends_preferred(use_mla, major):
    """``--block-size`` unset: the backend's preferred block size, from the default
    (``AttentionBackend.get_preferred_block_size``; ``Platform.update_block_size_for_backend``)."""
    from vllm.v1.attention.backend import AttentionBackend

    backend, sizes = _first_backend(use_mla, major)
    stand_in = type("Backend", (AttentionBackend,), {"get_supported_kernel_block_sizes": staticmethod(lambda: sizes)})
    from vllm.config import CacheConfig

    expected = stand_in.get_preferred_block_size(CacheConfig.DEFAULT_BLOCK_SIZE)
    card = dataclasses.replace(H100, compute_capability=(major, 0))
    assert facts.default_block_size(card, use_mla, release=RELEASE) == expected, f"{backend.name} on {major}.0"
    model = "DeepSeek-V2-Lite" if use_mla else "Llama-3-8B"
    assert kv.budget(model, card, max_model_len=4096, release=RELEASE).block_size == expected


def test_several_backends_take_the_smallest_size_all_accept():
    """Models that mix backends: the default when all accept it (``_preferred_block_size_for_backends``)."""
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    if not hasattr(Platform, "_preferred_block_size_for_backends"):
        pytest.skip("these sources ask the first backend only (before 0.34)")
    with_default = Platform._preferred_block_size_for_backends.__func__(
        Platform, [TritonAttentionBackend, TritonAttentionBackend], RULES.block_size, NS()
    )
    assert with_default == RULES.block_size


def test_the_cpu_platform_starts_from_128_and_needs_triton_on_x86():
    """The CPU platform's block size when none is given (0.32: ``check_and_update_config`` sets 128; 0.34:
    ``update_block_size_for_backend`` asks the backends for 128 first), and whether x86 without Triton is
    refused (why the runnable release stays older)."""
    from course.vllm_bump import refuses_without_triton

    root = _sources_root()
    sizes = set()
    for method in ("check_and_update_config", "update_block_size_for_backend"):
        node = find_symbol(root, "vllm/platforms/cpu.py", f"CpuPlatform.{method}")
        for call in ast.walk(node or ast.Module(body=[], type_ignores=[])):
            if isinstance(call, ast.Call) and "_preferred_block_size_for_backends" in ast.unparse(call.func):
                sizes.add(ast.literal_eval(call.args[1]))
            # the plain default: "elif not cache_config.user_specified_block_size: cache_config.block_size = N"
            if isinstance(call, ast.If) and "not cache_config.user_specified_block_size" in ast.unparse(call.test):
                for stmt in call.body:
                    target = ast.unparse(stmt.targets[0]) if isinstance(stmt, ast.Assign) else ""
                    if target == "cache_config.block_size" and isinstance(stmt.value, ast.Constant):
                        sizes.add(stmt.value.value)
    assert sizes == {RULES.cpu_block_size}
    assert refuses_without_triton(root) is RULES.cpu_requires_triton


# --- the extensible KV cache (vllm/config/cache.py, vllm/config/vllm.py, vllm/v1/worker/*.py) ---------------


@pytest.mark.parametrize("extensible", [True, False, None])
@pytest.mark.parametrize("utilization", [None, 0.5, 0.92])
def test_unset_utilization_resolves_by_sizing(extensible, utilization):
    from vllm.config import CacheConfig

    _needs_extensible_kv_cache()
    cache = CacheConfig(gpu_memory_utilization=utilization, enable_extensible_kv_cache=extensible)
    expected = utilization if utilization is not None else RULES.default_utilization(bool(extensible))
    assert cache.resolved_gpu_memory_utilization == expected


@pytest.mark.parametrize("platform", ["cuda", "rocm", "cpu"])
@pytest.mark.parametrize("given", ["nothing", "kv_cache_memory_bytes", "num_gpu_blocks_override"])
def test_when_the_extensible_kv_cache_is_on(monkeypatch, platform, given):
    """``VllmConfig._resolve_extensible_kv_cache`` with the flag unset: on for CUDA and ROCm unless the cache
    size or the block count is given."""
    import vllm.platforms
    from vllm.config import CacheConfig, VllmConfig

    _needs_extensible_kv_cache()
    monkeypatch.setattr(
        vllm.platforms,
        "current_platform",
        NS(is_cuda_alike=lambda: platform != "cpu", is_rocm=lambda: platform == "rocm"),
        raising=False,
    )
    sizes = {"kv_cache_memory_bytes": 4 * GiB} if given == "kv_cache_memory_bytes" else {}
    if given == "num_gpu_blocks_override":
        sizes["num_gpu_blocks_override"] = 512
    cache = CacheConfig(**sizes)
    config = NS(cache_config=cache, kv_transfer_config=None, parallel_config=NS(enable_elastic_ep=False))
    VllmConfig._resolve_extensible_kv_cache(config)
    device = dataclasses.replace(H100, platform=platform)
    ours = facts.extensible_kv_cache(device, release=RELEASE, **sizes)
    assert ours.on is bool(cache.enable_extensible_kv_cache), ours.reason


def test_the_margin():
    _needs_extensible_kv_cache()
    from vllm.v1.worker import extensible_kv_cache as ekc

    assert ekc.KV_CACHE_MARGIN_FRACTION == facts.KV_CACHE_MARGIN_FRACTION
    for platform, floor in facts.KV_CACHE_MARGIN_FLOOR_BYTES.items():
        stand_in = NS(is_rocm=lambda platform=platform: platform == "rocm")
        path = "vllm/v1/worker/extensible_kv_cache.py"
        assert source_constant(path, "KV_CACHE_MARGIN_FLOOR_BYTES", {"current_platform": stand_in}) == floor, platform


@pytest.mark.parametrize("requested_gib", [40.0, 71.2, 79.14])
@pytest.mark.parametrize("peak_gib", [0.0, 0.5, 1.19, 3.0])
@pytest.mark.parametrize("growth_gib", [0.0, 2.0])
@pytest.mark.parametrize("committed_gib", [0.0, 0.25])
def test_measure_kv_cache_bytes(requested_gib, peak_gib, growth_gib, committed_gib):
    _needs_extensible_kv_cache()
    from vllm.v1.worker.extensible_kv_cache import measure_kv_cache_bytes

    args = dict(init_free_memory=int(77 * GiB), free_memory=int(60 * GiB), committed_bytes=int(committed_gib * GiB),
                requested_memory=int(requested_gib * GiB), transient_peak_bytes=int(peak_gib * GiB),
                torch_reserve_growth_bytes=int(growth_gib * GiB))  # fmt: skip
    assert facts.measure_kv_cache_bytes(**args) == measure_kv_cache_bytes(**args)


class _StandInCache:
    """The parts of ``ExtensibleKVCache`` ``measure_kv_cache_blocks`` reads: nothing committed, blocks of one page."""

    def __init__(self, bytes_per_block: int, peak: int, growth: int = 0) -> None:
        self.bytes_per_block = bytes_per_block
        self.reserved_headroom_bytes = peak
        self.torch_reserve_growth_bytes = growth
        self.physical_bytes = 0
        self.torch_limit = None

    def blocks_within(self, num_bytes: int) -> int:
        return max(0, num_bytes // self.bytes_per_block)

    def physical_bytes_for(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    def set_torch_memory_limit(self, limit) -> None:
        self.torch_limit = limit


def _vllm_measured_budget(monkeypatch, b: kv.KVBudget):
    """vLLM's ``request_memory`` and ``measure_kv_cache_blocks`` on a stand-in device holding what ``b`` assumes:
    (blocks, the warning it logs or None, its "Memory after warmup" line)."""
    from vllm.config import CacheConfig
    from vllm.v1.worker import extensible_kv_cache as ekc
    from vllm.v1.worker.utils import request_memory

    utilization = b.utilization if b.utilization_given else None
    cache = CacheConfig(gpu_memory_utilization=utilization, enable_extensible_kv_cache=True)
    init_free = int(b.total_memory - b.other_processes)
    snapshot = NS(total_memory=int(b.total_memory), free_memory=init_free, device_="cuda:0")
    requested = request_memory(snapshot, cache)  # no refusal under the extensible KV cache
    free_after = init_free - int(b.weights + b.non_torch + b.cuda_graphs)
    logged = {}

    def record(kind):
        return lambda message, *args: logged.setdefault(kind, message % args)

    monkeypatch.setattr(ekc, "device_memory_info", lambda device: (free_after, int(b.total_memory)))
    accelerator = NS(synchronize=lambda *a: None, empty_cache=lambda *a: None, memory_reserved=lambda *a: 0)
    monkeypatch.setattr(ekc, "torch", NS(accelerator=accelerator))
    monkeypatch.setattr(ekc, "logger", NS(warning_once=record("warning"), info=record("info")))
    stand_in = _StandInCache(int(b.page_bytes), int(b.measured_peak), int(b.torch_reserve_growth))
    config = NS(cache_config=cache, model_config=NS(multimodal_config=None), parallel_config=NS())
    blocks = ekc.measure_kv_cache_blocks(
        stand_in, config, "cuda:0", init_free_memory=init_free, requested_memory=requested
    )
    return blocks, logged.get("warning"), logged.get("info")


@pytest.mark.parametrize(
    ("model", "gpu", "utilization", "others_gib", "activation_gib", "graphs_gib", "peak_gib"),
    [("Llama-3-8B", "H100-SXM", None, 0, 1.19, 0.0, None), ("Llama-3-8B", "H100-SXM", 0.9, 0, 1.19, 0.5, None),
     ("Llama-3-8B", "L4", None, 0, 0.0, 0.0, None), ("Qwen2.5-7B", "A100-80GB", 0.92, 0, 2.0, 0.4, 3.5),
     ("Llama-3-8B", "H100-SXM", None, 10, 1.19, 0.3, None), ("Llama-3-8B", "H100-SXM", 0.75, 0, 0.5, 0.0, None),
     ("Llama-3-8B", "H100-SXM", 0.98, 0, 1.19, 0.0, None), ("Llama-3.1-70B", "H200-SXM", None, 0, 4.0, 1.0, None)],
)  # fmt: skip
def test_the_budget_measured_after_warm_up(monkeypatch, model, gpu, utilization, others_gib, activation_gib,
                                           graphs_gib, peak_gib):  # fmt: skip
    """Blocks, the warning and the "Memory after warmup" line, as ``measure_kv_cache_blocks`` gives them."""
    _needs_extensible_kv_cache()
    b = kv.budget(model, gpu, utilization=utilization, max_model_len=8192, release=RELEASE,
                  other_process_bytes=others_gib * GiB, activation_bytes=activation_gib * GiB,
                  cuda_graph_bytes=graphs_gib * GiB,
                  transient_peak_bytes=None if peak_gib is None else peak_gib * GiB)  # fmt: skip
    assert b.extensible and b.startup_error is None
    blocks, warning, info = _vllm_measured_budget(monkeypatch, b)
    assert b.num_blocks == min(blocks, b.capacity_blocks), b.table()
    assert b.warning == warning
    assert info.startswith(b.memory_after_warmup.removesuffix("."))


@pytest.mark.parametrize(("free_gib", "utilization"), [(70.0, 0.92), (10.0, 0.5), (60.0, 1.0)])
@pytest.mark.parametrize("extensible", [True, False])
def test_the_startup_check_refuses_only_without_the_extensible_kv_cache(free_gib, utilization, extensible):
    from vllm.config import CacheConfig
    from vllm.v1.worker.utils import request_memory

    if extensible:
        _needs_extensible_kv_cache()
    total = int(79.14 * GiB)
    snapshot = NS(total_memory=total, free_memory=int(free_gib * GiB), device_="cuda:0")
    sizing = {"enable_extensible_kv_cache": extensible} if _has_extensible_kv_cache() else {}
    cache = CacheConfig(gpu_memory_utilization=utilization, **sizing)
    ours = facts.free_memory_error(total, int(free_gib * GiB), utilization, extensible=extensible)
    try:
        requested = request_memory(snapshot, cache)
    except ValueError as refused:
        assert ours == str(refused)
    else:
        assert ours is None and requested == math.ceil(total * utilization)


# --- batches in flight (vllm/config/vllm.py) ---------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_max_concurrent_batches_and_in_flight_tokens(async_scheduling, pp):
    from vllm.config import VllmConfig

    config = NS(parallel_config=NS(pipeline_parallel_size=pp), use_v2_model_runner=True,  # 0.32's GPU default
                scheduler_config=NS(async_scheduling=async_scheduling, max_num_batched_tokens=8192))  # fmt: skip
    config.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(config)
    assert facts.max_concurrent_batches(async_scheduling, pp, release=RELEASE) == config.max_concurrent_batches
    assert facts.max_in_flight_tokens(8192, async_scheduling, pp, release=RELEASE) == (
        VllmConfig.max_in_flight_tokens.fget(config)
    )


# --- scheduler budgets (vllm/engine/arg_utils.py) ------------------------------------------------------------------

B200 = hardware.HardwareSpec("B200", 192e9, 8e12, 2.25e15, "a >= 160 GiB stand-in", 178.35 * GiB)
GB10 = hardware.HardwareSpec("GB10", 128e9, 273e9, 1e15, "a GB10 stand-in", 119.7 * GiB, compute_capability=(12, 1))


def _platform(device: hardware.HardwareSpec) -> NS:
    return NS(
        get_device_total_memory=lambda device_id=0: int(device.total_memory),
        get_device_name=lambda device_id=0: device.name,
        is_device_capability=lambda capability, device_id=0: capability == device.compute_capability,
        is_tpu=lambda: False,
        is_cpu=lambda: device.platform == "cpu",
    )


@pytest.mark.parametrize("name", [*hardware.GPUS, "B200", "GB10", "CPU"])
def test_batch_defaults_per_device(monkeypatch, name):
    from vllm.engine import arg_utils
    from vllm.usage.usage_lib import UsageContext

    device = {"B200": B200, "GB10": GB10}.get(name) or hardware.gpu(name)
    monkeypatch.setattr(arg_utils, "current_platform", _platform(device))
    tokens, seqs = arg_utils.EngineArgs.get_batch_defaults(1)
    server, llm = UsageContext.OPENAI_API_SERVER, UsageContext.LLM_CLASS
    d = facts.batch_defaults(device, release=RELEASE)
    ours = (d.max_num_batched_tokens, d.max_num_seqs, d.llm_max_num_batched_tokens, d.llm_max_num_seqs)
    assert ours == (tokens[server], seqs[server], tokens[llm], seqs[llm]), d.reason


@pytest.mark.parametrize("name", ["H100-SXM", "A100-40GB"])
@pytest.mark.parametrize("max_model_len", [96, 131072])
@pytest.mark.parametrize(("chunked_prefill", "mode"), [(True, "balanced"), (False, "throughput")])
def test_scheduler_defaults_as_vllm_serve_sets_them(monkeypatch, name, max_model_len, chunked_prefill, mode):
    from vllm.engine import arg_utils
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    device = hardware.gpu(name)
    monkeypatch.setattr(arg_utils, "current_platform", _platform(device))
    args = NS(pipeline_parallel_size=1, tensor_parallel_size=1, get_batch_defaults=EngineArgs.get_batch_defaults,
              max_num_batched_tokens=None, max_num_seqs=None, performance_mode=mode,
              enable_chunked_prefill=chunked_prefill)  # fmt: skip
    model = NS(max_model_len=max_model_len, is_multimodal_model=False)
    EngineArgs._set_default_max_num_seqs_and_batched_tokens_args(
        args, UsageContext.OPENAI_API_SERVER, model, NS(use_batched_dp_moe=False)
    )
    ours = facts.scheduler_defaults(
        device, max_model_len, chunked_prefill=chunked_prefill, performance_mode=mode, release=RELEASE
    )
    assert (ours.max_num_batched_tokens, ours.max_num_seqs) == (args.max_num_batched_tokens, args.max_num_seqs)


# --- capacity (vllm/v1/kv_cache_interface.py, vllm/v1/core/kv_cache_planning.py, kv_cache_utils.py) ----------------


def _vllm_config(b: kv.KVBudget):
    """The parts of a VllmConfig the release's planning functions read, for the deployment ``b`` describes."""
    from vllm.config import CacheConfig, VllmConfig

    cache = CacheConfig(block_size=b.block_size)
    cache.mamba_cache_mode = "align" if b.state_pages == 2 else "none"
    cache.kv_cache_layout = "LBNHC"  # FlashAttention's (layer-outermost)
    config = NS(
        scheduler_config=NS(disable_hybrid_kv_cache_manager=False, max_num_batched_tokens=b.max_num_batched_tokens,
                            async_scheduling=b.async_scheduling, max_num_seqs=1024),
        cache_config=cache,
        model_config=NS(max_model_len=b.max_model_len, original_max_model_len=b.max_model_len),
        parallel_config=NS(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                           pipeline_parallel_size=b.pipeline_parallel, tensor_parallel_size=b.tp),
        attention_config=NS(hisparse_config=None),
        speculative_config=None,
        kv_transfer_config=None,
        use_v2_model_runner=True,
    )  # fmt: skip
    config.max_concurrent_batches = VllmConfig.max_concurrent_batches.fget(config)
    config.max_in_flight_tokens = VllmConfig.max_in_flight_tokens.fget(config)
    return config


def _layer_specs(g, b: kv.KVBudget) -> dict:
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
            specs[f"layers.{layer}.attn"] = (MLAAttentionSpec if g.is_mla else FullAttentionSpec)(dtype=dtype, **common)
        elif attention == SLIDING:
            specs[f"layers.{layer}.attn"] = SlidingWindowSpec(dtype=dtype, sliding_window=g.sliding_window, **common)
        elif attention == CHUNKED:
            specs[f"layers.{layer}.attn"] = ChunkedLocalAttentionSpec(
                dtype=dtype, attention_chunk_size=g.attention_chunk_size, **common
            )
        if g.layer_kind(layer) in WITH_STATE:
            specs[f"layers.{layer}.state"] = MambaSpec(
                block_size=b.block_size,
                shapes=((int(kv.state_bytes(g, b.kv_dtype)) // dtype.itemsize,),),
                dtypes=(dtype,),
                page_size_padded=int(b.layer_page_bytes),
                mamba_cache_mode="align" if b.state_pages == 2 else "none",
            )
    return specs


def _deployments():
    for name, entry in _catalogue().items():
        g = entry.geometry
        if any(g.layer_kind(i) == STATE for i in range(g.num_layers)):
            continue  # hybrids: the state page's alignment is the model class's (not imported here)
        for gpu, max_model_len, pp in (("H100-SXM", 8192, 1), ("A100-40GB", 32768, 1), ("H200-SXM", 32768, 2)):
            if max_model_len <= (g.max_position_embeddings or max_model_len):
                yield pytest.param(name, gpu, max_model_len, pp, id=f"{name}-{gpu}-{max_model_len}-pp{pp}")


@pytest.mark.parametrize(("model", "gpu", "max_model_len", "pp"), list(_deployments()))
def test_kv_capacity_as_the_release_plans_it(model, gpu, max_model_len, pp):
    """Blocks, the logged "KV cache size" tokens and "Maximum concurrency" for the same KV memory, at the
    release's block size and batches in flight."""
    from vllm.v1.core import kv_cache_utils

    try:  # 0.33 moved the planning functions out of kv_cache_utils
        planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    except ModuleNotFoundError:
        planning = kv_cache_utils
    b = kv.budget(model, gpu, max_model_len=max_model_len, kv_cache_memory_bytes=24 * GiB, release=RELEASE,
                  pipeline_parallel=pp)  # fmt: skip
    config = _vllm_config(b)
    specs = _layer_specs(kv.get_model(model), b)
    groups = planning.get_kv_cache_groups(config, specs)
    plan = planning.get_kv_cache_config_from_groups(config, groups, int(b.kv_memory))
    tokens, concurrency = kv_cache_utils.get_kv_cache_capacity(config, plan)
    assert b.layer_page_bytes in {spec.page_size_bytes for spec in specs.values()}
    assert len(groups) == len(b.groups)
    assert plan.num_blocks == b.num_blocks
    assert (tokens, round(concurrency, 6)) == (b.num_tokens, round(b.max_concurrency, 6)), b.log_line
