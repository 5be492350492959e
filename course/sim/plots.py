"""Plots of simulations: a batch Gantt chart, KV usage over time, latency CDFs, the load of each step.

Colours follow :mod:`course.plotting`: prefill and TTFT orange, decode and ITL blue. Every function
draws on ``ax`` when given (else a new figure) and returns the axes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from course import metrics, plotting
from course.sim.results import SimResult, StepLog

# One colour per compared run, in order; the first two keep the course's decode/prefill colours.
PALETTE = ["#2C6FBB", "#E07A1F", "#3A9A5B", "#C0392B", "#8E6BBF", "#7F7F7F"]
WAITING = "#D5D5D5"
PREEMPTED = "#C0392B"


def _as_runs(results: SimResult | Mapping[str, SimResult]) -> dict[str, SimResult]:
    return {results.name: results} if isinstance(results, SimResult) else dict(results)


def gantt(result: SimResult, ax=None, max_requests: int = 40, first: int = 0):
    """One row per request: waiting (grey), prefill (orange), decoding (blue), preemptions (red).

    A request waits from its arrival until it is scheduled, prefills until its first token (or, after
    a preemption, until it produced its next token), and decodes until its last token. Shows requests
    ``first .. first + max_requests - 1`` in arrival order.
    """
    ax = plotting.new_figure(f"Batch Gantt chart: {result.name}", "time (s)", "request (arrival order)", ax=ax)
    shown = result.requests[first : first + max_requests]
    for row, record in enumerate(shown):
        y = (row - 0.4, 0.8)
        if record.error or not len(record.token_times):
            ax.broken_barh([(record.arrival_time, 0)], y, color=WAITING)
            continue
        starts = list(record.scheduled) or [record.token_times[0]]
        # periods out of the batch: arrival -> first admission, and each preemption -> next admission
        outs = [(record.arrival_time, starts[0])] + list(zip(record.preempted, starts[1:]))
        ax.broken_barh([(a, b - a) for a, b in outs if b > a], y, color=WAITING)
        # each admission prefills until the first token produced after it
        prefills = []
        for admitted in starts:
            after = record.token_times[record.token_times >= admitted]
            if len(after):
                prefills.append((admitted, after[0] - admitted))
        ax.broken_barh(prefills, y, color=plotting.COLORS["prefill"])
        decodes, begin = [], record.token_times[0]
        for stop in [*record.preempted, record.token_times[-1]]:
            if stop > begin:
                decodes.append((begin, stop - begin))
            later = record.token_times[record.token_times > stop]
            begin = later[0] if len(later) else stop
        ax.broken_barh(decodes, y, color=plotting.COLORS["decode"])
        for t in record.preempted:
            ax.plot([t], [row], marker="x", color=PREEMPTED, markersize=6)
    ax.set_ylim(len(shown) - 0.5, -0.5)
    from matplotlib.patches import Patch

    handles = [
        Patch(color=WAITING, label="waiting"),
        Patch(color=plotting.COLORS["prefill"], label="prefill (to next token)"),
        Patch(color=plotting.COLORS["decode"], label="decoding"),
    ]
    if any(r.preempted for r in shown):
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], marker="x", color=PREEMPTED, linestyle="", label="preempted"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def kv_usage(results: SimResult | Mapping[str, SimResult], ax=None, title: str = "KV-cache usage over time"):
    """Fraction of KV blocks held during each step, with preemptions marked."""
    ax = plotting.new_figure(title, "time (s)", "KV blocks in use (%)", ax=ax)
    for color, (label, result) in zip(PALETTE * 4, _as_runs(results).items()):
        times, used = result.kv_usage()
        ax.step(times, used * 100, where="post", color=color, label=label, linewidth=1.5)
        preempted = sorted(t for r in result.requests for t in r.preempted)
        if preempted:
            ax.plot(preempted, [101] * len(preempted), "|", color=color, markersize=8)
    ax.set_ylim(0, 105)
    plotting.legend_outside(ax)
    return ax


def latency_cdfs(
    results: SimResult | Mapping[str, SimResult], metric: str = "ttft", ax=None, scale: float = 1e3, logx: bool = False
):
    """Empirical CDFs of one latency metric ("ttft", "itl", "tpot" or "e2e") for several runs, in ms."""
    if metric not in ("ttft", "itl", "tpot", "e2e"):
        raise ValueError(f"metric must be ttft, itl, tpot or e2e; got {metric!r}")
    ax = plotting.new_figure(f"{metric.upper()} distribution", f"{metric.upper()} (ms)", "fraction of values", ax=ax)
    for color, (label, result) in zip(PALETTE * 4, _as_runs(results).items()):
        plotting.cdf(ax, _values(result, metric), metric, label=label, scale=scale, color=color)
    if logx:
        ax.set_xscale("log")
    plotting.legend_outside(ax)
    return ax


def _values(result: SimResult, metric: str) -> list[float]:
    """The metric's values over the successful requests, as :func:`course.metrics.summarize` pools them (s)."""
    ok = [t for t in result.traces if t.succeeded]
    if metric == "itl":
        return [gap for t in ok for gap in metrics.itl(t)]  # pooled: one value per gap
    function = {"ttft": metrics.ttft, "e2e": metrics.e2e, "tpot": metrics.tpot}[metric]
    return [v for t in ok if (v := function(t)) is not None]


def _window(steps: StepLog, start: float | None, end: float | None) -> np.ndarray:
    """Which steps overlap ``[start, end]`` (either bound None: open), as a boolean mask."""
    keep = np.ones(len(steps), dtype=bool)
    if start is not None:
        keep &= steps.end >= start
    if end is not None:
        keep &= steps.start <= end
    return keep


def step_load(result: SimResult, ax=None, start: float | None = None, end: float | None = None):
    """Prefill and decode tokens computed by each step over time, and each step's duration."""
    ax = plotting.new_figure(f"What each step computed: {result.name}", "time (s)", "tokens in the step", ax=ax)
    steps = result.steps
    keep = _window(steps, start, end)
    left, width = steps.start[keep], steps.duration[keep]
    decode, prefill = steps.decode_tokens[keep], steps.prefill_tokens[keep]
    ax.bar(left, decode, width=width, align="edge", color=plotting.COLORS["decode"], label="decode tokens")
    ax.bar(
        left,
        prefill,
        width=width,
        bottom=decode,
        align="edge",
        color=plotting.COLORS["prefill"],
        label="prefill tokens",
    )
    plotting.legend_outside(ax)
    return ax


def step_times(
    results: SimResult | Mapping[str, SimResult], ax=None, start: float | None = None, end: float | None = None
):
    """How long each step took (ms) against when it started: a running stream waits this long per token."""
    ax = plotting.new_figure("Duration of each engine step", "time (s)", "step duration (ms)", ax=ax)
    for color, (label, result) in zip(PALETTE * 4, _as_runs(results).items()):
        steps = result.steps
        keep = _window(steps, start, end)
        ax.step(steps.start[keep], steps.duration[keep] * 1e3, where="post", color=color, label=label, linewidth=1.5)
    if start is not None or end is not None:
        ax.set_xlim(start, end)
    plotting.legend_outside(ax)
    return ax
