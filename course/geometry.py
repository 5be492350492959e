"""Model geometry: the few numbers of a transformer that set its compute and its KV cache.

Read from a Hugging Face ``config.json`` (a dict, a path, or a transformers config object).
The cost model (module 3), the measurements (module 1) and the KV calculator (module 4) all
speak this record.

The reader understands the shapes of attention that change the KV cache:

* multi-head (MHA: ``num_key_value_heads`` absent or equal to the heads), grouped-query (GQA)
  and multi-query attention (MQA: one KV head; older configs say ``multi_query: true``);
* an explicit ``head_dim`` that differs from ``hidden_size // num_attention_heads`` (Gemma,
  Qwen3);
* layer kinds (:data:`LAYER_KINDS`): ``layer_types`` with every value transformers 5.x and vLLM
  use, or the family's defaults where the config leaves them out: sliding-window layers on every
  layer (Mistral 7B v0.1, Phi-3) or on some (Gemma 2 alternates, Gemma 3 makes every 6th layer
  global, ``sliding_window_pattern``/``_sliding_window_pattern`` override), chunked local attention
  (Llama 4's ``attention_chunk_size``), linear-attention and Mamba layers that keep a constant-size
  state sized from the config (Qwen3-Next, Jamba, Mamba-2 hybrids), and MLP-only layers. Attention
  sinks add no cached tokens: gpt-oss's sink is one learned logit per head (``self_attn.sinks``),
  and its cache is read from its ``layer_types`` (128-token windows on every other layer);
* multi-head latent attention (MLA, DeepSeek-V2/V3: ``kv_lora_rank`` + ``qk_rope_head_dim``);
* the key names of older architectures (GPT-2's ``n_layer``/``n_head``/``n_embd``, Falcon's
  ``multi_query``/``num_kv_heads``, ChatGLM's ``multi_query_group_num``/``kv_channels``) and
  a nested ``text_config`` (multimodal wrappers), completed with its family's defaults (llava).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"  # Llama 4's local attention: a token sees only its own chunk
STATE = "linear_attention"  # Mamba, gated DeltaNet, lightning attention, short convolutions: a fixed-size state
HYBRID = "hybrid"  # attention and a state in one layer (Zamba2, Falcon-H1)
HYBRID_SLIDING = "hybrid_sliding"
NO_CACHE = "none"  # an MLP-only layer (Nemotron-H's "moe" layers): caches nothing
KINDS = (FULL, SLIDING, CHUNKED, STATE, HYBRID, HYBRID_SLIDING, NO_CACHE)

# Every ``layer_types`` value transformers 5.x allows (configuration_utils.ALLOWED_LAYER_TYPES and the
# legacy names of _LEGACY_LAYER_TYPE_REMAP) and the names vLLM's model files read, by what the layer
# caches. Sparse-attention kinds (DeepSeek's indexer, MiniMax-M3) keep full K/V for every token and
# are counted as full attention; their small extra index keys are left out.
LAYER_KINDS: dict[str, str] = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "indexed_attention": FULL,
    "deepseek_sparse_attention": FULL,
    "qwen_sparse_attention": FULL,
    "compressed_sparse_attention": FULL,
    "heavily_compressed_attention": FULL,
    "minimax_m3_sparse": FULL,
    "reference_sliding_attention": FULL,  # full attention over the prompt: an upper bound
    "sliding_attention": SLIDING,
    "local": SLIDING,
    "window_attention": SLIDING,
    "chunked_attention": CHUNKED,
    "linear_attention": STATE,
    "mamba": STATE,
    "mamba2": STATE,
    "conv": STATE,
    "hybrid": HYBRID,
    "hybrid_sliding": HYBRID_SLIDING,
    "moe": NO_CACHE,
    "mlp": NO_CACHE,
    "dense": NO_CACHE,
    "sparse": NO_CACHE,
    "none": NO_CACHE,
}
ATTENTION_OF = {FULL: FULL, SLIDING: SLIDING, CHUNKED: CHUNKED, HYBRID: FULL, HYBRID_SLIDING: SLIDING}
WITH_STATE = frozenset({STATE, HYBRID, HYBRID_SLIDING})

# Canonical field -> the config keys that carry it, in the order they are tried.
_ALIASES: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "dim"),
}
# The one table of dtype spellings (config ``torch_dtype``/``dtype``, torch, vLLM's --dtype and
# --kv-cache-dtype) -> the course's short names. course.kv reads it too.
DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
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
        layer_types: per layer, one of :data:`KINDS` (full, sliding-window or chunked attention,
            a constant-size state, both, or no cache); None when every layer is full attention
            (or, with ``sliding_window`` set, every layer slides).
        kv_lora_rank: MLA only: size of the compressed KV latent cached per token and layer.
        qk_rope_head_dim: MLA only: size of the decoupled RoPE key, cached beside the latent.
        max_position_embeddings: the longest context the model was configured for (tokens).
        weight_dtype: dtype of the published weights ("bf16", "fp16", "fp32", "fp8"), if stated.
        model_type: the config's ``model_type``.
        attention_chunk_size: chunked local attention (Llama 4): tokens per chunk.
        vocab_size: rows of the embedding (and of the LM head), when the config states it.
        tie_word_embeddings: whether the LM head reuses the input embedding's matrix.
        state_shapes: the shapes of the constant-size state one state layer keeps per sequence
            (vLLM's ``MambaStateShapeCalculator``, tensor parallel 1), e.g. a convolution state
            and an SSM state; None for models without state layers.
        ssm_state_dtype: the dtype of the SSM (temporal) state, the last of ``state_shapes``, where the
            model fixes one: NemotronH keeps it in float32 unless its config names another
            (``mamba_ssm_cache_dtype``; vLLM's ``NemotronHForCausalLMConfig``), Qwen3.5 takes its
            config's ``mamba_ssm_dtype`` (``Qwen3_5ForConditionalGenerationConfig``; both in
            vllm/model_executor/models/config.py). None: the convolution state's dtype.
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
    attention_chunk_size: int | None = None
    state_shapes: tuple[tuple[int, ...], ...] | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    ssm_state_dtype: str | None = None

    def __post_init__(self) -> None:
        self._check_shape()
        if self.layer_types is not None:
            self._check_layer_types(self.layer_types)

    def _check_shape(self) -> None:
        """The sizes are positive integers, the heads group evenly, and MLA has both of its sizes."""
        for field_name in ("num_layers", "num_query_heads", "num_kv_heads", "head_dim", "hidden_size"):
            _check_positive_int(self.name, field_name, getattr(self, field_name))
        if self.num_query_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_query_heads ({self.num_query_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads}); each KV head serves a whole group of query heads."
            )
        for field_name in (
            "sliding_window",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "max_position_embeddings",
            "attention_chunk_size",
        ):
            value = getattr(self, field_name)
            if value is not None:
                _check_positive_int(self.name, field_name, value)
        if (self.kv_lora_rank is None) != (self.qk_rope_head_dim is None):
            raise ValueError(
                f"{self.name}: MLA needs both kv_lora_rank and qk_rope_head_dim "
                f"(got {self.kv_lora_rank!r} and {self.qk_rope_head_dim!r})"
            )

    def _check_layer_types(self, layer_types: tuple[str, ...]) -> None:
        """One known kind per layer, and the size each kind needs is set (window, chunk, state shapes)."""
        if len(layer_types) != self.num_layers:
            raise ValueError(
                f"{self.name}: layer_types lists {len(layer_types)} layers, num_layers is {self.num_layers}"
            )
        unknown = set(layer_types) - set(KINDS)
        if unknown:
            raise ValueError(f"{self.name}: layer_types may hold {', '.join(KINDS)}; got {sorted(unknown)}")
        kinds = {ATTENTION_OF.get(kind) for kind in layer_types}
        if SLIDING in kinds and self.sliding_window is None:
            raise ValueError(f"{self.name}: layer_types has sliding layers but sliding_window is not set")
        if CHUNKED in kinds and self.attention_chunk_size is None:
            raise ValueError(f"{self.name}: layer_types has chunked layers but attention_chunk_size is not set")
        if WITH_STATE & set(layer_types) and not self.state_shapes:
            raise ValueError(f"{self.name}: layer_types has state layers but state_shapes is not set")

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
    def lm_head_params(self) -> int:
        """Parameters of the LM head (vocab x hidden), 0 when the vocabulary is unknown."""
        return (self.vocab_size or 0) * self.hidden_size

    @property
    def body_params(self) -> int | None:
        """Parameters used as matmuls for every token: all but the input embedding (a table lookup,
        not a matmul) and the LM head (a matmul only where logits are computed). None without
        num_params; num_params itself when the vocabulary is unknown."""
        if self.num_params is None:
            return None
        embedding_tables = 1 if self.tie_word_embeddings else 2
        body = self.num_params - embedding_tables * self.lm_head_params
        return body if body > 0 else self.num_params  # a count too small for its vocabulary: no split

    def layer_kind(self, layer: int) -> str:
        """What layer ``layer`` (0-based) caches: one of :data:`KINDS`."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return SLIDING if self.sliding_window is not None else FULL

    def attention_kind(self, layer: int) -> str | None:
        """The attention of layer ``layer``: FULL, SLIDING, CHUNKED, or None (no per-token cache)."""
        return ATTENTION_OF.get(self.layer_kind(layer))

    def count(self, *kinds: str) -> int:
        """How many layers have one of ``kinds`` as their attention (FULL, SLIDING, CHUNKED) or kind."""
        return sum(self.attention_kind(i) in kinds or self.layer_kind(i) in kinds for i in range(self.num_layers))

    @property
    def num_sliding_layers(self) -> int:
        """How many layers keep only the last ``sliding_window`` tokens."""
        return self.count(SLIDING)

    @property
    def num_state_layers(self) -> int:
        """How many layers keep a constant-size state (Mamba, linear attention) per sequence."""
        return sum(self.layer_kind(i) in WITH_STATE for i in range(self.num_layers))

    @property
    def state_values(self) -> int:
        """Values in the constant-size state of one state layer, for one sequence (0 without)."""
        return sum(prod(shape) for shape in self.state_shapes or ())

    def layer_is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) is a sliding-window layer."""
        return self.attention_kind(layer) == SLIDING

    @property
    def kv_values_per_token_per_layer(self) -> int:
        """Values one token adds to one layer's cache: 2 · KV heads · head_dim (K and V), or for MLA
        kv_lora_rank + qk_rope_head_dim (one latent shared by K and V: no factor 2)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, bytes_per_value: float) -> float:
        """KV-cache bytes one token occupies across all attention layers: 2 (K and V) · layers · KV heads
        · head_dim · bytes (MLA: layers · (kv_lora_rank + qk_rope_head_dim) · bytes).

        Every layer holds the token, as in full attention; a sliding-window layer stops holding it once
        it leaves the window (see :func:`course.kv.sequence_bytes` for a whole sequence).
        """
        return self.num_attention_layers * self.kv_values_per_token_per_layer * bytes_per_value

    @property
    def num_attention_layers(self) -> int:
        """Layers that cache K and V per token (full, sliding-window or chunked attention)."""
        return self.count(FULL, SLIDING, CHUNKED)

    def tokens_held(self, layer: int, seq_len: int) -> int:
        """Tokens layer ``layer`` keeps K and V for, in a sequence of ``seq_len`` tokens.

        A sliding-window layer keeps the last ``sliding_window - 1`` tokens: the next token attends to
        those plus itself, a window of ``sliding_window``. This is what transformers' cache keeps
        (``DynamicSlidingWindowLayer``); Mistral's reference rolling buffer keeps ``sliding_window``.
        transformers caches a chunked layer (Llama 4) the same way, with the chunk as the window;
        a state or MLP-only layer keeps no per-token K/V at all.
        """
        kind = self.attention_kind(layer)
        if kind == SLIDING:
            return min(seq_len, self.sliding_window - 1)
        if kind == CHUNKED:
            return min(seq_len, self.attention_chunk_size - 1)
        return seq_len if kind == FULL else 0


