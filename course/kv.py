"""KV-cache calculator: bytes per token, paged blocks, and the GPU-memory budget vLLM computes.

Everything here is arithmetic on a :class:`course.geometry.ModelGeometry` (from a Hugging Face
``config.json``, a path to one, or a catalogue name) and a :class:`course.hardware.HardwareSpec`:

* :func:`bytes_per_token`, :func:`sequence_bytes`, :func:`batch_bytes`: what the cache holds,
  per GPU, for any KV dtype in :data:`KV_DTYPES` (scale overheads stated there), with
  sliding-window layers and MLA's compressed latent;
* :func:`paged_blocks`: the fixed-size blocks a sequence occupies and the slots it wastes;
* :func:`budget`: vLLM's recipe (``gpu_memory_utilization`` x total memory - weights - activation
  peak - non-torch memory, then whole blocks), with tensor parallelism; the result answers
  "how many requests of ``max_model_len`` fit" and "how long can each of B requests get";
* :data:`MODELS`: a catalogue of real models, each with the source of its numbers;
* :func:`explorer`: a notebook widget with sliders (a static chart where widgets are unavailable).

The module-4 notebook has learners build the core of this themselves; ``course kv`` prints it
on the command line. Sizes are bytes; GiB = 2**30 bytes, GB = 10**9 bytes (datasheets).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from course import hardware
from course.geometry import ModelGeometry, from_hf_config
from course.hardware import GPUS, HardwareSpec

GiB = 2**30
MiB = 2**20
CATALOGUE_FILE = Path(__file__).parent / "data" / "kv_models.json"
VLLM_BLOCK_SIZE = 16  # vLLM's default on CUDA (platforms/cuda.py)


# --- KV dtypes --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVDtype:
    """How the cache stores one value, and what quantization adds on top.

    Attributes:
        name: "fp32", "bf16", "fp16", "fp8", "int8" or "int4".
        bits: bits per stored value.
        scale_bytes: extra bytes stored per cached vector (one head of one token, for K and for V
            separately; MLA: one per latent vector) for its scale and zero point.
        note: the scheme the overhead stands for, with its source.
    """

    name: str
    bits: int
    scale_bytes: float
    note: str

    def vector_bytes(self, values: int) -> float:
        """Bytes of one cached vector of ``values`` values, overhead included."""
        return values * self.bits / 8 + self.scale_bytes


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
            "vLLM's fp8 KV cache (e4m3/e5m2) keeps one fp32 scale per K and V tensor of each layer: 8 bytes per "
            "layer whatever the length, left out of the per-token figure "
            "(https://docs.vllm.ai/en/v0.11.2/features/quantization/quantized_kvcache/)",
        ),
        KVDtype(
            "int8",
            8,
            4,
            "LMDeploy-style online int8: asymmetric, per head and per token "
            "(https://lmdeploy.readthedocs.io/en/v0.13.0/quantization/kv_quant.html); we assume an fp16 scale "
            "and an fp16 zero point, 4 bytes per head vector",
        ),
        KVDtype(
            "int4",
            4,
            4,
            "LMDeploy-style online int4: asymmetric, per head and per token "
            "(https://lmdeploy.readthedocs.io/en/v0.13.0/quantization/kv_quant.html); we assume an fp16 scale "
            "and an fp16 zero point, 4 bytes per head vector",
        ),
    )
}
_DTYPE_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp8_e4m3": "fp8",
    "fp8_e5m2": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
}


def get_kv_dtype(dtype: str | KVDtype | Any) -> KVDtype:
    """The :class:`KVDtype` called ``dtype`` ("bf16", "fp8", ..., or a torch dtype such as torch.float16)."""
    if isinstance(dtype, KVDtype):
        return dtype
    key = str(dtype).removeprefix("torch.").strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ValueError(f"kv_dtype: unknown {dtype!r}; allowed: {', '.join(KV_DTYPES)}")
    return KV_DTYPES[key]


# The dtype vLLM serves weights in, given the checkpoint's ("auto": fp32 checkpoints run in fp16;
# fp8 checkpoints compute, and cache, in bf16).
# A config without a dtype is an fp32 checkpoint to vLLM (GPT-2's).
_SERVING_DTYPE = {"fp32": "fp16", "fp16": "fp16", "bf16": "bf16", "fp8": "bf16", None: "fp16"}
_WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def serving_dtype(geometry: ModelGeometry) -> str:
    """The KV dtype vLLM's ``kv_cache_dtype="auto"`` gives this model: its compute dtype."""
    return _SERVING_DTYPE.get(geometry.weight_dtype, "bf16")


