"""More than one GPU per replica: tensor parallelism (TP) and pipeline parallelism (PP), as vLLM does them.

**Tensor parallelism** (``--tensor-parallel-size``, Megatron-LM's layout: Shoeybi et al. 2019,
arXiv:1909.08053, section 3) cuts every layer's matrices across ``tp`` GPUs: each GPU holds
``1/tp`` of the weights and computes ``1/tp`` of the FLOPs, the query heads are dealt out evenly
(``tp`` must divide them), the KV heads too while there are enough, and each GPU keeps one replica of
a KV head when ``tp`` is larger than the KV heads (:func:`course.kv.sizes.kv_heads_per_gpu`). MLA
(DeepSeek-V2/V3) caches one latent per token that every GPU keeps whole. The price is two
all-reduces per layer, after the attention output projection and after the MLP (Megatron's ``g``
operator), each of ``tokens x hidden`` activations, over the interconnect
(:func:`course.hardware.interconnect`).

**Pipeline parallelism** (``--pipeline-parallel-size``) gives each of ``pp`` stages a contiguous slice
of the layers (vLLM's split: ``vllm/distributed/utils.py``, ``get_pp_indices``: the remainder goes to
the stages before the last), and sends the hidden states from stage to stage. vLLM keeps ``pp``
batches in flight to fill the pipeline, one more with async scheduling under its V2 model runner (the GPU
default in 0.32: the next batch is scheduled while the others run; ``vllm/config/vllm.py``,
``max_concurrent_batches``; :func:`batches_in_flight`).

The simulator's engine runs one batch per step, so PP is modelled **analytically** here: one simulated
step is one *round* of the pipeline, in which every running request advances once. The step's work is
cut into ``k = min(pp, requests in the step)`` equal micro-batches; a round lasts ``pp`` stage slots,
each the time one stage takes for one micro-batch (its share of the layers and of the weights on each
GPU, plus its all-reduces), plus the ``pp - 1`` hops of the activations between stages. With ``k <
pp`` the pipeline is partly empty: a share ``1 - k/pp`` of the stage slots is the **bubble**. Each
scheduled batch has its own token budget in vLLM, so :func:`pipeline_config` gives a round ``pp`` times
the budget. What this leaves out (and an engine change would add): micro-batches of unequal size, a
request that finishes in the middle of a round, and the scheduler running ahead of the pipeline.

**A mixture of experts** computes each token through its active parameters only and reads the experts
its step's tokens were routed to (:class:`course.roofline.MoeLayout`); a shard keeps that rule
(:func:`shard_moe_layout`). Under TP, vLLM cuts every expert like a dense MLP unless
``--enable-expert-parallel`` is given: each rank holds ``1/tp`` of every expert's intermediate size
(``vllm/model_executor/layers/fused_moe/config.py``: ``FusedMoEParallelConfig.make`` turns expert
parallelism on only with ``enable_expert_parallel``, and ``FusedMoEConfig`` sets
``intermediate_size_per_partition = intermediate_size // tp_size``), so a rank computes and reads
``1/tp`` of the same experts as the whole model. A pipeline stage holds its own layers' experts (the
dense layers DeepSeek-V3 starts with sit on the first stage) and a share of the dense part by layers.
Expert parallelism (whole experts per rank, tokens sent to them in all-to-alls, and the load imbalance
of hot experts) is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from course import hardware
from course.geometry import ModelGeometry
from course.hardware import HardwareSpec, Interconnect
from course.kv.sizes import kv_heads_per_gpu
from course.roofline import MoeLayout, moe_layout
from course.sim.config import SimConfig
from course.sim.cost import RooflineCost

# Two all-reduces per transformer layer in Megatron-LM's tensor-parallel layer (arXiv:1909.08053,
# figure 3: one after self-attention, one after the MLP); vLLM's RowParallelLinear does the same
# (vllm/model_executor/layers/linear.py, ``reduce_results``).
ALL_REDUCES_PER_LAYER = 2
MAX_TP = 64  # the largest group :func:`smallest_tp` tries (8 servers of 8 GPUs)


def pp_layer_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers of each pipeline stage, as vLLM 0.32 splits them (``get_pp_indices``).

    ``num_layers // pp`` each; the remainder goes one layer each to the stages before the last
    (the last stage also holds the final norm and the LM head).
    """
    if not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp: the pipeline-parallel size must be a positive integer, got {pp!r}")
    if pp > num_layers:
        raise ValueError(f"pp: {pp} stages for {num_layers} layers leaves a stage without a layer")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        parts[-i] += 1
    return tuple(parts)


