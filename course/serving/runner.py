"""The model runner: one forward pass over the engine's batch (nano-vllm's ``engine/model_runner.py``).

Two runners share one interface, ``runner(input_ids, cache, attention_mask=, position_ids=)``
returning ``(logits of the last position (rows, 1, vocab), cache)``, plus ``new_cache()`` and
``cache_from(layers)``, a cache that already holds given keys and values (a prefix-cache hit:
:mod:`course.serving.prefix_cache`), on which a forward pass then prefills the rest of a prompt:

* :class:`TransformersRunner` calls the ``transformers`` model itself. It serves every causal LM.
* :class:`LlamaRunner` runs Llama-family decoders (``llama``, ``qwen2``) itself, reading the
  same weights. It makes the same choices as vLLM's model code (``vllm/model_executor/models/llama.py``,
  v0.11): the q, k and v projections fused into one matrix (``QKVParallelLinear``), gate and up
  fused into another (``MergedColumnParallelLinear``), and one fused RMSNorm op. Its KV cache
  appends into spare room, where ``transformers``' dynamic cache copies every layer at every step
  (``torch.cat``). For a small model the per-step cost is mostly Python and operator launches, not
  arithmetic: on the course's 2-core CPU this cut the tiny model's decode step by about a third at
  batch 1 and at batch 16 (``benchmarks/serving.py`` prints both runners' raw step side by side).
  ``tests/test_serving_runner.py`` checks that its logits match the ``transformers`` forward pass.

:func:`runner_for` picks the fast runner when it can serve the model, else the general one.

On a CPU, :class:`LlamaRunner` multiplies with oneDNN's linear on weights reordered once into its
blocked layout (:data:`course.kernels.PACKED`), as vLLM's CPU build does (``vllm/model_executor/layers/
utils.py``: ``dispatch_cpu_unquantized_gemm`` in 0.32.0): PyTorch's stock ``F.linear`` hands a batch of
2-16 rows to a kernel that reads the weights several times, so a batched decode step of a model whose
weights outgrow the cache grew with the batch (module 1 shows it; ``benchmarks/serving.py --peers
--model 170m`` measures the server against vLLM). ``COURSE_LINEAR_KERNEL=stock`` forces the stock path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from course.forward_observers import forward_observers, observe_forward  # noqa: F401  (a name of this module too)
from course.kernels import PACKED, STOCK
from course.models import forward, new_cache

__all__ = ["KVCache", "LlamaRunner", "TransformersRunner", "runner_for"]

# Architectures LlamaRunner computes exactly as transformers does (checked by the runner tests).
LLAMA_FAMILY = ("llama", "qwen2")


class TransformersRunner:
    """The general runner: the ``transformers`` model's own forward pass and dynamic cache."""

    name = "transformers"

    def __init__(self, model: Any) -> None:
        import inspect

        self.model = model
        accepts = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        self._logits_kw = {"logits_to_keep": 1} if accepts else {}
        # With SDPA attention a ready 4D boolean mask skips transformers' per-step mask building.
        self.mask_4d = getattr(model.config, "_attn_implementation", None) == "sdpa"

    def new_cache(self) -> Any:
        return new_cache(self.model)

    @property
    def prefix_reuse_unsupported(self) -> str | None:
        """None when a prompt's cached keys and values can be reused as they are, else why not:
        only a cache whose layers keep every token (``DynamicLayer``) can; a sliding-window layer
        keeps the last window only."""
        kinds = {type(layer).__name__ for layer in self.new_cache().layers}
        if kinds - {"DynamicLayer"}:
            return f"the model's cache has {', '.join(sorted(kinds - {'DynamicLayer'}))} layers"
        return None

    def cache_from(self, layers: list[tuple[Any, Any]]) -> Any:
        """A new cache holding ``layers[i] = (keys, values)``, each ``(rows, kv_heads, T, head_dim)``."""
        cache = self.new_cache()
        for index, (keys, values) in enumerate(layers):
            cache.update(keys, values, index)
        return cache

    def __call__(self, input_ids, cache, attention_mask=None, position_ids=None):
        kwargs = dict(self._logits_kw)
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        logits, cache = forward(self.model, input_ids, cache, **kwargs)
        return logits[:, -1:], cache


