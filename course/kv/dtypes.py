"""KV-cache dtypes: bytes per cached vector, vLLM's own ``--kv-cache-dtype`` names included.

vLLM's cache dtypes (``vllm/config/cache.py``, ``CacheDType``) and their page sizes
(``vllm/v1/kv_cache_interface.py``, ``AttentionSpec.page_size_bytes``): fp8 variants store one byte per
value with per-tensor scales; ``int8_per_token_head`` and ``fp8_per_token_head`` add one fp32 scale per
token and head, for K and for V; ``nvfp4`` packs two 4-bit values per byte plus one fp8 scale per 16
values; ``fp8_ds_mla`` is DeepSeek-V3.2's MLA layout, 656 bytes per token and layer. Support and
accuracy differ by GPU, attention backend and model: confirm both on your server and model before
relying on a quantized cache (vLLM's quantized-KV docs, https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from course.geometry import DTYPE_ALIASES


@dataclass(frozen=True)
class KVDtype:
    """How the cache stores one value, and what quantization adds on top.

    Attributes:
        name: the course's name (vLLM's ``--kv-cache-dtype`` where vLLM has the dtype).
        bits: bits per stored value.
        scale_bytes: extra bytes per cached vector (one head of one token, for K and for V
            separately; MLA: one per latent vector) for its scales.
        note: the scheme the overhead stands for, with its source.
        mla_token_bytes: a fixed per-token-per-layer size that replaces the formula (fp8_ds_mla).
        scale_block: values that share one extra scale byte (nvfp4: 16), 0 for none.
    """

    name: str
    bits: int
    scale_bytes: float
    note: str
    mla_token_bytes: int | None = None
    scale_block: int = 0

    def vector_bytes(self, values: int) -> float:
        """Bytes of one cached vector of ``values`` values, overhead included."""
        blocks = values // self.scale_block if self.scale_block else 0
        return values * self.bits / 8 + self.scale_bytes + blocks


_SOURCE = "vllm/v1/kv_cache_interface.py, AttentionSpec.page_size_bytes"
KV_DTYPES: dict[str, KVDtype] = {
    d.name: d
    for d in (
        KVDtype("fp32", 32, 0, "no overhead"),
        KVDtype("bf16", 16, 0, "no overhead"),
        KVDtype("fp16", 16, 0, "no overhead"),
        KVDtype(
            "fp8",
            8,
            0,
            "vLLM's fp8 (= fp8_e4m3): one byte per value, per-tensor scales (a few bytes per layer whatever the "
            f"length, left out of the per-token figure); {_SOURCE}",
        ),
        KVDtype("fp8_e4m3", 8, 0, f"vLLM's fp8_e4m3: one byte per value, per-tensor scales; {_SOURCE}"),
        KVDtype("fp8_e5m2", 8, 0, f"vLLM's fp8_e5m2: one byte per value, per-tensor scales; {_SOURCE}"),
        KVDtype(
            "int8_per_token_head",
            8,
            4,
            "vLLM's int8_per_token_head: one byte per value plus one fp32 scale per token and head, for K and for "
            f"V (page_size_bytes adds 2 x block_size x num_kv_heads x 4 bytes); {_SOURCE}",
        ),
        KVDtype(
            "fp8_per_token_head",
            8,
            4,
            "vLLM's fp8_per_token_head: one byte per value plus one fp32 scale per token and head, for K and for "
            f"V; {_SOURCE}",
        ),
        KVDtype(
            "int4_per_token_head",
            4,
            4,
            "vLLM's int4_per_token_head: half a byte per value (two per byte) plus one fp32 scale per token and "
            "head, for K and for V, packed after each head's data (vllm/v1/attention/backends/triton_attn.py, "
            "TritonAttentionBackend.customize_spec: head_size // 2 bytes plus 4 bytes of scale per side); the "
            "values are a randomized Hadamard rotation of K and V stored as asymmetric 4-bit levels, the zero point "
            "in the scale's low mantissa bits (vllm/v1/attention/ops/int4_per_token_head.py); vLLM 0.32.0",
        ),
        KVDtype(
            "nvfp4",
            4,
            0,
            "vLLM's nvfp4: two 4-bit values per byte plus one fp8 scale per 16 values "
            f"(FullAttentionSpec.real_page_size_bytes, nvfp4_kv_cache_full_dim); {_SOURCE}",
            scale_block=16,
        ),
        KVDtype(
            "fp8_ds_mla",
            8,
            0,
            "vLLM's fp8_ds_mla, DeepSeek-V3.2's sparse-MLA layout: 656 bytes per token and layer "
            "(MLAAttentionSpec.real_page_size_bytes = block_size x 656); MLA models only",
            mla_token_bytes=656,
        ),
    )
}
# The course's earlier short names, and vLLM's model-dtype spellings.
_ALIASES = {
    **DTYPE_ALIASES,
    "int8": "int8_per_token_head",
    "int4": "int4_per_token_head",
}


def get_kv_dtype(dtype: str | KVDtype | Any) -> KVDtype:
    """The :class:`KVDtype` called ``dtype`` ("bf16", "fp8", "nvfp4", ..., or a torch dtype such as torch.float16)."""
    if isinstance(dtype, KVDtype):
        return dtype
    key = str(dtype).removeprefix("torch.").strip().lower()
    key = _ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ValueError(f"kv_dtype: unknown {dtype!r}; allowed: {', '.join(KV_DTYPES)} (or auto)")
    return KV_DTYPES[key]


WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