# Larger than any real model's field by far; a config beyond them is an error, not hours of arithmetic
# over 10^30 layers (every layer is visited to find its kind).
MAX_LAYERS = 100_000
MAX_CONFIG_INT = 2**53


def _check_positive_int(name: str, field_name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: {field_name} must be a positive integer, got {value!r}")
    limit = MAX_LAYERS if field_name == "num_layers" else MAX_CONFIG_INT
    if value > limit:
        raise ValueError(f"{name}: {field_name} is {value}, beyond any real model (at most {limit:,})")


def read_config_json(
    path: str | Path, *, label: str = "config", instead: str = "a dict of config keys"
) -> tuple[Path, dict]:
    """The keys of a config.json: ``path`` itself, or ``path/config.json`` when it is a folder.

    Returns (the file read, its JSON object). Raises ValueError naming the file when it does not
    exist (``label: no such config.json ...; give <instead> or the path of a config.json or of its
    folder``), cannot be read, is not valid JSON (with the line and column) or is not one JSON object.
    """
    path = Path(path).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        if path.is_dir():
            why = "the folder has no config.json"
        else:
            why = f"the {'file' if path.suffix else 'folder'} does not exist"
        raise ValueError(
            f"{label}: no such config.json {str(file)!r} ({why}); give {instead} or the path of a config.json "
            "or of its folder"
        )
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: cannot read it ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(
            f"{file}: a config.json must be one JSON object of config keys, this one is a {type(config).__name__}"
        )
    return file, config


def _read_config(config: Any) -> dict:
    if isinstance(config, (str, Path)):
        return read_config_json(config)[1]
    if hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ValueError(f"config: expected a JSON object of config keys (a config.json), got {type(config).__name__}")
    return config


def _family_defaults(inner: dict) -> dict:
    """``inner`` completed with its family's defaults, as transformers fills them in.

    Multimodal configs (llava) often list only what differs from the text model's defaults,
    e.g. ``{"model_type": "llama", "vocab_size": 32064}``: the layer count and heads come from
    ``LlamaConfig``'s defaults.
    """
    if any(k in inner for k in _ALIASES["num_hidden_layers"]) or not inner.get("model_type"):
        return inner
    try:
        from transformers import AutoConfig

        given = {k: v for k, v in inner.items() if k != "model_type"}
        filled = AutoConfig.for_model(inner["model_type"], **given).to_dict()
    except Exception as err:  # an unknown model_type or a transformers without it
        raise ValueError(
            f"text_config: model_type {inner['model_type']!r} gives no num_hidden_layers and transformers cannot "
            f"supply its defaults ({type(err).__name__}: {err}); add the layer count, heads and hidden size"
        ) from None
    return {**filled, **inner}


def _text_config(cfg: dict) -> dict:
    """The language model's part of a multimodal config (``text_config``, ``llm_config``)."""
    for key in ("text_config", "llm_config", "language_config"):
        inner = cfg.get(key)
        if isinstance(inner, dict):
            inner = _family_defaults(inner)
            if any(k in inner for k in _ALIASES["num_hidden_layers"]):
                return {**{k: v for k, v in cfg.items() if k not in inner and k != key}, **inner}
    if cfg.get("model_type") == "llava" and not any(k in cfg for k in _ALIASES["num_hidden_layers"]):
        return _text_config({**cfg, "text_config": {"model_type": "llama"}})  # LlavaConfig's default text model
    return cfg


def _pick(cfg: dict, field: str) -> int:
    for key in _ALIASES[field]:
        if cfg.get(key) is not None:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"config field {key!r} must be a positive integer, got {value!r}")
            limit = MAX_LAYERS if field == "num_hidden_layers" else MAX_CONFIG_INT
            if value > limit:
                raise ValueError(f"config field {key!r} is {value}, beyond any real model (at most {limit:,})")
            return value
    tried = ", ".join(repr(k) for k in _ALIASES[field])
    raise ValueError(
        f"config lacks {field!r} (looked for {tried}); this reader needs the layer count, the attention heads "
        "and the hidden size of a decoder-only transformer"
    )


