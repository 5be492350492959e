"""Scheduler settings, named as vLLM names them, with vLLM's defaults where it has one.

The dataclass defaults are vLLM's for GPUs under 70 GiB and A100s under ``vllm serve``
(``vllm/engine/arg_utils.py``, ``get_batch_defaults``): ``max_num_batched_tokens`` 2048 with chunked
prefill, ``max_num_seqs`` 256, ``block_size`` 16. H100/H200-class GPUs get 8192 and 1024, and vLLM
turns prefix caching on by default (``vllm/config/cache.py``): :meth:`SimConfig.vllm_defaults` gives
the settings ``vllm serve`` would use on a given GPU (the vLLM version and files are named in
:mod:`course.kv.vllm`). With chunked prefill off the budget is ``max_model_len``; V0's default
scheduler used ``max(max_model_len, 2048)`` and a free-block watermark of 1 % of the blocks.
``num_blocks`` depends on the GPU, the model and ``gpu_memory_utilization`` (module 4 computes it);
:func:`kv_blocks` gives it from a KV budget.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from course.geometry import ModelGeometry
from course.hardware import HardwareSpec

SCHEDULERS = ("continuous", "prefill-first", "static")
UNLIMITED = 2**62  # a token budget that never binds


@dataclass(frozen=True)
class SimConfig:
    """How the simulated engine schedules.

    Attributes:
        scheduler: "continuous" (vLLM V1: one token budget per step, prefill and decode mixed),
            "prefill-first" (vLLM V0's default: a step is all prefill or all decode), or "static"
            (padded batches run to completion, the pre-Orca baseline).
        max_num_seqs: most requests running at once (static: the batch size).
        max_num_batched_tokens: the token budget of one step; None = vLLM's default for the
            scheduler on a smaller GPU (2048 with chunked prefill, else ``max_model_len`` or
            unlimited); :meth:`vllm_defaults` sets the GPU's own.
        chunked_prefill: cut prompts that do not fit the remaining budget (continuous only).
        long_prefill_token_threshold: most tokens one request may compute per step (0 = no cap), when
            more than one request is running or waiting (vLLM 0.32: a lone request takes the budget).
        long_prefill_token_threshold_adaptive: never cap below ``budget // requests`` (vLLM's option).
        reserve_full_isl: admit a waiting request only when the blocks of its whole sequence are free
            (vLLM's ``scheduler_reserve_full_isl``, True since before 0.21); False is 0.11's rule (the
            first chunk's blocks suffice).
        block_size: tokens per KV block.
        num_blocks: KV blocks in the cache.
        enable_prefix_caching: reuse cached full prompt blocks (continuous and prefill-first); off
            here so a bare config isolates the scheduler, on in :meth:`vllm_defaults` as in vLLM.
        watermark: fraction of blocks kept free when admitting while others run: V1's optional
            ``--watermark`` (vLLM 0.32: 0.0, off) and V0's prefill-first watermark (0.01).
        max_num_queued_reqs: refuse (HTTP 503, vLLM's load shedding) a request that arrives while
            this many are unfinished; None = no limit (vLLM's default).
        max_model_len: longest prompt + output a request may have; longer ones are rejected.
        decode_after_prefill: prefill-first only: after a prefill step, always run one decode step
            before admitting again (the loop of module 2's reference server: each iteration prefills
            what it admitted, then decodes everyone); V0 keeps prefilling while prompts can start.
        async_scheduling: continuous only: vLLM's async scheduling (on by default on GPUs in 0.32,
            ``vllm/config/vllm.py``; :meth:`vllm_defaults` turns it on): step k+1 is scheduled before
            step k's output is processed, so a request that finished in step k holds its KV blocks and
            its ``max_num_seqs`` slot while step k+1 is scheduled (:mod:`course.rules`). Off here,
            so a bare config matches module 3's synchronous harness; V0 and static batching ignore it.
    """

    scheduler: str = "continuous"
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    reserve_full_isl: bool = True
    block_size: int = 16
    num_blocks: int = 16384
    enable_prefix_caching: bool = False
    watermark: float = 0.0
    max_model_len: int | None = None
    decode_after_prefill: bool = False
    max_num_queued_reqs: int | None = None
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)}; got {self.scheduler!r}")
        for name in ("max_num_seqs", "block_size", "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 disables it)")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark is a fraction of the blocks in [0, 1), got {self.watermark}")
        if self.max_num_queued_reqs is not None and self.scheduler == "static":
            raise ValueError("max_num_queued_reqs applies to the iteration-level schedulers, not static batching")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 0:
            raise ValueError(f"max_num_queued_reqs must be >= 0 (or None for no limit), got {self.max_num_queued_reqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def token_budget(self) -> int:
        """The step's token budget after vLLM's defaults."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.scheduler == "continuous" and self.chunked_prefill:
            return 2048
        if self.scheduler == "prefill-first":
            return max(self.max_model_len, 2048) if self.max_model_len else UNLIMITED
        return self.max_model_len or UNLIMITED

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)

    @property
    def kv_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        budget = "unlimited" if self.token_budget >= UNLIMITED else str(self.token_budget)
        parts = [self.scheduler]
        if self.scheduler == "static":
            parts.append(f"batch {self.max_num_seqs}")
        else:
            parts.append(f"max_num_seqs {self.max_num_seqs}, budget {budget} tokens/step")
            if self.scheduler == "continuous":
                parts.append("chunked prefill" if self.chunked_prefill else "no chunked prefill")
            if self.scheduler == "prefill-first" and self.decode_after_prefill:
                parts.append("a decode step after every prefill step")
            if self.enable_prefix_caching:
                parts.append("prefix caching")
            if self.scheduler == "continuous" and self.async_scheduling:
                parts.append("async scheduling")
        parts.append(f"{self.num_blocks} KV blocks of {self.block_size}")
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def vllm_defaults(cls, gpu: HardwareSpec | str, **settings) -> SimConfig:
        """The settings ``vllm serve`` uses on ``gpu`` (per-GPU token budget and running-request cap,
        prefix caching on), overridden by ``settings``."""
        from course import hardware
        from course.kv import vllm

        spec = hardware.gpu(gpu) if isinstance(gpu, str) else gpu
        defaults = vllm.batch_defaults(spec)
        base = {
            "max_num_batched_tokens": defaults.max_num_batched_tokens,
            "max_num_seqs": defaults.max_num_seqs,
            "enable_prefix_caching": vllm.ENABLE_PREFIX_CACHING,
            "async_scheduling": True,  # vLLM 0.32 on GPUs (vllm/config/vllm.py)
        }
        if settings.get("scheduler", "continuous") != "continuous" or settings.get("chunked_prefill") is False:
            del base["max_num_batched_tokens"]  # the scheduler's own rule (max_model_len) applies
        return cls(**{**base, **settings})

    @classmethod
    def from_dict(cls, data: dict) -> SimConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown scheduler settings {sorted(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)


def kv_blocks(kv_bytes: float, geometry: ModelGeometry, block_size: int = 16, bytes_per_value: float = 2.0) -> int:
    """Blocks that fit in ``kv_bytes`` of KV memory (vLLM: memory // (block bytes x layers)).

    A block holds ``block_size`` tokens of every layer: ``block_size x kv_bytes_per_token`` bytes.
    """
    if kv_bytes <= 0:
        raise ValueError(f"the KV budget must be positive, got {kv_bytes} bytes")
    per_block = block_size * geometry.kv_bytes_per_token(bytes_per_value)
    blocks = int(kv_bytes // per_block)
    if blocks < 1:
        raise ValueError(f"{kv_bytes:.3g} bytes hold no whole block of {per_block:.3g} bytes")
    return blocks


def read_config_file(path: str | Path) -> dict:
    """A settings file as a dict: TOML (``.toml``) or JSON (anything else)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"cannot read the config file {path}: {err.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ValueError(f"{path} is not valid {kind}: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a table/object of settings, got {type(data).__name__}")
    return data
