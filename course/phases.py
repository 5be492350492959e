"""Prefill and decode measured against this runtime's own roofs: the course's central claim, live.

The claim: prefill is limited by FLOP/s, decode by reading the weights (and the KV cache) once
per step, so a decode batch is almost free until it reaches the ridge point. This module turns
timings from :mod:`course.measure` on a model that is far larger than the CPU's caches
(:func:`course.models.load_phase_model`) into the figures that test it:

* ``decode_bandwidth_fraction``: bytes a batch-1 decode step must read (weights + KV cache) per
  second of step time, as a share of the measured streaming-read bandwidth;
* ``decode_step_ratio(8)``: the step at batch 8 over the step at batch 1;
* the batch where the step stops being nearly free (more than :data:`FREE_RATIO` x batch 1),
  predicted by the roofline from the measured roofs and observed in the sweep;
* ``prefill_flops_fraction``: achieved FLOP/s of the best prefill of at least 512 tokens, as a
  share of the measured matmul FLOP/s.

Module 1 prints them beside each measurement; ``benchmarks/phases.py --json`` prints them for
the runtime it runs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from course import kernels, measure, noise, roofline
from course.hardware import MeasuredRoofs, measure_roofs
from course.measure import Timing
from course.models import LanguageModel

# A step at most this many times the batch-1 step counts as "nearly free" (the target
# for batch 8 on a CPU); the ridge batches below use the same threshold.
FREE_RATIO = 1.5
LONG_PROMPT = 512  # prefill at or above this many tokens should be compute-bound


def decode_bytes_per_step(lm: LanguageModel, batch: int, context: int) -> float:
    """Bytes one decode step must read: every weight once, plus each sequence's KV cache."""
    return lm.weight_bytes + batch * context * lm.geometry.kv_bytes_per_token(lm.dtype.itemsize)


def decode_flops_per_step(lm: LanguageModel, batch: int, context: int) -> float:
    """FLOPs of one decode step (2 per parameter per token, plus attention over the cache)."""
    return roofline.decode_step_flops_bytes(lm.geometry, batch, context, lm.dtype.itemsize)[0]


def prefill_flops(lm: LanguageModel, prompt_tokens: int) -> float:
    """FLOPs of prefilling one prompt of ``prompt_tokens`` (logits at every position)."""
    return roofline.prefill_flops_bytes(lm.geometry, prompt_tokens, lm.dtype.itemsize)[0]


def roofline_step_seconds(lm: LanguageModel, roofs: MeasuredRoofs, batch: float, context: int) -> float:
    """The roofline's lower bound on a decode step at ``batch`` on the measured roofs."""
    per_sequence_flops = decode_flops_per_step(lm, 1, context)
    kv = context * lm.geometry.kv_bytes_per_token(lm.dtype.itemsize)
    return max(batch * per_sequence_flops / roofs.flops, (lm.weight_bytes + batch * kv) / roofs.bandwidth)


def predicted_free_batch(lm: LanguageModel, roofs: MeasuredRoofs, context: int) -> float:
    """The batch at which the roofline step time reaches FREE_RATIO x its batch-1 time.

    Below it the step reads the weights and little else; above it the FLOPs (or the batch's
    own KV reads) take over. inf when neither ever does.
    """
    target = FREE_RATIO * roofline_step_seconds(lm, roofs, 1, context)
    per_sequence_flops = decode_flops_per_step(lm, 1, context)
    kv = context * lm.geometry.kv_bytes_per_token(lm.dtype.itemsize)
    by_compute = target * roofs.flops / per_sequence_flops
    by_kv = (target * roofs.bandwidth - lm.weight_bytes) / kv if kv > 0 else math.inf
    return min(by_compute, by_kv)


def observed_free_batch(decode: Sequence[Timing]) -> float | None:
    """The batch where the measured step first exceeds FREE_RATIO x batch 1 (log-interpolated).

    None when no measured batch exceeds it: the free ride lasts beyond the sweep.
    """
    by_batch = sorted(decode, key=lambda t: t.size)
    base = by_batch[0].median
    for earlier, later in zip(by_batch, by_batch[1:]):
        r0, r1 = earlier.median / base, later.median / base
        if r1 > FREE_RATIO:
            if r0 >= FREE_RATIO or r1 == r0:
                return float(later.size)
            frac = (FREE_RATIO - r0) / (r1 - r0)
            return float(math.exp(math.log(earlier.size) + frac * (math.log(later.size) - math.log(earlier.size))))
    return None