def stage_span(num_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """(first layer, layers) of pipeline stage ``stage`` (0-based) of ``pp`` (:func:`pp_layer_partition`)."""
    parts = pp_layer_partition(num_layers, pp)
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    return sum(parts[:stage]), parts[stage]


def stage_geometry(g: ModelGeometry, pp: int, stage: int) -> ModelGeometry:
    """The layers of pipeline stage ``stage`` (0-based) as a model of its own (all TP ranks together).

    Its parameter count is the stage's: its layers' share of the body, plus the input embedding on
    the first stage and the LM head on the last (vLLM gives the last stage its own copy of a tied head).
    A mixture of experts' routed experts are counted where they are (DeepSeek-V3's first three layers
    have none); the rest of its body is shared by layers.
    """
    start, layers = stage_span(g.num_layers, pp, stage)
    if pp == 1:
        return g
    params = None
    if g.num_params is not None:
        routed = _routed_params(g, 0, g.num_layers)
        params = (g.body_params - routed) * layers / g.num_layers + _routed_params(g, start, start + layers)
        params += g.lm_head_params * ((stage == 0) + (stage == pp - 1))
        params = int(round(params))
    layer_types = g.layer_types[start : start + layers] if g.layer_types is not None else None
    return replace(
        g,
        name=f"{g.name} stage {stage + 1}/{pp}",
        num_layers=layers,
        layer_types=layer_types,
        num_params=params,
        source=f"layers {start}-{start + layers - 1} of {g.name}",
    )


def _routed_params(g: ModelGeometry, start: int, stop: int) -> float:
    """Parameters of the routed experts in layers ``start`` to ``stop - 1`` of ``g`` (0 for a dense model)."""
    layout = moe_layout(g)
    if layout is None:
        return 0.0
    return layout.moe_layers_in(start, stop, g.num_layers) * layout.experts * layout.expert_params


def shard_moe_layout(g: ModelGeometry, tp: int = 1, pp: int = 1, stage: int = 0) -> MoeLayout | None:
    """The mixture-of-experts layout of one GPU of stage ``stage`` of a ``tp x pp`` replica of ``g``; None
    for a dense model. Give it to the shard's :class:`RooflineCost` (``moe=``), as :func:`parallel_cost` does.

    The stage's own MoE layers, each GPU holding ``1/tp`` of every expert (vLLM's default, see the
    module docstring); the dense part of :class:`course.roofline.MoeLayout` (attention, dense and
    shared-expert MLPs, norms) shared by layers, with the input embedding on the first stage and the
    LM head on the last, as :func:`stage_geometry` shares the body, and cut in ``tp`` slices too. So
    one token runs ``1/tp`` of its stage's share of the active parameters on each GPU.
    """
    layout = moe_layout(g)
    if layout is None:
        return None
    name = shard_geometry(stage_geometry(g, pp, stage), tp).name  # validates tp, pp and stage
    if tp == pp == 1:
        return layout
    start, layers = stage_span(g.num_layers, pp, stage)
    dense = layout.dense_params
    if pp > 1:
        tables = g.num_params - g.body_params  # the input embedding and the LM head (one table when tied)
        heads = g.lm_head_params * ((stage == 0) + (stage == pp - 1))
        dense = (dense - tables) * layers / g.num_layers + heads
    return layout.part(name, layout.moe_layers_in(start, start + layers, g.num_layers), dense, tp)


def shard_geometry(g: ModelGeometry, tp: int) -> ModelGeometry:
    """What one GPU of a ``tp``-way tensor-parallel group holds of ``g``.

    ``1/tp`` of the parameters and query heads; ``kv_heads_per_gpu`` KV heads (a replica of one head
    when ``tp`` exceeds the KV heads); MLA's latent whole (its size does not depend on heads). The
    hidden size stays whole: it is what the all-reduces carry.
    """
    kv = kv_heads_per_gpu(g, tp)  # validates tp against the heads, as vLLM does
    if tp == 1:
        return g
    q = g.num_query_heads // tp
    return replace(
        g,
        name=f"{g.name} / TP{tp} shard",
        num_query_heads=q,
        num_kv_heads=q if g.is_mla else kv,  # MLA: the latent is cached, the head count only sets FLOPs
        num_params=None if g.num_params is None else int(round(g.num_params / tp)),
        vocab_size=None if g.vocab_size is None else math.ceil(g.vocab_size / tp),
    )


def allreduce_seconds(message_bytes: float, tp: int, link: Interconnect) -> float:
    """One ring all-reduce of ``message_bytes`` (bytes, per GPU) across ``tp`` GPUs (s).

    Each GPU sends and receives ``2 (tp - 1) / tp`` of the message (a reduce-scatter, then an
    all-gather: Patarasuk and Yuan 2009, the bandwidth-optimal all-reduce NCCL's ring implements), at
    the link's one-way bandwidth, after the link's fixed latency. 0 for a single GPU.
    """
    if tp == 1 or message_bytes <= 0:
        return 0.0
    return link.latency + 2 * (tp - 1) / tp * message_bytes / link.bandwidth


def p2p_seconds(message_bytes: float, link: Interconnect) -> float:
    """One point-to-point send of ``message_bytes`` from a stage to the next (s)."""
    return link.latency + message_bytes / link.bandwidth if message_bytes > 0 else 0.0


def pipeline_bubble(micro_batches: int, pp: int) -> float:
    """Share of stage slots idle in a round when only ``micro_batches`` batches fill ``pp`` stages."""
    if pp < 1 or micro_batches < 0:
        raise ValueError(f"pp must be >= 1 and micro_batches >= 0, got {pp}, {micro_batches}")
    return max(0.0, 1.0 - min(micro_batches, pp) / pp)


@dataclass(frozen=True)
class StepBreakdown:
    """Where one simulated step's time goes (s): compute and memory of the stages, all-reduces,
    stage-to-stage hops, and the share of stage slots left idle."""

    seconds: float
    stage_compute: float
    allreduce: float
    p2p: float
    micro_batches: int
    bubble: float


@dataclass(frozen=True)
class ParallelCost:
    """Step time of one replica spread over ``tp x pp`` GPUs; wraps any per-GPU cost model.

    Attributes:
        stage: the cost of the heaviest stage's work on one GPU of its TP group (a :class:`RooflineCost`
            of :func:`shard_geometry` of :func:`stage_geometry`, or any ``step_seconds`` model).
        tp, pp: the group sizes.
        hidden_size: the model width (values per token in an all-reduce and a hop).
        stage_layers: layers of the heaviest stage (all-reduces per stage: 2 per layer).
        tp_link: the link the TP group all-reduces over (None when tp is 1).
        pp_link: the link between stages (None when pp is 1).
        activation_bytes: bytes per activation value (2: bf16/fp16).
    """

    stage: Any
    tp: int
    pp: int
    hidden_size: int
    stage_layers: int
    tp_link: Interconnect | None = None
    pp_link: Interconnect | None = None
    activation_bytes: float = 2.0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "hidden_size", "stage_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tp > 1 and self.tp_link is None:
            raise ValueError("tp > 1 needs tp_link, the interconnect the all-reduces use")
        if self.pp > 1 and self.pp_link is None:
            raise ValueError("pp > 1 needs pp_link, the interconnect between stages")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def breakdown(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0, **extra
    ) -> StepBreakdown:
        """The step's time and its parts (see the module docstring for the round)."""
        requests = decode_tokens + (1 if prefill_tokens else 0)
        k = max(1, min(self.pp, requests))
        # one micro-batch: a k-th of the step's work (whole tokens; the last one may be a little lighter)
        prefill, decode = math.ceil(prefill_tokens / k), math.ceil(decode_tokens / k)
        kv, pairs = math.ceil(kv_tokens_read / k), attention_pairs / k
        tokens = prefill + decode
        compute = self.stage.step_seconds(prefill, decode, kv, pairs, **extra)
        message = tokens * self.hidden_size * self.activation_bytes
        allreduce = (
            ALL_REDUCES_PER_LAYER * self.stage_layers * allreduce_seconds(message, self.tp, self.tp_link)
            if self.tp > 1
            else 0.0
        )
        hops = (self.pp - 1) * p2p_seconds(message, self.pp_link) if self.pp > 1 else 0.0
        seconds = self.pp * (compute + allreduce) + hops
        return StepBreakdown(seconds, self.pp * compute, self.pp * allreduce, hops, k, pipeline_bubble(k, self.pp))

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0, **extra
    ) -> float:
        """Seconds of one step (a pipeline round when pp > 1); the engine's cost interface."""
        return self.breakdown(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs, **extra).seconds

    @property
    def spread_draw(self):
        """The stage cost's step-time spread (:func:`course.sim.cost.spread_draw`), drawn for the whole step."""
        return getattr(self.stage, "spread_draw", None)

    def describe(self) -> str:
        inner = self.stage.describe() if hasattr(self.stage, "describe") else repr(self.stage)
        parts = [f"TP {self.tp}" + (f" over {self.tp_link.name}" if self.tp_link and self.tp > 1 else "")]
        if self.pp > 1:
            parts.append(f"PP {self.pp} over {self.pp_link.name}")
        return f"{' x '.join(parts)} ({self.gpus} GPUs); per GPU: {inner}"