# --- the model catalogue ------------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogueEntry:
    """A real model: its config.json keys, where they come from, and its parameter count."""

    name: str
    hf_id: str
    config: dict
    num_params: int
    params_source: str
    source: str

    @property
    def geometry(self) -> ModelGeometry:
        g = from_hf_config(self.config, name=self.name, num_params=self.num_params)
        return _replace(g, source=self.source)


def _replace(geometry: ModelGeometry, **changes: Any) -> ModelGeometry:
    from dataclasses import replace

    return replace(geometry, **changes)


@cache
def _catalogue() -> dict[str, CatalogueEntry]:
    raw = json.loads(CATALOGUE_FILE.read_text())
    entries = {}
    for item in raw["models"]:
        params = item["num_params"] or count_params(item["config"])
        if params is None:
            raise ValueError(f"catalogue entry {item['name']}: no num_params and count_params cannot derive it")
        entries[item["name"]] = CatalogueEntry(
            item["name"], item["hf_id"], item["config"], params, item["params_source"], item["source"]
        )
    return entries


def catalogue() -> dict[str, CatalogueEntry]:
    """Every catalogue entry by name."""
    return dict(_catalogue())


def _normalise(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch.isalnum() or ch == ".")


def catalogue_entry(name: str) -> CatalogueEntry:
    """The catalogue entry called ``name`` (case and punctuation ignored; the Hub id works too)."""
    wanted = _normalise(name)
    for entry in _catalogue().values():
        if wanted in (_normalise(entry.name), _normalise(entry.hf_id), _normalise(entry.hf_id.split("/")[-1])):
            return entry
    raise ValueError(f"model: unknown {name!r}; catalogue models: {', '.join(_catalogue())} (or a config.json path)")


def get_model(spec: str | Path | dict | ModelGeometry, num_params: int | None = None) -> ModelGeometry:
    """Geometry of a catalogue model (by name), a config.json (path, folder or dict) or a geometry.

    For a config without a known parameter count, :func:`count_params` derives it where it can.
    """
    if isinstance(spec, ModelGeometry):
        return spec
    if isinstance(spec, dict):
        return from_hf_config(spec, num_params=num_params or count_params(spec))
    path = Path(spec)
    if path.suffix == ".json" or path.is_dir() or path.exists():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ValueError(f"model: no such config.json {str(file)!r}")
        cfg = json.loads(file.read_text())
        name = cfg.get("_name_or_path") or (path.stem if path.is_file() else path.name)
        g = from_hf_config(cfg, name=name, num_params=num_params or count_params(cfg))
        return _replace(g, source=str(path))
    return catalogue_entry(str(spec)).geometry


def _models() -> dict[str, ModelGeometry]:
    return {name: entry.geometry for name, entry in _catalogue().items()}


# --- parameter counts ----------------------------------------------------------------------------


def count_params(config: dict) -> int | None:
    """Exact parameter count of a model from its config.json, or None for architectures it does not know.

    Covers Llama-style decoders (llama, mistral, mixtral with its experts, qwen2/qwen3, gemma/gemma2,
    phi3), GPT-2 and Falcon's original (7B) architecture, by adding up every weight matrix, bias
    and norm. Tied input and output embeddings count once. MLA/MoE designs such as DeepSeek's return
    None: give their published count instead.
    """
    try:
        return _count_params(config)
    except (KeyError, TypeError):
        return None


