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

from dataclasses import dataclass, replace

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


def attention_flops_per_pair(geometry: ModelGeometry) -> float:
    """FLOPs of one (query token, key token) pair of attention over the whole model: Q·K and P·V, 2 per
    head dimension each, in every query head of every layer that attends over the cache (a hybrid's
    linear-attention or Mamba layers keep a constant-size state instead and count none)."""
    g = geometry
    return 4.0 * g.num_attention_layers * g.num_query_heads * g.head_dim


def decode_step_flops_bytes(
    geometry: ModelGeometry,
    batch: int,
    context: int,
    bytes_per_value: float = 2.0,
    *,
    weight_bytes_per_value: float | None = None,
) -> tuple[float, float]:
    """FLOPs and bytes of one decode step of ``batch`` sequences holding ``context`` tokens each.

    FLOPs: 2 per body and LM-head parameter per new token (every decode token is sampled), plus
    attention (Q·K and P·V: 4 · context · heads · head_dim per attention layer per token). Bytes:
    the body and the LM head once per step (shared by the batch), one embedding row per token, and
    every sequence's own KV cache (not shared). A mixture of experts (:data:`MOE_MODELS`) runs only
    its active parameters per token and reads only the experts the batch was routed to
    (:func:`weight_params_read`). ``bytes_per_value``: the KV cache's and the activations' bytes;
    ``weight_bytes_per_value``: the weights' (default the same; 1 for fp8 or int8, 0.5 for int4).
    """
    g = geometry
    wbytes = bytes_per_value if weight_bytes_per_value is None else weight_bytes_per_value
    attention_flops = attention_flops_per_pair(g) * context
    flops = batch * (2.0 * weight_params_read(g, 1) + attention_flops)
    lookup = batch * g.hidden_size * bytes_per_value
    kv = batch * context * g.kv_bytes_per_token(bytes_per_value)
    return flops, weight_params_read(g, batch) * wbytes + lookup + kv


def prefill_flops_bytes(
    geometry: ModelGeometry,
    prompt_tokens: int,
    bytes_per_value: float = 2.0,
    *,
    weight_bytes_per_value: float | None = None,
) -> tuple[float, float]:
    """FLOPs and bytes of prefilling one prompt (causal attention: each token sees half the prompt on average).

    The body runs on every prompt token, the LM head once (the last position's logits, the first
    output token); the embedding is read one row per token. A mixture of experts runs its active
    parameters per token and reads every expert its prompt was routed to (all of them, for a long
    prompt). Bytes per value as in :func:`decode_step_flops_bytes`.
    """
    g = geometry
    wbytes = bytes_per_value if weight_bytes_per_value is None else weight_bytes_per_value
    body, head = _weights(g)
    if (layout := moe_layout(g)) is not None:
        body = weight_params_read(g, 1) - head  # the active body: dense part and top-k experts
    attention_flops = attention_flops_per_pair(g) * prompt_tokens * prompt_tokens / 2
    flops = 2.0 * body * prompt_tokens + 2.0 * head + attention_flops
    lookup = prompt_tokens * g.hidden_size * bytes_per_value
    weights = weight_params_read(g, prompt_tokens) if layout is not None else body + head
    return flops, weights * wbytes + lookup + prompt_tokens * g.kv_bytes_per_token(bytes_per_value)


# --- the weights a step reads: dtype and mixture of experts ---------------------------------------

# Bytes one stored weight takes, by the dtype the weights are served in. fp8 (DeepSeek-V3 publishes
# its weights in fp8: its config's quantization_config) and int8 take one byte, int4 half of one; the
# per-channel or per-group scales that quantized formats keep beside the weights are left out (one
# fp32 scale per 4,096-value row is 0.1 % more).
WEIGHT_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


def weight_bytes_per_param(dtype: str) -> float:
    """Bytes per stored weight for ``dtype`` (a :data:`WEIGHT_BYTES_PER_PARAM` key)."""
    try:
        return WEIGHT_BYTES_PER_PARAM[dtype]
    except KeyError:
        raise ValueError(f"weight dtype {dtype!r}: choose one of {', '.join(WEIGHT_BYTES_PER_PARAM)}") from None