def heaviest_stage_index(g: ModelGeometry, pp: int) -> int:
    """The index of the stage with the most parameters (it sets the pipeline's pace; the first on a tie)."""
    stages = [stage_geometry(g, pp, s) for s in range(pp)]
    return max(range(pp), key=lambda s: (stages[s].num_params or 0, stages[s].num_layers))


def heaviest_stage(g: ModelGeometry, pp: int) -> ModelGeometry:
    """The stage with the most parameters (it sets the pipeline's pace)."""
    return stage_geometry(g, pp, heaviest_stage_index(g, pp))


def parallel_cost(
    geometry: ModelGeometry,
    gpu: HardwareSpec | str,
    tp: int = 1,
    pp: int = 1,
    *,
    interconnect: str | None = None,
    pp_interconnect: str | None = None,
    **roofline: Any,
) -> ParallelCost:
    """A :class:`ParallelCost` over roofline stages: ``geometry`` on ``tp x pp`` GPUs of ``gpu``.

    ``interconnect`` names the TP group's link ("nvlink", "pcie", "network"; default the fastest whose
    domain holds ``tp`` GPUs); ``pp_interconnect`` the stages' link (default: the fastest that holds all
    ``tp x pp`` GPUs, i.e. NVLink inside one server, the network across servers). ``roofline`` goes to
    :class:`course.sim.cost.RooflineCost` (efficiencies, step overhead, bytes per value). A mixture of
    experts' shard runs its share of the active parameters (:func:`shard_moe_layout`).
    """
    spec = hardware.gpu(gpu) if isinstance(gpu, str) else gpu
    index = heaviest_stage_index(geometry, pp)
    stage = stage_geometry(geometry, pp, index)
    shard = shard_geometry(stage, tp)
    tp_link = hardware.interconnect(spec, interconnect, gpus=tp) if tp > 1 else None
    pp_link = hardware.interconnect(spec, pp_interconnect, gpus=tp * pp) if pp > 1 else None
    return ParallelCost(
        RooflineCost(shard, spec, moe=shard_moe_layout(geometry, tp, pp, index), **roofline),
        tp,
        pp,
        geometry.hidden_size,
        stage.num_layers,
        tp_link,
        pp_link,
        activation_bytes=roofline.get("bytes_per_value", 2.0),
    )


