"""Weight-only quantization of a model's linear layers: a decode step that reads fewer bytes.

Decode is bound by reading the weights (module 1), so storing them in fewer bytes should make a
step faster by about the ratio of the bytes, as long as the kernel really reads the small format.
Weight-only means the activations stay in the model's dtype; only the stored weights shrink.

* int8, per output channel, symmetric: each row ``w`` of a weight matrix keeps ``round(w / s)`` in
  [-127, 127] with ``s = max|w| / 127``, one scale per row (what vLLM, TensorRT-LLM and torchao
  call per-channel weight-only int8). Two ways to run it:

  - :data:`INT8_KERNEL`: PyTorch's own int8 weight-only matmul (``torch.ops.aten._weight_int8pack_mm``,
    the CPU kernel torchao's int8 weight-only path calls), which reads the int8 weights directly;
  - :data:`INT8_DEQUANTIZE`: dequantize the whole matrix to the activation dtype on every call, then an
    ordinary matmul. It stores one byte per weight but *reads* more per step than the original (the
    int8 matrix, then the fp32 copy it wrote): a smaller model on disk, not a faster step.

* int4, per group of :data:`INT4_GROUP` input values, asymmetric (a scale and a zero point per group),
  :data:`INT4_KERNEL`: ``torch.ops.aten._weight_int4pack_mm_for_cpu``, where this PyTorch has it.

:func:`use_weight_only` switches a model's ``nn.Linear`` layers in place (and back to ``"fp"``),
like :func:`course.kernels.use_kernel_path`; :func:`weight_bytes_read` counts the bytes a decode step
reads on the path in force, for the roofline's prediction. Embedding tables stay as they are: a
step looks up one row per token, it does not read the table.

Both CPU kernels are fast only with bf16 activations: handed fp32 activations they fall back to a
slow path (measured on the course's 2-core machine, one thread, a 2816 x 1024 matrix times one
vector: int8 2.4 ms with fp32 activations against 0.15 ms with bf16; int4 13 ms against 0.16 ms;
fp32 ``F.linear`` 0.20 ms). So the kernel paths cast the activations to bf16 for the product and
the result back to the model's dtype: weight-only quantization with bf16 arithmetic, as torchao
and gpt-fast run it. The cast touches one activation vector per token, a few KiB, beside
megabytes of weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

FP = "fp"
INT8_KERNEL = "int8-kernel"
INT8_DEQUANTIZE = "int8-dequantize"
INT4_KERNEL = "int4-kernel"
QUANT_PATHS = {
    FP: "the weights as built (fp32 or bf16), torch.nn.functional.linear",
    INT8_KERNEL: "int8 per-channel weights read by PyTorch's int8 weight-only matmul (aten._weight_int8pack_mm)",
    INT8_DEQUANTIZE: "int8 per-channel weights dequantized to the activation dtype on every call, then a matmul",
    INT4_KERNEL: "int4 weights in groups of 128 (or 64, 32) with a scale and zero point each "
    "(aten._weight_int4pack_mm_for_cpu); a layer no group divides stays as built",
}
INT4_GROUP = 128  # input values per int4 scale and zero point (torchao's default group size)
# Group sizes the CPU int4 kernel takes; a layer whose d_in no group size divides stays unquantized.
INT4_GROUPS = (128, 64, 32)


def int4_group(d_in: int) -> int | None:
    """The largest group size of :data:`INT4_GROUPS` that divides ``d_in``, or None."""
    return next((g for g in INT4_GROUPS if d_in % g == 0), None)


def quantize_int8(weight: Any) -> tuple[Any, Any]:
    """(int8 weights, fp32 scales) of a (d_out, d_in) matrix, symmetric per output channel.

    scale[r] = max|weight[r]| / 127 (an all-zero row gets scale 1), q = round(weight / scale) in
    [-127, 127]; ``q * scale[:, None]`` gives the weights back within half a step per row.
    """
    import torch

    if weight.ndim != 2:
        raise ValueError(f"quantize_int8 wants a (d_out, d_in) matrix, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    scales = w.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.clamp(torch.round(w / scales[:, None]), -127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Any, scales: Any, dtype: Any = None) -> Any:
    """The (d_out, d_in) matrix ``q * scales[:, None]`` in ``dtype`` (default fp32)."""
    import torch

    return (q.float() * scales[:, None]).to(dtype or torch.float32)


def quantize_int4(weight: Any, group: int = INT4_GROUP) -> tuple[Any, Any]:
    """(values 0-15 as int32 (d_out, d_in), scales_and_zeros (d_in / group, d_out, 2)) of a matrix.

    Asymmetric per group of ``group`` input values: scale = (max - min) / 15, and the zero point
    is stored as the value of code 8 (the layout ``_weight_int4pack_mm_for_cpu`` expects:
    w = (q - 8) * scale + zero).
    """
    import torch

    d_out, d_in = weight.shape
    if d_in % group:
        raise ValueError(f"int4 needs d_in ({d_in}) to be a multiple of the group size ({group})")
    w = weight.detach().float().reshape(d_out, d_in // group, group)
    low, high = w.amin(dim=2), w.amax(dim=2)
    scales = ((high - low) / 15.0).clamp(min=1e-8)
    zeros = low + 8 * scales  # the value that code 8 stands for
    q = torch.clamp(torch.round((w - low[..., None]) / scales[..., None]), 0, 15).to(torch.int32)
    scales_and_zeros = torch.stack([scales, zeros], dim=2).transpose(0, 1).contiguous()  # (groups, d_out, 2)
    return q.reshape(d_out, d_in), scales_and_zeros


def dequantize_int4(q: Any, scales_and_zeros: Any, group: int = INT4_GROUP) -> Any:
    """The fp32 (d_out, d_in) matrix that :func:`quantize_int4`'s output stands for: (q - 8) x scale + zero."""
    d_out, d_in = q.shape
    scales = scales_and_zeros[..., 0].transpose(0, 1)  # (d_out, groups)
    zeros = scales_and_zeros[..., 1].transpose(0, 1)
    grouped = (q.reshape(d_out, d_in // group, group).float() - 8) * scales[..., None] + zeros[..., None]
    return grouped.reshape(d_out, d_in)


def int4_available() -> str | None:
    """None when this PyTorch can run the int4 CPU kernel, else why not."""
    import torch

    for op in ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu"):
        if not hasattr(torch.ops.aten, op):
            return f"this PyTorch ({torch.__version__}) has no torch.ops.aten.{op}"
    return None


KERNEL_ACTIVATIONS = "bfloat16"  # the activation dtype the CPU int8 and int4 kernels are fast with


def _int8_kernel_forward(q: Any, scales: Any, bias: Any) -> Callable[[Any], Any]:
    import torch

    compute = getattr(torch, KERNEL_ACTIVATIONS)
    bf16_scales = scales.to(compute)

    def forward(x: Any) -> Any:
        flat = x.reshape(-1, x.shape[-1]).to(compute)  # (tokens, d_in), bf16 for the kernel's fast path
        out = torch.ops.aten._weight_int8pack_mm(flat, q, bf16_scales).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], q.shape[0])

    return forward