def _count_params(cfg: dict) -> int | None:
    kind = str(cfg.get("model_type", "")).lower()
    if kind == "gpt2":
        h, layers, vocab = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
        inner = cfg.get("n_inner") or 4 * h
        per_layer = (
            2 * h  # ln_1 (weight, bias)
            + h * 3 * h
            + 3 * h  # c_attn
            + h * h
            + h  # attention c_proj
            + 2 * h  # ln_2
            + h * inner
            + inner  # c_fc
            + inner * h
            + h  # mlp c_proj
        )
        return vocab * h + cfg.get("n_positions", 1024) * h + layers * per_layer + 2 * h  # tied lm_head; ln_f
    if kind == "falcon" and not cfg.get("new_decoder_architecture") and not cfg.get("bias"):
        h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
        heads = cfg["num_attention_heads"]
        head_dim = h // heads
        kv = 1 if cfg.get("multi_query", True) else heads
        per_layer = h * (heads + 2 * kv) * head_dim + h * h + 2 * h * 4 * h + 2 * h  # qkv, dense, mlp, one layernorm
        return vocab * h + layers * per_layer + 2 * h  # tied lm_head; ln_f
    if kind not in {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "phi3"}:
        return None
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    q_size, kv_size = heads * head_dim, kv * head_dim
    attention = h * q_size + 2 * h * kv_size + q_size * h
    if kind == "qwen2" or cfg.get("attention_bias"):
        attention += q_size + 2 * kv_size  # q, k, v biases (Qwen2 always has them)
    if kind == "qwen3":
        attention += 2 * head_dim  # q_norm, k_norm
    mlp = 3 * h * cfg["intermediate_size"]
    if kind == "mixtral":
        experts = cfg["num_local_experts"]
        mlp = experts * mlp + h * experts  # every expert, plus the router
    norms = (4 if kind in ("gemma2",) else 2) * h
    tied = cfg.get("tie_word_embeddings", kind.startswith("gemma"))
    embeddings = vocab * h * (1 if tied else 2)
    return embeddings + layers * (attention + mlp + norms) + h  # final norm


# --- bytes ----------------------------------------------------------------------------------------


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
        return _whole(d.vector_bytes(g.kv_lora_rank + g.qk_rope_head_dim))
    return _whole(2 * kv_heads_per_gpu(g, tp) * d.vector_bytes(g.head_dim))