def _kv_heads(cfg: dict, heads: int) -> int:
    """KV heads under each architecture's naming (Falcon and GPT-BigCode spell MQA ``multi_query``)."""
    if cfg.get("num_key_value_heads") is not None:
        return _period(cfg, "num_key_value_heads", 0, "a KV-head count")
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


def _ssm_state_dtype(cfg: dict) -> str | None:
    """The SSM state's dtype the model's vLLM config hook sets for ``--mamba-ssm-cache-dtype auto``."""
    if str(cfg.get("model_type", "")).startswith("nemotron_h"):
        raw = cfg.get("mamba_ssm_cache_dtype", "float32")
    else:
        raw = cfg.get("mamba_ssm_dtype")
    if raw is None or raw == "auto":
        return None
    return DTYPE_ALIASES.get(str(raw).removeprefix("torch."), str(raw))


def _weight_dtype(cfg: dict) -> str | None:
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return "fp8"
    raw = cfg.get("torch_dtype") or cfg.get("dtype")
    if raw is None:
        return None
    name = DTYPE_ALIASES.get(str(raw).removeprefix("torch."), str(raw))
    return "fp8" if name.startswith("fp8") else name


# Families whose config.json leaves the layout to the model class's defaults (transformers 5.x
# configuration_<family>.py, __post_init__): every pattern-th layer is global, the rest slide.
_SLIDING_PATTERN_DEFAULTS = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}