@dataclass
class KVLayer:
    """One layer's keys and values, ``(rows, kv_heads, T, head_dim)``, with room to grow along T.

    ``keys``/``values`` may be replaced from outside (the batch cache joins and drops rows); the
    next :meth:`append` then starts a new buffer. Otherwise appending writes in place: amortised
    O(new tokens), where a concatenation copies all T tokens at every step.
    """

    keys: Any = None
    values: Any = None
    _key_buffer: Any = field(default=None, repr=False)
    _value_buffer: Any = field(default=None, repr=False)
    _view: Any = field(default=None, repr=False)  # the ``keys`` this layer last handed out

    @staticmethod
    def room_for(length: int) -> int:
        """The buffer length that holds ``length`` tokens and room to grow (by half)."""
        return length + max(16, length // 2)  # a request's decode allocates O(log T) times

    def adopt(self, key_buffer, value_buffer, length: int) -> None:
        """Take ``(rows, kv_heads, room, head_dim)`` buffers whose first ``length`` positions hold
        the keys and values (the batch cache builds them when rows join): the next appends write
        into their spare room instead of copying everything into a new buffer."""
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self.keys = self._view = key_buffer[:, :, :length]
        self.values = value_buffer[:, :, :length]

    def append(self, keys, values) -> tuple[Any, Any]:
        """Add ``(rows, kv_heads, new, head_dim)`` keys and values; returns all of them."""
        if self.keys is None:
            self.keys, self.values = keys, values
            return keys, values
        old = self.keys.shape[-2]
        end = old + keys.shape[-2]
        if self.keys is not self._view or end > self._key_buffer.shape[-2]:
            rows, heads, _, dim = self.keys.shape
            room = self.room_for(end)
            self._key_buffer = self.keys.new_empty((rows, heads, room, dim))
            self._value_buffer = self.values.new_empty((rows, heads, room, dim))
            self._key_buffer[:, :, :old] = self.keys
            self._value_buffer[:, :, :old] = self.values
        self._key_buffer[:, :, old:end] = keys
        self._value_buffer[:, :, old:end] = values
        self.keys = self._view = self._key_buffer[:, :, :end]
        self.values = self._value_buffer[:, :, :end]
        return self.keys, self.values


@dataclass
class KVCache:
    """The runner's cache: ``layers[i].keys`` / ``.values`` as in a ``transformers`` dynamic cache."""

    layers: list[KVLayer]


@dataclass
class _Layer:
    """One decoder layer's weights, fused as vLLM fuses them (views of the model's own parameters)."""

    input_norm: Any
    qkv: Callable  # hidden -> q + 2 kv
    out: Callable  # heads x head_dim -> hidden
    post_norm: Any
    gate_up: Callable  # hidden -> 2 intermediate
    down: Callable  # intermediate -> hidden
    intermediate: int


class LlamaRunner:
    """A Llama-family forward pass over a ``transformers`` model's weights (see the module docstring).

    The fused q/k/v and gate/up matrices are copies made once, when the runner is built (about 0.7x
    the model's non-embedding weights again); the packed kernel path adds a reordered copy of every
    linear weight and the output head (about the model's weights again, the tied embedding included).
    The model itself is left untouched (still savable with ``save_pretrained``).
    """

    name = "llama"
    mask_4d = False  # it takes the 2D padding mask

    def __init__(self, model: Any) -> None:
        import torch

        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"LlamaRunner cannot run this model: {reason}")
        config = model.config
        self.model = model
        self._observers = forward_observers(model)  # shared: observers added later are seen
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb  # transformers' own: every rope type, scaling included
        self.final_norm = inner.norm.weight
        self.kernel = linear_kernel(model)
        self.layers = []
        linear = _LINEAR_KERNELS[self.kernel]
        with torch.no_grad():
            self.lm_head = linear(model.lm_head.weight, None)
            for layer in inner.layers:
                attn, mlp = layer.self_attn, layer.mlp
                self.layers.append(
                    _Layer(
                        input_norm=layer.input_layernorm.weight,
                        qkv=linear(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj])),
                        out=linear(attn.o_proj.weight, attn.o_proj.bias),
                        post_norm=layer.post_attention_layernorm.weight,
                        gate_up=linear(*_fuse([mlp.gate_proj, mlp.up_proj])),
                        down=linear(mlp.down_proj.weight, None),
                        intermediate=mlp.gate_proj.weight.shape[0],
                    )
                )
        # The kernel a decode step of one sequence takes: measured, since the host decides it.
        self.one_row = STOCK
        if self.kernel == PACKED:
            linears = [
                self.lm_head,
                *(f for layer in self.layers for f in (layer.qkv, layer.out, layer.gate_up, layer.down)),
            ]
            self.one_row = one_row_kernel(linears)
            for packed_linear in linears:
                packed_linear.one_row_plain = self.one_row == STOCK

    prefix_reuse_unsupported = None  # every layer keeps every token

    def new_cache(self) -> KVCache:
        return KVCache([KVLayer() for _ in self.layers])

    def cache_from(self, layers: list[tuple[Any, Any]]) -> KVCache:
        """A new cache holding ``layers[i] = (keys, values)``, each ``(rows, kv_heads, T, head_dim)``
        (the first append copies them into a buffer with room to grow)."""
        return KVCache([KVLayer(keys, values) for keys, values in layers])

    def __call__(self, input_ids, cache: KVCache, attention_mask=None, position_ids=None):
        """input_ids: (rows, new) token ids; attention_mask: (rows, past + new), 1 where a real
        token is (None: no padding); position_ids: (rows, new) (None: past, past + 1, ...).
        Returns the last position's logits (rows, 1, vocab) and the grown cache."""
        import torch
        import torch.nn.functional as F

        for observe in self._observers:
            observe(input_ids)
        rows, new = input_ids.shape
        past = 0 if cache.layers[0].keys is None else cache.layers[0].keys.shape[-2]
        if position_ids is None:
            position_ids = torch.arange(past, past + new, device=input_ids.device).expand(rows, new)
        x = F.embedding(input_ids, self.embed)
        cos, sin = self.rotary(x, position_ids)  # (rows, new, head_dim)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        mask = _attention_mask(attention_mask, rows, new, past + new, x.device)
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        for layer, layer_cache in zip(self.layers, cache.layers):
            h = _rms_norm(x, layer.input_norm, self.eps)
            q, k, v = layer.qkv(h).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
            q = _rotate(q.view(rows, new, heads, dim).transpose(1, 2), cos, sin)
            k = _rotate(k.view(rows, new, kv_heads, dim).transpose(1, 2), cos, sin)
            k, v = layer_cache.append(k, v.view(rows, new, kv_heads, dim).transpose(1, 2))
            x = x + layer.out(_attend(q, k, v, mask, new, kv_heads))
            gate, up = layer.gate_up(_rms_norm(x, layer.post_norm, self.eps)).split(layer.intermediate, -1)
            x = x + layer.down(F.silu(gate) * up)
        logits = self.lm_head(_rms_norm(x[:, -1:], self.final_norm, self.eps))
        return logits, cache


