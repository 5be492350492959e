"""``course kv``: the KV-cache calculator on the command line."""

from __future__ import annotations

import json

from course.hardware import GPUS
from course.kv import vllm
from course.kv.budget import GiB, budget
from course.kv.catalogue import _catalogue, get_model
from course.kv.dtypes import KV_DTYPES, WEIGHT_BYTES
from course.kv.report import geometry_summary
from course.kv.sizes import _positive_int
from course.vllm_release import NEWEST, RELEASES, RUNNABLE


def add_cli_arguments(parser) -> None:
    """The options of ``course kv`` (an argparse parser), named after vLLM's engine arguments."""
    parser.add_argument("model", nargs="?", help="a catalogue model name (see --list) or a config.json file/folder")
    add_release_argument(parser)
    parser.add_argument(
        "--gpu",
        default="H100-SXM",
        help=f"one of {', '.join(GPUS)}, or CPU (vLLM's CPU build on this machine; its KV cache is "
        f"${vllm.CPU_KVCACHE_SPACE_ENV} GiB when that is set) (default H100-SXM)",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        help="the total memory your vLLM log prints as total_gpu_memory (GiB); default: the GPU's catalogue figure",
    )
    parser.add_argument(
        "--utilization",
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="gpu_memory_utilization (default: unset, as vLLM's: 1.0 under 0.34's extensible KV cache, 0.92 where "
        "the cache is sized from the estimate, as in 0.32; public logs of vLLM <= 0.11 used 0.9)",
    )
    parser.add_argument(
        "--no-extensible-kv-cache",
        "--no-enable-extensible-kv-cache",
        dest="extensible_kv_cache",
        action="store_false",
        default=None,
        help="0.34: size the cache from the startup estimate, as vLLM does where the driver lacks virtual-memory "
        "support (default: measured after warm-up on CUDA unless --kv-cache-memory-bytes is given)",
    )
    parser.add_argument(
        "--transient-peak-gib",
        type=float,
        help="0.34: the transient peak vLLM keeps free, GiB (the 'allocated at peak' of its 'Memory after warmup' "
        "line; default: activation peak + CUDA graphs)",
    )
    parser.add_argument("--max-model-len", type=int, help="longest request (default: the model's context)")
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="token budget per step (default: vLLM's for the GPU)"
    )
    parser.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        default="auto",
        help=f"auto (the model's dtype) or one of {', '.join(KV_DTYPES)} (default auto)",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="vLLM's --dtype: auto (a float32 checkpoint is served in bf16, or fp16 where the device has no bf16), "
        "float32, bfloat16 or float16 (default auto)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per KV block (default vLLM's: {vllm.GPU_BLOCK_SIZE} on GPUs in 0.34, {vllm.BLOCK_SIZE} in 0.32, "
        f"{vllm.CPU_BLOCK_SIZE} on the CPU build)",
    )
    parser.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        default=None,
        help="one batch in flight (vLLM's --no-async-scheduling; the CPU build's default)",
    )
    parser.add_argument(
        "--mamba-cache-mode",
        choices=("align", "none"),
        default="align",
        help="state pages per request for hybrids: align (prefix caching on, vLLM's default) keeps 2, none 1",
    )
    parser.add_argument("--weight-dtype", help=f"dtype of the served weights: {', '.join(WEIGHT_BYTES)}")
    parser.add_argument("--weights-gib", type=float, help="total weight memory in GiB (overrides the parameter count)")
    parser.add_argument("--activation-gib", type=float, default=0.0, help="peak activation memory per GPU, GiB")
    parser.add_argument("--non-torch-gib", type=float, default=0.0, help="memory outside PyTorch per GPU, GiB")
    parser.add_argument("--cuda-graph-gib", type=float, default=0.0, help="CUDA-graph memory per GPU, GiB")
    parser.add_argument(
        "--kv-cache-memory-bytes", type=float, help="vLLM's override: the KV cache size per GPU in bytes"
    )
    parser.add_argument(
        "--num-gpu-blocks-override", type=int, help="vLLM's num_gpu_blocks_override: exactly this many blocks"
    )
    parser.add_argument(
        "--other-process-gib", type=float, default=0.0, help="memory another process holds on the GPU at startup, GiB"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128], help="batches for max context")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--list", action="store_true", help="list the catalogue models and GPUs")