def _listed_kinds(listed: Any, num_layers: int) -> tuple[str, ...]:
    if not isinstance(listed, list) or len(listed) != num_layers:
        raise ValueError(f"config field 'layer_types' must list one kind per layer ({num_layers}), got {listed!r}")
    unknown = sorted({str(kind) for kind in listed} - set(LAYER_KINDS))
    if unknown:
        raise ValueError(f"config field 'layer_types' holds unknown kinds {unknown}; known: {', '.join(LAYER_KINDS)}")
    return tuple(LAYER_KINDS[str(kind)] for kind in listed)


def _layer_kinds(cfg: dict, num_layers: int) -> tuple[str, ...] | None:
    """Per-layer kinds under each family's convention (transformers 5.x semantics), or None (all full)."""
    model_type = str(cfg.get("model_type", ""))
    window = cfg.get("sliding_window")
    if cfg.get("layer_types"):
        return _listed_kinds(cfg["layer_types"], num_layers)
    if model_type == "jamba":  # JambaConfig.layers_block_type: attention where i % period == offset
        period, offset = _period(cfg, "attn_layer_period", 8), cfg.get("attn_layer_offset", 4)
        return tuple(FULL if i % period == offset else STATE for i in range(num_layers))
    if model_type in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):  # every full_attention_interval-th layer is full
        interval = _period(cfg, "full_attention_interval", 4)
        return tuple(FULL if (i + 1) % interval == 0 else STATE for i in range(num_layers))
    if cfg.get("hybrid_override_pattern"):  # Nemotron-H: M = Mamba, * = attention, - = MLP only
        pattern = cfg["hybrid_override_pattern"]
        kinds = {"M": STATE, "*": FULL, "-": NO_CACHE, "E": NO_CACHE}
        return tuple(kinds.get(ch, FULL) for ch in pattern[:num_layers])
    if cfg.get("attention_chunk_size"):  # Llama 4: chunked where RoPE is used, every 4th layer global (NoPE)
        no_rope = cfg.get("no_rope_layers") or [
            int((i + 1) % _period(cfg, "no_rope_layer_interval", 4) != 0) for i in range(num_layers)
        ]
        kinds = tuple(CHUNKED if flag else FULL for flag in no_rope[:num_layers])
        return kinds if CHUNKED in kinds else None
    if not window or cfg.get("use_sliding_window") is False:  # Qwen2/Qwen3 ship a window but switch it off
        return None
    pattern = (
        cfg.get("sliding_window_pattern")
        or cfg.get("_sliding_window_pattern")
        or _SLIDING_PATTERN_DEFAULTS.get(model_type)
    )
    if pattern:  # every pattern-th layer is global (Gemma 2: 2, Gemma 3: 6)
        pattern = _period({"sliding_window_pattern": pattern}, "sliding_window_pattern", 1)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if cfg.get("use_sliding_window") and "max_window_layers" in cfg:  # Qwen2: layers from max_window_layers on
        kinds = tuple(SLIDING if i >= cfg["max_window_layers"] else FULL for i in range(num_layers))
        return kinds if SLIDING in kinds else None
    return tuple(SLIDING for _ in range(num_layers))  # every layer slides (Mistral 7B v0.1, Phi-3, Starcoder2)


