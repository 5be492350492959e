"""vLLM's KV-cache budget for a model on a device, computed the way vLLM 0.32.0 computes it (see :mod:`course.kv.vllm`).

At startup vLLM:

1. checks that ``ceil(gpu_memory_utilization x total)`` is free (``v1/worker/utils.py``, ``request_memory``);
2. loads the weights, profiles one forward pass at ``max_num_batched_tokens`` (the activation peak),
   notes memory outside PyTorch and the CUDA graphs it will capture (``v1/worker/gpu_worker.py``);
3. gives the KV cache ``requested - weights - activation peak - non-torch - CUDA graphs``, or exactly
   ``kv_cache_memory_bytes`` when that is set (on the CPU build: ``VLLM_CPU_KVCACHE_SPACE`` GiB);
4. splits the layers into KV-cache groups and cuts the memory into blocks (``v1/core/kv_cache_utils.py``):
   ``num_blocks = memory // (page_size x layers_per_group)``;
5. logs "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: C x"
   (``get_kv_cache_capacity``): C is the blocks over the blocks one ``max_model_len`` request needs in
   every group (each group's need from its spec's ``max_memory_usage_bytes``: a sliding-window layer
   needs ``min(window - 1 + max_in_flight_tokens, max_model_len)`` tokens plus one block, where
   ``max_in_flight_tokens`` is 2 x ``max_num_batched_tokens`` under async scheduling), and
   N = ``int(C x max_model_len)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from course import hardware
from course.geometry import CHUNKED, FULL, SLIDING, STATE, WITH_STATE, ModelGeometry
from course.hardware import HardwareSpec
from course.kv import vllm
from course.kv.catalogue import get_model
from course.kv.dtypes import WEIGHT_BYTES, KVDtype, get_kv_dtype
from course.kv.sizes import _positive_int, kv_heads_per_gpu, layer_bytes_per_token, state_bytes
from course.sim.blocks import cdiv

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV-cache groups: layers of one kind sharing a block table.

    Attributes:
        kind: "full_attention", "sliding_attention", "chunked_attention" or "linear_attention" (a state).
        layers: real layers in the group (a group with fewer than the group size is padded up to it).
        blocks_per_request: blocks this group needs for one request of ``max_model_len`` tokens.
        window: the sliding window or attention chunk (tokens), if any.
    """

    kind: str
    layers: int
    blocks_per_request: int
    window: int | None = None


def state_pages_per_request(mamba_cache_mode: str) -> int:
    """State pages one request holds per state layer (``MambaSpec.max_memory_usage_bytes``).

    "align" (vLLM's mode for hybrids when prefix caching is on, its default) keeps the running state
    and the one at the last block boundary: 2 pages; "none" keeps 1. Mamba-2 mixers add a prefill
    checkpoint page in "align" (``mamba_mixer2.py``, ``num_prefill_checkpoint_blocks=1``).
    """
    if mamba_cache_mode not in ("align", "none"):
        raise ValueError(f"mamba_cache_mode: 'align' or 'none' (vLLM 0.32), got {mamba_cache_mode!r}")
    return 2 if mamba_cache_mode == "align" else 1


def _blocks_for(
    kind: str, window: int | None, max_model_len: int, in_flight: int, block_size: int, state_pages: int = 1
) -> int:
    """Blocks one layer of ``kind`` needs for a max_model_len request (``*Spec.max_memory_usage_bytes``).

    ``in_flight`` is vLLM's ``max_in_flight_tokens``: the tokens of every batch scheduled but not yet
    settled, which sliding-window and chunked-local layers hold beyond their window.
    """
    if kind == SLIDING:
        return cdiv(min(window - 1 + in_flight, max_model_len), block_size) + 1
    if kind == CHUNKED:
        return cdiv(min(window + in_flight, max_model_len), block_size)
    if kind == STATE:
        return state_pages
    return cdiv(max_model_len, block_size)