def add_release_argument(parser) -> None:
    """``--vllm 0.32|0.34``: the release whose rules a printout follows (shared by ``course kv`` and
    ``course simulate``)."""
    parser.add_argument(
        "--vllm",
        dest="release",
        default=NEWEST.short,
        choices=[r.short for r in RELEASES] + [r.version for r in RELEASES],
        help=f"the vLLM release whose rules apply: {NEWEST.short} (default: {NEWEST.role}) or {RUNNABLE.short} "
        f"({RUNNABLE.role})",
    )


# The options budget() takes under the same name, and those given in GiB: option -> budget()'s keyword in bytes.
_AS_GIVEN = (
    "utilization",
    "max_model_len",
    "kv_dtype",
    "block_size",
    "tp",
    "weight_dtype",
    "kv_cache_memory_bytes",
    "max_num_batched_tokens",
    "dtype",
    "async_scheduling",
    "mamba_cache_mode",
    "release",
    "extensible_kv_cache",
    "num_gpu_blocks_override",
)
_IN_GIB = {
    "weights_gib": "weight_bytes",
    "activation_gib": "activation_bytes",
    "non_torch_gib": "non_torch_bytes",
    "cuda_graph_gib": "cuda_graph_bytes",
    "gpu_memory_gib": "gpu_memory_bytes",
    "other_process_gib": "other_process_bytes",
    "transient_peak_gib": "transient_peak_bytes",
}


def _gib(name: str, value: float | None) -> float | None:
    """The option ``name`` (an argparse dest, e.g. "weights_gib") in bytes; None stays None."""
    if value is None:
        return None
    if value != value or value < 0:  # NaN or negative
        raise ValueError(f"--{name.replace('_', '-')}: must be a number of GiB >= 0, got {value!r}")
    return value * GiB


def _cpu_kvcache_space() -> float | None:
    """The CPU build's KV cache in bytes from ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB), or None when unset."""
    import os

    raw = os.environ.get(vllm.CPU_KVCACHE_SPACE_ENV, "")
    if raw == "":
        return None
    if not raw.isdigit():
        raise ValueError(f"{vllm.CPU_KVCACHE_SPACE_ENV}: must be a whole number of GiB, as vLLM reads it, got {raw!r}")
    return int(raw) * GiB


def run_cli(args) -> int:
    """Carry out ``course kv`` with parsed ``args``; raises ValueError on bad input."""
    if args.list:
        if args.json:
            print(json.dumps({"models": list(_catalogue()), "gpus": list(GPUS)}, indent=1))
            return 0
        print("models:")
        for entry in _catalogue().values():
            print(f"  {geometry_summary(entry.geometry)}")
        print("GPUs (datasheet memory; total as the driver reports it):")
        for spec in GPUS.values():
            print(
                f"  {spec.name:10s} {spec.datasheet_memory:13s} ({spec.total_memory / GiB:6.2f} GiB) "
                f"{spec.bandwidth / 1e9:6.0f} GB/s"
            )
        return 0
    if not args.model:
        raise ValueError("model: give a catalogue model name or a config.json path (course kv --list shows them)")
    g = get_model(args.model)
    if args.gpu_memory_gib is not None and not args.gpu_memory_gib > 0:
        raise ValueError(f"--gpu-memory-gib: must be a positive number of GiB, got {args.gpu_memory_gib!r}")
    options = {name: getattr(args, name) for name in _AS_GIVEN}
    options.update({keyword: _gib(name, getattr(args, name)) for name, keyword in _IN_GIB.items()})
    if args.gpu.upper() == "CPU" and options["kv_cache_memory_bytes"] is None:
        options["kv_cache_memory_bytes"] = _cpu_kvcache_space()
    b = budget(g, args.gpu, **options)
    batches = tuple(_positive_int("batch", batch) for batch in args.batch)
    if args.json:
        data = {"model": geometry_summary(g), "source": g.source, **b.to_dict()}
        data["max_context_at_batch"] = {str(batch): b.max_context(batch) for batch in batches}
        print(json.dumps(data, indent=1))
    else:
        print(geometry_summary(g))
        print(b.table(batches))
    return 0