def _int8_dequantize_forward(q: Any, scales: Any, bias: Any) -> Callable[[Any], Any]:
    import torch

    def forward(x: Any) -> Any:
        return torch.nn.functional.linear(x, dequantize_int8(q, scales, x.dtype), bias)

    return forward


def _int4_kernel_forward(packed: Any, scales_and_zeros: Any, group: int, d_out: int, bias: Any) -> Callable[[Any], Any]:
    import torch

    compute = getattr(torch, KERNEL_ACTIVATIONS)
    bf16_scales = scales_and_zeros.to(compute)

    def forward(x: Any) -> Any:
        flat = x.reshape(-1, x.shape[-1]).to(compute)  # bf16 for the kernel's fast path
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group, bf16_scales).to(x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], d_out)

    return forward


def use_weight_only(model: Any, path: str) -> int:
    """Run every ``nn.Linear`` of ``model`` on ``path`` (a :data:`QUANT_PATHS` key); in place.

    The quantized copies are made once per layer and kept beside the original weights, so
    switching back to :data:`FP` (or between paths) is free. Returns how many layers were switched.
    Raises ValueError for an unknown path, one this PyTorch cannot run, or a model off the CPU
    (the int8 and int4 kernels used here are PyTorch's CPU ones).
    """
    import torch

    _check_weight_path(model, path)
    switched = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and _switch_linear(module, path):
            switched += 1
    model._course_weight_path = path
    return switched


