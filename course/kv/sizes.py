"""KV bytes: per token, per layer kind, per sequence and per batch, on one GPU.

Attention layers cache K and V per token (MLA: one latent); sliding-window and chunked layers keep
only their window or chunk; state layers (Mamba, linear attention) keep a constant-size state per
sequence whatever its length; MLP-only layers keep nothing (layer kinds: :mod:`course.geometry`).
"""

from __future__ import annotations

from math import prod
from typing import Any

from course.geometry import ModelGeometry
from course.kv.catalogue import get_model
from course.kv.dtypes import KVDtype, get_kv_dtype


def _positive_int(field_name: str, value: Any, allowed: str = "a positive integer") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field_name}: must be {allowed}, got {value!r}")
    return value


def _non_negative_int(field_name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{field_name}: must be an integer >= 0, got {value!r}")
    return value


def _whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def kv_heads_per_gpu(geometry: ModelGeometry, tp: int = 1) -> int:
    """KV heads each of ``tp`` tensor-parallel GPUs stores.

    vLLM shards the query heads evenly, so ``tp`` must divide them. KV heads are split too while
    there are enough; when ``tp`` exceeds the KV heads each GPU keeps one (heads are replicated:
    ``max(1, kv_heads // tp)``, and ``tp`` must be a multiple of the KV heads). MLA caches one
    latent per token that every GPU keeps whole.
    """
    g = geometry
    _positive_int("tp", tp, "a positive integer (the tensor-parallel size)")
    if g.num_query_heads % tp:
        raise ValueError(
            f"tp: {tp} does not divide the {g.num_query_heads} query heads of {g.name}; "
            f"allowed: {', '.join(str(d) for d in range(1, g.num_query_heads + 1) if g.num_query_heads % d == 0)}"
        )
    if g.is_mla:
        return 1
    if tp <= g.num_kv_heads:
        if g.num_kv_heads % tp:
            raise ValueError(f"tp: {tp} does not divide the {g.num_kv_heads} KV heads of {g.name}")
        return g.num_kv_heads // tp
    if tp % g.num_kv_heads:
        raise ValueError(f"tp: {tp} is above the {g.num_kv_heads} KV heads of {g.name} but not a multiple of them")
    return 1


def layer_bytes_per_token(geometry: ModelGeometry, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """Bytes one token adds to one layer's cache on one GPU: 2 (K and V) · KV heads per GPU · head
    vector bytes; MLA: one latent of kv_lora_rank + qk_rope_head_dim values (no factor 2)."""
    d = get_kv_dtype(dtype)
    g = geometry
    if g.is_mla:
        kv_heads_per_gpu(g, tp)  # validates tp
        if d.mla_token_bytes is not None:
            return d.mla_token_bytes
        return _whole(d.vector_bytes(g.kv_lora_rank + g.qk_rope_head_dim))
    if d.mla_token_bytes is not None:
        raise ValueError(f"kv_dtype: {d.name} is an MLA layout; {g.name} has no MLA latent")
    return _whole(2 * kv_heads_per_gpu(g, tp) * d.vector_bytes(g.head_dim))


def state_bytes(geometry: ModelGeometry, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """Bytes of the constant-size state one state layer keeps per sequence, on one GPU.

    vLLM's ``MambaSpec.page_size_bytes``: the product of each state shape times its dtype's size
    (``mamba_cache_dtype="auto"``: the model's dtype; the SSM state in ``geometry.ssm_state_dtype``
    where the model fixes one, ``MambaStateDtypeCalculator``), the heads and channels split over
    ``tp`` GPUs (``MambaStateShapeCalculator``). 0 for models without state layers.
    """
    if not geometry.state_shapes:
        return 0
    d = get_kv_dtype(dtype)
    bits = 16 if d.bits < 16 else d.bits  # KV quantization does not apply to Mamba states
    total_bits = geometry.state_values * bits
    if geometry.ssm_state_dtype is not None:
        ssm_values = prod(geometry.state_shapes[-1])
        total_bits += ssm_values * (get_kv_dtype(geometry.ssm_state_dtype).bits - bits)
    return _whole(total_bits / 8 / tp)


def bytes_per_token(model: Any, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """KV bytes of one token in every attention layer, on one GPU (the full-attention cost of a token)."""
    g = get_model(model)
    return _whole(g.num_attention_layers * layer_bytes_per_token(g, dtype, tp))


def sequence_bytes(model: Any, tokens: int, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """Cache bytes one sequence of ``tokens`` tokens holds on one GPU, as transformers' cache keeps it.

    Sliding-window and chunked layers keep only the last ``window - 1`` tokens, full-attention layers
    every token, state layers their constant state once the sequence has a token (sized as vLLM
    sizes it: transformers' convolution state keeps one more column, the kernel's full width).
    """
    g = get_model(model)
    _non_negative_int("tokens", tokens)
    per_layer = layer_bytes_per_token(g, dtype, tp)
    held = sum(g.tokens_held(layer, tokens) for layer in range(g.num_layers))
    states = g.num_state_layers * state_bytes(g, dtype, tp) if tokens else 0
    return _whole(held * per_layer + states)


def batch_bytes(model: Any, tokens: int, batch: int, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """Cache bytes of ``batch`` sequences of ``tokens`` tokens each, on one GPU."""
    _positive_int("batch", batch)
    return _whole(batch * sequence_bytes(model, tokens, dtype, tp))