def batches_in_flight(pp: int, async_scheduling: bool = True) -> int:
    """Batches vLLM keeps in flight for ``pp`` stages (``max_concurrent_batches``; 0.32's V2 model runner and
    0.34 alike): ``pp`` to fill the pipeline, plus one scheduled ahead with async scheduling (2 for a single
    stage). :func:`course.kv.vllm.max_concurrent_batches` holds the rule, and 0.32's V1 runner's."""
    from course.kv import vllm

    return vllm.max_concurrent_batches(async_scheduling, pp)


def pipeline_config(config: SimConfig, pp: int) -> SimConfig:
    """The simulated round's settings: ``pp`` in-flight batches, each with vLLM's token budget (the batch
    async scheduling keeps ahead is the engine's ``async_scheduling``, not a stage's work)."""
    if pp == 1:
        return config
    return replace(config, max_num_batched_tokens=config.token_budget * pp)


# --- memory: the KV budget per GPU, from course.kv's budget ------------------------------------------


def parallel_budget(model: Any, gpu: HardwareSpec | str = "H100-SXM", tp: int = 1, pp: int = 1, **budget_args: Any):
    """vLLM's KV budget for one GPU of a ``tp x pp`` replica (a :class:`course.kv.budget.KVBudget`).

    Each stage is budgeted by :func:`course.kv.budget` with its own layers and parameters and the TP
    split; vLLM gives every stage the fewest blocks any stage has (the KV-cache configs of the workers
    are unified to the minimum: ``vllm/v1/core/kv_cache_utils.py``, ``get_kv_cache_configs``), so the
    stage with the fewest is returned.
    """
    from course.kv import budget
    from course.kv.catalogue import get_model

    g = get_model(model)
    if pp == 1:
        return budget(g, gpu, tp=tp, **budget_args)
    budgets = [budget(stage_geometry(g, pp, s), gpu, tp=tp, **budget_args) for s in range(pp)]
    return min(budgets, key=lambda b: b.num_blocks)


