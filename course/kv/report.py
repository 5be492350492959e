"""One-line summaries of a model's geometry, for ``course kv --list`` and notebook printouts."""

from __future__ import annotations

from course.geometry import CHUNKED, FULL, ModelGeometry


def geometry_summary(geometry: ModelGeometry) -> str:
    """One line: layers by kind, heads, head_dim, attention kind, windows, state, parameters."""
    g = geometry
    parts = [f"{g.num_layers} layers", f"{g.num_query_heads} query / {g.num_kv_heads} KV heads ({g.attention})"]
    parts.append(f"head_dim {g.head_dim}")
    if g.is_mla:
        parts.append(f"MLA latent {g.kv_lora_rank} + rope {g.qk_rope_head_dim}")
    if g.num_sliding_layers:
        parts.append(f"{g.num_sliding_layers} sliding-window layers (window {g.sliding_window})")
    if g.count(CHUNKED):
        parts.append(f"{g.count(CHUNKED)} chunked-attention layers (chunk {g.attention_chunk_size})")
    if g.num_state_layers:
        parts.append(f"{g.num_state_layers} state layers ({g.state_values:,} values each per sequence)")
    if g.layer_types is not None and g.count(FULL) != g.num_layers:
        parts.append(f"{g.count(FULL)} full-attention layers")
    if g.num_params:
        parts.append(f"{g.num_params / 1e9:,.2f} B params")
    return f"{g.name}: " + ", ".join(parts)
