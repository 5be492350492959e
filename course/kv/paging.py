"""Paged blocks: the fixed-size blocks a sequence occupies in a paged KV cache, and the slots they waste."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from course.kv.dtypes import KVDtype
from course.kv.sizes import _non_negative_int, _positive_int, _whole, bytes_per_token
from course.kv.vllm import BLOCK_SIZE
from course.units import cdiv


@dataclass(frozen=True)
class PagedBlocks:
    """The blocks one sequence occupies in a paged KV cache.

    Attributes:
        tokens: tokens in the sequence.
        block_size: tokens per block.
        blocks: blocks allocated, ceil(tokens / block_size).
        slots: token slots those blocks provide, blocks x block_size.
        waste_tokens: allocated slots holding nothing (all in the last block).
        waste_fraction: waste_tokens / slots (0 when no blocks).
    """

    tokens: int
    block_size: int
    blocks: int
    slots: int
    waste_tokens: int
    waste_fraction: float


def paged_blocks(tokens: int, block_size: int = BLOCK_SIZE) -> PagedBlocks:
    """Blocks for a sequence of ``tokens`` tokens: only the last block can be partly empty."""
    _non_negative_int("tokens", tokens)
    _positive_int("block_size", block_size, "a positive integer (vLLM allows 1, 8, 16, 32, 64, 128)")
    blocks = cdiv(tokens, block_size)
    slots = blocks * block_size
    waste = slots - tokens
    return PagedBlocks(tokens, block_size, blocks, slots, waste, waste / slots if slots else 0.0)


def page_bytes(model: Any, block_size: int = BLOCK_SIZE, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """Bytes of one block across all attention layers on one GPU (vLLM: page_size_bytes x num_layers)."""
    _positive_int("block_size", block_size)
    return _whole(block_size * bytes_per_token(model, dtype, tp))