def valid_tp_sizes(g: ModelGeometry, limit: int = MAX_TP) -> list[int]:
    """TP sizes vLLM accepts for ``g`` up to ``limit``: they divide the query heads, and divide the KV
    heads or are a multiple of them (:func:`course.kv.sizes.kv_heads_per_gpu`)."""
    sizes = []
    for tp in range(1, limit + 1):
        try:
            kv_heads_per_gpu(g, tp)
        except ValueError:
            continue
        sizes.append(tp)
    return sizes


def smallest_tp(
    model: Any, gpu: HardwareSpec | str = "H100-SXM", pp: int = 1, limit: int = MAX_TP, **budget_args: Any
) -> int | None:
    """The smallest TP size at which vLLM would start ``model`` on ``gpu`` (one request of
    ``max_model_len`` fits in the KV cache), or None when none up to ``limit`` does."""
    from course.kv.catalogue import get_model

    g = get_model(model)
    for tp in valid_tp_sizes(g, limit):
        if parallel_budget(g, gpu, tp, pp, **budget_args).fits_one_request:
            return tp
    return None


def does_not_fit_message(
    model: Any, gpu: HardwareSpec | str, tp: int = 1, pp: int = 1, max_model_len: int | None = None, **budget_args
) -> str | None:
    """None when ``model`` starts on ``tp x pp`` GPUs of ``gpu``; else why not and what would fit:
    the smallest TP at this ``max_model_len``, at 8,192 tokens, and on the largest catalogue GPU."""
    from course.kv.catalogue import get_model

    g = get_model(model)
    spec = hardware.gpu(gpu) if isinstance(gpu, str) else gpu
    args = dict(budget_args, max_model_len=max_model_len)
    b = parallel_budget(g, spec, tp, pp, **args)
    if b.fits_one_request:
        return None
    per_request = b.blocks_per_request * b.page_bytes
    where = f"{tp * pp} x {spec.name} (TP {tp}" + (f", PP {pp})" if pp > 1 else ")")
    text = (
        f"{g.name} does not fit on {where} at max_model_len {b.max_model_len:,}: weights take "
        f"{b.weights / 2**30:,.1f} GiB per GPU, {max(b.kv_memory, 0) / 2**30:,.1f} GiB is left for the KV cache "
        f"and one {b.max_model_len:,}-token request needs {per_request / 2**30:,.1f} GiB per GPU."
    )
    best = smallest_tp(g, spec, pp, **args)
    if best is not None:
        text += f" The smallest tensor-parallel size that fits: --tp {best} ({best * pp} GPUs)."
    else:
        text += f" No tensor-parallel size up to {MAX_TP} fits."
    if b.max_model_len > 8192:
        short = smallest_tp(g, spec, pp, **dict(args, max_model_len=8192))
        if short is not None and short != best:
            text += f" With --max-model-len 8192: --tp {short}."
    if best is None:
        biggest = max(hardware.GPUS.values(), key=lambda s: s.memory_bytes)
        other = smallest_tp(g, biggest, pp, **args)
        if other is not None:
            text += f" On {biggest.name}: --gpu {biggest.name} --tp {other}."
    return text


