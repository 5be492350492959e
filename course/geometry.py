"""Model geometry: the few numbers of a transformer that set its compute and its KV cache.

Read from a Hugging Face ``config.json`` (a dict, a path, or a transformers config object).
The cost model (module 3), the measurements (module 1) and the KV calculator (module 4) all
speak this record.

The reader understands the shapes of attention that change the KV cache:

* multi-head (MHA: ``num_key_value_heads`` absent or equal to the heads), grouped-query (GQA)
  and multi-query attention (MQA: one KV head; older configs say ``multi_query: true``);
* an explicit ``head_dim`` that differs from ``hidden_size // num_attention_heads`` (Gemma,
  Qwen3);
* sliding-window layers, on every layer (Mistral 7B v0.1, Phi-3) or on some of them
  (Gemma 2 alternates; ``layer_types`` lists them in newer configs);
* multi-head latent attention (MLA, DeepSeek-V2/V3: ``kv_lora_rank`` + ``qk_rope_head_dim``);
* the key names of older architectures (GPT-2's ``n_layer``/``n_head``/``n_embd``, Falcon's
  ``multi_query``/``num_kv_heads``, ChatGLM's ``multi_query_group_num``/``kv_channels``) and
  a nested ``text_config`` (multimodal wrappers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"

# Canonical field -> the config keys that carry it, in the order they are tried.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
}
# The normalised names of weight dtypes found in ``torch_dtype`` / ``dtype``.
_DTYPE_NAMES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
}


@dataclass(frozen=True)
class ModelGeometry:
    """Shape of a decoder-only transformer.

    Attributes:
        name: a label.
        num_layers: decoder layers.
        num_query_heads: attention (query) heads per layer.
        num_kv_heads: key/value heads per layer (= query heads for MHA, 1 for MQA).
        head_dim: size of one (query/key) head; for MLA ``qk_nope_head_dim + qk_rope_head_dim``.
        hidden_size: model width.
        num_params: parameter count, when known.
        source: where the numbers come from.
        sliding_window: attention window (tokens) of the sliding-window layers, or None.
        layer_types: per layer, ``"full_attention"`` or ``"sliding_attention"``; None when every
            layer attends to the whole context.
        kv_lora_rank: MLA only: size of the compressed KV latent cached per token and layer.
        qk_rope_head_dim: MLA only: size of the decoupled RoPE key, cached beside the latent.
        max_position_embeddings: the longest context the model was configured for (tokens).
        weight_dtype: dtype of the published weights ("bf16", "fp16", "fp32", "fp8"), if stated.
        model_type: the config's ``model_type``.
    """

    name: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_params: int | None = None
    source: str = ""
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    max_position_embeddings: int | None = None
    weight_dtype: str | None = None
    model_type: str = ""

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "hidden_size"):
            _check_positive_int(self.name, field_name, getattr(self, field_name))
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_query_heads ({self.num_query_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}); each KV head serves a whole group of query heads."
            )
        for field_name in ("sliding_window", "kv_lora_rank", "qk_rope_head_dim", "max_position_embeddings"):
            value = getattr(self, field_name)
            if value is not None:
                _check_positive_int(self.name, field_name, value)
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(
                f"{self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim "
                f"(got {self.kv_lora_rank!r} and {self.qk_rope_head_dim!r})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"{self.name}: layer_types lists {len(self.layer_types)} layers, num_layers is {self.num_layers}"
                )
            unknown = set(self.layer_types) - {FULL, SLIDING}
            if unknown:
                raise ValueError(f"{self.name}: layer_types may hold {FULL!r} or {SLIDING!r}, got {sorted(unknown)}")
            if SLIDING in self.layer_types and self.sliding_window is None:
                raise ValueError(f"{self.name}: layer_types has sliding layers but sliding_window is not set")

    @property
    def is_mla(self) -> bool:
        """True for multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank is not None

    @property
    def attention(self) -> str:
        """ "MHA", "GQA", "MQA" or "MLA"."""
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == self.num_query_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def num_sliding_layers(self) -> int:
        """How many layers keep only the last ``sliding_window`` tokens."""
        if self.sliding_window is None:
            return 0
        if self.layer_types is None:
            return self.num_layers
        return sum(kind == SLIDING for kind in self.layer_types)

    def layer_is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a sliding-window layer."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == SLIDING

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """Values one token adds to one layer's cache: 2 · KV heads · head_dim (K and V), or for MLA
        kv_lora_rank + qk_rope_head_dim (one latent shared by K and V: no factor 2)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, bytes_per_value: float) -> float:
        """KV-cache bytes one token occupies across all layers: 2 (K and V) · layers · KV heads · head_dim
        · bytes (MLA: layers · (kv_lora_rank + qk_rope_head_dim) · bytes).

        Every layer holds the token, as in full attention; a sliding-window layer stops holding it once
        it leaves the window (see :func:`course.kv.sequence_bytes` for a whole sequence).
        """
        return self.num_layers * self.kv_values_per_token_per_layer * bytes_per_value

    def tokens_held(self, layer: int, seq_len: int) -> int:
        """Tokens layer ``layer`` keeps for a sequence of ``seq_len`` tokens.

        A sliding-window layer keeps the last ``sliding_window - 1`` tokens: the next token attends to
        those plus itself, a window of ``sliding_window``. This is what transformers' cache keeps
        (``DynamicSlidingWindowLayer``); Mistral's reference rolling buffer keeps ``sliding_window``.
        """
        if self.layer_is_sliding(layer):
            return min(seq_len, self.sliding_window - 1)
        return seq_len


def _check_positive_int(name: str, field_name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: {field_name} must be a positive integer, got {value!r}")


def _read_config(config: Any) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, Path)):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ValueError(f"config: no such file {str(path)!r}; give a config.json, its folder, or a dict")
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"config: {str(path)!r} is not valid JSON ({err})") from err
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected a config dict, a path to config.json or a transformers config, got {type(config)}")


def _text_config(cfg: dict) -> dict:
    """The language model's part of a multimodal config (``text_config``, ``llm_config``)."""
    for key in ("text_config", "llm_config", "language_config"):
        inner = cfg.get(key)
        if isinstance(inner, dict) and any(k in inner for k in _ALIASES["num_hidden_layers"]):
            return {**{k: v for k, v in cfg.items() if k not in inner}, **inner}
    return cfg


