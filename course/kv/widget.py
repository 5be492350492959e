"""The notebook widget: sliders for context, batch, KV dtype and GPU over one GPU's memory bar."""

from __future__ import annotations

from typing import Any

from course.hardware import GPUS
from course.kv import vllm
from course.kv.budget import GiB, KVBudget, budget
from course.kv.catalogue import get_model
from course.kv.dtypes import get_kv_dtype

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

    Keys: weights, overheads (activation peak + non-torch + CUDA graphs), kv used (whole blocks), kv free,
    reserved (1 - utilization), overflow (KV demand beyond the budget).
    """
    demand = batch * b.blocks_for(context) * b.page_bytes
    usable = b.num_blocks * b.page_bytes  # whole blocks; the rest of kv_memory counts as free but unusable
    used = min(demand, usable)
    return {
        "weights": b.weights,
        "overheads": b.activation_peak + b.non_torch + b.cuda_graphs,
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
    dtypes: tuple[str, ...] = ("bf16", "fp16", "fp8", "int8_per_token_head", "nvfp4", "fp32"),
    *,
    context: int = 4096,
    batch: int = 8,
    gpu: str = "H100-SXM",
    kv_dtype: str = "bf16",
    utilization: float = vllm.GPU_MEMORY_UTILIZATION,
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