def _period(cfg: dict, key: str, default: int, what: str = "a layer period") -> int:
    """A positive integer the config states (a layer-pattern period, a head count), or a clear error naming it."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive integer ({what}), got {value!r}")
    return value


def _first(cfg: dict, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def _state_shapes(cfg: dict, hidden: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of one state layer's per-sequence state, as vLLM allocates them at tensor parallel 1.

    vLLM 'vllm/model_executor/layers/mamba/mamba_utils.py', ``MambaStateShapeCalculator``: gated
    DeltaNet (Qwen3-Next) keeps a convolution state (kernel - 1, 2·k_heads·k_dim + v_heads·v_dim) and
    a recurrent state (v_heads, v_dim, k_dim); Mamba-2 a convolution state (kernel - 1,
    intermediate + 2·groups·d_state) and an SSM state (heads, head_dim, d_state); Mamba-1 (Jamba)
    (kernel - 1, intermediate) and (intermediate, d_state); lightning attention (MiniMax) one
    (heads, head_dim, head_dim); a short convolution (LFM2) (kernel - 1, hidden).
    """
    if cfg.get("linear_num_value_heads") is not None:  # gated DeltaNet
        k_heads, v_heads = cfg.get("linear_num_key_heads", 16), cfg["linear_num_value_heads"]
        k_dim, v_dim = cfg.get("linear_key_head_dim", 128), cfg.get("linear_value_head_dim", 128)
        kernel = cfg.get("linear_conv_kernel_dim", 4)
        return ((kernel - 1, 2 * k_heads * k_dim + v_heads * v_dim), (v_heads, v_dim, k_dim))
    heads = _first(cfg, "mamba_n_heads", "mamba_num_heads")
    if heads is not None:  # Mamba-2 (Bamba, Falcon-H1, Granite-4 hybrid, Nemotron-H, Zamba2)
        d_state = _first(cfg, "mamba_d_state", "ssm_state_size", default=128)
        groups = _first(cfg, "mamba_n_groups", "n_groups", default=1)
        kernel = _first(cfg, "mamba_d_conv", "conv_kernel", default=4)
        head_dim = _first(cfg, "mamba_d_head", "mamba_head_dim", default=None)
        intermediate = (
            _first(cfg, "mamba_d_ssm", default=None) or _first(cfg, "mamba_expand", "expand", default=2) * hidden
        )
        head_dim = head_dim or intermediate // heads
        return ((kernel - 1, intermediate + 2 * groups * d_state), (heads, head_dim, d_state))
    if _first(cfg, "mamba_d_state", "state_size") is not None:  # Mamba-1 (Jamba, Mamba)
        d_state = _first(cfg, "mamba_d_state", "state_size")
        kernel = _first(cfg, "mamba_d_conv", "conv_kernel", default=4)
        intermediate = _first(cfg, "mamba_expand", "expand", default=2) * hidden
        if cfg.get("model_type") == "mamba" and cfg.get("intermediate_size"):
            intermediate = cfg["intermediate_size"]
        return ((kernel - 1, intermediate), (intermediate, d_state))
    if cfg.get("conv_L_cache") is not None:  # LFM2 short convolutions
        return ((cfg["conv_L_cache"] - 1, hidden),)
    if cfg.get("model_type") in ("minimax", "minimax_m1"):  # lightning attention
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        return ((heads, head_dim, head_dim),)
    raise ValueError(
        f"config: model_type {cfg.get('model_type')!r} has state layers (linear attention / Mamba) but none of "
        "the fields that size their state (linear_num_value_heads, mamba_n_heads, mamba_d_state, conv_L_cache)"
    )


