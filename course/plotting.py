"""Plotting helpers with one look across the course.

Colours carry meaning everywhere: prefill/TTFT are orange, decode/ITL are blue, TPOT is green,
E2E is grey, and the naive average is red. Every figure gets a title and axis labels with units.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

COLORS = {
    "prefill": "#E07A1F",
    "ttft": "#E07A1F",
    "decode": "#2C6FBB",
    "itl": "#2C6FBB",
    "tpot": "#3A9A5B",
    "e2e": "#7F7F7F",
    "naive": "#C0392B",
    "memory": "#2C6FBB",
    "compute": "#E07A1F",
    "other": "#8E6BBF",
}

STYLE = {
    "figure.figsize": (7.0, 4.0),
    "figure.dpi": 100,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "axes.labelsize": 10,
    "legend.frameon": False,
    "legend.fontsize": 9,
    "lines.linewidth": 2.0,
    "lines.markersize": 5,
}


def use_course_style() -> None:
    """Apply the course look to every later matplotlib figure."""
    import matplotlib

    matplotlib.rcParams.update(STYLE)


def new_figure(title: str, xlabel: str, ylabel: str, *, logx: bool = False, logy: bool = False, ax=None):
    """A titled, labelled axes (a new figure unless ``ax`` is given); returns the axes."""
    import matplotlib.pyplot as plt

    use_course_style()
    if ax is None:
        _, ax = plt.subplots()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(_plain_numbers())
    if logy:
        ax.set_yscale("log")
    return ax


def _plain_numbers():
    """Tick labels like 16, 256, 0.5 instead of 2^4, 2^8, 2^-1."""
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: f"{value:g}")


def legend_outside(ax) -> None:
    """Put the legend to the right of the axes, where it cannot hide data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))


def line(ax, xs: Sequence[float], ys: Sequence[float], kind: str, label: str | None = None, **kwargs):
    """A line with markers in the colour of ``kind`` (see COLORS)."""
    return ax.plot(xs, ys, marker="o", color=COLORS.get(kind, COLORS["other"]), label=label, **kwargs)


def band(ax, xs: Sequence[float], low: Sequence[float], high: Sequence[float], kind: str):
    """Shade the spread (e.g. min..max of repeats) behind a line."""
    return ax.fill_between(xs, low, high, color=COLORS.get(kind, COLORS["other"]), alpha=0.18, linewidth=0)


def cdf(ax, values: Sequence[float], kind: str, label: str | None = None, scale: float = 1.0, color: str | None = None):
    """Empirical CDF of ``values`` (multiplied by ``scale``, e.g. 1e3 for ms).

    Drawn in the colour of ``kind`` (see COLORS), or in ``color`` when several runs of the same
    metric share one axes.
    """
    xs = np.sort(np.asarray(values, dtype=float)) * scale
    ys = np.arange(1, len(xs) + 1) / max(len(xs), 1)
    return ax.step(xs, ys, where="post", color=color or COLORS.get(kind, COLORS["other"]), label=label)


def mark_percentiles(ax, values: Sequence[float], kind: str, qs: Sequence[float] = (50, 95, 99), scale: float = 1.0):
    """Vertical dotted lines at the chosen percentiles of ``values``, labelled p50/p95/p99."""
    for q in qs:
        x = float(np.percentile(values, q)) * scale
        ax.axvline(x, color=COLORS.get(kind, COLORS["other"]), linestyle=":", linewidth=1)
        ax.annotate(f"p{q:g}", (x, 0.02), rotation=90, fontsize=8, xytext=(2, 0), textcoords="offset points")


def note(ax, text: str, width: int = 110) -> None:
    """A small grey caption under the plot (sources, runtime, settings), wrapped to ``width``."""
    import textwrap

    ax.annotate(
        textwrap.fill(text, width),
        (0, 0),
        xycoords="axes fraction",
        xytext=(0, -36),
        textcoords="offset points",
        fontsize=7.5,
        color="#666666",
        va="top",
    )
