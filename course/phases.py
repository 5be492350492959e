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

On a GPU the decode sweep runs twice: eagerly (a dynamic cache, one kernel launch at a time,
which for a model this small is bound by launches rather than bandwidth) and as CUDA-graph
replays of a static-cache step (:mod:`course.cuda_graphs`, the launch overhead removed). Both are
kept side by side; the decode figures above come from the graph sweep where there is one, and
say so (``decode_headline``). On a CPU there is no graph sweep and the figures are eager.

Module 1 prints them beside each measurement; ``benchmarks/phases.py --json`` prints them for
the runtime it runs on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from course import cuda_graphs, kernels, measure, noise, roofline
from course.hardware import MeasuredRoofs, measure_roofs
from course.measure import Timing
from course.models import LanguageModel

# A step at most this many times the batch-1 step counts as "nearly free" (the target
# for batch 8 on a CPU); the ridge batches below use the same threshold.
FREE_RATIO = 1.5
LONG_PROMPT = 512  # prefill at or above this many tokens should be compute-bound
# Torch threads for the phase measurements on a CPU runtime (module 1, section 3, says why): on the
# course's 2-core machine one thread with prepacked oneDNN weights met all three targets and torch's
# default two missed them (benchmarks/RESULTS.md, benchmarks/phases.py). The roofs are measured with the same count.
CPU_THREADS = 1


def phase_threads(lm: LanguageModel) -> int | None:
    """Torch threads to measure ``lm``'s phases with: CPU_THREADS on a CPU, None (torch's own) on a GPU."""
    return CPU_THREADS if lm.device.type == "cpu" else None


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
    decode: list[Timing]  # eager steps, one per batch size (size = batch), seconds per step
    prefill: list[Timing]  # one per prompt length (size = tokens), seconds per prefill
    threads: int
    load: float | None = None  # load average per core after measuring
    # The same sweep as CUDA-graph replays of a static-cache step (course.cuda_graphs); None off CUDA.
    decode_graph: list[Timing] | None = None
    graph_note: str = ""  # what the graph sweep did, or why there is none

    @property
    def decode_headline(self) -> str:
        """Which sweep the decode figures come from: "cuda-graph" where there is one, else "eager"."""
        return "cuda-graph" if self.decode_graph else "eager"

    def decode_timings(self, graph: bool | None = None) -> list[Timing]:
        """The eager sweep (graph False), the graph sweep (True), or the headline one (None)."""
        if graph is None:
            graph = bool(self.decode_graph)
        if not graph:
            return self.decode
        if not self.decode_graph:
            raise ValueError(f"no CUDA-graph decode sweep was measured: {self.graph_note or 'not asked for'}")
        return self.decode_graph

    def decode_at(self, batch: int, graph: bool | None = None) -> Timing:
        timings = self.decode_timings(graph)
        for t in timings:
            if t.size == batch:
                return t
        raise ValueError(f"batch {batch} was not measured; measured: {[t.size for t in timings]}")

    def decode_bandwidth(self, batch: int = 1, graph: bool | None = None) -> float:
        """Bytes per second the step at ``batch`` must have read (weights + KV)."""
        return decode_bytes_per_step(self.lm, batch, self.context) / self.decode_at(batch, graph).median

    def bandwidth_fraction(self, graph: bool | None = None) -> float:
        """Share of the measured bandwidth that the batch-1 step's bytes per second reach."""
        return self.decode_bandwidth(1, graph) / self.roofs.bandwidth

    @property
    def decode_bandwidth_fraction(self) -> float:
        """The headline share: from the CUDA-graph sweep where there is one, else the eager one."""
        return self.bandwidth_fraction()

    def decode_step_ratio(self, batch: int, graph: bool | None = None) -> float:
        return self.decode_at(batch, graph).median / self.decode_at(1, graph).median

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
        return observed_free_batch(self.decode_timings())

    def noise_check(self) -> noise.NoiseCheck:
        return noise.check(
            [*self.decode, *(self.decode_graph or []), *self.prefill],
            "the shares of the roofs and the batch ratios",
            load=self.load,
        )

    def decode_lines(self, graph: bool | None = None) -> list[str]:
        """One printed line per batch size: step time, ratio, bytes/s and its share of the roof."""
        lines = []
        for t in self.decode_timings(graph):
            bw = self.decode_bandwidth(t.size, graph)
            lines.append(
                f"batch {t.size:3d}: step {noise.spread_text(t)}, "
                f"{t.median / self.decode_at(1, graph).median:4.2f}x batch 1, "
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

        def ratio8(graph: bool | None) -> float | None:
            return self.decode_step_ratio(8, graph) if any(t.size == 8 for t in self.decode_timings(graph)) else None

        has_graph = bool(self.decode_graph)
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
            "decode_headline": self.decode_headline,
            "decode_bandwidth_fraction": self.decode_bandwidth_fraction,
            "decode_step_ratio_batch8": ratio8(None),
            "decode_bandwidth_fraction_eager": self.bandwidth_fraction(False),
            "decode_step_ratio_batch8_eager": ratio8(False),
            "decode_bandwidth_fraction_graph": self.bandwidth_fraction(True) if has_graph else None,
            "decode_step_ratio_batch8_graph": ratio8(True) if has_graph else None,
            "graph_note": self.graph_note,
            "free_batch_predicted": self.predicted_free_batch,
            "free_batch_observed": observed,
            "prefill_flops_fraction": self.prefill_flops_fraction,
            "decode_steps": {str(t.size): timing_dict(t) for t in self.decode},
            "decode_steps_graph": {str(t.size): timing_dict(t) for t in self.decode_graph} if has_graph else None,
            "prefill": {str(t.size): timing_dict(t) for t in self.prefill},
            "load_per_core": self.load,
            "noise_check_passed": check.ok,
            "noise_check": check.message,
        }