def from_hf_config(config: Any, name: str | None = None, num_params: int | None = None) -> ModelGeometry:
    """Geometry of a decoder-only model from its Hugging Face config.

    A missing ``num_key_value_heads`` means multi-head attention (unless the architecture spells
    MQA another way); an explicit ``head_dim`` wins over ``hidden_size // num_attention_heads``
    (they differ in e.g. Gemma and Qwen3). Layer kinds follow ``layer_types`` when the config lists
    them, else the family's defaults (Gemma 2/3 patterns, Llama 4's chunks, Jamba's and
    Qwen3-Next's hybrids). Raises ValueError naming the field when one is missing or wrong.
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
        kv_lora_rank = _period(cfg, "kv_lora_rank", None, "MLA's latent rank")
        rope_dim = _period(cfg, "qk_rope_head_dim", None, "MLA's rotary dimension")
        head_dim = (cfg.get("qk_nope_head_dim") or 0) + rope_dim or cfg.get("head_dim")
    else:
        head_dim = _first(cfg, "head_dim", "kv_channels")  # a stated 0 is an error below, not "absent"
    if head_dim is None:
        if hidden % heads:
            raise ValueError(
                f"{label}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) and the "
                "config has no 'head_dim'; add head_dim to the config"
            )
        head_dim = hidden // heads
    kinds = _layer_kinds(cfg, layers)
    window = cfg.get("sliding_window") if kinds and SLIDING in {ATTENTION_OF.get(k) for k in kinds} else None
    if kinds is not None and set(kinds) == {SLIDING}:
        kinds = None  # every layer slides: sliding_window alone says so
    state = _state_shapes(cfg, hidden) if kinds and WITH_STATE & set(kinds) else None
    chunk = cfg.get("attention_chunk_size") if kinds and CHUNKED in kinds else None
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
        attention_chunk_size=chunk,
        state_shapes=state,
        ssm_state_dtype=_ssm_state_dtype(cfg) if state and len(state) > 1 else None,
        vocab_size=cfg.get("vocab_size") if isinstance(cfg.get("vocab_size"), int) else None,
        tie_word_embeddings=bool(
            cfg.get("tie_word_embeddings", str(cfg.get("model_type", "")).startswith(("gemma", "gpt2")))
        ),
    )