@dataclass(frozen=True)
class MoeLayout:
    """How a mixture-of-experts model spends its parameters: a dense part every token runs, and
    routed experts of which each token runs ``experts_per_token`` per MoE layer.

    Attributes:
        name: the catalogue name (:mod:`course.kv.catalogue`).
        moe_layers: layers whose MLP is a set of routed experts.
        experts: routed experts per MoE layer.
        experts_per_token: routed experts each token runs per MoE layer (top-k).
        expert_params: parameters of one routed expert (gate, up and down projections).
        active_params: parameters one token runs, as the model card counts them (dense part, shared
            experts and its top-k routed experts). The course's one count of them: a token computes
            through these (2 FLOPs each) and a step of one token reads them (:meth:`params_read`).
        total_params: every parameter, as the model card counts them.
        source: where the numbers come from.
    """

    name: str
    moe_layers: int
    experts: int
    experts_per_token: int
    expert_params: float
    active_params: float
    total_params: float
    source: str

    @property
    def dense_params(self) -> float:
        """Parameters every token runs whatever the routing: attention, dense and shared-expert MLPs,
        norms, router, embeddings."""
        return self.active_params - self.moe_layers * self.experts_per_token * self.expert_params

    def experts_read(self, tokens: float) -> float:
        """Expected distinct routed experts a step of ``tokens`` tokens reads per MoE layer.

        Each token picks ``experts_per_token`` of ``experts``; with routing spread evenly and
        independently over the tokens, an expert is left unread with probability (1 - k/E)^tokens,
        so a step reads E (1 - (1 - k/E)^tokens) of them: k at one token, all E for a large batch or
        a prefill. Real routers are not uniform (a few experts are hot), which makes this an upper
        bound on the distinct experts of a small batch.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        return self.experts * (1.0 - (1.0 - self.experts_per_token / self.experts) ** tokens)

    def params_read(self, tokens: float) -> float:
        """Parameters a step of ``tokens`` tokens reads: the dense part once, plus the experts it touches
        (at one token, :attr:`active_params`)."""
        return self.dense_params + self.moe_layers * self.experts_read(tokens) * self.expert_params

    def moe_layers_in(self, start: int, stop: int, num_layers: int) -> int:
        """MoE layers among layers ``start`` to ``stop - 1`` of a model of ``num_layers`` layers.

        The dense layers come first: DeepSeek-V3's first three (``first_k_dense_replace``); the other
        catalogue models route in every layer.
        """
        return max(0, stop - max(start, num_layers - self.moe_layers))

    def part(self, name: str, moe_layers: int, dense_params: float, tp: int = 1) -> MoeLayout:
        """A part of the model as a layout of its own: ``moe_layers`` of its MoE layers and ``dense_params``
        of its dense part, every weight cut in ``tp`` slices (a pipeline stage, one GPU of a
        tensor-parallel group: see :mod:`course.sim.parallel`). Its active and total counts are the
        part's own; one token still runs ``experts_per_token`` experts of ``experts`` per layer."""
        expert, dense = self.expert_params / tp, dense_params / tp
        return replace(
            self,
            name=name,
            moe_layers=moe_layers,
            expert_params=expert,
            active_params=dense + moe_layers * self.experts_per_token * expert,
            total_params=dense + moe_layers * self.experts * expert,
            source=f"{name}, a part of {self.name}: {self.source}",
        )


def _expert(hidden: int, ffn: int) -> int:
    return 3 * hidden * ffn  # gate, up and down projections of a SwiGLU expert, no biases


# The four MoE models of the catalogue. Layer, expert and size fields from each config.json (the same
# values are transformers' defaults in configuration_<family>.py); totals and active counts from
# the model cards and papers, where a learner can check them: DeepSeek-V3's 37 B active of 671 B in
# its technical report's abstract (arXiv:2412.19437), Mixtral-8x7B's 12.9 B of 46.7 B in Mistral AI's
# announcement (the paper's abstract, arXiv:2401.04088, rounds them to 13 B of 47 B). The dense part is
# derived (active minus the top-k experts); tests/test_hardware_geometry_roofline.py checks that it
# plus every expert adds up to the published total, and that the catalogue's parameter count less the
# experts a token skips lands within 2 % of the published active count (Mixtral, DeepSeek-V3).
MOE_MODELS: dict[str, MoeLayout] = {
    layout.name: layout
    for layout in [
        MoeLayout(
            "Mixtral-8x7B", 32, 8, 2, _expert(4096, 14336), 12.9e9, 46.7e9,
            "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (32 layers, num_local_experts "
            "8, num_experts_per_tok 2, intermediate_size 14336); 46.7B total, 12.9B active: Mistral AI, "
            "'Mixtral of experts', https://mistral.ai/news/mixtral-of-experts and arXiv 2401.04088",
        ),
        MoeLayout(
            "DeepSeek-V3", 58, 256, 8, _expert(7168, 2048), 37e9, 671e9,
            "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (61 layers, first_k_dense_replace 3, "
            "n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, moe_intermediate_size 2048); "
            "671B total, 37B activated per token: DeepSeek-V3 technical report, arXiv 2412.19437",
        ),
        MoeLayout(
            "Qwen3-Next-80B-A3B", 48, 512, 10, _expert(2048, 512), 3e9, 80e9,
            "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json (48 layers, "
            "decoder_sparse_step 1, num_experts 512, num_experts_per_tok 10, moe_intermediate_size 512, one shared "
            "expert); 80B total, 3B activated: the model card",
        ),
        MoeLayout(
            "Llama-4-Scout", 48, 16, 1, _expert(5120, 8192), 17e9, 109e9,
            "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json (text_config: 48 "
            "layers, interleave_moe_layer_step 1, num_local_experts 16, num_experts_per_tok 1, intermediate_size 8192, "
            "one shared expert); 17B active, 109B total (the vision encoder included): the model card",
        ),
    ]
}  # fmt: skip


def moe_layout(geometry: ModelGeometry | str) -> MoeLayout | None:
    """The MoE layout of a catalogue model (by geometry or name), None for a dense model."""
    name = geometry if isinstance(geometry, str) else geometry.name
    return MOE_MODELS.get(name)


def weight_params_read(geometry: ModelGeometry, tokens: float) -> float:
    """Parameters a step of ``tokens`` tokens (a decode batch, or a prefill's prompt) must read.

    A dense model reads every matmul weight once (the body and the LM head; the input embedding is a
    table lookup, see :func:`decode_step_flops_bytes`). A mixture of experts reads its dense part and
    only the experts its tokens were routed to: the active parameters at one token, and more of the
    experts as the batch grows (:meth:`MoeLayout.experts_read`), all of them for a long prefill.
    """
    body, head = _weights(geometry)
    layout = moe_layout(geometry)
    if layout is None:
        return body + head
    embedding = geometry.num_params - body - head  # the input table, when it is not the LM head too
    return layout.params_read(tokens) - embedding


def moe_decode_bytes(geometry: ModelGeometry, batch: int, weight_dtype: str = "bf16") -> float:
    """Weight bytes one decode step of ``batch`` sequences reads (dense or MoE), in ``weight_dtype``."""
    return weight_params_read(geometry, batch) * weight_bytes_per_param(weight_dtype)
