"""Cost models: how long one engine step takes, given what the step computes.

A step is described by four numbers, all counted by the scheduler:

* ``prefill_tokens``: prompt tokens computed this step (whole prompts, chunks of prompts, and the
  tokens a preempted request recomputes);
* ``decode_tokens``: running requests that each compute their one next token;
* ``kv_tokens_read``: cached tokens the step's attention reads (the context every scheduled
  request already had in the KV cache before the step);
* ``attention_pairs``: (query token, key token) pairs of the step's attention, for the attention
  FLOPs: a chunk of ``n`` tokens after ``c`` cached ones has ``n*c + n*(n+1)/2`` pairs.

Two models turn them into seconds:

* :class:`RooflineCost`, from a GPU's datasheet and a model's geometry: the step takes the longer
  of its compute time, FLOPs / (peak x efficiency), and its memory time, (weight bytes + KV bytes
  read) / (bandwidth x efficiency). Prefill-heavy steps land on the first, decode steps on the
  second. Efficiencies default to what measured GEMMs reach (see :data:`ROOFLINE_EFFICIENCY`).
* :class:`LinearCost`, ``a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_read``, fitted by
  least squares to step times measured on a real runtime (:meth:`LinearCost.fit`). This is the
  latency model of simulators such as BLIS/inference-sim (``L = b0 + b1*X + b2*Y``) with a KV term.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from course.geometry import ModelGeometry
from course.hardware import HardwareSpec

# Fraction of the datasheet roofs that dense GEMMs reach, derived from Vidur's measured GEMM times
# (github.com/microsoft/vidur, data/profiling/compute/*/mlp.csv):
# A100 and H100 decode steps reach 77-78 % of peak bandwidth, long prefills 73-77 % of peak FLOP/s,
# i.e. a pure roofline under-predicts by 1.3-1.5x (up to 2x near the ridge point).
ROOFLINE_EFFICIENCY = {"flops": 0.75, "bandwidth": 0.77}


class CostModel(Protocol):
    """Anything with ``step_seconds(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs=0)``."""

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float: ...


@dataclass(frozen=True)
class RooflineCost:
    """Step time from the roofline of ``hardware`` running ``geometry``.

    Args:
        geometry: the model (``num_params`` is needed: weights are read once per step).
        hardware: peak FLOP/s and bandwidth (datasheet or measured).
        bytes_per_value: 2 for bf16/fp16 weights and KV cache.
        flops_efficiency, bandwidth_efficiency: fraction of each roof that real kernels reach.
        step_overhead: fixed seconds per step (scheduler, kernel launches); 0 = pure roofline.
        attention_flops: count the attention's FLOPs (4 x layers x query heads x head_dim per pair)
            on top of 2 FLOPs per parameter per token.
    """

    geometry: ModelGeometry
    hardware: HardwareSpec
    bytes_per_value: float = 2.0
    flops_efficiency: float = ROOFLINE_EFFICIENCY["flops"]
    bandwidth_efficiency: float = ROOFLINE_EFFICIENCY["bandwidth"]
    step_overhead: float = 0.0
    attention_flops: bool = True

    def __post_init__(self) -> None:
        if self.geometry.num_params is None:
            raise ValueError(
                f"{self.geometry.name}: the roofline cost needs num_params (weights are read every step); "
                "pass a ModelGeometry with num_params set"
            )
        for name in ("flops_efficiency", "bandwidth_efficiency"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value}")

    # Cached: the cost is asked for every simulated step, and the geometry derives the KV bytes from
    # its layer kinds (one pass over the layers), which made 10,000-request runs 10-30 % slower.
    @functools.cached_property
    def weight_bytes(self) -> float:
        return self.geometry.num_params * self.bytes_per_value

    @functools.cached_property
    def kv_bytes_per_token(self) -> float:
        return self.geometry.kv_bytes_per_token(self.bytes_per_value)

    def flops(self, prefill_tokens: int, decode_tokens: int, attention_pairs: float = 0.0) -> float:
        g = self.geometry
        flops = 2.0 * g.num_params * (prefill_tokens + decode_tokens)
        if self.attention_flops:
            flops += 4.0 * g.num_layers * g.num_query_heads * g.head_dim * attention_pairs
        return flops

    def bytes_moved(self, kv_tokens_read: int) -> float:
        """Weights once per step, plus the cached KV that attention reads.

        Activations and the new tokens' KV writes are left out: for a 2048-token chunk of
        Llama-3-8B they are about 2 % of the 16 GB of weights.
        """
        return self.weight_bytes + self.kv_bytes_per_token * kv_tokens_read

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        compute = self.flops(prefill_tokens, decode_tokens, attention_pairs) / (
            self.hardware.flops * self.flops_efficiency
        )
        memory = self.bytes_moved(kv_tokens_read) / (self.hardware.bandwidth * self.bandwidth_efficiency)
        return self.step_overhead + max(compute, memory)

    def describe(self) -> str:
        return (
            f"roofline: {self.geometry.name} on {self.hardware.name}, {self.bytes_per_value:g} B/value, "
            f"efficiency {self.flops_efficiency:.0%} FLOP/s, {self.bandwidth_efficiency:.0%} bandwidth"
            + (f", {self.step_overhead * 1e3:g} ms overhead per step" if self.step_overhead else "")
        )


@dataclass(frozen=True)
class StepSample:
    """One measured step: what it computed and how long it took (s)."""

    prefill_tokens: int
    decode_tokens: int
    kv_tokens_read: int
    seconds: float


FEATURES = ("per step", "per prefill token", "per decode token", "per KV token read")


@dataclass(frozen=True)
class LinearCost:
    """``a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_read`` seconds per step.

    Attributes:
        a: fixed seconds per step (launches, Python, reading the weights when that does not grow).
        b: seconds per prefill token.
        c: seconds per decode token.
        d: seconds per cached KV token read by attention.
    """

    a: float
    b: float
    c: float
    d: float

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        return self.a + self.b * prefill_tokens + self.c * decode_tokens + self.d * kv_tokens_read

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return (self.a, self.b, self.c, self.d)

    def describe(self) -> str:
        return (
            f"linear: {self.a * 1e3:.3g} ms + {self.b * 1e6:.3g} us/prefill token + "
            f"{self.c * 1e6:.3g} us/decode token + {self.d * 1e9:.3g} ns/KV token read"
        )

    def predict(self, samples: Sequence[StepSample]) -> np.ndarray:
        """Predicted seconds of each sample's step."""
        return np.array([self.step_seconds(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read) for s in samples])

    @classmethod
    def fit(cls, samples: Sequence[StepSample], relative: bool = True) -> LinearCost:
        """Least-squares fit with every coefficient >= 0.

        ``relative=True`` minimises relative errors (each sample weighted by 1/seconds), so a
        2 ms decode step counts as much as a 200 ms prefill. The non-negative solution is exact:
        with four coefficients, every subset of them is solved and the best feasible one kept.
        Features that never vary in the samples get 0 (a constant column is the intercept's job).
        """
        if len(samples) < 2:
            raise ValueError(f"fitting a linear cost needs at least 2 measured steps, got {len(samples)}")
        x = np.array([[1.0, s.prefill_tokens, s.decode_tokens, s.kv_tokens_read] for s in samples])
        y = np.array([s.seconds for s in samples], dtype=float)
        if np.any(y <= 0):
            raise ValueError("measured step times must be positive")
        weights = 1.0 / y if relative else np.ones_like(y)
        xw, yw = x * weights[:, None], y * weights
        usable = [j for j in range(4) if j == 0 or np.ptp(x[:, j]) > 0]
        best, best_error = np.zeros(4), np.inf
        for size in range(1, len(usable) + 1):
            for subset in itertools.combinations(usable, size):
                coef, *_ = np.linalg.lstsq(xw[:, subset], yw, rcond=None)
                if np.any(coef < 0):
                    continue
                error = float(np.sum((xw[:, subset] @ coef - yw) ** 2))
                if error < best_error:
                    best_error = error
                    best = np.zeros(4)
                    best[list(subset)] = coef
        return cls(*(float(v) for v in best))


def samples_from_timings(
    prefill: Sequence = (), decode: Sequence = (), decode_context: int | None = None
) -> list[StepSample]:
    """Step samples from ``course.measure`` timings.

    ``prefill``: :class:`course.measure.Timing` of prefills (``size`` = prompt tokens, batch 1).
    ``decode``: timings of decode steps (``size`` = batch), each sequence holding ``decode_context``
    cached tokens, so the step reads ``batch x context`` KV tokens.
    """
    samples = [StepSample(t.size, 0, 0, t.median) for t in prefill]
    if decode and decode_context is None:
        raise ValueError("decode timings need decode_context (cached tokens per sequence)")
    samples += [StepSample(0, t.size, t.size * decode_context, t.median) for t in decode]
    return samples