def timing_dict(t: Timing) -> dict[str, float]:
    """One timing as JSON-ready seconds and its count."""
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
    graph: bool | None = None,
) -> PhaseFigures:
    """Measure the roofs (unless given), a decode sweep and a prefill sweep of ``lm`` on ``path``.

    path: a :data:`course.kernels.KERNEL_PATHS` key; None keeps the model's current path.
    The decode cache is filled with random keys and values (see
    :func:`course.measure.filled_cache`), so the sweep costs decode steps only.
    graph: also time the decode sweep as CUDA-graph replays (:mod:`course.cuda_graphs`). None: on
    CUDA, and a failed capture is reported in ``graph_note`` instead of raised; True raises
    where it cannot run; False: eager only.
    """
    import torch

    default_batches, default_lengths = sweep_sizes(quick)
    if path is not None:
        kernels.use_kernel_path(lm.model, path)
    if roofs is None:
        roofs = measure_roofs(lm.device.type, lm.dtype, quick=quick)
    batches, steps = batch_sizes or default_batches, steps or (4 if quick else 8)
    decode = measure.decode_sweep(lm, batches, context, steps, prefill=False)
    decode_graph, graph_note = graph_sweep(lm, batches, context, steps, graph)
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
        decode_graph=decode_graph,
        graph_note=graph_note,
    )


def graph_sweep(
    lm: LanguageModel, batch_sizes: Sequence[int], context: int, steps: int, graph: bool | None = None
) -> tuple[list[Timing] | None, str]:
    """(the CUDA-graph decode sweep or None, what was done or why not), for :func:`measure_phases`.

    graph None: where CUDA graphs can run, and a capture that fails (a transformers version
    whose forward synchronises with the host, say) becomes the note; True: raise instead.
    """
    if graph is False:
        return None, "not asked for: decode timed eagerly only"
    if reason := cuda_graphs.graph_unavailable(lm):
        if graph:
            raise ValueError(reason)
        return None, reason
    try:
        timings = cuda_graphs.decode_sweep(lm, batch_sizes, context, steps, graph=True)
    except Exception as err:  # noqa: BLE001 - any capture failure is reported, the eager figures stand
        if graph:
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:200]
        return None, f"the CUDA-graph capture failed ({type(err).__name__}: {first_line}); decode timed eagerly only"
    return timings, cuda_graphs.WHAT_WAS_DONE