# --- one replica, ready to simulate --------------------------------------------------------------------


class DoesNotFit(ValueError):
    """The model does not start on the GPUs asked for; the message says what would."""


def get_geometry(model: Any) -> ModelGeometry:
    """A catalogue name, config.json path/dict or ModelGeometry as a geometry with a parameter count."""
    from course.kv.catalogue import get_model

    g = get_model(model)
    if g.num_params is None:
        raise ValueError(f"{g.name}: the parameter count is unknown; the cost model and the budget need it")
    return g


def deployment(
    model: Any,
    gpu: HardwareSpec | str = "H100-SXM",
    tp: int = 1,
    pp: int = 1,
    *,
    max_model_len: int | None = None,
    interconnect: str | None = None,
    pp_interconnect: str | None = None,
    roofline: dict | None = None,
    release: str | None = None,
    **scheduler: Any,
) -> tuple[SimConfig, ParallelCost]:
    """One vLLM replica of ``model`` on ``tp x pp`` GPUs: the simulator's settings and cost model.

    The KV blocks are vLLM's budget per GPU (:func:`parallel_budget`, at vLLM 0.32's default
    utilization with the reference startup log's activation peak and non-torch memory, as ``course
    simulate`` budgets one GPU); the scheduler settings are ``vllm serve``'s for the GPU
    (:meth:`SimConfig.vllm_defaults`, overridden by ``scheduler``), with ``pp`` batches' token budget
    per round (:func:`pipeline_config`). Raises :class:`DoesNotFit`, naming the smallest TP that fits,
    when vLLM would not start. ``roofline`` goes to :class:`RooflineCost` (efficiencies, step overhead).
    ``release`` names the vLLM release whose block size and budget apply ("0.34"; default 0.32's,
    :mod:`course.vllm_release`).
    """
    from course.kv import vllm

    g = get_geometry(model)
    spec = hardware.gpu(gpu) if isinstance(gpu, str) else gpu
    release = release or vllm.VLLM_VERSION
    block_size = scheduler.get("block_size", vllm.default_block_size(spec, g.is_mla, release=release))
    budget_args = {
        "max_model_len": max_model_len or scheduler.get("max_model_len") or g.max_position_embeddings or 8192,
        "block_size": block_size,
        "activation_bytes": vllm.REFERENCE_LOG.activation_bytes,
        "non_torch_bytes": vllm.REFERENCE_LOG.non_torch_bytes,
        "release": release,
    }
    b = parallel_budget(g, spec, tp, pp, **budget_args)
    if not b.fits_one_request:
        raise DoesNotFit(does_not_fit_message(g, spec, tp, pp, **budget_args))
    settings = {"num_blocks": b.num_blocks, "block_size": block_size, **scheduler}
    config = pipeline_config(SimConfig.vllm_defaults(spec, **settings), pp)
    cost = parallel_cost(
        g, spec, tp, pp, interconnect=interconnect, pp_interconnect=pp_interconnect, **(roofline or {})
    )
    return config, cost