def _pick(cfg: dict, field: str) -> Any:
    for key in _ALIASES[field]:
        if cfg.get(key) is not None:
            return cfg[key]
    tried = ", ".join(repr(k) for k in _ALIASES[field])
    raise ValueError(
        f"config lacks {field!r} (looked for {tried}); this reader needs the layer count, the attention heads "
        "and the hidden size of a decoder-only transformer"
    )


def _kv_heads(cfg: dict, heads: int) -> int:
    """KV heads under each architecture's naming (Falcon and GPT-BigCode spell MQA ``multi_query``)."""
    if cfg.get("num_key_value_heads") is not None:
        return cfg["num_key_value_heads"]
    if cfg.get("model_type") in ("falcon", "RefinedWeb", "RefinedWebModel") or "new_decoder_architecture" in cfg:
        # transformers' FalconAttention: num_kv_heads only with the new architecture, else MQA or MHA
        # (the pre-transformers "RefinedWeb" configs of Falcon-40B/180B are the new architecture)
        if cfg.get("new_decoder_architecture") or cfg.get("model_type") == "RefinedWeb":
            return cfg.get("num_kv_heads") or cfg.get("n_head_kv") or heads
        return 1 if cfg.get("multi_query", True) else heads
    for key in ("num_kv_heads", "n_head_kv", "n_kv_heads", "num_kv_head"):
        if cfg.get(key) is not None:
            return cfg[key]
    if cfg.get("multi_query_attention") and cfg.get("multi_query_group_num"):  # ChatGLM
        return cfg["multi_query_group_num"]
    if cfg.get("multi_query"):  # GPT-BigCode (StarCoder), old Falcon RW configs
        return 1
    return heads