@dataclass
class PhaseFigures:
    """Phase timings of one model on one kernel path, with the roofs they are compared with."""

    lm: LanguageModel = field(repr=False)
    roofs: MeasuredRoofs
    kernel_path: str
    context: int  # cached tokens per sequence in the decode sweep
    decode: list[Timing]  # one per batch size (size = batch), seconds per step
    prefill: list[Timing]  # one per prompt length (size = tokens), seconds per prefill
    threads: int
    load: float | None = None  # load average per core after measuring

    def decode_at(self, batch: int) -> Timing:
        for t in self.decode:
            if t.size == batch:
                return t
        raise ValueError(f"batch {batch} was not measured; measured: {[t.size for t in self.decode]}")

    def decode_bandwidth(self, batch: int = 1) -> float:
        """Bytes per second the step at ``batch`` must have read (weights + KV)."""
        return decode_bytes_per_step(self.lm, batch, self.context) / self.decode_at(batch).median

    @property
    def decode_bandwidth_fraction(self) -> float:
        return self.decode_bandwidth(1) / self.roofs.bandwidth

    def decode_step_ratio(self, batch: int) -> float:
        return self.decode_at(batch).median / self.decode_at(1).median

    def prefill_flops_per_s(self, timing: Timing) -> float:
        return prefill_flops(self.lm, timing.size) / timing.median

    @property
    def prefill_flops_fraction(self) -> float:
        """Best achieved share of the matmul roof at >= LONG_PROMPT tokens (the longest if none is)."""
        long = [t for t in self.prefill if t.size >= LONG_PROMPT] or [max(self.prefill, key=lambda t: t.size)]
        return max(self.prefill_flops_per_s(t) for t in long) / self.roofs.flops

    @property
    def predicted_free_batch(self) -> float:
        return predicted_free_batch(self.lm, self.roofs, self.context)

    @property
    def observed_free_batch(self) -> float | None:
        return observed_free_batch(self.decode)

    def noise_check(self) -> noise.NoiseCheck:
        return noise.check(
            [*self.decode, *self.prefill],
            "the shares of the roofs and the batch ratios",
            load=self.load,
        )

    def decode_lines(self) -> list[str]:
        """One printed line per batch size: step time, ratio, bytes/s and its share of the roof."""
        lines = []
        for t in self.decode:
            bw = self.decode_bandwidth(t.size)
            lines.append(
                f"batch {t.size:3d}: step {noise.spread_text(t)}, {t.median / self.decode_at(1).median:4.2f}x batch 1, "
                f"reads {bw / 1e9:5.1f} GB/s = {bw / self.roofs.bandwidth:4.0%} of the measured "
                f"{self.roofs.bandwidth / 1e9:.1f} GB/s"
            )
        return lines

    def prefill_lines(self) -> list[str]:
        lines = []
        for t in self.prefill:
            f = self.prefill_flops_per_s(t)
            lines.append(
                f"{t.size:5d} tokens: {noise.spread_text(t)}, {f / 1e9:6.1f} GFLOP/s = "
                f"{f / self.roofs.flops:4.0%} of the "
                f"measured {self.roofs.flops / 1e9:.0f} GFLOP/s {self.roofs.dtype} matmul"
            )
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain JSON-ready values (seconds, bytes/s, FLOP/s unless named otherwise)."""
        observed = self.observed_free_batch
        check = self.noise_check()
        ratio8 = self.decode_step_ratio(8) if any(t.size == 8 for t in self.decode) else None
        return {
            "device": self.roofs.name,
            "model": self.lm.name,
            "model_params": self.lm.num_params,
            "weight_bytes": self.lm.weight_bytes,
            "dtype": str(self.lm.dtype).removeprefix("torch."),
            "kernel_path": self.kernel_path,
            "threads": self.threads,
            "measured_bandwidth_gbs": self.roofs.bandwidth / 1e9,
            "measured_flops_gflops": self.roofs.flops / 1e9,
            "roofs_source": self.roofs.source,
            "decode_context_tokens": self.context,
            "decode_bandwidth_fraction": self.decode_bandwidth_fraction,
            "decode_step_ratio_batch8": ratio8,
            "free_batch_predicted": self.predicted_free_batch,
            "free_batch_observed": observed,
            "prefill_flops_fraction": self.prefill_flops_fraction,
            "decode_steps": {str(t.size): _timing_dict(t) for t in self.decode},
            "prefill": {str(t.size): _timing_dict(t) for t in self.prefill},
            "load_per_core": self.load,
            "noise_check_passed": check.ok,
            "noise_check": check.message,
        }


def _timing_dict(t: Timing) -> dict[str, float]:
    return {"median_s": t.median, "min_s": t.low, "max_s": t.high, "n": t.n}


def sweep_sizes(quick: bool) -> tuple[list[int], list[int]]:
    """(batch sizes, prompt lengths) of the phase sweeps; quick mode keeps batches 1 and 8, short prompts."""
    if quick:
        return [1, 8], [32, 256]
    return [1, 2, 4, 8, 16, 32], [32, 128, 512, 1024]


def measure_phases(
    lm: LanguageModel,
    *,
    quick: bool = False,
    path: str | None = None,
    roofs: MeasuredRoofs | None = None,
    batch_sizes: Sequence[int] | None = None,
    prompt_lengths: Sequence[int] | None = None,
    context: int = 256,
    steps: int | None = None,
    repeats: int = 3,
) -> PhaseFigures:
    """Measure the roofs (unless given), a decode sweep and a prefill sweep of ``lm`` on ``path``.

    path: a :data:`course.kernels.KERNEL_PATHS` key; None keeps the model's current path.
    The decode cache is filled with random keys and values (see
    :func:`course.measure.filled_cache`), so the sweep costs decode steps only.
    """
    import torch

    default_batches, default_lengths = sweep_sizes(quick)
    if path is not None:
        kernels.use_kernel_path(lm.model, path)
    if roofs is None:
        roofs = measure_roofs(lm.device.type, lm.dtype, quick=quick)
    decode = measure.decode_sweep(
        lm, batch_sizes or default_batches, context, steps or (4 if quick else 8), prefill=False
    )
    prefill = measure.prefill_sweep(lm, prompt_lengths or default_lengths, repeats=repeats)
    return PhaseFigures(
        lm=lm,
        roofs=roofs,
        kernel_path=kernels.kernel_path(lm.model),
        context=context,
        decode=decode,
        prefill=prefill,
        threads=torch.get_num_threads(),
        load=noise.load_per_core(),
    )
