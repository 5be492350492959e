"""What vLLM does today, read from its source: the one place that says which vLLM and which files.

Every vLLM fact the calculator (``course kv``, module 4) and the simulator (``course simulate``,
module 3) rely on is stated here once, with the file it was read from:

* vLLM ``main`` as of 2026-12 (after v0.21.0, the release that made CUDA-graph memory profiling the
  default), files read from the vllm-project/vllm repository:
  ``vllm/config/cache.py`` (commit 002f10e: ``gpu_memory_utilization`` 0.92, ``CacheDType``,
  ``kv_cache_memory_bytes``, ``enable_prefix_caching`` True, block size 16),
  ``vllm/engine/arg_utils.py`` (``get_batch_defaults``: per-GPU ``max_num_batched_tokens`` and
  ``max_num_seqs``), ``vllm/v1/worker/gpu_worker.py`` (the startup free-memory check),
  ``vllm/v1/kv_cache_interface.py`` (commit 001cabc: page sizes, ``SlidingWindowSpec`` and
  ``ChunkedLocalAttentionSpec.max_memory_usage_bytes``, ``MambaSpec``),
  ``vllm/v1/core/kv_cache_utils.py`` (commit 001cabc: KV-cache groups, ``get_num_blocks``,
  ``get_max_concurrency_for_kv_cache_config``, the "GPU KV cache size" log) and
  ``vllm/model_executor/layers/mamba/mamba_utils.py`` (commit 02d7108: state shapes) and
  ``vllm/model_executor/models/config.py`` (the hybrid attention + Mamba block size, read in public
  copies of the file and checked against public startup logs).
* The 0.11-era values the course started from (``gpu_memory_utilization`` 0.90) are kept as
  :data:`SEED_GPU_MEMORY_UTILIZATION`: the seed's starting point, and what most public startup logs
  (including the one the module-4 notebook reproduces) were run with.
"""

from __future__ import annotations

from dataclasses import dataclass

from course.hardware import GiB, HardwareSpec

VLLM_VERSION = "vLLM main, 2026-12 (after v0.21.0)"
SOURCE_FILES = (
    "vllm/config/cache.py",
    "vllm/engine/arg_utils.py",
    "vllm/v1/worker/gpu_worker.py",
    "vllm/v1/kv_cache_interface.py",
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/model_executor/layers/mamba/mamba_utils.py",
    "vllm/model_executor/models/config.py",
)
GPU_MEMORY_UTILIZATION = (
    0.92  # CacheConfig.gpu_memory_utilization: "If unspecified, will use the default value of 0.92"
)
SEED_GPU_MEMORY_UTILIZATION = 0.90  # vLLM <= 0.11's default, the seed's starting point
BLOCK_SIZE = 16  # CacheConfig.DEFAULT_BLOCK_SIZE
ENABLE_PREFIX_CACHING = True  # CacheConfig.enable_prefix_caching (generative models)
# Kernel alignment of the attention block size vLLM raises for hybrid attention + state models so
# that one attention page holds at least one state page (FlashAttention's 16-token granularity).
HYBRID_BLOCK_ALIGNMENT = 16


@dataclass(frozen=True)
class StartupLog:
    """The memory lines of one public vLLM startup log (GiB), the course's reference measurement.

    "the current vLLM instance can use total_gpu_memory (79.14GiB) x gpu_memory_utilization (0.90) =
    71.22GiB; model weights take 14.99GiB; non_torch_memory takes 0.12GiB; PyTorch activation peak
    memory takes 1.19GiB; the rest of the memory reserved for KV Cache is 54.93GiB" (an 8B Llama-3
    model in bf16 on an 80 GB card; quoted in the course's serving reference, section 11). Modules 3
    and 4 use its activation peak and non-torch memory for Llama-3-8B on 80 GB cards, so both
    modules budget the same model on the same GPU identically.
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
    """vLLM's scheduler defaults for one GPU (``EngineArgs.get_batch_defaults``).

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


def batch_defaults(gpu: HardwareSpec) -> BatchDefaults:
    """vLLM's per-GPU scheduler defaults (``vllm/engine/arg_utils.py``, ``get_batch_defaults``).

    GPUs with at least 70 GiB of device memory (as the driver reports it) and not an A100 get 8,192
    tokens / 1,024 sequences under ``vllm serve``; the rest 2,048 / 256. The A100 exception: "Setting
    large `max_num_batched_tokens` for A100 reduces throughput, see PR #17885".
    """
    large = gpu.total_memory >= 70 * GiB and "a100" not in gpu.name.lower()
    if large:
        return BatchDefaults(8192, 1024, 16384, 1024, f"{gpu.name}: >= 70 GiB and not an A100")
    why = "an A100" if "a100" in gpu.name.lower() else "< 70 GiB"
    return BatchDefaults(2048, 256, 8192, 256, f"{gpu.name}: {why}")


def max_num_batched_tokens_default(gpu: HardwareSpec, max_model_len: int, chunked_prefill: bool = True) -> int:
    """The token budget ``vllm serve`` picks (``_set_default_max_num_seqs_and_batched_tokens_args``).

    Without chunked prefill the budget is at least ``max_model_len`` (a whole prompt must fit a step);
    it never exceeds ``max_num_seqs x max_model_len``.
    """
    d = batch_defaults(gpu)
    tokens = d.max_num_batched_tokens if chunked_prefill else max(max_model_len, d.max_num_batched_tokens)
    return min(d.max_num_seqs * max_model_len, tokens)


def free_memory_error(total: float, free: float, utilization: float) -> str | None:
    """vLLM's startup check (``vllm/v1/worker/gpu_worker.py``): the requested share must be free.

    ``requested = total x gpu_memory_utilization`` of the *total* memory; when another process holds
    memory, less is free and vLLM refuses to start with this message (None when it starts).
    """
    requested = total * utilization
    if free >= requested:
        return None
    return (
        f"Free memory on device ({free / GiB:.2f}/{total / GiB:.2f} GiB) on startup is less than desired GPU "
        f"memory utilization ({utilization}, {requested / GiB:.2f} GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes."
    )