def kv_cache_groups(
    g: ModelGeometry, max_model_len: int, in_flight_tokens: int, block_size: int, state_pages: int = 1
) -> tuple[tuple[KVGroup, ...], int]:
    """vLLM's KV-cache groups and the layers per group (``_get_kv_cache_groups_uniform_page_size``).

    One kind of layer: one group of all layers. Several kinds: layers are grouped by kind, the group
    size is the smallest kind's count (or the largest's when it is under 1.5x the smallest), and each
    kind is dealt round-robin into ``cdiv(count, group_size)`` groups; every group is budgeted as
    ``group_size`` layers (the shorter ones padded).
    """
    counts: dict[tuple[str, int | None], int] = {}
    for layer in range(g.num_layers):
        attention = g.attention_kind(layer)
        if attention is not None:
            window = (
                g.sliding_window if attention == SLIDING else g.attention_chunk_size if attention == CHUNKED else None
            )
            counts[(attention, window)] = counts.get((attention, window), 0) + 1
        if g.layer_kind(layer) in WITH_STATE:
            counts[(STATE, None)] = counts.get((STATE, None), 0) + 1
    if not counts:
        raise ValueError(f"{g.name}: no layer keeps a KV cache or a state")
    if len(counts) == 1:
        (kind, window), layers = next(iter(counts.items()))
        return (
            KVGroup(
                kind,
                layers,
                _blocks_for(kind, window, max_model_len, in_flight_tokens, block_size, state_pages),
                window,
            ),
        ), layers
    smallest, largest = min(counts.values()), max(counts.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups = []
    for (kind, window), layers in counts.items():
        per_request = _blocks_for(kind, window, max_model_len, in_flight_tokens, block_size, state_pages)
        # vLLM deals the layers of a kind round-robin over its groups (layers[i::num_groups]), so that
        # pipeline stages pad evenly: the groups differ by at most one layer.
        num_groups = cdiv(layers, group_size)
        for i in range(num_groups):
            groups.append(KVGroup(kind, len(range(i, layers, num_groups)), per_request, window))
    return tuple(groups), group_size


def hybrid_block_size(g: ModelGeometry, attention_page_per_token: float, state_page: float, block_size: int) -> int:
    """The attention block size vLLM uses when state layers share the pool with attention layers.

    vLLM raises the attention block size until one attention page (``block_size`` tokens of one layer)
    holds one state page, in multiples of the kernel alignment, and pads the state page to match
    (``vllm/model_executor/models/config.py``, the hybrid attention + Mamba config: ``attn_block_size =
    alignment x cdiv(mamba_page_size, alignment x attn_page_size_1_token)``, logged as "Setting attention
    block size to N tokens to ensure that attention page size is >= mamba page size"; public logs show
    528-784 tokens for Qwen3.5 and Granite-4 hybrids).
    """
    if not g.num_state_layers or not attention_page_per_token:
        return block_size
    needed = cdiv(int(state_page), int(attention_page_per_token))
    aligned = cdiv(needed, vllm.HYBRID_BLOCK_ALIGNMENT) * vllm.HYBRID_BLOCK_ALIGNMENT
    return max(block_size, aligned)


@dataclass(frozen=True)
class KVBudget:
    """What one GPU of a vLLM deployment has for the KV cache, in vLLM's arithmetic. Bytes per GPU.

    ``requested = utilization x total``; ``kv_memory = requested - weights - activation_peak -
    non_torch - cuda_graphs`` (or ``kv_cache_memory_bytes`` when given); ``num_blocks = kv_memory //
    page_bytes // layers_per_group``.
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
    cuda_graphs: float = 0.0
    kv_cache_memory_bytes: float | None = None
    other_processes: float = 0.0
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = vllm.ASYNC_SCHEDULING
    state_pages: int = 1
    device_label: str = "GPU"
    layer_page_bytes: float = 0.0
    layers_per_group: int = 1
    groups: tuple[KVGroup, ...] = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def requested(self) -> float:
        """utilization x total memory (bytes): vLLM's share of the GPU, of total not free memory."""
        return self.utilization * self.total_memory

    @property
    def free_at_startup(self) -> float:
        """Memory free when vLLM starts: the total minus what other processes hold."""
        return self.total_memory - self.other_processes

    @property
    def startup_error(self) -> str | None:
        """vLLM's refusal to start when the requested share is not free (None when it starts).

        The worker checks this when it initialises the device (``vllm/v1/worker/gpu_worker.py``,
        ``init_device``); the copies of that code the course read do not skip the check when
        ``kv_cache_memory_bytes`` is set, so neither does the course.
        """
        return vllm.free_memory_error(self.total_memory, self.free_at_startup, self.utilization)

    @property
    def kv_memory(self) -> float:
        """Bytes left for the KV cache (negative when the rest does not even fit)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return self.requested - self.weights - self.activation_peak - self.non_torch - self.cuda_graphs

    @property
    def page_bytes(self) -> float:
        """One block of every layer of one group (bytes): the unit vLLM allocates."""
        return self.layer_page_bytes * self.layers_per_group

    @property
    def num_blocks(self) -> int:
        """Whole blocks that fit in the KV memory (``get_num_blocks``)."""
        if self.startup_error or self.layer_page_bytes <= 0:
            return 0
        return max(0, int(self.kv_memory // self.layer_page_bytes // self.layers_per_group))

    @property
    def in_flight_tokens(self) -> int:
        """vLLM's ``max_in_flight_tokens``: the step budget times the batches in flight."""
        return vllm.max_in_flight_tokens(self.max_num_batched_tokens, self.async_scheduling)

    @property
    def num_tokens(self) -> int:
        """What vLLM logs as "GPU KV cache size: N tokens" (``get_kv_cache_capacity``):
        ``int(max_concurrency x max_model_len)``, the tokens of that many max-length requests."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def log_line(self) -> str:
        """The startup log line vLLM prints for this budget (``update_kv_cache_capacity``)."""
        return (
            f"{self.device_label} KV cache size: {self.num_tokens:,} tokens, Maximum concurrency for "
            f"{self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x"
        )

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of max_model_len tokens needs, summed over the groups."""
        return sum(group.blocks_per_request for group in self.groups)

    @property
    def max_concurrency(self) -> float:
        """vLLM's logged "Maximum concurrency" (``get_max_concurrency_for_kv_cache_config``)."""
        return self.num_blocks / self.blocks_per_request if self.blocks_per_request else 0.0

    @property
    def fits_one_request(self) -> bool:
        """vLLM refuses to start unless one max_model_len request fits (``_check_enough_kv_cache_memory``)."""
        return self.startup_error is None and self.num_blocks >= self.blocks_per_request

    def blocks_for(self, context: int) -> int:
        """Blocks one sequence of ``context`` tokens occupies across the groups (all layers in use)."""
        _positive_int("context", context)
        return sum(
            _blocks_for(group.kind, group.window, context, self.in_flight_tokens, self.block_size, self.state_pages)
            for group in self.groups
        )

    def max_batch(self, context: int) -> int:
        """How many sequences of ``context`` tokens fit at once."""
        return self.num_blocks // self.blocks_for(context)

    def max_context(self, batch: int) -> int:
        """The longest context (tokens) each of ``batch`` sequences can hold at once, in whole blocks.

        Full-attention models only grow linearly; for hybrids the answer is found by bisection over
        :meth:`blocks_for`. Not capped at max_model_len: compare the two.
        """
        _positive_int("batch", batch)
        if len(self.groups) == 1 and self.groups[0].kind == FULL:
            return (self.num_blocks // batch) * self.block_size
        low, high = 0, 1 << 40
        while low < high:
            mid = (low + high + 1) // 2
            if batch * self.blocks_for(mid) <= self.num_blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def to_dict(self) -> dict:
        """Every input and derived figure, JSON-ready."""
        data = asdict(self)
        data["notes"] = list(self.notes)
        data["groups"] = [asdict(group) for group in self.groups]
        for name in (
            "requested",
            "kv_memory",
            "page_bytes",
            "num_blocks",
            "num_tokens",
            "blocks_per_request",
            "startup_error",
            "in_flight_tokens",
            "log_line",
        ):
            data[name] = getattr(self, name)
        data["max_concurrency"] = round(self.max_concurrency, 4)
        data["fits_one_request"] = self.fits_one_request
        data["vllm_version"] = vllm.VLLM_RELEASE
        return data

    def table(self, batches: tuple[int, ...] = (1, 8, 32, 128)) -> str:
        """A readable report."""
        gib = lambda x: f"{x / GiB:8.2f} GiB"  # noqa: E731
        lines = [
            f"KV-cache budget: {self.model} on {self.gpu} (tensor parallel {self.tp}), per device, "
            f"as {vllm.VLLM_RELEASE}",
            f"  total memory        {gib(self.total_memory)}  (as the driver reports it)",
        ]
        if self.kv_cache_memory_bytes is not None:
            lines.append(f"  = KV cache          {gib(self.kv_memory)}  (kv_cache_memory_bytes; utilization ignored)")
        else:
            lines += [
                f"  x utilization {self.utilization:<5g} {gib(self.requested)}",
                f"  - weights           {gib(self.weights)}",
                f"  - activation peak   {gib(self.activation_peak)}",
                f"  - non-torch memory  {gib(self.non_torch)}",
                f"  - CUDA graphs       {gib(self.cuda_graphs)}",
                f"  = KV cache          {gib(self.kv_memory)}",
            ]
        lines += [
            f"  KV per token        {self.bytes_per_token:,.0f} B ({self.kv_dtype}, {self.kv_heads_per_gpu} KV "
            f"head{'s' if self.kv_heads_per_gpu > 1 else ''} per GPU, attention layers)",
            f"  block               {self.block_size} tokens x {self.layers_per_group} layers = "
            f"{self.page_bytes / MiB:,.3f} MiB",
            f"  KV-cache groups     {len(self.groups)}: "
            + ", ".join(sorted({f"{g.kind}" + (f" ({g.window})" if g.window else "") for g in self.groups})),
            f"  blocks              {self.num_blocks:,}",
            f"  {self.device_label} KV cache size   {self.num_tokens:,} tokens (max concurrency x max_model_len)",
            f"  max_model_len       {self.max_model_len:,} tokens = {self.blocks_per_request:,} blocks per request",
            f"  max concurrency     {self.max_concurrency:,.2f}x (every request at max_model_len, as vLLM logs it)",
        ]
        lines.append(f"  vLLM logs           {self.log_line}")
        for batch in batches:
            lines.append(f"  max context at batch {batch:<4d} {self.max_context(batch):,} tokens")
        if self.startup_error:
            lines.append(f"  DOES NOT START: {self.startup_error}")
        elif not self.fits_one_request:
            lines.append(
                "  DOES NOT FIT: not even one max_model_len request; vLLM would refuse to start "
                "(raise the utilization, shorten max_model_len, quantize the KV cache or add GPUs)"
            )
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def total_weight_bytes(
    geometry: ModelGeometry, weight_dtype: str | None = None, device: str | HardwareSpec = "H100-SXM"
) -> float:
    """Bytes of all weights (all GPUs together) in ``weight_dtype``, by default the dtype vLLM serves the
    checkpoint in on ``device`` (:func:`course.kv.vllm.served_dtype`; fp8 checkpoints keep fp8 weights)."""
    if geometry.num_params is None:
        raise ValueError(
            f"weights: the parameter count of {geometry.name} is unknown; pass weight_bytes (CLI: --weights-gib)"
        )
    if weight_dtype is None and geometry.weight_dtype != "fp8":
        spec = device if isinstance(device, HardwareSpec) else hardware.gpu(device)
        weight_dtype = vllm.served_dtype(geometry.weight_dtype, spec)
    name = weight_dtype or geometry.weight_dtype
    if name not in WEIGHT_BYTES:
        raise ValueError(f"weight_dtype: unknown {name!r}; allowed: {', '.join(WEIGHT_BYTES)}")
    return geometry.num_params * WEIGHT_BYTES[name]


def _bytes_arg(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name}: must be a number of bytes >= 0, got {value!r}")
    return float(value)


def _total_memory(spec: HardwareSpec, utilization: Any, gpu_memory_bytes: Any) -> float:
    """The device's total (bytes) as vLLM sees it, after checking the two memory arguments."""
    if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
        raise ValueError(f"utilization: must be a number in (0, 1] (gpu_memory_utilization), got {utilization!r}")
    if gpu_memory_bytes is None:
        return spec.total_memory
    if isinstance(gpu_memory_bytes, bool) or not isinstance(gpu_memory_bytes, (int, float)) or gpu_memory_bytes <= 0:
        raise ValueError(f"gpu_memory_bytes: must be a positive number of bytes, got {gpu_memory_bytes!r}")
    return float(gpu_memory_bytes)


def _max_model_len(g: ModelGeometry, max_model_len: int | None) -> int:
    if max_model_len is None:
        if g.max_position_embeddings is None:
            raise ValueError(f"max_model_len: {g.name} does not state max_position_embeddings; give max_model_len")
        max_model_len = g.max_position_embeddings
    _positive_int("max_model_len", max_model_len)
    return max_model_len


def _weights(
    g: ModelGeometry,
    spec: HardwareSpec,
    dtype: str,
    model_dtype: str,
    weight_dtype: str | None,
    weight_bytes: float | None,
    kv_cache_memory_bytes: float | None,
) -> tuple[float, str | None]:
    """All weights' bytes (every GPU together), and a note when they are not needed and unknown."""
    if weight_bytes is not None:
        return _bytes_arg("weight_bytes", weight_bytes), None
    if kv_cache_memory_bytes is not None and g.num_params is None:
        # the KV size is given: vLLM does not budget the weights for it
        return 0.0, "weights unknown (no parameter count): not needed, kv_cache_memory_bytes sets the KV cache"
    # fp8 checkpoints keep fp8 weights whatever --dtype says; otherwise the weights are in the served dtype
    served = None if dtype == "auto" or g.weight_dtype == "fp8" else model_dtype
    return total_weight_bytes(g, weight_dtype or served, spec), None


def _notes(
    g: ModelGeometry,
    spec: HardwareSpec,
    tp: int,
    kv: KVDtype,
    dtype: str,
    model_dtype: str,
    profiled: bool,
    groups: tuple[KVGroup, ...],
    per_group: int,
    block_size: int,
    effective_block: int,
    state_page: float,
    in_flight: int,
    max_num_batched_tokens: int,
) -> list[str]:
    """What the report should say about how this budget differs from the plain formula."""
    notes = []
    if model_dtype != (g.weight_dtype or "fp32") and g.weight_dtype != "fp8" and dtype == "auto":
        notes.append(
            f"the checkpoint is {g.weight_dtype or 'fp32'}: vLLM serves it in {model_dtype} on {spec.name} "
            "(--dtype auto; give --dtype float32 to keep it)"
        )
    if not profiled:
        notes.append(
            "activation peak, non-torch and CUDA-graph memory not given (0): vLLM measures them at startup, so the "
            "real budget is smaller"
        )
    if len({group.kind for group in groups}) > 1:
        notes.append(
            f"{len(groups)} KV-cache groups of {per_group} layers ({', '.join(sorted({gr.kind for gr in groups}))}): "
            "each group has its own block table, a request takes blocks in every group"
        )
    if effective_block != block_size:
        notes.append(
            f"state layers hold {state_page / MiB:,.2f} MiB per sequence: vLLM raises the attention block size to "
            f"{effective_block} tokens so one attention page holds one state page"
        )
    if g.num_sliding_layers:
        notes.append(
            f"{g.num_sliding_layers} of {g.num_layers} layers use a {g.sliding_window}-token window: vLLM budgets "
            f"min(window - 1 + max_in_flight_tokens ({in_flight:,} = {in_flight // max_num_batched_tokens} x "
            f"max_num_batched_tokens), max_model_len) tokens + 1 block for them"
        )
    if not g.is_mla and tp > g.num_kv_heads:
        notes.append(f"tp {tp} > {g.num_kv_heads} KV heads: each GPU keeps a replica of one KV head")
    if g.is_mla and tp > 1:
        notes.append("MLA: every GPU keeps the whole latent cache (it has no heads to split)")
    if kv.scale_bytes or kv.scale_block or kv.bits < 16:
        notes.append(f"{kv.name}: {kv.note}; support and accuracy: confirm on your server and model")
    return notes


def budget(
    model: Any,
    gpu: str | HardwareSpec = "H100-SXM",
    *,
    utilization: float = vllm.GPU_MEMORY_UTILIZATION,
    max_model_len: int | None = None,
    kv_dtype: str | KVDtype = "auto",
    block_size: int | None = None,
    tp: int = 1,
    dtype: str = "auto",
    weight_dtype: str | None = None,
    weight_bytes: float | None = None,
    activation_bytes: float = 0.0,
    non_torch_bytes: float = 0.0,
    cuda_graph_bytes: float = 0.0,
    gpu_memory_bytes: float | None = None,
    kv_cache_memory_bytes: float | None = None,
    other_process_bytes: float = 0.0,
    max_num_batched_tokens: int | None = None,
    async_scheduling: bool | None = None,
    mamba_cache_mode: str = "align",
) -> KVBudget:
    """vLLM's KV-cache budget for a model on ``tp`` devices of one kind (GPUs, or vLLM's CPU build).

    Args:
        model: catalogue name, config.json path/dict, or a ModelGeometry.
        gpu: catalogue GPU name, "CPU" (vLLM's CPU build on this machine), or a HardwareSpec.
        utilization: vLLM's ``gpu_memory_utilization``, a share of *total* memory, in (0, 1]; default
            0.92, vLLM 0.32's (vLLM <= 0.11 used 0.90).
        max_model_len: longest request (tokens); default the model's max_position_embeddings.
        kv_dtype: "auto" (the model's served dtype, as vLLM) or one of :data:`KV_DTYPES`.
        block_size: tokens per block; default vLLM's: 16 on GPUs, 128 on the CPU build (hybrids with
            state layers get a larger one).
        dtype: vLLM's ``--dtype``: "auto" serves a float32 checkpoint in bf16 where the device has
            it, else fp16 (:func:`course.kv.vllm.served_dtype`); or "float32", "bfloat16", "float16".
        tp: tensor-parallel GPUs; weights are split evenly, KV heads as :func:`kv_heads_per_gpu`.
        weight_dtype: dtype of the served weights (default: the served dtype; fp8 checkpoints keep fp8).
        weight_bytes: total weight bytes, overriding the parameter count.
        activation_bytes: peak activation memory per GPU (vLLM measures it with a dummy forward
            pass at ``max_num_batched_tokens``); 0 when not given.
        non_torch_bytes: CUDA context, NCCL buffers and other memory outside PyTorch's allocator.
        cuda_graph_bytes: memory of the CUDA graphs vLLM captures (profiled and subtracted by default
            since v0.21); 0 when not given.
        gpu_memory_bytes: the total the driver reports, overriding the GPU's catalogue figure (read it
            from your startup log: ``total_gpu_memory (79.14GiB)``).
        kv_cache_memory_bytes: vLLM's ``--kv-cache-memory-bytes`` (on the CPU build,
            ``VLLM_CPU_KVCACHE_SPACE`` GiB): the KV cache gets exactly this, ``gpu_memory_utilization``
            is ignored, and the weights need not be known.
        other_process_bytes: memory other processes on the GPU hold at startup; vLLM refuses to start
            when ``utilization x total`` is more than what is left free.
        max_num_batched_tokens: the step's token budget; default vLLM's for this GPU
            (:func:`course.kv.vllm.scheduler_defaults`). Sliding-window and chunked layers reserve
            for it in every batch in flight.
        async_scheduling: two batches in flight (vLLM's default on GPUs; None = the device's default:
            on for GPUs, off on the CPU build).
        mamba_cache_mode: "align" (vLLM's default for hybrids with prefix caching on: 2 state pages
            per request) or "none" (1).
    """
    g = get_model(model)
    spec = hardware.gpu(gpu) if isinstance(gpu, str) else gpu
    total = _total_memory(spec, utilization, gpu_memory_bytes)
    cpu = spec.platform == "cpu"
    max_model_len = _max_model_len(g, max_model_len)
    if block_size is None:
        block_size = vllm.mla_block_size(spec) if g.is_mla else vllm.CPU_BLOCK_SIZE if cpu else vllm.BLOCK_SIZE
    _positive_int("block_size", block_size, "a positive integer (vLLM allows 1, 8, 16, 32, 64, 128)")
    if async_scheduling is None:
        async_scheduling = not cpu and vllm.ASYNC_SCHEDULING
    state_pages = state_pages_per_request(mamba_cache_mode)
    activation = _bytes_arg("activation_bytes", activation_bytes)
    non_torch = _bytes_arg("non_torch_bytes", non_torch_bytes)
    graphs = _bytes_arg("cuda_graph_bytes", cuda_graph_bytes)
    others = _bytes_arg("other_process_bytes", other_process_bytes)
    if kv_cache_memory_bytes is not None:
        kv_cache_memory_bytes = _bytes_arg("kv_cache_memory_bytes", kv_cache_memory_bytes)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = vllm.max_num_batched_tokens_default(spec, max_model_len)
    _positive_int("max_num_batched_tokens", max_num_batched_tokens)

    # the cache's layout: dtypes, bytes per token and layer, the block, the KV-cache groups
    model_dtype = vllm.served_dtype(g.weight_dtype, spec, dtype)
    kv = get_kv_dtype(model_dtype if str(kv_dtype).lower() == "auto" else kv_dtype)
    per_token_layer = layer_bytes_per_token(g, kv, tp) if g.num_attention_layers else 0
    state_page = state_bytes(g, model_dtype, tp)
    effective_block = hybrid_block_size(g, per_token_layer, state_page, block_size)
    in_flight = vllm.max_in_flight_tokens(max_num_batched_tokens, async_scheduling)
    groups, per_group = kv_cache_groups(g, max_model_len, in_flight, effective_block, state_pages)
    layer_page = effective_block * per_token_layer if per_token_layer else state_page

    total_weights, weights_note = _weights(
        g, spec, dtype, model_dtype, weight_dtype, weight_bytes, kv_cache_memory_bytes
    )
    profiled = kv_cache_memory_bytes is not None or bool(activation or non_torch or graphs)
    notes = ([weights_note] if weights_note else []) + _notes(
        g, spec, tp, kv, dtype, model_dtype, profiled, groups, per_group, block_size, effective_block, state_page,
        in_flight, max_num_batched_tokens,
    )  # fmt: skip
    return KVBudget(
        model=g.name,
        gpu=spec.name,
        total_memory=total,
        utilization=float(utilization),
        weights=total_weights / tp,
        activation_peak=activation,
        non_torch=non_torch,
        kv_dtype=kv.name,
        block_size=effective_block,
        tp=tp,
        kv_heads_per_gpu=kv_heads_per_gpu(g, tp),
        bytes_per_token=g.num_attention_layers * per_token_layer,
        max_model_len=max_model_len,
        cuda_graphs=graphs,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        other_processes=others,
        max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=async_scheduling,
        state_pages=state_pages,
        device_label="CPU" if cpu else "GPU",
        layer_page_bytes=layer_page,
        layers_per_group=per_group,
        groups=groups,
        notes=tuple(notes),
    )
