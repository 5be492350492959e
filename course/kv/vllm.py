"""The KV-cache and scheduler facts of the two vLLM releases the course names (:mod:`course.vllm_release`).

Every fact the calculator (``course kv``, module 4) and the simulator (``course simulate``, module 3)
rely on is stated here once, with the file and function it was read from (paths relative to the
``vllm`` package). Where vLLM 0.32.0 (the runnable release) and 0.34.0 (the newest, on GPUs) differ,
both rules are kept in :data:`RULES`, each with its citation; the functions take ``release`` ("0.32" or
"0.34"). ``tests/oracle/test_drift.py`` checks the 0.32 facts against the installed CPU build,
``tests/oracle/sources/`` the 0.34 facts against that release's own Python sources from PyPI.

Read from vLLM 0.32.0:

* ``config/cache.py`` (``CacheConfig``): ``gpu_memory_utilization`` 0.92, ``DEFAULT_BLOCK_SIZE`` 16,
  ``enable_prefix_caching`` True, ``kv_cache_memory_bytes``, ``mamba_cache_mode``;
* ``engine/arg_utils.py`` (``EngineArgs.get_batch_defaults`` and
  ``_set_default_max_num_seqs_and_batched_tokens_args``): the per-device ``max_num_batched_tokens``
  and ``max_num_seqs``;
* ``config/vllm.py`` (``VllmConfig.max_concurrent_batches``, ``max_in_flight_tokens``): async
  scheduling keeps two batches in flight, and sliding-window layers reserve for both;
* ``v1/worker/utils.py`` (``request_memory``): the startup free-memory check;
* ``v1/kv_cache_interface.py``: page sizes and each spec's ``max_memory_usage_bytes``;
* ``v1/core/kv_cache_utils.py``: KV-cache groups, ``get_max_concurrency_for_kv_cache_config`` and
  ``get_kv_cache_capacity`` (the "KV cache size" log line);
* ``platforms/cpu.py`` (``CpuPlatform.check_and_update_config``): the CPU build's block size 128,
  ``VLLM_CPU_KVCACHE_SPACE`` and async scheduling off;
* ``config/model.py`` (``_resolve_auto_dtype``): a float32 checkpoint is served in the platform's
  first supported dtype.

What vLLM 0.34.0 changed (:data:`RULES` ``["0.34.0"]``; the rest is the same code, function by function):

* the **extensible KV cache** (``config/cache.py``, ``CacheConfig.enable_extensible_kv_cache`` and
  ``resolved_gpu_memory_utilization``; ``config/vllm.py``, ``VllmConfig._resolve_extensible_kv_cache``): on
  by default on CUDA and ROCm, it reserves the cache's address range and sizes it from the memory *measured*
  free after warm-up and CUDA-graph capture (``v1/worker/extensible_kv_cache.py``,
  ``measure_kv_cache_bytes`` and ``measure_kv_cache_blocks``: :func:`measure_kv_cache_bytes` here), an unset
  ``gpu_memory_utilization`` means 1.0 (0.92 only where the cache is sized from the profiling estimate), and
  the startup free-memory check no longer refuses (``v1/worker/utils.py``, ``request_memory``);
* **64-token blocks** (``CacheConfig.DEFAULT_BLOCK_SIZE``; ``platforms/interface.py``,
  ``Platform.update_block_size_for_backend`` and ``_preferred_block_size_for_backends``): every CUDA
  attention backend the course's models pick, MLA's included, accepts 64; the CPU platform starts from 128
  (``platforms/cpu.py``, ``CpuPlatform.update_block_size_for_backend``) and refuses to start on x86 without
  ``triton-cpu`` (``CpuPlatform.check_and_update_config``);
* **no V1 model runner**: with async scheduling, ``pipeline stages + 1`` batches in flight
  (``VllmConfig.max_concurrent_batches``);
* GB10 (compute capability 12.1) leaves the >= 70 GiB tier of ``get_batch_defaults``.

The 0.11-era default utilization (0.90) is kept as :data:`OLD_GPU_MEMORY_UTILIZATION`: most public
startup logs, including the one modules 3 and 4 reproduce, were run with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from course.geometry import DTYPE_ALIASES
from course.hardware import GiB, HardwareSpec
from course.vllm_release import (
    GPU_VLLM_RELEASE,
    GPU_VLLM_VERSION,
    NEWEST,
    RUNNABLE,
    VLLM_RELEASE,
    VLLM_VERSION,
    Release,
    get_release,
)

__all__ = ["GPU_VLLM_RELEASE", "GPU_VLLM_VERSION", "VLLM_VERSION", "VLLM_RELEASE"]

# The files the 0.32.0 facts below were read from (module 4 prints them).
SOURCE_FILES = (
    "vllm/config/cache.py",
    "vllm/config/vllm.py",
    "vllm/engine/arg_utils.py",
    "vllm/v1/worker/utils.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/platforms/cpu.py",
    "vllm/platforms/interface.py",
    "vllm/config/model.py",
    "vllm/model_executor/layers/mamba/mamba_utils.py",
)
# The files the 0.34.0 rules were read from: the same, and the extensible KV cache's.
GPU_SOURCE_FILES = (*SOURCE_FILES, "vllm/v1/worker/extensible_kv_cache.py", "vllm/v1/worker/gpu_worker.py")


@dataclass(frozen=True)
class KVRules:
    """The KV-cache rules of one vLLM release, where the course's two releases differ.

    Attributes:
        release: the release.
        block_size: ``CacheConfig.DEFAULT_BLOCK_SIZE``: the block size on GPUs unless a backend refuses it.
        cpu_block_size: the CPU platform's default block size (standard attention).
        estimate_utilization: the default ``gpu_memory_utilization`` when the cache is sized from the
            profiling estimate (0.32: always; 0.34: where the extensible KV cache is off).
        extensible_kv_cache: whether the cache is sized from memory measured after warm-up by default on
            CUDA and ROCm (0.34's extensible KV cache); then an unset utilization means 1.0.
        v1_model_runner: whether the V1 model runner exists (0.32: the fallback when Triton is missing or a
            feature needs it), which keeps ``pipeline_parallel`` batches in flight (2 for one stage).
        gb10_large_batches: whether GB10 (compute capability 12.1) gets the >= 70 GiB batch defaults.
        cpu_requires_triton: whether the CPU platform refuses to start on x86 without Triton (``triton-cpu``,
            which is not on PyPI); 0.32 only warns.
        sources: each rule's citation, "file (function)", at this release.
    """

    release: Release
    block_size: int
    cpu_block_size: int
    estimate_utilization: float
    extensible_kv_cache: bool
    v1_model_runner: bool
    gb10_large_batches: bool
    cpu_requires_triton: bool
    sources: Mapping[str, str] = field(default_factory=dict)

    def default_utilization(self, extensible: bool) -> float:
        """What an unset ``gpu_memory_utilization`` means (``CacheConfig.resolved_gpu_memory_utilization``)."""
        return 1.0 if extensible else self.estimate_utilization


RULES: dict[str, KVRules] = {
    RUNNABLE.version: KVRules(
        RUNNABLE,
        block_size=16,
        cpu_block_size=128,
        estimate_utilization=0.92,
        extensible_kv_cache=False,
        v1_model_runner=True,
        gb10_large_batches=True,
        cpu_requires_triton=False,
        sources={
            "block_size": "vllm/config/cache.py (CacheConfig.DEFAULT_BLOCK_SIZE = 16)",
            "cpu_block_size": "vllm/platforms/cpu.py (CpuPlatform.check_and_update_config: block_size = 128)",
            "utilization": "vllm/config/cache.py (CacheConfig.gpu_memory_utilization: Field(default=0.92))",
            "budget": "vllm/v1/worker/gpu_worker.py (Worker.determine_available_memory: requested - profiled)",
            "startup_check": "vllm/v1/worker/utils.py (request_memory: refuses when free < requested)",
            "mla_block_size": "vllm/platforms/cuda.py (_get_backend_priorities) and vllm/platforms/interface.py "
            "(Platform.update_block_size_for_backend)",
            "batches_in_flight": "vllm/config/vllm.py (VllmConfig.max_concurrent_batches: V2 runner pp + 1, "
            "V1 runner 2 for one stage, else pp)",
            "batch_defaults": "vllm/engine/arg_utils.py (EngineArgs.get_batch_defaults)",
            "triton": "vllm/platforms/cpu.py (CpuPlatform.check_and_update_config: x86 without Triton only warns)",
        },
    ),
    NEWEST.version: KVRules(
        NEWEST,
        block_size=64,
        cpu_block_size=128,
        estimate_utilization=0.92,
        extensible_kv_cache=True,
        v1_model_runner=False,
        gb10_large_batches=False,
        cpu_requires_triton=True,
        sources={
            "block_size": "vllm/config/cache.py (CacheConfig.DEFAULT_BLOCK_SIZE = 64) and "
            "vllm/platforms/interface.py (Platform.update_block_size_for_backend, "
            "_preferred_block_size_for_backends)",
            "cpu_block_size": "vllm/platforms/cpu.py (CpuPlatform.update_block_size_for_backend: from 128)",
            "utilization": "vllm/config/cache.py (CacheConfig.resolved_gpu_memory_utilization: 1.0 with the "
            "extensible KV cache, else DEFAULT_GPU_MEMORY_UTILIZATION = 0.92)",
            "extensible": "vllm/config/cache.py (CacheConfig.enable_extensible_kv_cache) and vllm/config/vllm.py "
            "(VllmConfig._resolve_extensible_kv_cache)",
            "budget": "vllm/v1/worker/extensible_kv_cache.py (measure_kv_cache_bytes, measure_kv_cache_blocks)",
            "margin": "vllm/v1/worker/extensible_kv_cache.py (KV_CACHE_MARGIN_FLOOR_BYTES, KV_CACHE_MARGIN_FRACTION)",
            "startup_check": "vllm/v1/worker/utils.py (request_memory: no refusal with the extensible KV cache)",
            "mla_block_size": "vllm/platforms/cuda.py (_get_backend_priorities) and vllm/v1/attention/backend.py "
            "(AttentionBackend.get_preferred_block_size)",
            "batches_in_flight": "vllm/config/vllm.py (VllmConfig.max_concurrent_batches: pp + 1 with async)",
            "batch_defaults": "vllm/engine/arg_utils.py (EngineArgs.get_batch_defaults: GB10 excluded from the "
            ">= 70 GiB tier)",
            "triton": "vllm/platforms/cpu.py (CpuPlatform.check_and_update_config: x86 without Triton raises)",
        },
    ),
}


def rules(release: str | Release | None = None) -> KVRules:
    """The KV-cache rules of ``release`` ("0.32", "0.34.0", "vLLM 0.34.0"; None is the newest)."""
    return RULES[get_release(release).version]


# vLLM 0.32.0's facts by name (the runnable release; module 4's exercises reproduce its budget).
GPU_MEMORY_UTILIZATION = RULES[RUNNABLE.version].estimate_utilization  # CacheConfig.gpu_memory_utilization
OLD_GPU_MEMORY_UTILIZATION = 0.90  # vLLM <= 0.11's default, in most public startup logs
BLOCK_SIZE = RULES[RUNNABLE.version].block_size  # CacheConfig.DEFAULT_BLOCK_SIZE (CUDA), 0.32
CPU_BLOCK_SIZE = RULES[RUNNABLE.version].cpu_block_size  # CpuPlatform, when no --block-size is given
GPU_BLOCK_SIZE = RULES[NEWEST.version].block_size  # 0.34's CacheConfig.DEFAULT_BLOCK_SIZE (CUDA, ROCm)
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB; sets kv_cache_memory_bytes on the CPU build
ENABLE_PREFIX_CACHING = True  # CacheConfig.enable_prefix_caching (generative models), both releases
ASYNC_SCHEDULING = True  # VllmConfig resolves async_scheduling None to True on GPUs; the CPU build sets False
# The smallest kernel block of the attention backends the course's models run on CUDA (FlashAttention,
# FlashInfer, Triton: multiples of 16); vLLM aligns the attention block of hybrid attention + state
# models to the larger of it and the block size (Platform._align_hybrid_block_size).
HYBRID_BLOCK_ALIGNMENT = 16

# The extensible KV cache (0.34, vllm/v1/worker/extensible_kv_cache.py): the margin kept free beyond the
# measured transient peak is max(floor, fraction x peak), the floor 3 GiB on ROCm and 1 GiB elsewhere.
KV_CACHE_MARGIN_FLOOR_BYTES = {"cuda": 1 * GiB, "rocm": 3 * GiB}  # KV_CACHE_MARGIN_FLOOR_BYTES
KV_CACHE_MARGIN_FRACTION = 0.75  # KV_CACHE_MARGIN_FRACTION
# measure_kv_cache_blocks warns when an explicit utilization in this open range withholds >= 1 GiB.
WITHHOLD_WARNING_RANGE = (0.7, 1.0)
WITHHOLD_WARNING_BYTES = 1 * GiB


def max_concurrent_batches(
    async_scheduling: bool = ASYNC_SCHEDULING,
    pipeline_parallel: int = 1,
    *,
    release: str | Release = RUNNABLE,
    v2_model_runner: bool = True,
) -> int:
    """Batches in flight at once (``VllmConfig.max_concurrent_batches``).

    Pipeline parallelism keeps one batch per stage; async scheduling schedules one more ahead while the
    others run: ``pipeline_parallel + 1``. vLLM 0.32's V1 model runner (its fallback when Triton is
    missing or a feature needs it, ``v2_model_runner=False``) keeps 2 for one stage and only
    ``pipeline_parallel`` beyond; 0.34 has no V1 runner. Without async scheduling: ``pipeline_parallel``.
    """
    if not async_scheduling:
        return pipeline_parallel
    if rules(release).v1_model_runner and not v2_model_runner:
        return 2 if pipeline_parallel <= 1 else pipeline_parallel
    return pipeline_parallel + 1


def max_in_flight_tokens(
    max_num_batched_tokens: int,
    async_scheduling: bool = ASYNC_SCHEDULING,
    pipeline_parallel: int = 1,
    *,
    release: str | Release = RUNNABLE,
) -> int:
    """Tokens scheduled but not yet settled (``VllmConfig.max_in_flight_tokens``): what sliding-window and
    chunked-local layers reserve beyond their window."""
    return max_concurrent_batches(async_scheduling, pipeline_parallel, release=release) * max_num_batched_tokens


def default_block_size(device: HardwareSpec, is_mla: bool = False, *, release: str | Release = RUNNABLE) -> int:
    """The KV block size vLLM picks on ``device`` when no ``--block-size`` is given (before a hybrid model's
    alignment, :func:`course.kv.budget.hybrid_block_size`).

    The CPU platform: 128. GPUs: ``CacheConfig.DEFAULT_BLOCK_SIZE`` (16 in 0.32, 64 in 0.34) when the
    attention backend accepts it, else the backend's smallest size
    (``AttentionBackend.get_preferred_block_size``; with several backends, the smallest size all accept:
    ``Platform._preferred_block_size_for_backends``, 0.34). The backends vLLM picks for standard attention on
    CUDA (FlashAttention, FlashInfer, Triton: multiples of 16, or 16/32/64) take either default; MLA models
    go by :func:`mla_block_size`.
    """
    if device.platform == "cpu":
        return rules(release).cpu_block_size
    return mla_block_size(device, release=release) if is_mla else rules(release).block_size


@dataclass(frozen=True)
class BatchDefaults:
    """vLLM's scheduler defaults for one device (``EngineArgs.get_batch_defaults``), before
    ``_set_default_max_num_seqs_and_batched_tokens_args`` fits them to the model (:func:`scheduler_defaults`).

    Attributes:
        max_num_batched_tokens: token budget per step, for ``vllm serve`` (the OpenAI API server).
        max_num_seqs: most running requests, for ``vllm serve``.
        llm_max_num_batched_tokens: the same for the offline ``LLM`` class.
        llm_max_num_seqs: the same for the offline ``LLM`` class.
        reason: which branch of ``get_batch_defaults`` applied.
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    llm_max_num_batched_tokens: int
    llm_max_num_seqs: int
    reason: str