def _check_weight_path(model: Any, path: str) -> None:
    """Raise ValueError unless ``model``'s linear layers can run on ``path`` here (see :func:`use_weight_only`)."""
    if path not in QUANT_PATHS:
        raise ValueError(f"weight path {path!r}: choose one of {', '.join(QUANT_PATHS)}")
    if path == INT4_KERNEL and (reason := int4_available()):
        raise ValueError(f"{INT4_KERNEL} cannot run here: {reason}")
    device = next(model.parameters()).device
    if path != FP and device.type != "cpu":
        raise ValueError(f"weight-only {path} is wired to PyTorch's CPU kernels; the model is on {device.type}")


def _switch_linear(module: Any, path: str) -> bool:
    """Point one ``nn.Linear``'s forward at ``path``; False for a layer the int4 path leaves as built."""
    if path == FP:
        module.__dict__.pop("forward", None)
    elif path in (INT8_KERNEL, INT8_DEQUANTIZE):
        q, scales = quantize_int8_cached(module)
        make = _int8_kernel_forward if path == INT8_KERNEL else _int8_dequantize_forward
        module.forward = make(q, scales, module.bias)
    elif (group := int4_group(module.in_features)) is None:
        module.__dict__.pop("forward", None)  # no group size fits: this layer stays as built
        return False
    else:
        packed, scales_and_zeros = _int4_packed_cached(module, group)
        module.forward = _int4_kernel_forward(packed, scales_and_zeros, group, module.out_features, module.bias)
    return True


def _int4_packed_cached(module: Any, group: int) -> tuple[Any, Any]:
    """The int4 kernel's packed weights and their scales and zeros for a linear layer, made once and kept on it."""
    import torch

    if getattr(module, "_course_int4", None) is None:
        q, scales_and_zeros = quantize_int4(module.weight, group)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        module._course_int4 = (packed, scales_and_zeros)
    return module._course_int4


def weight_path(model: Any) -> str:
    """The path ``model``'s linear layers run on now (:data:`FP` unless switched)."""
    return getattr(model, "_course_weight_path", FP)


def _nbytes(*tensors: Any) -> int:
    return sum(t.nelement() * t.element_size() for t in tensors if t is not None)


def weight_bytes_read(model: Any, path: str | None = None) -> int:
    """Bytes of weights one decode step reads on ``path`` (default: the path in force).

    Every linear layer's stored weight (int8 plus its fp32 scales, packed int4 plus its scales and
    zeros, or the original) and bias, every other parameter except embedding tables (norms: read
    whole), which a step only looks up one row of. A tied LM head is a linear layer: read. On the
    dequantize path this is what is *stored*; the step reads it and then writes and reads an
    fp32 copy of every matrix on top (see the module docstring).
    """
    import torch

    path = weight_path(model) if path is None else path
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    seen = {id(m.weight) for m in linears} | {id(m.bias) for m in linears if m.bias is not None}
    embeddings = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    total = 0
    for m in linears:
        if path == FP:
            total += _nbytes(m.weight, m.bias)
        elif path in (INT8_KERNEL, INT8_DEQUANTIZE):
            total += _nbytes(*quantize_int8_cached(m), m.bias)
        elif int4_group(m.in_features) is None:
            total += _nbytes(m.weight, m.bias)  # stays as built on the int4 path
        else:
            total += _nbytes(*getattr(m, "_course_int4", None) or _int4_sizes(m), m.bias)
    for p in model.parameters():
        if id(p) not in seen and id(p) not in embeddings:
            total += _nbytes(p)
    return total


