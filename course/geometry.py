"""Model geometry: the few numbers of a transformer that set its compute and its KV cache.

Read from a Hugging Face ``config.json`` (a dict, a path, or a transformers config object).
The cost model (module 3), the measurements (module 1) and the KV calculator (module 4) all
speak this record.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelGeometry:
    """Shape of a decoder-only transformer.

    Attributes:
        name: a label.
        num_layers: decoder layers.
        num_query_heads: attention (query) heads per layer.
        num_kv_heads: key/value heads per layer (= query heads for MHA, 1 for MQA).
        head_dim: size of one head.
        hidden_size: model width.
        num_params: parameter count, when known.
        source: where the numbers come from.
    """

    name: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_params: int | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "hidden_size"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{self.name}: {field_name} must be a positive integer, got {value!r}")
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_query_heads ({self.num_query_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}); each KV head serves a whole group of query heads."
            )

    @property
    def attention(self) -> str:
        """ "MHA", "GQA" or "MQA"."""
        if self.num_kv_heads == self.num_query_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    def kv_bytes_per_token(self, bytes_per_value: float) -> float:
        """KV-cache bytes one token occupies across all layers: 2 (K and V) · layers · KV heads · head_dim."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value


def _read_config(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        return json.loads(path.read_text())
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected a config dict, a path to config.json or a transformers config, got {type(config)}")


def from_hf_config(config: Any, name: str | None = None, num_params: int | None = None) -> ModelGeometry:
    """Geometry of a Llama-style model from its Hugging Face config.

    A missing ``num_key_value_heads`` means multi-head attention; an explicit ``head_dim`` wins
    over ``hidden_size // num_attention_heads`` (they differ in e.g. Gemma and Qwen3).
    """
    cfg = _read_config(config)
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if key not in cfg:
            raise ValueError(f"config lacks {key!r}; this reader needs a Llama-style config.json")
    heads = cfg["num_attention_heads"]
    return ModelGeometry(
        name=name or cfg.get("_name_or_path") or cfg.get("model_type", "model"),
        num_layers=cfg["num_hidden_layers"],
        num_query_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        hidden_size=cfg["hidden_size"],
        num_params=num_params,
        source=str(config) if isinstance(config, (str, Path)) else "config",
    )


# Two real models that module 1 reasons about; numbers from their config.json on the Hub.
LLAMA2_7B = ModelGeometry(
    "Llama-2-7B",
    num_layers=32,
    num_query_heads=32,
    num_kv_heads=32,
    head_dim=128,
    hidden_size=4096,
    num_params=6_738_415_616,
    source="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json (no num_key_value_heads: MHA); "
    "6.74B parameters per its model card",
)
LLAMA3_8B = ModelGeometry(
    "Llama-3-8B",
    num_layers=32,
    num_query_heads=32,
    num_kv_heads=8,
    head_dim=128,
    hidden_size=4096,
    num_params=8_030_261_248,
    source="https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json (num_key_value_heads 8: GQA); "
    "8.03B parameters per its model card",
)