def batch_defaults(device: HardwareSpec, world_size: int = 1, *, release: str | Release = RUNNABLE) -> BatchDefaults:
    """vLLM's per-device scheduler defaults (``vllm/engine/arg_utils.py``, ``get_batch_defaults``).

    Devices with at least 160 GiB (as the driver reports it: B200, B300) get 16,384 tokens / 1,024
    sequences under ``vllm serve``; at least 70 GiB and not an A100 (H100, H200), 8,192 / 1,024 (0.34:
    and not a GB10, compute capability 12.1); the rest, A100s included, 2,048 / 256 ("Setting large
    `max_num_batched_tokens` for A100 reduces throughput, see PR #17885"). The CPU build: 2,048 / 128 per
    worker (``world_size`` = TP x PP).
    """
    if device.platform == "cpu":
        return BatchDefaults(
            2048 * world_size, 128 * world_size, 4096 * world_size, 256 * world_size, "CPU: 2,048 x world size"
        )
    if device.total_memory >= 160 * GiB:
        return BatchDefaults(16384, 1024, 16384, 1024, f"{device.name}: >= 160 GiB")
    gb10 = device.compute_capability == (12, 1) and not rules(release).gb10_large_batches
    if device.total_memory >= 70 * GiB and "a100" not in device.name.lower() and not gb10:
        return BatchDefaults(8192, 1024, 16384, 1024, f"{device.name}: >= 70 GiB and not an A100")
    why = "an A100" if "a100" in device.name.lower() else "a GB10" if gb10 else "< 70 GiB"
    return BatchDefaults(2048, 256, 8192, 256, f"{device.name}: {why}")