def _weight_dtype(cfg: dict) -> str | None:
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return "fp8"
    raw = cfg.get("torch_dtype") or cfg.get("dtype")
    if raw is None:
        return None
    return _DTYPE_NAMES.get(str(raw).removeprefix("torch."), str(raw))


def _layer_types(cfg: dict, num_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """(sliding_window, layer_types) under each family's convention (transformers 5.x semantics)."""
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:  # Qwen2/Qwen3 ship a window but switch it off
        return None, None
    listed = cfg.get("layer_types")
    if listed:
        kinds = tuple(SLIDING if "sliding" in str(kind) else FULL for kind in listed)
        if SLIDING not in kinds or not window:
            return None, None
        return window, kinds
    if not window:
        return None, None
    model_type = cfg.get("model_type", "")
    if model_type == "gemma2":  # alternating: even layers (0, 2, ...) slide
        return window, tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))
    pattern = cfg.get("sliding_window_pattern")
    if pattern:  # Gemma 3: every pattern-th layer is global
        return window, tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if cfg.get("use_sliding_window") and "max_window_layers" in cfg:  # Qwen2: layers from max_window_layers on
        kinds = tuple(SLIDING if i >= cfg["max_window_layers"] else FULL for i in range(num_layers))
        return (window, kinds) if SLIDING in kinds else (None, None)
    return window, None  # every layer slides (Mistral 7B v0.1, Phi-3, Starcoder2)


def from_hf_config(config: Any, name: str | None = None, num_params: int | None = None) -> ModelGeometry:
    """Geometry of a decoder-only model from its Hugging Face config.

    A missing ``num_key_value_heads`` means multi-head attention (unless the architecture spells
    MQA another way); an explicit ``head_dim`` wins over ``hidden_size // num_attention_heads``
    (they differ in e.g. Gemma and Qwen3). Raises ValueError naming the field when one is missing.
    """
    cfg = _text_config(_read_config(config))
    layers = _pick(cfg, "num_hidden_layers")
    heads = _pick(cfg, "num_attention_heads")
    hidden = _pick(cfg, "hidden_size")
    label = name or cfg.get("_name_or_path") or cfg.get("model_type") or "model"
    kv_lora_rank, rope_dim = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if kv_lora_rank is not None and rope_dim is None:
        raise ValueError(f"{label}: config has kv_lora_rank (MLA) but lacks 'qk_rope_head_dim'")
    if kv_lora_rank is not None:
        head_dim = (cfg.get("qk_nope_head_dim") or 0) + rope_dim or cfg.get("head_dim")
    else:
        head_dim = cfg.get("head_dim") or cfg.get("kv_channels")
    if not head_dim:
        if not isinstance(heads, int) or heads <= 0 or hidden % heads:
            raise ValueError(
                f"{label}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) and the "
                "config has no 'head_dim'; add head_dim to the config"
            )
        head_dim = hidden // heads
    window, kinds = _layer_types(cfg, layers if isinstance(layers, int) else 0)
    return ModelGeometry(
        name=label,
        num_layers=layers,
        num_query_heads=heads,
        num_kv_heads=_kv_heads(cfg, heads),
        head_dim=head_dim,
        hidden_size=hidden,
        num_params=num_params,
        source=str(config) if isinstance(config, (str, Path)) else "config",
        sliding_window=window,
        layer_types=kinds,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim if kv_lora_rank is not None else None,
        max_position_embeddings=cfg.get("max_position_embeddings") or cfg.get("n_positions") or cfg.get("seq_length"),
        weight_dtype=_weight_dtype(cfg),
        model_type=str(cfg.get("model_type", "")),
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
    source="https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json (num_key_value_heads 32 = "
    "heads: MHA); 6.74B parameters per its model card",
    max_position_embeddings=4096,
    weight_dtype="fp16",
    model_type="llama",
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
    max_position_embeddings=8192,
    weight_dtype="bf16",
    model_type="llama",
)