def bytes_per_token(model: Any, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """KV bytes of one token in every layer, on one GPU (the full-attention cost of a token)."""
    g = get_model(model)
    return _whole(g.num_layers * layer_bytes_per_token(g, dtype, tp))


def sequence_bytes(model: Any, tokens: int, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """KV bytes one sequence of ``tokens`` tokens holds on one GPU.

    Sliding-window layers keep only ``sliding_window - 1`` tokens (transformers' layout); every
    other layer keeps them all.
    """
    g = get_model(model)
    _non_negative_int("tokens", tokens)
    per_layer = layer_bytes_per_token(g, dtype, tp)
    held = sum(g.tokens_held(layer, tokens) for layer in range(g.num_layers))
    return _whole(held * per_layer)


def batch_bytes(model: Any, tokens: int, batch: int, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """KV bytes of ``batch`` sequences of ``tokens`` tokens each, on one GPU."""
    _positive_int("batch", batch)
    return _whole(batch * sequence_bytes(model, tokens, dtype, tp))


# --- paged blocks -----------------------------------------------------------------------------------


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


def paged_blocks(tokens: int, block_size: int = VLLM_BLOCK_SIZE) -> PagedBlocks:
    """Blocks for a sequence of ``tokens`` tokens: only the last block can be partly empty."""
    _non_negative_int("tokens", tokens)
    _positive_int("block_size", block_size, "a positive integer (vLLM allows 1, 8, 16, 32, 64, 128)")
    blocks = -(-tokens // block_size)
    slots = blocks * block_size
    waste = slots - tokens
    return PagedBlocks(tokens, block_size, blocks, slots, waste, waste / slots if slots else 0.0)


def page_bytes(model: Any, block_size: int = VLLM_BLOCK_SIZE, dtype: str | KVDtype = "bf16", tp: int = 1) -> float:
    """Bytes of one block across all layers on one GPU (vLLM: page_size_bytes x num_layers)."""
    _positive_int("block_size", block_size)
    return _whole(block_size * bytes_per_token(model, dtype, tp))


# --- the memory budget -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVBudget:
    """What one GPU of a vLLM deployment has for the KV cache, in vLLM's arithmetic.

    ``requested = utilization x total``; ``kv_memory = requested - weights - activation_peak -
    non_torch``; ``num_blocks = kv_memory // page_bytes``. All byte figures are per GPU.
    """

    model: str
    gpu: str
    total_memory: float
    utilization: float
    weights: float
    activation_peak: float
    non_torch: float
    kv_dtype: str
    block_size: int
    tp: int
    kv_heads_per_gpu: int
    bytes_per_token: float
    max_model_len: int
    notes: tuple[str, ...] = field(default=())

    @property
    def requested(self) -> float:
        """utilization x total memory (bytes): vLLM's share of the GPU, of total not free memory."""
        return self.utilization * self.total_memory

    @property
    def kv_memory(self) -> float:
        """Bytes left for the KV cache (negative when the rest does not even fit)."""
        return self.requested - self.weights - self.activation_peak - self.non_torch

    @property
    def page_bytes(self) -> float:
        """One block of ``block_size`` tokens in every layer (bytes)."""
        return self.block_size * self.bytes_per_token

    @property
    def num_blocks(self) -> int:
        """Whole blocks that fit in the KV memory."""
        return max(0, int(self.kv_memory // self.page_bytes))

    @property
    def num_tokens(self) -> int:
        """Token slots in those blocks (vLLM logs this as "GPU KV cache size")."""
        return self.num_blocks * self.block_size

    @property
    def blocks_per_request(self) -> int:
        """Blocks a request of max_model_len tokens needs."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """vLLM's logged "Maximum concurrency": blocks / blocks per max_model_len request (a worst case)."""
        return self.num_blocks / self.blocks_per_request

    @property
    def fits_one_request(self) -> bool:
        """vLLM refuses to start unless one max_model_len request fits."""
        return self.num_blocks >= self.blocks_per_request

    def max_batch(self, context: int) -> int:
        """How many sequences of ``context`` tokens fit at once."""
        _positive_int("context", context)
        return self.num_blocks // -(-context // self.block_size)

    def max_context(self, batch: int) -> int:
        """The longest context (tokens) each of ``batch`` sequences can hold at once, in whole blocks.

        Not capped at max_model_len: compare the two.
        """
        _positive_int("batch", batch)
        return (self.num_blocks // batch) * self.block_size

    def to_dict(self) -> dict:
        """Every input and derived figure, JSON-ready."""
        data = asdict(self)
        data["notes"] = list(self.notes)
        for name in ("requested", "kv_memory", "page_bytes", "num_blocks", "num_tokens", "blocks_per_request"):
            data[name] = getattr(self, name)
        data["max_concurrency"] = round(self.max_concurrency, 4)
        data["fits_one_request"] = self.fits_one_request
        return data

    def table(self, batches: tuple[int, ...] = (1, 8, 32, 128)) -> str:
        """A readable report."""
        gib = lambda x: f"{x / GiB:8.2f} GiB"  # noqa: E731
        lines = [
            f"KV-cache budget: {self.model} on {self.gpu} (tensor parallel {self.tp}), per GPU",
            f"  total memory        {gib(self.total_memory)}",
            f"  x utilization {self.utilization:<5g} {gib(self.requested)}",
            f"  - weights           {gib(self.weights)}",
            f"  - activation peak   {gib(self.activation_peak)}",
            f"  - non-torch memory  {gib(self.non_torch)}",
            f"  = KV cache          {gib(self.kv_memory)}",
            f"  KV per token        {self.bytes_per_token:,.0f} B ({self.kv_dtype}, {self.kv_heads_per_gpu} KV "
            f"head{'s' if self.kv_heads_per_gpu > 1 else ''} per GPU)",
            f"  block               {self.block_size} tokens = {self.page_bytes / MiB:,.3f} MiB",
            f"  blocks              {self.num_blocks:,}",
            f"  tokens              {self.num_tokens:,}",
            f"  max_model_len       {self.max_model_len:,} tokens = {self.blocks_per_request:,} blocks per request",
            f"  max concurrency     {self.max_concurrency:,.2f}x (every request at max_model_len, as vLLM logs it)",
        ]
        for batch in batches:
            lines.append(f"  max context at batch {batch:<4d} {self.max_context(batch):,} tokens")
        if not self.fits_one_request:
            lines.append(
                "  DOES NOT FIT: not even one max_model_len request; vLLM would refuse to start "
                "(raise the utilization, shorten max_model_len, quantize the KV cache or add GPUs)"
            )
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def total_weight_bytes(geometry: ModelGeometry, weight_dtype: str | None = None) -> float:
    """Bytes of all weights (all GPUs together) in the serving dtype."""
    if geometry.num_params is None:
        raise ValueError(
            f"weights: the parameter count of {geometry.name} is unknown; pass weight_bytes (CLI: --weights-gib)"
        )
    name = weight_dtype or (geometry.weight_dtype if geometry.weight_dtype == "fp8" else serving_dtype(geometry))
    if name not in _WEIGHT_BYTES:
        raise ValueError(f"weight_dtype: unknown {name!r}; allowed: {', '.join(_WEIGHT_BYTES)}")
    return geometry.num_params * _WEIGHT_BYTES[name]


def budget(
    model: Any,
    gpu: str | HardwareSpec = "H100-SXM",
    *,
    utilization: float = 0.9,
    max_model_len: int | None = None,
    kv_dtype: str | KVDtype = "auto",
    block_size: int = VLLM_BLOCK_SIZE,
    tp: int = 1,
    weight_dtype: str | None = None,
    weight_bytes: float | None = None,
    activation_bytes: float = 0.0,
    non_torch_bytes: float = 0.0,
) -> KVBudget:
    """vLLM's KV-cache budget for a model on ``tp`` GPUs of one kind.

    Args:
        model: catalogue name, config.json path/dict, or a ModelGeometry.
        gpu: catalogue GPU name or a HardwareSpec (memory per GPU).
        utilization: vLLM's ``gpu_memory_utilization``, a share of *total* memory, in (0, 1].
        max_model_len: longest request (tokens); default the model's max_position_embeddings.
        kv_dtype: "auto" (the model's compute dtype, as vLLM) or one of :data:`KV_DTYPES`.
        block_size: tokens per block (vLLM's default 16).
        tp: tensor-parallel GPUs; weights are split evenly, KV heads as :func:`kv_heads_per_gpu`.
        weight_dtype: dtype of the served weights (default: the checkpoint's, fp32 served as fp16).
        weight_bytes: total weight bytes, overriding the parameter count.
        activation_bytes: peak activation memory per GPU (vLLM measures it with a dummy forward
            pass at ``max_num_batched_tokens``); 0 when not given.
        non_torch_bytes: CUDA context, NCCL buffers and other memory outside PyTorch's allocator.
    """
    g = get_model(model)
    spec = hardware.gpu(gpu) if isinstance(gpu, str) else gpu
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"utilization: must be a number in (0, 1] (gpu_memory_utilization), got {utilization!r}")
    if max_model_len is None:
        if g.max_position_embeddings is None:
            raise ValueError(f"max_model_len: {g.name} does not state max_position_embeddings; give max_model_len")
        max_model_len = g.max_position_embeddings
    _positive_int("max_model_len", max_model_len)
    _positive_int("block_size", block_size, "a positive integer (vLLM allows 1, 8, 16, 32, 64, 128)")
    for name, value in (("activation_bytes", activation_bytes), ("non_torch_bytes", non_torch_bytes)):
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name}: must be a number of bytes >= 0, got {value!r}")
    dtype = get_kv_dtype(serving_dtype(g) if str(kv_dtype).lower() == "auto" else kv_dtype)
    heads = kv_heads_per_gpu(g, tp)
    total_weights = total_weight_bytes(g, weight_dtype) if weight_bytes is None else float(weight_bytes)
    if total_weights < 0:
        raise ValueError(f"weight_bytes: must be >= 0, got {weight_bytes!r}")
    notes = []
    if not activation_bytes and not non_torch_bytes:
        notes.append(
            "activation peak and non-torch memory not given (0): vLLM measures both at startup, so the real "
            "budget is smaller"
        )
    if g.num_sliding_layers:
        notes.append(
            f"{g.num_sliding_layers} of {g.num_layers} layers use a {g.sliding_window}-token sliding window; the "
            "budget pages them like full attention (vLLM without its hybrid allocator); sequence_bytes() gives "
            "the smaller windowed cache"
        )
    if not g.is_mla and tp > g.num_kv_heads:
        notes.append(f"tp {tp} > {g.num_kv_heads} KV heads: each GPU keeps a replica of one KV head")
    if g.is_mla and tp > 1:
        notes.append("MLA: every GPU keeps the whole latent cache (it has no heads to split)")
    if dtype.scale_bytes:
        notes.append(f"{dtype.name}: {dtype.note}")
    return KVBudget(
        model=g.name,
        gpu=spec.name,
        total_memory=spec.memory_bytes,
        utilization=float(utilization),
        weights=total_weights / tp,
        activation_peak=float(activation_bytes),
        non_torch=float(non_torch_bytes),
        kv_dtype=dtype.name,
        block_size=block_size,
        tp=tp,
        kv_heads_per_gpu=heads,
        bytes_per_token=bytes_per_token(g, dtype, tp),
        max_model_len=max_model_len,
        notes=tuple(notes),
    )


# --- the notebook widget -------------------------------------------------------------------------------------

_BAR_COLORS = {
    "weights": "#7F7F7F",
    "overheads": "#8E6BBF",
    "kv used": "#2C6FBB",
    "kv free": "#A9C8EC",
    "reserved": "#E6E6E6",
    "overflow": "#C0392B",
}


def memory_breakdown(b: KVBudget, context: int, batch: int) -> dict[str, float]:
    """Bytes per GPU of each part of the memory bar for ``batch`` sequences of ``context`` tokens.

    Keys: weights, overheads (activation peak + non-torch), kv used (whole blocks), kv free,
    reserved (1 - utilization), overflow (KV demand beyond the budget).
    """
    blocks = batch * -(-context // b.block_size)
    demand = blocks * b.page_bytes
    usable = b.num_blocks * b.page_bytes  # whole blocks; the rest of kv_memory counts as free but unusable
    used = min(demand, usable)
    return {
        "weights": b.weights,
        "overheads": b.activation_peak + b.non_torch,
        "kv used": used,
        "kv free": max(0.0, b.kv_memory - used),
        "reserved": b.total_memory - b.requested,
        "overflow": max(0.0, demand - usable),
    }


def draw_memory_bar(ax, b: KVBudget, context: int, batch: int) -> None:
    """Draw one GPU's memory as a stacked horizontal bar (GiB) on ``ax``."""
    parts = memory_breakdown(b, context, batch)
    left = 0.0
    for name, value in parts.items():
        if value <= 0:
            continue
        hatch = "//" if name == "overflow" else None
        ax.barh([0], [value / GiB], left=left, color=_BAR_COLORS[name], hatch=hatch, edgecolor="white", label=name)
        left += value / GiB
    ax.axvline(b.total_memory / GiB, color="black", linewidth=1)
    fits = b.max_batch(context)
    verdict = "fits" if parts["overflow"] == 0 else "does NOT fit: requests wait or are preempted"
    ax.set_title(
        f"{b.model} on {b.gpu}, KV {b.kv_dtype}: {batch} x {context:,} tokens {verdict}\n"
        f"at most {fits:,} sequences of {context:,} tokens; {b.max_concurrency:,.1f}x at max_model_len "
        f"{b.max_model_len:,}",
        fontsize=10,
    )
    ax.set_xlabel("GPU memory (GiB)")
    ax.set_yticks([])
    ax.set_xlim(0, max(b.total_memory, left * GiB) / GiB * 1.02)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=6, fontsize=8)


def explorer(
    model: Any = "Llama-3-8B",
    gpus: tuple[str, ...] = ("T4", "L4", "A10G", "A100-40GB", "A100-80GB", "H100-SXM", "H200-SXM"),
    dtypes: tuple[str, ...] = ("bf16", "fp16", "fp8", "int8", "int4", "fp32"),
    *,
    context: int = 4096,
    batch: int = 8,
    gpu: str = "H100-SXM",
    kv_dtype: str = "bf16",
    utilization: float = 0.9,
    tp: int = 1,
    max_context: int = 131072,
    max_batch: int = 256,
    interactive: bool | None = None,
    **budget_kwargs: Any,
):
    """Sliders for context, batch, KV dtype and GPU that redraw the memory bar and the concurrency.

    With ipywidgets and ``interactive`` not False, returns the widget (leave it as a cell's last
    value to display it). Without ipywidgets, or with ``interactive=False`` (tests, autograding),
    draws the chart once for the given values and returns the :class:`KVBudget` instead.
    """
    import matplotlib.pyplot as plt

    from course.plotting import use_course_style

    g = get_model(model)
    unknown = [name for name in gpus if name not in GPUS]
    if unknown:
        raise ValueError(f"gpus: unknown {unknown}; allowed: {', '.join(GPUS)}")
    for name in dtypes:
        get_kv_dtype(name)

    def render(context: int, batch: int, kv_dtype: str, gpu: str) -> KVBudget:
        b = budget(g, gpu, utilization=utilization, kv_dtype=kv_dtype, tp=tp, **budget_kwargs)
        use_course_style()
        fig, ax = plt.subplots(figsize=(8, 2.4))
        draw_memory_bar(ax, b, context, batch)
        fig.tight_layout()
        plt.show()
        return b

    def redraw(context: int, batch: int, kv_dtype: str, gpu: str) -> None:
        render(context, batch, kv_dtype, gpu)

    widgets = None
    if interactive is not False:
        try:
            import ipywidgets as widgets
        except ImportError:
            if interactive:
                raise
            print("ipywidgets is not installed: drawing a static chart (pip install ipywidgets for sliders).")
    if widgets is None:
        return render(context, batch, kv_dtype, gpu)
    return widgets.interactive(
        redraw,
        context=widgets.IntSlider(value=context, min=256, max=max_context, step=256, description="context"),
        batch=widgets.IntSlider(value=batch, min=1, max=max_batch, description="batch"),
        kv_dtype=widgets.Dropdown(options=list(dtypes), value=kv_dtype, description="KV dtype"),
        gpu=widgets.Dropdown(options=list(gpus), value=gpu, description="GPU"),
    )


def describe(geometry: ModelGeometry) -> str:
    """One line: layers, heads, head_dim, attention kind, windows, parameters."""
    g = geometry
    parts = [f"{g.num_layers} layers", f"{g.num_query_heads} query / {g.num_kv_heads} KV heads ({g.attention})"]
    parts.append(f"head_dim {g.head_dim}")
    if g.is_mla:
        parts.append(f"MLA latent {g.kv_lora_rank} + rope {g.qk_rope_head_dim}")
    if g.num_sliding_layers:
        parts.append(f"{g.num_sliding_layers} sliding-window layers (window {g.sliding_window})")
    if g.num_params:
        parts.append(f"{g.num_params / 1e9:,.2f} B params")
    return f"{g.name}: " + ", ".join(parts)


# The catalogue as geometries, by name (loaded at import: a small JSON file).
MODELS: dict[str, ModelGeometry] = _models()


# --- the command line (`course kv`) ----------------------------------------------------------------------


def add_cli_arguments(parser) -> None:
    """The options of ``course kv`` (an argparse parser)."""
    parser.add_argument("model", nargs="?", help="a catalogue model name (see --list) or a config.json file/folder")
    parser.add_argument("--gpu", default="H100-SXM", help=f"one of {', '.join(GPUS)} (default H100-SXM)")
    parser.add_argument("--utilization", type=float, default=0.9, help="gpu_memory_utilization (default 0.9)")
    parser.add_argument("--max-model-len", type=int, help="longest request (default: the model's context)")
    parser.add_argument(
        "--kv-dtype", default="auto", help=f"auto (the model's dtype) or one of {', '.join(KV_DTYPES)} (default auto)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (default 1)")
    parser.add_argument("--block-size", type=int, default=VLLM_BLOCK_SIZE, help="tokens per KV block (default 16)")
    parser.add_argument("--weight-dtype", help=f"dtype of the served weights: {', '.join(_WEIGHT_BYTES)}")
    parser.add_argument("--weights-gib", type=float, help="total weight memory in GiB (overrides the parameter count)")
    parser.add_argument("--activation-gib", type=float, default=0.0, help="peak activation memory per GPU, GiB")
    parser.add_argument("--non-torch-gib", type=float, default=0.0, help="memory outside PyTorch per GPU, GiB")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 128], help="batches for max context")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--list", action="store_true", help="list the catalogue models and GPUs")


def run_cli(args) -> int:
    """Carry out ``course kv`` with parsed ``args``; raises ValueError on bad input."""
    if args.list:
        if args.json:
            print(json.dumps({"models": list(_catalogue()), "gpus": list(GPUS)}, indent=1))
            return 0
        print("models:")
        for entry in _catalogue().values():
            print(f"  {describe(entry.geometry)}")
        print("GPUs:")
        for spec in GPUS.values():
            print(f"  {spec.name:10s} {spec.memory_bytes / 1e9:5.0f} GB {spec.bandwidth / 1e9:6.0f} GB/s")
        return 0
    if not args.model:
        raise ValueError("model: give a catalogue model name or a config.json path (course kv --list shows them)")
    g = get_model(args.model)
    b = budget(
        g,
        args.gpu,
        utilization=args.utilization,
        max_model_len=args.max_model_len,
        kv_dtype=args.kv_dtype,
        block_size=args.block_size,
        tp=args.tp,
        weight_dtype=args.weight_dtype,
        weight_bytes=None if args.weights_gib is None else args.weights_gib * GiB,
        activation_bytes=args.activation_gib * GiB,
        non_torch_bytes=args.non_torch_gib * GiB,
    )
    batches = tuple(_positive_int("batch", batch) for batch in args.batch)
    if args.json:
        data = {"model": describe(g), "source": g.source, **b.to_dict()}
        data["max_context_at_batch"] = {str(batch): b.max_context(batch) for batch in batches}
        print(json.dumps(data, indent=1))
    else:
        print(describe(g))
        print(b.table(batches))
    return 0