def _stock_linear(weight, bias) -> Callable:
    """``x -> x @ weight.T + bias`` with ``torch.nn.functional.linear`` on the plain weight."""
    import torch.nn.functional as F

    return lambda x: F.linear(x, weight, bias)


class _PackedLinear:
    """``x -> x @ weight.T + bias`` with oneDNN's linear on the weight reordered once into its blocked
    layout; a single row goes to ``F.linear`` on the plain weight instead while ``one_row_plain`` is set
    (:func:`one_row_kernel` measures which is faster on this host)."""

    def __init__(self, weight, bias) -> None:
        from course.kernels import packed_linear

        self.weight, self.bias = weight, bias
        self._packed = packed_linear(weight, bias)
        self.one_row_plain = False

    def plain_product(self, x):
        import torch.nn.functional as F

        return F.linear(x, self.weight, self.bias)

    def packed_product(self, x):
        return self._packed(x)

    def __call__(self, x):
        if self.one_row_plain and x.numel() == x.shape[-1]:
            return self.plain_product(x)
        return self.packed_product(x)


# Alternated rounds of :func:`one_row_kernel`; the median of each side's totals decides.
ONE_ROW_ROUNDS = 5


def one_row_kernel(linears: list[_PackedLinear], rounds: int = ONE_ROW_ROUNDS) -> str:
    """Which kernel multiplies a single row (a decode step of one sequence) faster on this host:
    :data:`STOCK` (``F.linear`` on the plain weight: PyTorch's matrix-vector kernel) or :data:`PACKED`.

    ``linears``: the runner's linear layers. Every round times one row through all of them on each
    kernel, alternating so that the machine's drift falls on both; the faster median wins. Measured
    because the answer is the host's, not the model's: the 170 M model's linear layers took 70 ms plain
    against 78 ms packed for one row on the course's 2-core Intel machine (2026-12-02, a whole decode
    step) and 32.5 ms against 19.4 ms on an AMD EPYC one (2026-12-06; one thread, medians of 15). A tiny
    model pays microseconds for the measurement; the 170 M model about 0.3 s at start-up.
    """
    import statistics
    import time

    import torch

    rows = [torch.randn(1, linear.weight.shape[1], dtype=linear.weight.dtype) for linear in linears]
    plain_times, packed_times = [], []
    with torch.no_grad():
        for _ in range(rounds):
            start = time.perf_counter()
            for x, linear in zip(rows, linears):
                linear.plain_product(x)
            middle = time.perf_counter()
            for x, linear in zip(rows, linears):
                linear.packed_product(x)
            plain_times.append(middle - start)
            packed_times.append(time.perf_counter() - middle)
    return STOCK if statistics.median(plain_times) < statistics.median(packed_times) else PACKED


