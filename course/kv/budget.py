"""vLLM's KV-cache budget for a model on a device, computed the way vLLM computes it (see :mod:`course.kv.vllm`).

Two rules, one per release the course names (``release``):

**vLLM 0.32.0, and 0.34.0 where the extensible KV cache is off** (the CPU build, ``--kv-cache-memory-bytes``,
``num_gpu_blocks_override``): the cache is sized from a profiling *estimate*. At startup vLLM

1. checks that ``ceil(gpu_memory_utilization x total)`` is free (``v1/worker/utils.py``, ``request_memory``);
2. loads the weights, profiles one forward pass at ``max_num_batched_tokens`` (the activation peak),
   notes memory outside PyTorch and the CUDA graphs it will capture (``v1/worker/gpu_worker.py``);
3. gives the KV cache ``requested - weights - activation peak - non-torch - CUDA graphs``, or exactly
   ``kv_cache_memory_bytes`` when that is set (on the CPU build: ``VLLM_CPU_KVCACHE_SPACE`` GiB).

**vLLM 0.34.0 on CUDA and ROCm** (the extensible KV cache, on by default): the same estimate, at an unset
utilization's 1.0, only reserves the cache's address range; after warm-up and CUDA-graph capture vLLM
measures what is free and gives the cache (``v1/worker/extensible_kv_cache.py``, ``measure_kv_cache_bytes``)
``min(requested - used, free - margin) - transient peak``, where ``used`` is everything resident (weights,
memory outside PyTorch, the CUDA graphs), the transient peak is the larger of the profiled activation peak
plus the CUDA-graph estimate and what the warm-up steps allocated at peak, and the margin is
``max(1 GiB, 0.75 x transient peak)`` (3 GiB on ROCm). Nothing refuses at startup. Before the engine starts,
the weights, the total and what other processes hold are known; the transient peak, the memory outside
PyTorch and the CUDA graphs are measured, so the course gives the budget for the ones you give and the
ceiling no start can exceed (:attr:`KVBudget.kv_memory_range`).

Then, in both releases:

4. vLLM splits the layers into KV-cache groups and cuts the memory into blocks (``v1/core/kv_cache_utils.py``):
   ``num_blocks = memory // (page_size x layers_per_group)``;
5. logs "GPU KV cache size: N tokens, Maximum concurrency for L tokens per request: C x"
   (``get_kv_cache_capacity``): C is the blocks over the blocks one ``max_model_len`` request needs in
   every group (each group's need from its spec's ``max_memory_usage_bytes``: a sliding-window layer
   needs ``min(window - 1 + max_in_flight_tokens, max_model_len)`` tokens plus one block, where
   ``max_in_flight_tokens`` is the batches in flight x ``max_num_batched_tokens``: 2 under async
   scheduling), and N = ``int(C x max_model_len)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from course import hardware
from course.geometry import CHUNKED, FULL, SLIDING, STATE, WITH_STATE, ModelGeometry
from course.hardware import HardwareSpec
from course.kv import vllm
from course.kv.catalogue import get_model
from course.kv.dtypes import WEIGHT_BYTES, KVDtype, get_kv_dtype
from course.kv.sizes import _positive_int, kv_heads_per_gpu, layer_bytes_per_token, state_bytes
from course.units import cdiv

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
    holds one state page, in multiples of the alignment, and pads the state page to match
    (``vllm/platforms/interface.py``, ``Platform._align_hybrid_block_size``: ``attn_block_size = alignment x
    cdiv(mamba_page_size, alignment x attn_page_size_1_token)``, the alignment being the larger of the
    backend's smallest kernel block (16) and the block size: 16 in 0.32, 64 in 0.34; logged as "Setting
    attention block size to N tokens to ensure that attention page size is >= mamba page size"; public logs
    of 0.32-era releases show 528-784 tokens for Qwen3.5 and Granite-4 hybrids).
    """
    if not g.num_state_layers or not attention_page_per_token:
        return block_size
    alignment = max(vllm.HYBRID_BLOCK_ALIGNMENT, block_size)
    needed = cdiv(int(state_page), int(attention_page_per_token))
    return max(block_size, cdiv(needed, alignment) * alignment)


