"""The roofline: is a piece of work limited by FLOP/s or by memory bandwidth?

time >= max(FLOPs / peak FLOP/s, bytes moved / bandwidth). The ratio FLOPs / bytes is the
arithmetic intensity; above the hardware's ridge point (peak / bandwidth) the work is
compute-bound, below it memory-bound. Module 1 derives these; module 3's cost model uses them.
A roofline is a lower bound: real kernels reach 70-80 % of either roof at best (see the
module-3 notebook for measured ratios).

The model's FLOPs and bytes follow what an engine runs: the input embedding is a table lookup (it
reads one row per token, no matmul), and the LM head is a matmul only at the positions whose logits
are computed. vLLM computes logits only where it samples: the last position of a prefill and every
decode token. So a prefill of n tokens costs 2 x body_params x n + 2 x lm_head_params FLOPs, not
2 x num_params x n (Llama-3-8B: 13-15 % fewer), and a decode step reads the body and the LM head
once, not the embedding table too (Llama-3-8B: 6.5 % fewer bytes). When the vocabulary is unknown
(a hand-made geometry) every parameter is counted as a matmul, an upper bound.
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


def _weights(geometry: ModelGeometry) -> tuple[int, int]:
    """(body parameters, LM-head parameters) of a geometry that knows its parameter count."""
    if geometry.num_params is None:
        raise ValueError(f"{geometry.name}: num_params is needed for the weight traffic")
    body = geometry.body_params
    return body, (geometry.lm_head_params if body != geometry.num_params else 0)  # no split: all in the body


def decode_step_flops_bytes(
    geometry: ModelGeometry, batch: int, context: int, bytes_per_value: float = 2.0
) -> tuple[float, float]:
    """FLOPs and bytes of one decode step of ``batch`` sequences holding ``context`` tokens each.

    FLOPs: 2 per body and LM-head parameter per new token (every decode token is sampled), plus
    attention (Q·K and P·V: 4 · context · heads · head_dim per attention layer per token). Bytes:
    the body and the LM head once per step (shared by the batch), one embedding row per token, and
    every sequence's own KV cache (not shared).
    """
    g = geometry
    body, head = _weights(g)
    attention_flops = 4.0 * context * g.num_query_heads * g.head_dim * g.num_attention_layers
    flops = batch * (2.0 * (body + head) + attention_flops)
    lookup = batch * g.hidden_size * bytes_per_value
    bytes_moved = (body + head) * bytes_per_value + lookup + batch * context * g.kv_bytes_per_token(bytes_per_value)
    return flops, bytes_moved


def prefill_flops_bytes(
    geometry: ModelGeometry, prompt_tokens: int, bytes_per_value: float = 2.0
) -> tuple[float, float]:
    """FLOPs and bytes of prefilling one prompt (causal attention: each token sees half the prompt on average).

    The body runs on every prompt token, the LM head once (the last position's logits, the first
    output token); the embedding is read one row per token.
    """
    g = geometry
    body, head = _weights(g)
    attention_flops = 4.0 * g.num_attention_layers * g.num_query_heads * g.head_dim * prompt_tokens * prompt_tokens / 2
    flops = 2.0 * body * prompt_tokens + 2.0 * head + attention_flops
    lookup = prompt_tokens * g.hidden_size * bytes_per_value
    bytes_moved = (body + head) * bytes_per_value + lookup + prompt_tokens * g.kv_bytes_per_token(bytes_per_value)
    return flops, bytes_moved