_LINEAR_KERNELS = {STOCK: _stock_linear, PACKED: _PackedLinear}


def linear_kernel(model: Any) -> str:
    """The kernel path :class:`LlamaRunner` takes for ``model``'s linear layers (see the module docstring).

    ``COURSE_LINEAR_KERNEL=stock`` or ``=onednn-packed`` forces one (A/B runs); the packed path is
    refused with the reason when this PyTorch or device cannot run it.
    """
    import os

    from course.kernels import packed_path_available

    wanted = os.environ.get("COURSE_LINEAR_KERNEL", "auto")
    if wanted not in ("auto", *_LINEAR_KERNELS):
        raise ValueError(f"COURSE_LINEAR_KERNEL={wanted!r}: use auto, {STOCK} or {PACKED}")
    reason = packed_path_available(model)
    if wanted == PACKED and reason:
        raise ValueError(f"COURSE_LINEAR_KERNEL={PACKED}: {reason}")
    return STOCK if wanted == STOCK or reason else PACKED


def unsupported_reason(model: Any) -> str | None:
    """None when :class:`LlamaRunner` computes ``model`` exactly as ``transformers`` does, else why not."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in LLAMA_FAMILY:
        return f"model_type {model_type!r} is not one of {', '.join(LLAMA_FAMILY)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the runner implements SiLU)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(config, "mlp_bias", False):
        return "an MLP with biases"
    if getattr(config, "use_sliding_window", False):
        return "sliding-window attention"
    if type(model).__name__ not in ("LlamaForCausalLM", "Qwen2ForCausalLM"):
        return f"{type(model).__name__} is not the stock causal-LM class"
    return None


def runner_for(model: Any, prefer: str = "auto") -> LlamaRunner | TransformersRunner:
    """The runner for ``model``: ``prefer="auto"`` takes :class:`LlamaRunner` where it applies,
    ``"transformers"`` always the general one."""
    if prefer not in ("auto", "transformers"):
        raise ValueError(f"runner must be 'auto' or 'transformers', got {prefer!r}")
    if prefer == "auto" and unsupported_reason(model) is None:
        return LlamaRunner(model)
    return TransformersRunner(model)


# --- the pieces of the forward pass ------------------------------------------------------------


def _fuse(linears: list) -> tuple[Any, Any]:
    """(weight, bias) of the linears stacked on their output side (a zero bias where some have none)."""
    import torch

    weight = torch.cat([lin.weight for lin in linears])
    if all(lin.bias is None for lin in linears):
        return weight, None
    zeros = [lin.weight.new_zeros(lin.weight.shape[0]) for lin in linears]
    bias = torch.cat([lin.bias if lin.bias is not None else zero for lin, zero in zip(linears, zeros)])
    return weight, bias


def _rms_norm(x, weight, eps: float):
    """transformers' Llama RMSNorm: normalise in float32 (whatever the dtype), cast back, then scale."""
    import torch
    import torch.nn.functional as F

    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate(x, cos, sin):
    """Rotary position embedding on (rows, heads, new, head_dim), the rotate-half convention."""
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _attention_mask(padding, rows: int, new: int, total: int, device) -> Any:
    """A boolean SDPA mask, or None when plain causal attention is right.

    padding: (rows, total) with 1 at real tokens, or None. Decode (new == 1): (rows, 1, 1, total).
    Prefill: (rows, 1, new, total), causal and hiding padding; a padding query sees itself so that
    no row is fully masked (which would make SDPA return NaN).
    """
    import torch

    if padding is None:
        return None
    if padding.dim() == 4:  # already an SDPA mask
        return padding.bool()
    visible = padding.bool()[:, None, None, :]
    if new == 1:
        return visible
    query = torch.arange(total - new, total, device=device)[:, None]
    key = torch.arange(total, device=device)[None, :]
    return (visible & (key <= query)) | (key == query)


def _attend(q, k, v, mask, new: int, kv_heads: int):
    """Scaled dot-product attention; returns (rows, new, heads * head_dim)."""
    import torch.nn.functional as F

    rows, heads, _, dim = q.shape
    if new == 1:
        # One query per row: put the query heads that share a KV head side by side as "positions",
        # so attention runs on the KV heads without repeating them (as transformers does).
        grouped = q.reshape(rows, kv_heads, heads // kv_heads, dim)
        return F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).reshape(rows, 1, heads * dim)
    if mask is None and k.shape[-2] == new:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    else:
        if heads != kv_heads:  # masked GQA: repeat the KV heads (the fused kernels need no mask)
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        if mask is None:  # new tokens after a cached past: causal with an offset
            mask = _attention_mask(k.new_ones((rows, k.shape[-2]), dtype=bool), rows, new, k.shape[-2], k.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(rows, new, heads * dim)