def quantize_int8_cached(module: Any) -> tuple[Any, Any]:
    """The int8 weights and scales of a linear layer, made once and kept on the layer."""
    if getattr(module, "_course_int8", None) is None:
        module._course_int8 = quantize_int8(module.weight)
    return module._course_int8


def _int4_sizes(module: Any) -> tuple[Any, Any]:
    """Stand-ins with the int4 path's sizes (half a byte per weight, two fp32 values per group)."""
    import torch

    d_out, d_in = module.weight.shape
    groups = d_in // int4_group(d_in)
    return torch.empty(d_out * d_in // 2, dtype=torch.uint8), torch.empty(groups, d_out, 2)


@dataclass(frozen=True)
class WeightPathFigures:
    """A batch-1 decode step on one weight path, against the bytes it reads and the memory roof.

    bytes_read: weights (as stored on the path) plus the KV cache, per step.
    step: the step's time across rounds (each round's value the fastest of its steps), seconds.
    bandwidth_fraction: median over rounds of bytes_read / step against the round's own streaming read.
    predicted: bytes_read / the best measured bandwidth: the roofline's lower bound on the step (s).
    """

    path: str
    bytes_read: float
    step: Any  # course.measure.Timing
    bandwidth_fraction: float
    predicted: float

    @property
    def stored_bytes_note(self) -> str:
        if self.path == INT8_DEQUANTIZE:
            return "stored int8, but each call writes and reads an fp32 copy of every matrix"
        return ""


def measure_weight_paths(
    lm: Any,
    paths: list[str],
    *,
    context: int = 256,
    steps: int = 8,
    rounds: int = 3,
    quick: bool = False,
) -> tuple[dict[str, WeightPathFigures], Any]:
    """Time a batch-1 decode step of ``lm`` on each weight path, interleaved with the memory roof.

    Each round measures the streaming read (best of 3, :func:`course.hardware.measure_roofs`), then
    one step sweep per path (the fastest of ``steps`` steps after a warm-up), so every path meets the
    same machine as its roof. Returns ({path: figures}, the roofs of all rounds combined). The
    model is left on :data:`FP`.
    """
    import statistics

    from course import measure, phases
    from course.hardware import measure_roofs

    if not paths:
        raise ValueError("give at least one weight path")
    times: dict[str, list[float]] = {p: [] for p in paths}
    fractions: dict[str, list[float]] = {p: [] for p in paths}
    needs = {}
    for p in paths:
        use_weight_only(lm.model, p)
        needs[p] = phases.decode_bytes_per_step(lm, 1, context, weight_bytes_read(lm.model))
    measured = []
    try:
        for _ in range(rounds):
            roofs = measure_roofs(lm.device.type, lm.dtype, quick=quick, repeats=3)
            measured.append(roofs)
            bandwidth = roofs.read_bytes / min(roofs.read_times)
            for p in paths:
                use_weight_only(lm.model, p)
                t = measure.decode_step_seconds(lm, 1, context, steps, prefill=False).low
                times[p].append(t)
                fractions[p].append(needs[p] / t / bandwidth)
    finally:
        use_weight_only(lm.model, FP)
    roofs = phases.combine_roofs(measured)
    figures = {
        p: WeightPathFigures(
            p,
            needs[p],
            measure.Timing.of(1, times[p]),
            statistics.median(fractions[p]),
            needs[p] / roofs.bandwidth,
        )
        for p in paths
    }
    return figures, roofs
