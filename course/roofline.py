"""The roofline: is a piece of work limited by FLOP/s or by memory bandwidth?

time >= max(FLOPs / peak FLOP/s, bytes moved / bandwidth). The ratio FLOPs / bytes is the
arithmetic intensity; above the hardware's ridge point (peak / bandwidth) the work is
compute-bound, below it memory-bound. Module 1 derives these; module 3's cost model uses them.
A roofline is a lower bound: real kernels reach 70-80 % of either roof at best (see the
module-3 notebook for measured ratios).
"""

from __future__ import annotations

from course.geometry import ModelGeometry
from course.hardware import HardwareSpec


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs per byte moved to or from memory."""
    if bytes_moved <= 0:
        raise ValueError("bytes_moved must be positive")
    return flops / bytes_moved


def linear_layer_flops_bytes(tokens: int, d_in: int, d_out: int, bytes_per_value: float) -> tuple[float, float]:
    """FLOPs and bytes of Y = X @ W with X (tokens, d_in) and W (d_in, d_out).

    Each output element takes d_in multiply-adds (2 FLOPs each). Memory traffic: W and X are
    read once and Y written once.
    """
    flops = 2.0 * tokens * d_in * d_out
    bytes_moved = bytes_per_value * (d_in * d_out + tokens * d_in + tokens * d_out)
    return flops, bytes_moved


def bound(intensity: float, spec: HardwareSpec) -> str:
    """ "memory" below the ridge point, "compute" at or above it."""
    return "memory" if intensity < spec.ridge_point else "compute"


def roofline_seconds(flops: float, bytes_moved: float, spec: HardwareSpec) -> float:
    """Lower bound on the time of the work: the slower of its compute and its memory traffic."""
    return max(flops / spec.flops, bytes_moved / spec.bandwidth)


def decode_step_flops_bytes(
    geometry: ModelGeometry, batch: int, context: int, bytes_per_value: float = 2.0
) -> tuple[float, float]:
    """FLOPs and bytes of one decode step of ``batch`` sequences holding ``context`` tokens each.

    FLOPs: 2 per parameter per new token, plus attention (Q·K and P·V: 4 · context · heads ·
    head_dim per layer per token). Bytes: every weight once per step (shared by the batch) plus
    every sequence's own KV cache (not shared).
    """
    if geometry.num_params is None:
        raise ValueError(f"{geometry.name}: num_params is needed for the weight traffic")
    g = geometry
    attention_flops = 4.0 * context * g.num_query_heads * g.head_dim * g.num_layers
    flops = batch * (2.0 * g.num_params + attention_flops)
    bytes_moved = g.num_params * bytes_per_value + batch * context * g.kv_bytes_per_token(bytes_per_value)
    return flops, bytes_moved


def prefill_flops_bytes(
    geometry: ModelGeometry, prompt_tokens: int, bytes_per_value: float = 2.0
) -> tuple[float, float]:
    """FLOPs and bytes of prefilling one prompt (causal attention: each token sees half the prompt on average)."""
    if geometry.num_params is None:
        raise ValueError(f"{geometry.name}: num_params is needed for the weight traffic")
    g = geometry
    attention_flops = 4.0 * g.num_layers * g.num_query_heads * g.head_dim * prompt_tokens * prompt_tokens / 2
    flops = 2.0 * g.num_params * prompt_tokens + attention_flops
    bytes_moved = g.num_params * bytes_per_value + prompt_tokens * g.kv_bytes_per_token(bytes_per_value)
    return flops, bytes_moved
