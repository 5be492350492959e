"""The KV-cache and scheduler facts of the vLLM release the course follows (:mod:`course.vllm_release`).

Every fact the calculator (``course kv``, module 4) and the simulator (``course simulate``, module 3)
rely on is stated here once, with the file and function of vLLM 0.32.0 it was read from (paths
relative to the ``vllm`` package; ``tests/oracle/test_drift.py`` compares each with what that code
returns):

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

The 0.11-era default utilization (0.90) is kept as :data:`OLD_GPU_MEMORY_UTILIZATION`: most public
startup logs, including the one modules 3 and 4 reproduce, were run with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course.geometry import DTYPE_ALIASES
from course.hardware import GiB, HardwareSpec
from course.vllm_release import VLLM_RELEASE, VLLM_VERSION

__all__ = ["VLLM_VERSION", "VLLM_RELEASE"]

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
GPU_MEMORY_UTILIZATION = 0.92  # CacheConfig.gpu_memory_utilization: Field(default=0.92)
OLD_GPU_MEMORY_UTILIZATION = 0.90  # vLLM <= 0.11's default, in most public startup logs
BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE (CUDA)
CPU_BLOCK_SIZE = 128  # CpuPlatform.check_and_update_config, when no --block-size is given
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB; sets kv_cache_memory_bytes on the CPU build
ENABLE_PREFIX_CACHING = True  # CacheConfig.enable_prefix_caching (generative models)
ASYNC_SCHEDULING = True  # VllmConfig resolves async_scheduling None to True on GPUs; the CPU build sets False
# Kernel alignment of the attention block size vLLM raises for hybrid attention + state models so
# that one attention page holds at least one state page (Platform._align_hybrid_block_size).
HYBRID_BLOCK_ALIGNMENT = 16


def max_concurrent_batches(async_scheduling: bool = ASYNC_SCHEDULING, pipeline_parallel: int = 1) -> int:
    """Batches in flight at once (``VllmConfig.max_concurrent_batches``, V1 model runner).

    Async scheduling overlaps the next step's scheduling with this step's forward pass: two batches
    (with one pipeline stage); pipeline parallelism keeps one per stage.
    """
    if async_scheduling and pipeline_parallel <= 1:
        return 2
    return pipeline_parallel


def max_in_flight_tokens(max_num_batched_tokens: int, async_scheduling: bool = ASYNC_SCHEDULING) -> int:
    """Tokens scheduled but not yet settled (``VllmConfig.max_in_flight_tokens``): what sliding-window and
    chunked-local layers reserve beyond their window."""
    return max_concurrent_batches(async_scheduling) * max_num_batched_tokens


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


def batch_defaults(device: HardwareSpec, world_size: int = 1) -> BatchDefaults:
    """vLLM's per-device scheduler defaults (``vllm/engine/arg_utils.py``, ``get_batch_defaults``).

    Devices with at least 160 GiB (as the driver reports it: B200, B300) get 16,384 tokens / 1,024
    sequences under ``vllm serve``; at least 70 GiB and not an A100 (H100, H200), 8,192 / 1,024; the
    rest, A100s included, 2,048 / 256 ("Setting large `max_num_batched_tokens` for A100 reduces
    throughput, see PR #17885"). The CPU build: 2,048 / 128 per worker (``world_size`` = TP x PP).
    """
    if device.platform == "cpu":
        return BatchDefaults(
            2048 * world_size, 128 * world_size, 4096 * world_size, 256 * world_size, "CPU: 2,048 x world size"
        )
    if device.total_memory >= 160 * GiB:
        return BatchDefaults(16384, 1024, 16384, 1024, f"{device.name}: >= 160 GiB")
    if device.total_memory >= 70 * GiB and "a100" not in device.name.lower():
        return BatchDefaults(8192, 1024, 16384, 1024, f"{device.name}: >= 70 GiB and not an A100")
    why = "an A100" if "a100" in device.name.lower() else "< 70 GiB"
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
) -> SchedulerDefaults:
    """The budgets ``vllm serve`` picks (``_set_default_max_num_seqs_and_batched_tokens_args``).

    ``--performance-mode throughput`` doubles both; without chunked prefill the token budget is at
    least ``max_model_len`` (a whole prompt must fit a step); it never exceeds ``max_num_seqs x
    max_model_len``; and ``max_num_seqs`` never exceeds the token budget.
    """
    d = batch_defaults(device, world_size)
    tokens, seqs = d.max_num_batched_tokens, d.max_num_seqs
    if performance_mode == "throughput":
        tokens, seqs = tokens * 2, seqs * 2
    if not chunked_prefill:
        tokens = max(max_model_len, tokens)
    tokens = min(seqs * max_model_len, tokens)
    return SchedulerDefaults(tokens, min(seqs, tokens))


def max_num_batched_tokens_default(device: HardwareSpec, max_model_len: int, chunked_prefill: bool = True) -> int:
    """The token budget ``vllm serve`` picks on ``device`` (:func:`scheduler_defaults`)."""
    return scheduler_defaults(device, max_model_len, chunked_prefill=chunked_prefill).max_num_batched_tokens


def free_memory_error(total: float, free: float, utilization: float, device: str = "cuda:0") -> str | None:
    """vLLM's startup check (``vllm/v1/worker/utils.py``, ``request_memory``): the requested share must be free.

    ``requested = ceil(total x gpu_memory_utilization)`` of the *total* memory; when another process
    holds memory, less is free and vLLM refuses to start with this message (None when it starts).
    """
    requested = math.ceil(total * utilization)
    if free >= requested:
        return None
    gib = lambda size: round(size / GiB, 2)  # noqa: E731  vllm/utils/mem_utils.py, format_gib
    return (
        f"Free memory on device {device} ({gib(free)}/{gib(total)} GiB) on startup is less than "
        f"desired GPU memory utilization ({utilization}, {gib(requested)} GiB). Decrease GPU memory "
        "utilization or reduce GPU memory used by other processes."
    )


def mla_block_size(device: HardwareSpec) -> int:
    """The KV block size vLLM gives a (dense) MLA model on ``device`` when no ``--block-size`` is given.

    ``CudaPlatform`` ranks the MLA backends by compute capability (``vllm/platforms/cuda.py``,
    ``_get_backend_priorities``) and the block size becomes the first usable backend's preferred one
    (``vllm/platforms/interface.py``, ``update_block_size_for_backend``; ``AttentionBackend.
    get_preferred_block_size``: the default 16 when the backend takes it, else its smallest size):
    Hopper (9.x) runs FLASH_ATTN_MLA (FlashAttention 3's MLA kernels, which vLLM's CUDA wheels ship; a
    build without them falls to FLASHMLA, 64), multiples of 16, so 16; Blackwell (10.x) runs FLASHINFER_MLA, which
    takes 32 or 64, so 32; other GPUs run TRITON_MLA, multiples of 16. The CPU build keeps 128. Sparse MLA
    (DeepSeek-V3.2's) and an explicit ``--attention-backend`` choose differently.
    """
    if device.platform == "cpu":
        return CPU_BLOCK_SIZE
    major = device.compute_capability[0] if device.compute_capability else None
    return 32 if major == 10 else BLOCK_SIZE


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