@dataclass(frozen=True)
class SchedulerDefaults:
    """What ``vllm serve`` runs with when neither budget is given: tokens per step and running requests."""

    max_num_batched_tokens: int
    max_num_seqs: int


def scheduler_defaults(
    device: HardwareSpec,
    max_model_len: int,
    *,
    chunked_prefill: bool = True,
    performance_mode: str = "balanced",
    world_size: int = 1,
    release: str | Release = RUNNABLE,
) -> SchedulerDefaults:
    """The budgets ``vllm serve`` picks (``_set_default_max_num_seqs_and_batched_tokens_args``, the same code
    in 0.32 and 0.34).

    ``--performance-mode throughput`` doubles both; without chunked prefill the token budget is at
    least ``max_model_len`` (a whole prompt must fit a step); it never exceeds ``max_num_seqs x
    max_model_len``; and ``max_num_seqs`` never exceeds the token budget.
    """
    d = batch_defaults(device, world_size, release=release)
    tokens, seqs = d.max_num_batched_tokens, d.max_num_seqs
    if performance_mode == "throughput":
        tokens, seqs = tokens * 2, seqs * 2
    if not chunked_prefill:
        tokens = max(max_model_len, tokens)
    tokens = min(seqs * max_model_len, tokens)
    return SchedulerDefaults(tokens, min(seqs, tokens))


