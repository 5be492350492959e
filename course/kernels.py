"""Which CPU kernels a model's linear layers run: the stock path or prepacked oneDNN weights.

On a CPU the math library decides whether a small decode batch is free. PyTorch's stock
``F.linear`` hands each (batch x d_in) @ (d_in x d_out) product to MKL or oneDNN with the
weights in their plain row-major layout; for batch 1 that is a matrix-vector product that
streams the weights at full bandwidth, but for batches of 2-16 some library versions choose a
blocking that reads the weights several times, and the step grows with the batch although the
physics says it should not. Reordering each weight once into oneDNN's blocked layout (what
``torch.compile`` with freezing does on a CPU) lets every batch size read it once.

A third path writes the same product as ``W @ X^T`` (a matrix times a few vectors), which asks
BLAS for a different kernel shape without any reordering. :func:`use_kernel_path` switches a
model between them in place; module 1 measures the stock and packed paths side by side,
``benchmarks/phases.py`` all three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

STOCK = "stock"
PACKED = "onednn-packed"
WEIGHT_MAJOR = "weight-major"
KERNEL_PATHS = {
    STOCK: "torch.nn.functional.linear on the plain weights (MKL / oneDNN choose the kernel per call)",
    PACKED: "oneDNN linear on weights reordered once into its blocked layout (torch.ops.mkldnn)",
    WEIGHT_MAJOR: "the same product written W @ X^T, a matrix times a few vectors (another BLAS kernel shape)",
}


def packed_path_available(model: Any) -> str | None:
    """None when the packed path can run ``model``, else the reason it cannot."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN (mkldnn)"
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the packed path is for CPUs; the model is on {param.device.type}"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN packs fp32 and bf16 weights, not {param.dtype}"
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return "this PyTorch has no torch.ops.mkldnn._reorder_linear_weight"
    return None


def packed_linear(weight, bias) -> Callable:
    """``x -> x @ weight.T + bias`` with oneDNN's linear on ``weight`` (``(d_out, d_in)``) reordered once into its
    blocked layout (a copy beside the original); ``x`` is ``(..., d_in)``."""
    import torch

    with torch.no_grad():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def forward(x):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return forward


def _weight_major_forward(weight, bias):
    def forward(x):
        flat = x.reshape(-1, x.shape[-1])  # (tokens, d_in)
        out = (weight @ flat.T).T  # (d_out, d_in) @ (d_in, tokens): the batch is the narrow side
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])

    return forward


def use_kernel_path(model: Any, path: str) -> int:
    """Make every ``nn.Linear`` of ``model`` run on ``path`` (``STOCK`` or ``PACKED``); in place.

    The packed path keeps a reordered copy of each weight beside the original (the original
    stays for the stock path and for tied embeddings). Returns how many layers were switched.
    The weight-major path runs anywhere (CPU or GPU). Raises ValueError for an unknown path or
    one this runtime cannot run.
    """
    import torch

    if path not in KERNEL_PATHS:
        raise ValueError(f"kernel path {path!r}: choose one of {', '.join(KERNEL_PATHS)}")
    if path == PACKED and (reason := packed_path_available(model)):
        raise ValueError(f"kernel path {PACKED!r} cannot run here: {reason}; use {STOCK!r}")
    switched = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if path == STOCK:
            module.__dict__.pop("forward", None)  # back to the class's own forward
        elif path == WEIGHT_MAJOR:
            module.forward = _weight_major_forward(module.weight, module.bias)
        else:
            forward = getattr(module, "_course_packed_forward", None)
            if forward is None:  # packed once per layer, however often the path is switched
                forward = module._course_packed_forward = packed_linear(module.weight, module.bias)
            module.forward = forward
        switched += 1
    model._course_kernel_path = path
    return switched


def kernel_path(model: Any) -> str:
    """The path ``model``'s linear layers run on now."""
    return getattr(model, "_course_kernel_path", STOCK)


@contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run the block with ``threads`` torch intra-op threads, then restore the previous count.

    None leaves torch's own count. Yields the count in force. On a small CPU this decides
    whether a small decode batch is free: a step split across every core waits for the slowest
    one, so a second core busy with other work makes the whole step wait.
    """
    import torch

    if threads is not None and threads < 1:
        raise ValueError(f"threads must be a positive count (or None for torch's own), not {threads}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