@dataclass(frozen=True)
class KVBudget:
    """What one GPU of a vLLM deployment has for the KV cache, in vLLM's arithmetic. Bytes per GPU.

    ``requested = utilization x total``. Sized from the estimate (``extensible`` False: vLLM 0.32, and 0.34
    where the extensible KV cache is off): ``kv_memory = requested - weights - activation_peak - non_torch -
    cuda_graphs`` (or ``kv_cache_memory_bytes`` when given). Measured after warm-up (0.34's extensible KV
    cache): :func:`course.kv.vllm.measure_kv_cache_bytes` of the same figures, with the transient peak
    ``max(transient_peak, activation_peak + cuda_graphs)`` kept free and a margin. ``num_blocks =
    kv_memory // page_bytes // layers_per_group`` (capped, when measured, by the blocks the estimate
    reserved).
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
    release: str = vllm.VLLM_VERSION
    extensible: bool = False
    utilization_given: bool = True
    transient_peak: float = 0.0
    torch_reserve_growth: float = 0.0
    margin_floor: float = vllm.KV_CACHE_MARGIN_FLOOR_BYTES["cuda"]
    pipeline_parallel: int = 1
    num_gpu_blocks_override: int | None = None

    @property
    def release_name(self) -> str:
        """ "vLLM 0.34.0": the release whose rules this budget follows."""
        return f"vLLM {self.release}"

    @property
    def sizing(self) -> str:
        """How vLLM sizes this cache, in words."""
        if self.num_gpu_blocks_override is not None:
            return "num_gpu_blocks_override"
        if self.kv_cache_memory_bytes is not None:
            return "kv_cache_memory_bytes"
        if self.extensible:
            return "measured after warm-up (extensible KV cache)"
        return "estimated at startup (profiling)"

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
        ``kv_cache_memory_bytes`` is set, so neither does the course. 0.34's extensible KV cache skips it.
        """
        return vllm.free_memory_error(
            self.total_memory, self.free_at_startup, self.utilization, extensible=self.extensible
        )

    @property
    def estimate_memory(self) -> float:
        """The profiling estimate: ``requested - weights - activation peak - non-torch - CUDA graphs`` (bytes).

        The KV cache of 0.32 (and of 0.34 with the extensible KV cache off); under the extensible KV cache,
        the address range it reserves (``num_blocks`` never exceeds it).
        """
        return self.requested - self.weights - self.activation_peak - self.non_torch - self.cuda_graphs

    @property
    def measured_peak(self) -> float:
        """The transient peak the extensible KV cache keeps free (bytes): the profiled activation peak plus
        the CUDA-graph estimate, or the warm-up steps' peak when that is larger (``transient_peak``)."""
        return max(self.transient_peak, self.activation_peak + self.cuda_graphs)

    @property
    def margin(self) -> float:
        """The extensible KV cache's margin beyond the transient peak: ``max(floor, 0.75 x peak)`` (bytes)."""
        return max(self.margin_floor, int(self.measured_peak * vllm.KV_CACHE_MARGIN_FRACTION))

    def _measured(self, requested: float, *, peak: float, non_torch: float, graphs: float, growth: float) -> float:
        used = self.weights + non_torch + graphs  # resident after warm-up and capture, the KV prefix aside
        init_free = self.free_at_startup
        return vllm.measure_kv_cache_bytes(
            init_free_memory=init_free,
            free_memory=init_free - used,
            committed_bytes=0,
            requested_memory=requested,
            transient_peak_bytes=peak,
            torch_reserve_growth_bytes=growth,
            margin_floor_bytes=self.margin_floor,
        )

    @property
    def kv_memory(self) -> float:
        """Bytes left for the KV cache (negative when the rest does not even fit, estimated)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if self.extensible:
            return self._measured(
                math.ceil(self.requested),
                peak=self.measured_peak,
                non_torch=self.non_torch,
                graphs=self.cuda_graphs,
                growth=self.torch_reserve_growth,
            )
        return self.estimate_memory

    @property
    def kv_memory_ceiling(self) -> float:
        """The most the extensible KV cache can get on this device (bytes): with nothing measured but the
        weights (no activation peak, memory outside PyTorch or CUDA graphs), only the margin's floor kept.
        Equal to :attr:`kv_memory` when the cache is not measured."""
        if not self.extensible or self.kv_cache_memory_bytes is not None:
            return self.kv_memory
        return self._measured(math.ceil(self.requested), peak=0.0, non_torch=0.0, graphs=0.0, growth=0.0)

    @property
    def kv_memory_range(self) -> tuple[float, float]:
        """(with the overheads given, the ceiling) in bytes: what the course can say before the engine starts.

        Under the extensible KV cache the transient peak, memory outside PyTorch and the CUDA graphs are
        measured at startup; the lower figure takes the ones given (0 when not given: then both are the
        ceiling), and each GiB more of transient peak measured costs 1.75 GiB of cache once the margin is
        past its floor (1 GiB below that), each GiB more of other resident memory 1 GiB. Sized from the
        estimate or given, both figures are :attr:`kv_memory`.
        """
        return self.kv_memory, self.kv_memory_ceiling

    @property
    def binding_bound(self) -> str:
        """Which of the measured budget's two bounds binds: the requested share, or free memory less the margin."""
        used = self.weights + self.non_torch + self.cuda_graphs
        cap = math.ceil(self.requested) - used
        free = self.free_at_startup - used - self.margin
        if cap < free:
            return f"the requested share (utilization {self.utilization:g} x total): it keeps free memory out"
        return "free memory less the margin (the requested share leaves it all)"

    @property
    def withheld(self) -> float:
        """Free memory an explicit utilization below 1 keeps out of the extensible KV cache (bytes): what the
        cache would get with all memory free at startup as its budget, less what it gets."""
        if not self.extensible or self.kv_cache_memory_bytes is not None:
            return 0.0
        unbounded = self._measured(
            self.free_at_startup,
            peak=self.measured_peak,
            non_torch=self.non_torch,
            graphs=self.cuda_graphs,
            growth=self.torch_reserve_growth,
        )
        return max(0.0, unbounded - self.kv_memory)

    @property
    def warning(self) -> str | None:
        """The warning 0.34 logs when an explicit ``gpu_memory_utilization`` in (0.7, 1) withholds >= 1 GiB."""
        if not self.extensible or not self.utilization_given:
            return None
        return vllm.withheld_warning(self.utilization, math.ceil(self.requested), self.withheld)

    @property
    def capacity_blocks(self) -> int:
        """Blocks of address range the extensible KV cache reserves: the estimate's blocks (at 1.0 when unset)."""
        if self.layer_page_bytes <= 0:
            return 0
        return max(0, int(self.estimate_memory // self.layer_page_bytes // self.layers_per_group))

    @property
    def page_bytes(self) -> float:
        """One block of every layer of one group (bytes): the unit vLLM allocates."""
        return self.layer_page_bytes * self.layers_per_group

    @property
    def num_blocks(self) -> int:
        """Whole blocks that fit in the KV memory (``get_num_blocks``; measured: ``blocks_within``, at most the
        reserved capacity, ``finalize_extensible_kv_cache``)."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        if self.startup_error or self.layer_page_bytes <= 0:
            return 0
        blocks = max(0, int(self.kv_memory // self.layer_page_bytes // self.layers_per_group))
        if self.extensible and self.kv_cache_memory_bytes is None:
            blocks = min(blocks, self.capacity_blocks)
        return blocks

    @property
    def in_flight_tokens(self) -> int:
        """vLLM's ``max_in_flight_tokens``: the step budget times the batches in flight."""
        return vllm.max_in_flight_tokens(
            self.max_num_batched_tokens, self.async_scheduling, self.pipeline_parallel, release=self.release
        )

    @property
    def memory_after_warmup(self) -> str | None:
        """The start of the line 0.34 logs once the extensible KV cache is measured (``measure_kv_cache_blocks``),
        for the figures this budget assumes; None when not measured. The committed prefix is taken as 0 and
        the line's last sentence (torch's reservation cap) is left out: both depend on the allocator's state."""
        if not self.extensible or self.kv_cache_memory_bytes is not None:
            return None
        gib = vllm.format_gib
        free = self.free_at_startup - self.weights - self.non_torch - self.cuda_graphs
        kept = max(self.measured_peak, self.torch_reserve_growth)
        return (
            f"Memory after warmup: {gib(free)} GiB free, 0.0 GiB committed to the KV cache, {gib(kept)} GiB kept "
            f"for transient activations ({gib(self.measured_peak)} GiB allocated at peak, "
            f"{gib(self.torch_reserve_growth)} GiB of torch reservation growth); {self.num_blocks} KV cache blocks "
            f"({gib(self.num_blocks * self.page_bytes)} GiB) fit within the requested "
            f"{gib(math.ceil(self.requested))} GiB."
        )

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
            "estimate_memory",
            "kv_memory_ceiling",
            "sizing",
            "warning",
            "memory_after_warmup",
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
        data["vllm_version"] = self.release_name
        if self.extensible:
            data["margin"] = self.margin
            data["measured_peak"] = self.measured_peak
        return data

    def table(self, batches: tuple[int, ...] = (1, 8, 32, 128)) -> str:
        """A readable report."""
        gib = lambda x: f"{x / GiB:8.2f} GiB"  # noqa: E731
        lines = [
            f"KV-cache budget: {self.model} on {self.gpu} (tensor parallel {self.tp}), per device, "
            f"as {self.release_name} sizes it: {self.sizing}",
            f"  total memory        {gib(self.total_memory)}  (as the driver reports it)",
        ]
        unset = "" if self.utilization_given else " (unset: "
        if not self.utilization_given:
            unset += "1.0 with the extensible KV cache)" if self.extensible else f"{self.release_name}'s default)"
        if self.num_gpu_blocks_override is not None:
            lines.append(f"  = KV blocks         {self.num_gpu_blocks_override:,} (num_gpu_blocks_override)")
        elif self.kv_cache_memory_bytes is not None:
            lines.append(f"  = KV cache          {gib(self.kv_memory)}  (kv_cache_memory_bytes; utilization ignored)")
        elif self.extensible:
            low, high = self.kv_memory_range
            lines += [
                f"  x utilization {self.utilization:<5g} {gib(self.requested)}{unset}",
                f"  - other processes   {gib(self.other_processes)}  (not free at startup)",
                f"  - weights           {gib(self.weights)}",
                f"  - non-torch memory  {gib(self.non_torch)}",
                f"  - CUDA graphs       {gib(self.cuda_graphs)}",
                f"  - transient peak    {gib(self.measured_peak)}  (activation peak + CUDA-graph estimate, or "
                "warm-up's; kept free)",
                f"  - margin            {gib(self.margin)}  (max({self.margin_floor / GiB:g} GiB, "
                f"{vllm.KV_CACHE_MARGIN_FRACTION} x transient peak), from free memory only)",
                f"  = KV cache          {gib(low)}  (measured after warm-up: with the overheads given; at most "
                f"{high / GiB:,.2f} GiB)",
                f"  bound by            {self.binding_bound}",
            ]
        else:
            lines += [
                f"  x utilization {self.utilization:<5g} {gib(self.requested)}{unset}",
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
        if self.memory_after_warmup:
            lines.append(f"  vLLM logs           {self.memory_after_warmup}")
        lines.append(f"  vLLM logs           {self.log_line}")
        for batch in batches:
            lines.append(f"  max context at batch {batch:<4d} {self.max_context(batch):,} tokens")
        if self.warning:
            lines.append(f"  vLLM warns          {self.warning}")
        if self.startup_error:
            lines.append(f"  DOES NOT START: {self.startup_error}")
        elif not self.fits_one_request:
            raise_it = "" if self.utilization >= 1 else "raise the utilization, "
            lines.append(
                "  DOES NOT FIT: not even one max_model_len request; vLLM would refuse to start "
                f"({raise_it}shorten max_model_len, quantize the KV cache or add GPUs)"
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


def _extensible_status(
    spec: HardwareSpec,
    rules: vllm.KVRules,
    asked: bool | None,
    kv_cache_memory_bytes: float | None,
    num_gpu_blocks_override: int | None,
) -> vllm.ExtensibleStatus:
    """Whether 0.34's extensible KV cache sizes this budget: as vLLM resolves it
    (:func:`course.kv.vllm.extensible_kv_cache`), or as ``asked`` (``--[no-]enable-extensible-kv-cache``); asking
    for it where vLLM would refuse it is a ValueError."""
    status = vllm.extensible_kv_cache(
        spec,
        release=rules.release,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        num_gpu_blocks_override=num_gpu_blocks_override,
    )
    if asked is None:
        return status
    if asked and not status.on and rules.extensible_kv_cache:
        raise ValueError(f"extensible_kv_cache: cannot be on here ({status.reason}); vLLM refuses the same")
    if asked and not rules.extensible_kv_cache:
        raise ValueError(f"extensible_kv_cache: {rules.release.name} has none (it came in 0.34)")
    if not asked and status.on:
        return vllm.ExtensibleStatus(False, "the extensible KV cache is off (--no-enable-extensible-kv-cache)")
    return status


def _sizing_notes(
    g: ModelGeometry,
    spec: HardwareSpec,
    dtype: str,
    model_dtype: str,
    profiled: bool,
    rules: vllm.KVRules,
    extensible: vllm.ExtensibleStatus,
) -> list[str]:
    """How vLLM sizes the memory here: the extensible KV cache or the estimate, the platform, the served dtype,
    and the measurements not given."""
    notes = []
    if extensible.on:
        notes.append(
            "vLLM measures the transient peak, memory outside PyTorch and the CUDA graphs after warm-up and "
            "capture; the course cannot know them before the engine starts: each GiB more of transient peak costs up "
            "to 1.75 GiB of cache (the peak itself, and 0.75 of it as margin once past the floor), each GiB more of "
            'other resident memory 1 GiB; read them from the "Memory after warmup" line of your log'
        )
        notes.append(
            "gpu_memory_utilization now only caps the instance: leave it unset (1.0) unless memory vLLM does not "
            "measure needs room (other processes, including ones that allocate later; a unified-memory CPU; "
            "weight-update buffers; a KV connector's buffers); vLLM falls back to the 0.92 estimate where the "
            "driver lacks virtual-memory support (course kv --no-extensible-kv-cache)"
        )
    elif rules.extensible_kv_cache and spec.platform != "cpu":
        notes.append(f"{extensible.reason}: the profiling estimate applies (the extensible KV cache is off)")
    if spec.platform == "cpu" and rules.cpu_requires_triton:
        notes.append(
            f"{rules.release.name}'s CPU platform refuses to start on x86 without triton-cpu, which is not on PyPI "
            "(vllm/platforms/cpu.py, CpuPlatform.check_and_update_config): this is the budget it would compute"
        )
    if model_dtype != (g.weight_dtype or "fp32") and g.weight_dtype != "fp8" and dtype == "auto":
        notes.append(
            f"the checkpoint is {g.weight_dtype or 'fp32'}: vLLM serves it in {model_dtype} on {spec.name} "
            "(--dtype auto; give --dtype float32 to keep it)"
        )
    if not profiled:
        notes.append(
            "activation peak, non-torch and CUDA-graph memory not given (0): vLLM measures them at startup, so the "
            "real budget is smaller" + (" (the figure above is the ceiling)" if extensible.on else "")
        )
    return notes


def _layout_notes(
    g: ModelGeometry,
    tp: int,
    kv: KVDtype,
    groups: tuple[KVGroup, ...],
    per_group: int,
    block_size: int,
    effective_block: int,
    state_page: float,
    in_flight: int,
    max_num_batched_tokens: int,
) -> list[str]:
    """What the cache's layout adds: several KV-cache groups, a block raised for state layers, sliding windows,
    heads replicated or a latent kept whole under tensor parallelism, a quantized KV dtype."""
    notes = []
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
    utilization: float | None = None,
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
    release: str = vllm.VLLM_VERSION,
    extensible_kv_cache: bool | None = None,
    transient_peak_bytes: float | None = None,
    torch_reserve_growth_bytes: float = 0.0,
    num_gpu_blocks_override: int | None = None,
    pipeline_parallel: int = 1,
) -> KVBudget:
    """vLLM's KV-cache budget for a model on ``tp`` devices of one kind (GPUs, or vLLM's CPU build).

    Args:
        model: catalogue name, config.json path/dict, or a ModelGeometry.
        gpu: catalogue GPU name, "CPU" (vLLM's CPU build on this machine), or a HardwareSpec.
        utilization: vLLM's ``gpu_memory_utilization``, a share of *total* memory, in (0, 1]; None (unset)
            means the release's default: 0.92 when the cache is sized from the estimate (vLLM 0.32, and 0.34
            where the extensible KV cache is off), 1.0 under 0.34's extensible KV cache (vLLM <= 0.11 used 0.90).
        max_model_len: longest request (tokens); default the model's max_position_embeddings.
        kv_dtype: "auto" (the model's served dtype, as vLLM) or one of :data:`KV_DTYPES`.
        block_size: tokens per block; default the release's (:func:`course.kv.vllm.default_block_size`):
            16 on GPUs in 0.32, 64 in 0.34, 128 on the CPU build (hybrids with state layers get a larger one).
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
        release: the vLLM release whose rules apply: "0.32" (the default: the runnable release, whose
            estimate module 4's exercises reproduce) or "0.34" (today's GPU release: 64-token blocks and the
            extensible KV cache). See :mod:`course.vllm_release`.
        extensible_kv_cache: 0.34's ``--[no-]enable-extensible-kv-cache``; None resolves it as vLLM does
            (:func:`course.kv.vllm.extensible_kv_cache`: on for CUDA and ROCm unless the cache size or the
            block count is given). False models the fallback where the driver lacks virtual-memory support.
        transient_peak_bytes: the transient peak the extensible KV cache keeps free, when known (the "GiB
            allocated at peak" of its "Memory after warmup" log line); it is never below ``activation_bytes +
            cuda_graph_bytes``.
        torch_reserve_growth_bytes: the torch reservation's growth over a sizing step (the same line's).
        num_gpu_blocks_override: vLLM's ``num_gpu_blocks_override``: exactly this many blocks.
        pipeline_parallel: pipeline stages of the deployment (this budget is one stage's GPU): sliding-window
            layers reserve for every batch in flight (:func:`course.kv.vllm.max_concurrent_batches`).
    """
    g = get_model(model)
    spec = hardware.gpu(gpu) if isinstance(gpu, str) else gpu
    rules = vllm.rules(release)
    if num_gpu_blocks_override is not None:
        _positive_int("num_gpu_blocks_override", num_gpu_blocks_override)
    _positive_int("pipeline_parallel", pipeline_parallel)
    status = _extensible_status(spec, rules, extensible_kv_cache, kv_cache_memory_bytes, num_gpu_blocks_override)
    utilization_given = utilization is not None
    if utilization is None:
        utilization = rules.default_utilization(status.on)
    total = _total_memory(spec, utilization, gpu_memory_bytes)
    cpu = spec.platform == "cpu"
    max_model_len = _max_model_len(g, max_model_len)
    if block_size is None:
        block_size = vllm.default_block_size(spec, g.is_mla, release=rules.release)
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
    peak = _bytes_arg("transient_peak_bytes", transient_peak_bytes) if transient_peak_bytes is not None else 0.0
    growth = _bytes_arg("torch_reserve_growth_bytes", torch_reserve_growth_bytes)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = vllm.max_num_batched_tokens_default(spec, max_model_len, release=rules.release)
    _positive_int("max_num_batched_tokens", max_num_batched_tokens)

    # the cache's layout: dtypes, bytes per token and layer, the block, the KV-cache groups
    model_dtype = vllm.served_dtype(g.weight_dtype, spec, dtype)
    kv = get_kv_dtype(model_dtype if str(kv_dtype).lower() == "auto" else kv_dtype)
    per_token_layer = layer_bytes_per_token(g, kv, tp) if g.num_attention_layers else 0
    state_page = state_bytes(g, model_dtype, tp)
    effective_block = hybrid_block_size(g, per_token_layer, state_page, block_size)
    in_flight = vllm.max_in_flight_tokens(
        max_num_batched_tokens, async_scheduling, pipeline_parallel, release=rules.release
    )
    groups, per_group = kv_cache_groups(g, max_model_len, in_flight, effective_block, state_pages)
    layer_page = effective_block * per_token_layer if per_token_layer else state_page

    total_weights, weights_note = _weights(
        g, spec, dtype, model_dtype, weight_dtype, weight_bytes, kv_cache_memory_bytes
    )
    given = kv_cache_memory_bytes is not None or num_gpu_blocks_override is not None
    profiled = given or bool(activation or non_torch or graphs or peak)
    # how this budget differs from the plain formula: first how the memory is sized, then the cache's layout
    notes = [weights_note] if weights_note else []
    notes += _sizing_notes(g, spec, dtype, model_dtype, profiled, rules, status)
    notes += _layout_notes(
        g, tp, kv, groups, per_group, block_size, effective_block, state_page, in_flight, max_num_batched_tokens
    )
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
        release=rules.release.version,
        extensible=status.on,
        utilization_given=utilization_given,
        transient_peak=peak,
        torch_reserve_growth=growth,
        margin_floor=vllm.KV_CACHE_MARGIN_FLOOR_BYTES.get(spec.platform, vllm.KV_CACHE_MARGIN_FLOOR_BYTES["cuda"]),
        pipeline_parallel=pipeline_parallel,
        num_gpu_blocks_override=num_gpu_blocks_override,
    )