def max_num_batched_tokens_default(
    device: HardwareSpec, max_model_len: int, chunked_prefill: bool = True, *, release: str | Release = RUNNABLE
) -> int:
    """The token budget ``vllm serve`` picks on ``device`` (:func:`scheduler_defaults`)."""
    return scheduler_defaults(
        device, max_model_len, chunked_prefill=chunked_prefill, release=release
    ).max_num_batched_tokens


def format_gib(size: float) -> float:
    """GiB rounded to two places, as vLLM prints memory (``vllm/utils/mem_utils.py``, ``format_gib``)."""
    return round(size / GiB, 2)


def free_memory_error(
    total: float, free: float, utilization: float, device: str = "cuda:0", *, extensible: bool = False
) -> str | None:
    """vLLM's startup check (``vllm/v1/worker/utils.py``, ``request_memory``): the requested share must be free.

    ``requested = ceil(total x gpu_memory_utilization)`` of the *total* memory; when another process
    holds memory, less is free and vLLM refuses to start with this message (None when it starts). With
    0.34's extensible KV cache (``extensible``) the share is only a cap and the check never refuses:
    exceeding free memory over-reserves address space, not pages.
    """
    requested = math.ceil(total * utilization)
    if free >= requested or extensible:
        return None
    gib = format_gib
    return (
        f"Free memory on device {device} ({gib(free)}/{gib(total)} GiB) on startup is less than "
        f"desired GPU memory utilization ({utilization}, {gib(requested)} GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )


def mla_block_size(device: HardwareSpec, *, release: str | Release = RUNNABLE) -> int:
    """The KV block size vLLM gives a (dense) MLA model on ``device`` when no ``--block-size`` is given.

    ``CudaPlatform`` ranks the MLA backends by compute capability (``vllm/platforms/cuda.py``,
    ``_get_backend_priorities``) and the block size becomes the first usable backend's preferred one
    (``vllm/platforms/interface.py``, ``update_block_size_for_backend``; ``AttentionBackend.
    get_preferred_block_size``: the default when the backend takes it, else its smallest size). Hopper (9.x)
    runs FLASH_ATTN_MLA (FlashAttention 3's MLA kernels, which vLLM's CUDA wheels ship; a build without them
    falls to FLASHMLA, 64), multiples of 16; Blackwell (10.x) runs FLASHINFER_MLA, which takes 32 or 64; other
    GPUs run TRITON_MLA, multiples of 16. With 0.32's default of 16: 16, 32 on Blackwell; with 0.34's 64:
    64 everywhere. The CPU build keeps 128. Sparse MLA (DeepSeek-V3.2's) and an explicit
    ``--attention-backend`` choose differently.
    """
    if device.platform == "cpu":
        return rules(release).cpu_block_size
    default = rules(release).block_size
    major = device.compute_capability[0] if device.compute_capability else None
    if major == 10 and default % 32 != 0:  # FLASHINFER_MLA takes 32 or 64: the smallest, 32
        return 32
    return default


@dataclass(frozen=True)
class ExtensibleStatus:
    """Whether 0.34's extensible KV cache sizes the cache, and why (``VllmConfig._resolve_extensible_kv_cache``)."""

    on: bool
    reason: str


def extensible_kv_cache(
    device: HardwareSpec,
    *,
    release: str | Release = RUNNABLE,
    kv_cache_memory_bytes: float | None = None,
    num_gpu_blocks_override: int | None = None,
) -> ExtensibleStatus:
    """Whether the cache is sized from memory measured after warm-up (0.34: ``enable_extensible_kv_cache``
    unset resolves to on where supported).

    Off in 0.32 (no such feature), on platforms other than CUDA and ROCm, with ``--kv-cache-memory-bytes``
    or ``num_gpu_blocks_override`` (each overrides the measurement). vLLM also turns it off where the
    course cannot see it: elastic expert parallelism, KV connectors that share the cache through legacy
    CUDA IPC or their own memory pool (and, on ROCm, connectors that register it for RDMA), and at startup
    where the driver lacks virtual-memory support (``Worker.extensible_kv_cache_unsupported_reason``); then
    the estimate at 0.92 applies (:func:`course.kv.budget`, ``extensible=False``).
    """
    r = rules(release)
    if not r.extensible_kv_cache:
        return ExtensibleStatus(False, f"{r.release.name} sizes the KV cache from the profiling estimate")
    if device.platform not in ("cuda", "rocm"):
        return ExtensibleStatus(False, "the extensible KV cache is only supported on CUDA and ROCm")
    if kv_cache_memory_bytes is not None:
        return ExtensibleStatus(False, "kv_cache_memory_bytes sets the KV cache size (it overrides the measurement)")
    if num_gpu_blocks_override is not None:
        return ExtensibleStatus(False, "num_gpu_blocks_override sets the block count (it overrides the measurement)")
    return ExtensibleStatus(True, "the extensible KV cache: sized from the memory measured after warm-up")


def measure_kv_cache_bytes(
    *,
    init_free_memory: float,
    free_memory: float,
    committed_bytes: float,
    requested_memory: float,
    transient_peak_bytes: float = 0,
    torch_reserve_growth_bytes: float = 0,
    margin_floor_bytes: float = KV_CACHE_MARGIN_FLOOR_BYTES["cuda"],
    margin_fraction: float = KV_CACHE_MARGIN_FRACTION,
) -> float:
    """Bytes 0.34's extensible KV cache gets from the memory measured after warm-up (``vllm/v1/worker/
    extensible_kv_cache.py``, ``measure_kv_cache_bytes``; the same arguments).

    Everything resident but the committed KV prefix is the engine's (``non_kv_used = init_free - free -
    committed``); the cache gets the rest of the requested budget, capped by the device's headroom (``free
    + committed``) less a margin of ``max(margin_floor, margin_fraction x transient_peak)``; then the larger
    of the transient peak and the torch reservation's growth is kept free in full::

        min(requested - non_kv_used, headroom - margin) - max(transient_peak, torch_reserve_growth)
    """
    non_kv_used = init_free_memory - free_memory - committed_bytes
    headroom = free_memory + committed_bytes
    margin = max(margin_floor_bytes, int(transient_peak_bytes * margin_fraction))
    available = min(requested_memory - non_kv_used, headroom - margin)
    available -= max(transient_peak_bytes, torch_reserve_growth_bytes)
    return max(available, 0)


def withheld_warning(utilization: float | None, requested: float, withheld: float) -> str | None:
    """0.34's warning when an explicit ``gpu_memory_utilization`` keeps free memory out of the extensible KV
    cache (``measure_kv_cache_blocks``): a value in (0.7, 1.0) that withholds at least 1 GiB; None otherwise.

    ``withheld`` is what the cache would get with all memory free at startup as the budget, less what it
    gets with ``requested``.
    """
    low, high = WITHHOLD_WARNING_RANGE
    if utilization is None or not low < utilization < high or withheld < WITHHOLD_WARNING_BYTES:
        return None
    return (
        f"gpu_memory_utilization={utilization} caps this instance at {format_gib(requested)} GiB, keeping "
        f"{format_gib(withheld)} GiB of free device memory out of the KV cache. The extensible KV cache is sized "
        "from the memory measured after warmup and CUDA graph capture, so vLLM's own use needs no headroom below "
        "1.0. Leave gpu_memory_utilization unset unless it leaves room for memory vLLM does not measure: other "
        "processes sharing the GPU (including ones that allocate on it later), the CPU on a unified-memory "
        "device, weight transfer buffers for weight updates, or a KV connector's own device buffers."
    )


@dataclass(frozen=True)
class StartupLog:
    """The memory lines of one public vLLM startup log (GiB), the measurement modules 3 and 4 budget with.

    "the current vLLM instance can use total_gpu_memory (79.14GiB) x gpu_memory_utilization (0.90) =
    71.22GiB; model weights take 14.99GiB; non_torch_memory takes 0.12GiB; PyTorch activation peak
    memory takes 1.19GiB; the rest of the memory reserved for KV Cache is 54.93GiB": an 8B Llama-3
    model in bf16 on an 80 GB card, the memory-breakdown line vLLM printed up to 0.11 (0.32 prints
    "Model loading took ..." and "Available KV cache memory: ..." instead, ``v1/worker/gpu_worker.py``).
    Modules 3 and 4 use its activation peak and non-torch memory for Llama-3-8B on 80 GB cards, so
    both modules budget the same model on the same GPU identically.
    """

    total_gib: float = 79.14
    utilization: float = 0.90
    weights_gib: float = 14.99
    non_torch_gib: float = 0.12
    activation_gib: float = 1.19
    kv_cache_gib: float = 54.93

    @property
    def activation_bytes(self) -> float:
        return self.activation_gib * GiB

    @property
    def non_torch_bytes(self) -> float:
        return self.non_torch_gib * GiB


REFERENCE_LOG = StartupLog()


def served_dtype(config_dtype: str | None, device: HardwareSpec, dtype: str = "auto") -> str:
    """The dtype vLLM serves a checkpoint in (``vllm/config/model.py``, ``_resolve_auto_dtype``).

    ``--dtype auto`` keeps a bf16 or fp16 checkpoint's dtype where the device has it, and serves a
    float32 one (or one that states no dtype) in the device's first supported dtype: bf16 on Ampere
    and later GPUs and on x86/aarch64 CPUs, fp16 on older GPUs. Any other ``--dtype`` is taken as
    given. An fp8-quantized checkpoint computes (and caches) in bf16. Returns the course's short name
    ("bf16", "fp16", "fp32").
    """
    if dtype != "auto":
        return DTYPE_ALIASES.get(dtype, dtype)
    preferred = "bf16" if device.supports_bf16 else "fp16"
    # fp8 checkpoints store fp8 weights but state bf16 as their dtype (quantization_config says fp8)
    if config_dtype in (None, "fp32", "fp8"):
        return preferred
    if config_dtype == "bf16" and not device.supports_bf16:
        return "fp16"
    return config_dtype
