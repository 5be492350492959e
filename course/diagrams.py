"""Pictures of the mechanisms, drawn from the library's own objects so they stay true to its numbers.

Each function takes the record the library computes with and returns a matplotlib ``Figure``:

* :func:`request_timeline`: one request as a client saw it (a :class:`course.trace.RequestTrace`, or a
  simulated :class:`course.sim.RequestRecord`, whose admission time splits the wait into queue and
  prefill), with TTFT, one ITL, TPOT and E2E marked as :mod:`course.metrics` defines them;
* :func:`batched_timeline`: the requests of a simulation (:class:`course.sim.SimResult`) as token ticks
  over the engine's steps, so a long prefill that stalls the running decodes shows as a gap;
* :func:`block_tables`: a paged KV cache (:class:`course.sim.BlockManager`): which request owns which
  physical block, and each request's block table; several snapshots side by side show a preemption;
* :func:`prefix_hashes`: the chained block hashes prefix caching looks up
  (:func:`course.sim.prompt_block_hashes`), for prompts described by their segments
  (:class:`course.workload.RequestSpec`), hits against the earlier prompts in green;
* :func:`memory_budget`: vLLM's GPU-memory budget (:class:`course.kv.KVBudget`) as a stacked bar.

The figures are made without ``pyplot`` and show themselves as PNG (:class:`DiagramFigure`), so a
notebook cell that ends with the call shows the picture once, as a PNG output, in JupyterLab, Colab and
GitHub's notebook view alike, and nothing stays open in pyplot's list of figures. Every drawn element that carries a
number has a ``gid`` (``artist.get_gid()``) so the tests can check that the picture says what the
library computed.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.figure import Figure

from course import metrics, plotting
from course.trace import RequestTrace

if TYPE_CHECKING:  # imported for the annotations only: drawing a trace needs neither the simulator nor the KV code
    from matplotlib.axes import Axes

    from course.kv.budget import KVBudget
    from course.sim.blocks import BlockManager
    from course.sim.results import RequestRecord, SimResult, StepLog
    from course.workload import RequestSpec

GiB = 2**30
MS = 1e3  # the timelines are drawn in milliseconds

# The course's colours (course.plotting.COLORS) plus the few this module needs beyond them.
QUEUE = "#D5D5D5"
HIT = "#3A9A5B"
MISS = "#C0392B"
ROW = 1.25  # rows of cells are this far apart (a cell is 1 high)
PARTIAL = "#EEEEEE"
BUDGET_COLORS = {
    "weights": "#7F7F7F",
    "activation peak": plotting.COLORS["prefill"],
    "non-torch memory": plotting.COLORS["other"],
    "CUDA graphs": "#C9A227",
    "KV cache": plotting.COLORS["decode"],
    "not given to vLLM": "#F2F2F2",
}
# Distinct colours for the requests of a block table, in the order they first appear.
OWNER_COLORS = ["#2C6FBB", "#E07A1F", "#3A9A5B", "#8E6BBF", "#C9A227", "#17A2B8", "#B5527F", "#6B8E23"]


class DiagramFigure(Figure):
    """A Figure that IPython shows as a PNG by itself (``_repr_png_``).

    The inline backend registers its PNG formatter for figures only once pyplot has drawn something,
    so a notebook whose first picture is a diagram would otherwise show ``<Figure size ...>``.
    """

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png", bbox_inches="tight")  # as the inline backend saves
        return buffer.getvalue()


def _figure(rows: int = 1, cols: int = 1, *, width: float = 9.0, height: float = 3.2, **kwargs) -> tuple:
    """A course-styled :class:`DiagramFigure` (not registered with pyplot) and its axes array."""
    plotting.use_course_style()
    fig = DiagramFigure(figsize=(width, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, **kwargs)
    return fig, axes


def _span(ax: Axes, start: float, end: float, y: float, label: str, gid: str, *, above: bool = True) -> None:
    """A double-headed arrow from ``start`` to ``end`` at height ``y`` with its label (data units)."""
    ax.annotate(
        "",
        xy=(end, y),
        xytext=(start, y),
        arrowprops={"arrowstyle": "<->", "color": "black", "linewidth": 1.0, "shrinkA": 0, "shrinkB": 0},
        gid=gid,
    )
    offset = 0.08 if above else -0.08  # "above" on screen, whichever way the y axis runs
    ax.text(
        (start + end) / 2,
        y - offset if ax.yaxis_inverted() else y + offset,
        label,
        ha="center",
        va="bottom" if above else "top",
        fontsize=8.5,
        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0, "alpha": 0.85},
        gid=f"{gid} label",
    )


# --- one request ---------------------------------------------------------------------------------


def request_timeline(request: RequestTrace | RequestRecord, *, admitted: float | None = None) -> Figure:
    """One request's life on a time axis (ms from its send time), with its latencies marked.

    Args:
        request: a trace a client recorded (module 2), or a simulated request record (module 3),
            whose first admission to the batch is taken as ``admitted``.
        admitted: when the engine took the request into its batch (s, the trace's clock), if known:
            the wait before the first token is then drawn as queue (grey) and prefill (orange). A
            client cannot see this split; without it the wait is one span, labelled as such.

    Drawn: the wait for the first token, a tick per streamed chunk, and the spans of TTFT and E2E,
    the longest ITL and the TPOT, each computed by :mod:`course.metrics` (vLLM's definitions).
    Raises ValueError for a failed request (no chunk: it has no TTFT).
    """
    if isinstance(request, RequestTrace):
        trace = request
    else:  # a simulated RequestRecord: its own trace, admitted at its first scheduling
        trace = request.trace()
        if admitted is None and len(request.scheduled):
            admitted = float(request.scheduled[0])
    if not trace.succeeded:
        raise ValueError(f"request {trace.request_id!r} failed ({trace.error or 'no chunk'}): nothing to draw")
    send = trace.send_time
    times = (np.asarray(trace.chunk_times) - send) * MS
    ttft, e2e, gaps, tpot = metrics.ttft(trace), metrics.e2e(trace), metrics.itl(trace), metrics.tpot(trace)
    if admitted is not None and not send <= admitted <= trace.chunk_times[0]:
        raise ValueError(
            f"admitted={admitted} lies outside [send time {send}, first chunk {trace.chunk_times[0]}]: "
            "is it on the trace's clock?"
        )

    fig, axes = _figure(height=2.6)
    ax = axes[0, 0]
    lane = 0.0
    if admitted is None:
        ax.barh([lane], [ttft * MS], left=0, height=0.4, color=QUEUE, gid="wait")
        ax.text(ttft * MS / 2, lane, "queue + tokenize + prefill (+ network)", ha="center", va="center", fontsize=8)
    else:
        queue = (admitted - send) * MS
        ax.barh([lane], [queue], left=0, height=0.4, color=QUEUE, gid="queue")
        ax.barh([lane], [ttft * MS - queue], left=queue, height=0.4, color=plotting.COLORS["prefill"], gid="prefill")
        if queue > 0:
            ax.text(queue / 2, lane, "queue", ha="center", va="center", fontsize=8)
        ax.text((queue + ttft * MS) / 2, lane, "prefill", ha="center", va="center", fontsize=8)
    ax.vlines(times, lane - 0.25, lane + 0.25, color=plotting.COLORS["decode"], linewidth=1.5, gid="chunks")
    ax.plot([0], [lane], marker=">", color="black", gid="send")

    _span(ax, 0.0, ttft * MS, 0.45, f"TTFT {ttft * MS:.3g} ms", "ttft")
    _span(ax, 0.0, e2e * MS, 0.95, f"E2E {e2e * MS:.3g} ms", "e2e")
    if gaps:
        k = int(np.argmax(gaps))  # the longest gap: the one a reader should notice
        _span(ax, times[k], times[k + 1], -0.45, f"ITL {gaps[k] * MS:.3g} ms", "itl", above=False)
    if tpot is not None:
        _span(
            ax,
            ttft * MS,
            e2e * MS,
            -0.95,
            f"TPOT = (E2E - TTFT) / ({trace.output_tokens} - 1 tokens) = {tpot * MS:.3g} ms",
            "tpot",
            above=False,
        )
    ax.set_ylim(-1.35, 1.35)
    ax.set_yticks([])
    ax.grid(False)
    ax.set_xlim(-0.02 * e2e * MS, 1.04 * e2e * MS)
    ax.set_xlabel("ms since the request was sent")
    ax.set_title(
        f"Request {trace.request_id}: {trace.prompt_tokens} prompt tokens, {trace.output_tokens} output tokens "
        f"in {len(times)} chunks"
    )
    return fig


# --- a batch over steps --------------------------------------------------------------------------


def _shown_requests(result: SimResult, start: float, end: float, max_requests: int) -> list[RequestRecord]:
    """The requests alive in [start, end] (arrived before its end, last token after its start)."""
    alive = [
        r for r in result.requests if r.arrival_time <= end and (not len(r.token_times) or r.token_times[-1] >= start)
    ]
    return alive[:max_requests]


def _draw_batch(ax: Axes, result: SimResult, start: float, end: float, max_requests: int) -> None:
    """One panel of :func:`batched_timeline`: the steps behind, a row per request, the longest pause marked."""
    _draw_steps(ax, result.steps, start, end, max_requests)
    shown = _shown_requests(result, start, end, max_requests)
    for row, r in enumerate(shown):
        _draw_request_row(ax, row, r)
    ax.set_yticks(range(len(shown)), [f"{r.request_id} ({r.prompt_tokens} in)" for r in shown], fontsize=8)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    ax.set_xlim(start * MS, end * MS)
    ax.grid(False)
    stall = _longest_pause(shown, start, end)
    if stall is not None:
        row, a, b = stall
        _span(ax, a * MS, b * MS, row + 0.45, f"longest ITL {(b - a) * MS:.3g} ms", "longest itl", above=False)


def _draw_steps(ax: Axes, steps: StepLog, start: float, end: float, max_requests: int) -> None:
    """A thin line at every step start in [start, end], and a band over every step that computed prompt tokens."""
    keep = np.flatnonzero((steps.end >= start) & (steps.start <= end))
    # Steps that computed prompt tokens, shaded: their length is the pause every running stream sees.
    for i in keep:
        if steps.prefill_tokens[i]:
            ax.axvspan(
                steps.start[i] * MS,
                steps.end[i] * MS,
                color=plotting.COLORS["prefill"],
                alpha=0.12,
                linewidth=0,
                gid=f"step {i}",
            )
    ax.vlines(steps.start[keep] * MS, -0.5, max_requests, color="#BBBBBB", linewidth=0.5, gid="boundaries of the steps")


def _draw_request_row(ax: Axes, row: int, r: RequestRecord) -> None:
    """Request ``r`` in row ``row``: its queueing, each admission's prefill, its tokens, its preemptions."""
    admitted = list(r.scheduled)
    if admitted and admitted[0] > r.arrival_time:
        ax.broken_barh([(r.arrival_time * MS, (admitted[0] - r.arrival_time) * MS)], (row - 0.3, 0.6), color=QUEUE)
    for t in admitted:  # each admission prefills (or recomputes) until its next token
        after = r.token_times[r.token_times >= t]
        if len(after):
            ax.broken_barh([(t * MS, (after[0] - t) * MS)], (row - 0.3, 0.6), color=plotting.COLORS["prefill"])
    ax.vlines(
        r.token_times * MS, row - 0.35, row + 0.35, color=plotting.COLORS["decode"], linewidth=1.2,
        gid=f"tokens {r.request_id}",
    )  # fmt: skip
    for t in r.preempted:
        ax.plot([t * MS], [row], marker="x", color=MISS, gid=f"preempted {r.request_id}")


def _longest_pause(shown: list[RequestRecord], start: float, end: float) -> tuple[int, float, float] | None:
    """The longest pause between two tokens of one request inside [start, end]: the stall, if any, as
    (row, the token before it, the token after it; s); None when no row has two tokens there."""
    worst, where = 0.0, None
    for row, r in enumerate(shown):
        times = r.token_times[(r.token_times >= start) & (r.token_times <= end)]
        if len(times) > 1:
            k = int(np.argmax(np.diff(times)))
            if times[k + 1] - times[k] > worst:
                worst, where = float(times[k + 1] - times[k]), (row, times[k], times[k + 1])
    return where


def batched_timeline(
    results: SimResult | Mapping[str, SimResult],
    *,
    start: float | None = None,
    end: float | None = None,
    max_requests: int = 12,
) -> Figure:
    """Requests as rows of token ticks over the engine's steps, one panel per simulation run.

    Args:
        results: one :class:`course.sim.SimResult`, or several by label (drawn one above the other on
            the same time axis, e.g. without and with chunked prefill).
        start, end: the window to draw (s on the simulated clock); default: every step of every run.
        max_requests: most rows per panel (requests alive in the window, in arrival order).

    Drawn per request: queueing (grey), each admission's prefill until its next token (orange), a
    blue tick per output token (its time from the run), red crosses at preemptions; behind them, a
    thin line at every step start and an orange band over every step that computed prompt tokens.
    Every running request gets at most one token per step, so a long prefill step is a gap in every
    row; the longest such gap in the window is marked.
    """
    from course.sim.results import SimResult

    runs = {results.name: results} if isinstance(results, SimResult) else dict(results)
    if not runs:
        raise ValueError("batched_timeline needs at least one SimResult")
    logs = [result.steps for result in runs.values() if len(result.steps)]
    if start is None:
        start = min((float(steps.start[0]) for steps in logs), default=0.0)
    if end is None:
        end = max((float(steps.end[-1]) for steps in logs), default=1.0)
    if not end > start:
        raise ValueError(f"the window must have end > start, got start={start}, end={end}")
    fig, axes = _figure(len(runs), 1, height=0.32 * max_requests + 1.2, sharex=True)
    for ax, (label, result) in zip(axes[:, 0], runs.items()):
        _draw_batch(ax, result, start, end, max_requests)
        ax.set_title(label)
    axes[-1, 0].set_xlabel("simulated time (ms)")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(color=QUEUE, label="queued"),
        Patch(color=plotting.COLORS["prefill"], label="prefill (to its next token)"),
        Line2D([], [], color=plotting.COLORS["decode"], marker="|", linestyle="", markersize=10, label="output token"),
        Patch(color=plotting.COLORS["prefill"], alpha=0.12, label="a step with prompt tokens"),
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8)
    return fig


# --- paged blocks ---------------------------------------------------------------------------------


def block_owners(blocks: BlockManager, request_ids: Sequence[str]) -> dict[int, tuple[str, int]]:
    """Physical block -> (request, its position in that request's block table), for ``request_ids``.

    A block shared by several requests (prefix caching) is listed under the first of them.
    """
    owners: dict[int, tuple[str, int]] = {}
    for request_id in request_ids:
        if request_id in blocks:
            for index, block in enumerate(blocks.block_table(request_id)):
                owners.setdefault(block, (request_id, index))
    return owners


def block_tables(snapshots: BlockManager | Mapping[str, BlockManager], request_ids: Sequence[str]) -> Figure:
    """Paged KV caches as rows of physical blocks, each coloured by the request that owns it.

    Args:
        snapshots: a :class:`course.sim.BlockManager`, or several by label (copies taken at different
            moments, e.g. before and after a preemption).
        request_ids: the requests to show, in a fixed order so each keeps its colour in every panel.

    Each panel shows the cache's ``num_blocks`` blocks in id order (physical memory), a block labelled
    ``request:index`` (its place in that request's block table) and free blocks white; below, the block
    table of every request that holds blocks. A request that holds none (finished, or preempted) is
    listed as holding no blocks.
    """
    from course.sim.blocks import BlockManager

    panels = {"KV cache": snapshots} if isinstance(snapshots, BlockManager) else dict(snapshots)
    if not panels:
        raise ValueError("block_tables needs at least one BlockManager")
    colors = {rid: OWNER_COLORS[i % len(OWNER_COLORS)] for i, rid in enumerate(request_ids)}
    widest = max(b.num_blocks for b in panels.values())
    fig, axes = _figure(len(panels), 1, width=max(6.0, 0.55 * widest + 1.5), height=1.2 + 0.3 * len(request_ids))
    for ax, (label, blocks) in zip(axes[:, 0], panels.items()):
        owners = block_owners(blocks, request_ids)
        for block in range(blocks.num_blocks):
            owner, index = owners.get(block, ("free", None))
            color = colors.get(owner, "white")
            ax.add_patch(_cell(block, 0, color, f"block {block}: {owner}"))
            text = "free" if index is None else f"{owner}:{index}"
            ax.text(
                block + 0.5,
                0.5,
                text,
                ha="center",
                va="center",
                fontsize=7,
                color="#999999" if index is None else "white",
            )
            ax.text(block + 0.5, 1.08, str(block), ha="center", va="bottom", fontsize=7, color="#666666")
        for i, rid in enumerate(request_ids):
            if rid in blocks:
                table = f"{rid}: {blocks.block_table(rid)} ({blocks.num_tokens(rid)} tokens)"
            else:
                table = f"{rid}: no blocks"
            ax.text(0, -0.35 - 0.32 * i, table, ha="left", va="top", fontsize=8, color=colors[rid], gid=f"table {rid}")
        ax.set_xlim(-0.1, widest + 0.1)
        ax.set_ylim(-0.45 - 0.32 * len(request_ids), 1.45)
        ax.set_axis_off()
        used = blocks.num_blocks - blocks.num_free_blocks
        ax.set_title(f"{label}: {used} of {blocks.num_blocks} blocks of {blocks.block_size} tokens in use", fontsize=10)
    return fig


def _cell(x: float, y: float, color: str, gid: str, *, hatch: str | None = None):
    from matplotlib.patches import Rectangle

    return Rectangle(
        (x + 0.04, y), 0.92, 1.0, facecolor=color, edgecolor="#555555", linewidth=0.6, hatch=hatch, gid=gid
    )


# --- prefix caching -------------------------------------------------------------------------------


def prefix_hashes(prompts: Sequence[RequestSpec], block_size: int = 16) -> Figure:
    """The chained hashes of each prompt's full blocks, and which ones a prefix cache would hit.

    Args:
        prompts: requests with ``prompt_segments`` (named spans of tokens; equal names are equal text),
            in the order they arrive; each is hashed by :func:`course.sim.prompt_block_hashes`.
        block_size: tokens per block.

    Each row is one prompt, one cell per block (labelled with the segments it covers and the last four
    hex digits of its hash). A full block is green when the earlier prompts left that same hash at the
    same position in the cache: prefix caching looks up the longest chain of such hits, so the green
    cells start at the left and stop at the first red one. The trailing partial block is never cached
    (grey). Because each hash covers its parent's, one differing token turns its block and every later
    one red.
    """
    from course.sim.blocks import prompt_block_hashes
    from course.units import cdiv

    if not prompts:
        raise ValueError("prefix_hashes needs at least one prompt")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    widest = max(cdiv(p.prompt_tokens, block_size) for p in prompts)
    fig, axes = _figure(width=max(6.5, 1.25 * widest + 2.0), height=0.8 * len(prompts) + 0.8)
    ax = axes[0, 0]
    cached: set[tuple[int, int]] = set()  # (position, hash) left in the cache by earlier prompts
    for row, spec in enumerate(prompts):
        hashes = prompt_block_hashes(spec.request_id, spec.prompt_tokens, block_size, spec.prompt_segments)
        pieces = _block_pieces(spec, block_size)
        y = ROW * (len(prompts) - 1 - row)
        hit_chain = True
        for k in range(cdiv(spec.prompt_tokens, block_size)):
            if k < len(hashes):
                hit_chain = hit_chain and (k, hashes[k]) in cached
                color, gid = (HIT if hit_chain else MISS), f"{spec.request_id} block {k}: {hashes[k]}"
                label = f"{pieces[k]}\n#{hashes[k] & 0xFFFF:04x}"
            else:
                color, gid, label = PARTIAL, f"{spec.request_id} block {k}: partial", f"{pieces[k]}\n(partial)"
            ax.add_patch(_cell(1.25 * k, y, color, gid))
            ax.text(1.25 * k + 0.5, y + 0.5, label, ha="center", va="center", fontsize=6.5,
                    color="white" if color != PARTIAL else "#555555")  # fmt: skip
        ax.text(-0.2, y + 0.5, spec.request_id, ha="right", va="center", fontsize=9)
        cached.update(enumerate(hashes))
    ax.set_xlim(-2.0, 1.25 * widest)
    ax.set_ylim(-0.2, ROW * (len(prompts) - 1) + 1.1)
    ax.set_axis_off()
    ax.set_title(f"Chained hashes of {block_size}-token blocks; green: cached by an earlier prompt", fontsize=10)
    return fig


def _block_pieces(spec: RequestSpec, block_size: int) -> list[str]:
    """What each block of the prompt holds, as short segment names ("system 0-16", ...), one string per block."""
    from course.units import cdiv

    segments = spec.prompt_segments or (("unique", spec.prompt_tokens),)
    out: list[list[str]] = [[] for _ in range(cdiv(spec.prompt_tokens, block_size))]
    position = 0
    for name, length in segments:
        offset = 0
        while offset < length:
            take = min(length - offset, block_size - position % block_size)
            out[position // block_size].append(f"{name.split()[0]} {offset}-{offset + take}")
            offset += take
            position += take
    return ["\n".join(parts) for parts in out]


# --- the memory budget ----------------------------------------------------------------------------


def budget_parts(budget: KVBudget) -> dict[str, float]:
    """One GPU's memory split the way vLLM budgets it (bytes, in the bar's order).

    Weights, activation peak, non-torch memory and CUDA graphs come off ``gpu_memory_utilization x
    total``; the KV cache gets the rest (``KVBudget.kv_memory``, 0 when the rest is negative); the
    ``1 - utilization`` share of the total is not given to vLLM. The parts sum to the total whenever the
    budget fits. With ``kv_cache_memory_bytes`` set the KV cache is that size and whatever the other
    parts leave of the total is not given to vLLM.
    """
    fixed = budget.weights + budget.activation_peak + budget.non_torch + budget.cuda_graphs
    kv = max(0.0, budget.kv_memory)
    if budget.kv_cache_memory_bytes is None:  # fixed + kv = requested when it fits; the rest is never vLLM's
        outside = budget.total_memory - max(budget.requested, fixed)
    else:
        outside = budget.total_memory - fixed - kv
    return {
        "weights": budget.weights,
        "activation peak": budget.activation_peak,
        "non-torch memory": budget.non_torch,
        "CUDA graphs": budget.cuda_graphs,
        "KV cache": kv,
        "not given to vLLM": max(0.0, outside),
    }


def budget_shortfall(budget: KVBudget) -> float:
    """Bytes by which the weights and overheads exceed what vLLM may use (0 when the budget fits).

    Without ``kv_cache_memory_bytes`` that is their excess over ``utilization x total`` (vLLM refuses
    to start: no memory is left for the KV cache); with it, their excess plus the KV cache over the total.
    """
    fixed = budget.weights + budget.activation_peak + budget.non_torch + budget.cuda_graphs
    if budget.kv_cache_memory_bytes is None:
        return max(0.0, fixed - budget.requested)
    return max(0.0, fixed + budget.kv_cache_memory_bytes - budget.total_memory)


def memory_budget(budgets: KVBudget | Mapping[str, KVBudget]) -> Figure:
    """vLLM's GPU-memory budget as one stacked horizontal bar per budget (GiB).

    Args:
        budgets: one :class:`course.kv.KVBudget` (from ``course.kv.budget``), or several by label
            (e.g. two utilizations, or two GPUs).

    Segments, left to right (:func:`budget_parts`): weights, activation peak, non-torch memory, CUDA
    graphs, the KV cache, then the ``1 - gpu_memory_utilization`` share vLLM leaves alone; a black line
    marks ``gpu_memory_utilization x total``. When the weights and overheads alone pass that line, the
    part beyond it is hatched red (:func:`budget_shortfall`) and there is no KV cache: vLLM would not start.
    """
    from course.kv.budget import KVBudget

    bars = {f"{budgets.model} on {budgets.gpu}": budgets} if isinstance(budgets, KVBudget) else dict(budgets)
    if not bars:
        raise ValueError("memory_budget needs at least one KVBudget")
    from matplotlib.patches import Patch

    fig, axes = _figure(height=0.75 * len(bars) + 1.9, width=10.0)
    ax = axes[0, 0]
    drawn: dict[str, Patch] = {}
    for row, (label, b) in enumerate(bars.items()):
        left = 0.0
        for name, size in budget_parts(b).items():
            if size <= 0:
                continue
            ax.barh(
                [row], [size / GiB], left=left, height=0.6, color=BUDGET_COLORS[name], edgecolor="white",
                gid=f"{label}: {name}",
            )  # fmt: skip
            drawn.setdefault(name, Patch(facecolor=BUDGET_COLORS[name], edgecolor="#BBBBBB", label=name))
            share = size / b.total_memory  # name and size where they fit, the size alone where only it does
            text = f"{name}\n{size / GiB:.2f} GiB" if share > 0.2 else f"{size / GiB:.2f}" if share > 0.04 else ""
            ax.text(left + size / GiB / 2, row, text, ha="center", va="center", fontsize=7.5,
                    color="black" if name == "not given to vLLM" else "white")  # fmt: skip
            left += size / GiB
        limit = b.requested if b.kv_cache_memory_bytes is None else b.total_memory
        short = budget_shortfall(b)
        if short > 0:
            ax.barh(
                [row], [short / GiB], left=limit / GiB, height=0.6, color="none", edgecolor=MISS, hatch="//",
                gid=f"{label}: does not fit",
            )  # fmt: skip
            drawn["does not fit"] = Patch(facecolor="none", edgecolor=MISS, hatch="//", label="does not fit: no start")
        ax.vlines(b.total_memory / GiB, row - 0.34, row + 0.34, color="#555555", linewidth=1, linestyle=":")
        if b.kv_cache_memory_bytes is None:
            ax.vlines(
                b.requested / GiB, row - 0.38, row + 0.38, color="black", linewidth=1.5, gid=f"{label}: requested"
            )
            ax.text(b.requested / GiB, row - 0.4, f"x {b.utilization:g}", ha="center", va="bottom", fontsize=7.5)
    ax.set_yticks(range(len(bars)), list(bars), fontsize=8.5)
    ax.set_ylim(len(bars) - 0.4, -0.8)
    ax.set_xlabel("GiB of the device's total memory as its driver reports it (dotted line: the total)")
    ax.set_title(
        "vLLM's budget: utilization x total - weights - activations - non-torch - CUDA graphs = KV", fontsize=10.5
    )
    ax.grid(axis="y", visible=False)
    fig.legend(handles=list(drawn.values()), loc="outside lower center", ncols=min(len(drawn), 4), fontsize=8)
    return fig


# --- the central claim ----------------------------------------------------------------------------


def phases_overview(prompt_tokens: int = 8, batch: int = 3) -> Figure:
    """Prefill and decode side by side: the course's central claim as one static picture.

    Prefill multiplies a wide matrix, one row per prompt token (``prompt_tokens`` rows), by every
    weight matrix: each weight read does ``prompt_tokens`` multiply-adds, so the step is bound by
    compute. It writes the keys and values of every prompt token into the KV cache. A decode step
    multiplies ``batch`` rows, one new token per sequence, by the same weights: every weight is read
    for ``batch`` multiply-adds, so the step is bound by reading memory; each sequence also reads its
    own KV cache and appends one token to it. Drawn schematically (cells are tokens, not bytes); the
    gids ``prefill-x``, ``decode-x``, ``weights-prefill``, ``weights-decode``, ``kv-prefill`` and
    ``kv-decode`` name the drawn parts for the tests.
    """
    if prompt_tokens < 2 or batch < 1 or batch >= prompt_tokens:
        raise ValueError(f"draw at least 2 prompt tokens and fewer decode rows than that; got {prompt_tokens}, {batch}")
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, axes = _figure(width=10.0, height=3.9)
    ax = axes[0, 0]
    ax.set_axis_off()
    cell = 0.3  # one token's row is this high
    top = 1.15 + prompt_tokens * cell  # the prefill matrix's top edge (captions go below it)
    w = 1.5  # the weight matrix is drawn w x w
    prefill_color, decode_color = plotting.COLORS["prefill"], plotting.COLORS["decode"]

    def rows(x: float, n: int, color: str, gid: str, width: float = 0.9) -> None:
        for i in range(n):
            ax.add_patch(
                Rectangle(
                    (x, top - (i + 1) * cell),
                    width,
                    cell,
                    facecolor=color,
                    edgecolor="white",
                    linewidth=1.2,
                    gid=f"{gid} {i}",
                )
            )

    def weights(x: float, gid: str) -> None:
        ax.add_patch(Rectangle((x, top - w), w, w, facecolor="#7F7F7F", edgecolor="black", linewidth=0.8, gid=gid))
        ax.text(x + w / 2, top - w / 2, "W\n(every\nweight)", ha="center", va="center", color="white", fontsize=9)

    def symbol(x: float, text: str) -> None:
        ax.text(x, top - w / 2, text, ha="center", va="center", fontsize=16)

    # Prefill: X (prompt_tokens rows) @ W = Y.
    rows(0.0, prompt_tokens, prefill_color, "prefill-x")
    symbol(1.2, "×")
    weights(1.5, "weights-prefill")
    ax.text(0.45, top + 0.12, f"{prompt_tokens} prompt tokens", ha="center", va="bottom", fontsize=8.5)
    ax.text(1.7, top + 0.75, "Prefill: sets TTFT", ha="center", fontsize=12, weight="bold")
    ax.text(
        1.7,
        0.05,
        "one wide matrix product over every prompt token:\n"
        "each weight read does a multiply-add per token\n→ bound by compute (FLOP/s)",
        ha="center",
        va="bottom",
        fontsize=9,
    )

    # The KV cache between them: the prompt's tokens, then one more per decode step.
    kv_x = 4.55
    for i in range(prompt_tokens):
        ax.add_patch(
            Rectangle(
                (kv_x, top - (i + 1) * cell),
                0.9,
                cell,
                facecolor=prefill_color,
                alpha=0.45,
                edgecolor="white",
                linewidth=1.2,
                gid=f"kv-prefill {i}",
            )
        )
    ax.add_patch(
        Rectangle(
            (kv_x, top - (prompt_tokens + 1) * cell),
            0.9,
            cell,
            facecolor=decode_color,
            alpha=0.6,
            edgecolor="white",
            linewidth=1.2,
            gid="kv-decode 0",
        )
    )
    ax.text(kv_x + 0.45, top + 0.12, "KV cache\n(per sequence)", ha="center", va="bottom", fontsize=10, weight="bold")
    ax.text(kv_x + 0.95, top - (prompt_tokens + 0.5) * cell, " +1 token per step", ha="left", va="center", fontsize=8)
    arrow = {"arrowstyle": "-|>", "mutation_scale": 12, "color": "black", "linewidth": 1.0}
    ax.add_patch(FancyArrowPatch((3.1, top - 0.4), (kv_x - 0.05, top - 0.4), **arrow, gid="writes"))
    ax.text(3.8, top - 0.32, "writes K, V\nof every token", ha="center", va="bottom", fontsize=8)
    ax.add_patch(FancyArrowPatch((kv_x + 0.95, top - 0.4), (6.45, top - 0.4), **arrow, gid="reads"))
    ax.text(5.95, top - 0.32, "read in full\nevery step", ha="center", va="bottom", fontsize=8)

    # Decode: X (batch rows, one new token per sequence) @ W = Y.
    dx = 6.5
    rows(dx, batch, decode_color, "decode-x")
    symbol(dx + 1.2, "×")
    weights(dx + 1.5, "weights-decode")
    ax.text(dx + 0.45, top + 0.12, f"{batch} sequences,\n1 new token each", ha="center", va="bottom", fontsize=8.5)
    ax.text(dx + 1.7, top + 0.75, "Decode: sets ITL / TPOT", ha="center", fontsize=12, weight="bold")
    ax.text(
        dx + 1.7,
        0.05,
        "one token per sequence per step: every weight\nand each sequence's KV cache read "
        "for a few\nmultiply-adds → bound by memory bandwidth",
        ha="center",
        va="bottom",
        fontsize=9,
    )
    ax.set_xlim(-0.1, dx + 3.3)
    ax.set_ylim(0.0, top + 1.15)
    ax.set_aspect("equal")
    return fig
