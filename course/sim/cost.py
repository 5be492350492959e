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
  latency model of simulators such as BLIS/inference-sim (``L = b0 + b1*X + b2*Y``) with a KV term,
  and an ``f`` per attention pair among a step's prefill tokens (:func:`prefill_pairs`), because a
  prompt's attention grows with its square while the rest of its pass grows with its length: the
  ``n_ctx`` term of the forward FLOPs per token in Kaplan et al., "Scaling Laws for Neural Language
  Models" (2020, table 1), and the roofline's ``attention_pairs`` below; and a ``g`` per step of two
  or more token rows, because a single decode row multiplies every weight matrix by one vector
  (a matrix-vector kernel) and more rows take a matrix-matrix kernel with a fixed cost of its own.
  What a server spends outside the forward pass is part of it too, fitted from the same
  measurements: ``e`` seconds for every request whose prompt a step starts (parsing the HTTP
  request, tokenizing, the hand-off to the engine and the first token's way out, where they share
  the engine's CPU), or a ``latency`` that every request spends off the engine's steps (an API
  server in another process: vLLM's front end); and the step-time spread, the measured steps'
  relative deviations from their mean (decode steps and prefill steps apart), which the simulator
  draws for each step from a seeded hash of the step's index (:func:`spread_draw`), so a simulation
  stays deterministic.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from course import roofline
from course.geometry import ModelGeometry
from course.hardware import HardwareSpec
from course.sim.rules import SHARED_CORE_SLOWDOWN

# Fraction of the datasheet roofs that dense GEMMs reach, derived from Vidur's measured GEMM times
# (github.com/microsoft/vidur, data/profiling/compute/*/mlp.csv):
# A100 and H100 decode steps reach 77-78 % of peak bandwidth, long prefills 73-77 % of peak FLOP/s,
# i.e. a pure roofline under-predicts by 1.3-1.5x (up to 2x near the ridge point).
ROOFLINE_EFFICIENCY = {"flops": 0.75, "bandwidth": 0.77}


class CostModel(Protocol):
    """Anything with ``step_seconds(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs=0)``, and
    optionally a ``spread_draw`` (:func:`spread_draw`) that the simulator multiplies each step by."""

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
        weight_bytes_per_param: bytes per stored weight when they differ from the KV cache's (1 for fp8
            or int8 weights, 0.5 for int4); None: 1 where the model publishes fp8 weights (its config's
            ``quantization_config``, e.g. DeepSeek-V3), else ``bytes_per_value``.
        flops_efficiency, bandwidth_efficiency: fraction of each roof that real kernels reach.
        step_overhead: fixed seconds per step (scheduler, kernel launches); 0 = pure roofline.
        attention_flops: count the attention's FLOPs (4 x attention layers x query heads x head_dim per
            pair) on top of 2 FLOPs per active parameter per token. Only the layers that attend over
            the cache count: a hybrid's linear-attention or Mamba layers (Qwen3-Next's three in four)
            keep a constant-size state instead. A sliding-window layer is counted as if it attended to
            the whole context, an upper bound.
        moe: the mixture-of-experts layout of ``geometry`` (:class:`course.roofline.MoeLayout`); None:
            the catalogue's by the geometry's name (``course.roofline.MOE_MODELS``), else a dense
            model. A part of a model (a pipeline stage, a tensor-parallel shard) passes its own
            (:func:`course.sim.parallel.shard_moe_layout`).

    A dense model computes through every parameter for every token and reads them all every step. A
    mixture of experts computes through its active parameters only (its dense part, shared experts
    and top-k routed experts: DeepSeek-V3's 37 B of 671 B) and reads its dense part plus the experts
    the step's tokens were routed to; both counts come from :meth:`params_run`.
    """

    geometry: ModelGeometry
    hardware: HardwareSpec
    bytes_per_value: float = 2.0
    weight_bytes_per_param: float | None = None
    flops_efficiency: float = ROOFLINE_EFFICIENCY["flops"]
    bandwidth_efficiency: float = ROOFLINE_EFFICIENCY["bandwidth"]
    step_overhead: float = 0.0
    attention_flops: bool = True
    moe: roofline.MoeLayout | None = None

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
        if self.moe is None:
            object.__setattr__(self, "moe", roofline.moe_layout(self.geometry))

    # Cached: the cost is asked for every simulated step, and the geometry derives the KV bytes from
    # its layer kinds (one pass over the layers), which made 10,000-request runs 10-30 % slower.
    @functools.cached_property
    def bytes_per_weight(self) -> float:
        """Bytes one stored weight takes (see ``weight_bytes_per_param``)."""
        if self.weight_bytes_per_param is not None:
            return self.weight_bytes_per_param
        return 1.0 if self.geometry.weight_dtype == "fp8" else self.bytes_per_value

    @functools.cached_property
    def weight_bytes(self) -> float:
        """Bytes of every weight: what a dense model reads each step (a MoE model: at most this)."""
        return self.geometry.num_params * self.bytes_per_weight

    def params_run(self, tokens: float) -> float:
        """Parameters a step of ``tokens`` tokens runs: every one of a dense model; a mixture of experts'
        dense part and the experts those tokens were routed to (:meth:`course.roofline.MoeLayout.params_read`:
        the active parameters at one token, every expert for a long prefill), at most all of them."""
        if self.moe is None:
            return self.geometry.num_params
        return min(self.moe.params_read(max(tokens, 1)), self.geometry.num_params)

    @functools.cached_property
    def active_params(self) -> float:
        """Parameters one token computes through (2 FLOPs each): :meth:`params_run` of one token."""
        return self.params_run(1)

    def weight_bytes_read(self, tokens: float) -> float:
        """Weight bytes a step of ``tokens`` tokens reads (:meth:`params_run`): all of them for a dense
        model, the dense part and the experts routed to for a mixture of experts."""
        if self.moe is None:
            return self.weight_bytes
        return self.params_run(tokens) * self.bytes_per_weight

    @functools.cached_property
    def kv_bytes_per_token(self) -> float:
        return self.geometry.kv_bytes_per_token(self.bytes_per_value)

    @functools.cached_property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (query token, key token) pair (:func:`course.roofline.attention_flops_per_pair`),
        cached: the geometry counts its attention layers in a pass over every layer."""
        return roofline.attention_flops_per_pair(self.geometry)

    def flops(self, prefill_tokens: int, decode_tokens: int, attention_pairs: float = 0.0) -> float:
        """FLOPs of the step: 2 per active parameter per token (each token runs only its own experts, however
        many the batch touches), plus the attention's per (query, key) pair."""
        flops = 2.0 * self.active_params * (prefill_tokens + decode_tokens)
        if self.attention_flops:
            flops += self.attention_flops_per_pair * attention_pairs
        return flops

    def bytes_moved(self, kv_tokens_read: int, tokens: float | None = None) -> float:
        """Weights once per step (only those ``tokens`` tokens were routed to, for a mixture of experts;
        None: every weight), plus the cached KV that attention reads.

        Activations and the new tokens' KV writes are left out: for a 2048-token chunk of
        Llama-3-8B they are about 2 % of the 16 GB of weights.
        """
        weights = self.weight_bytes if tokens is None else self.weight_bytes_read(tokens)
        return weights + self.kv_bytes_per_token * kv_tokens_read

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        compute = self.flops(prefill_tokens, decode_tokens, attention_pairs) / (
            self.hardware.flops * self.flops_efficiency
        )
        tokens = prefill_tokens + decode_tokens
        memory = self.bytes_moved(kv_tokens_read, tokens) / (self.hardware.bandwidth * self.bandwidth_efficiency)
        return self.step_overhead + max(compute, memory)

    def describe(self) -> str:
        return (
            f"roofline: {self.geometry.name} on {self.hardware.name}, {self.bytes_per_value:g} B/value"
            + (f" ({self.bytes_per_weight:g} B/weight)" if self.bytes_per_weight != self.bytes_per_value else "")
            + ", "
            f"efficiency {self.flops_efficiency:.0%} FLOP/s, {self.bandwidth_efficiency:.0%} bandwidth"
            + (f", {self.step_overhead * 1e3:g} ms overhead per step" if self.step_overhead else "")
        )


@dataclass(frozen=True)
class StepSample:
    """One measured step: what it computed and how long it took (s).

    ``deviations`` (optional): the single measurements this sample summarizes, each minus their
    mean (s), e.g. every chunk gap of a decode microbenchmark; :meth:`LinearCost.fit` turns them
    into the step-time spread. A sample with ``prefill_tokens`` is one prompt's prefill (batch 1),
    as every calibration in the course measures it, unless ``attention_pairs`` says otherwise (the
    step's (query, key) pairs as the simulator counts them; 0: one fresh prompt, decodes reading
    their cache).
    """

    prefill_tokens: int
    decode_tokens: int
    kv_tokens_read: int
    seconds: float
    deviations: tuple[float, ...] = field(default=(), kw_only=True)
    attention_pairs: float = field(default=0.0, kw_only=True)


FEATURES = (
    "per step",
    "per prefill token",
    "per decode token",
    "per KV token read",
    "per prompt started",
    "per prefill attention pair",
    "per step of two or more token rows",
)
FRONT_END = ("step", "latency", "none")
# Probabilities at which a fitted spread keeps its quantiles (every 2.5 %: p95 and p97.5 are points).
SPREAD_PROBABILITIES = tuple(np.linspace(0.0, 1.0, 41))
# Prompt lengths a fit needs before it fits the prefill's attention term f: one more than the prefill's
# three terms (intercept, per token, per pair), so that the curve is checked by a point it does not pass
# through by construction.
CURVE_LENGTHS = 4
# A step with a large negative draw still lasts this fraction of its expected time: measured gaps near 0
# are chunks a client read in one burst, not steps that took no time.
MIN_STEP_FRACTION = 0.05


def prefill_pairs(
    prefill_tokens: float, decode_tokens: float, kv_tokens_read: float, attention_pairs: float = 0.0
) -> float:
    """The attention pairs a step's prefill tokens compute beyond one read of each cached token (which
    ``d`` charges): the step's pairs less its KV reads and one pair per decode (a decode of ``c`` cached
    tokens has ``c + 1`` pairs). A fresh prompt of ``n`` tokens: ``n(n+1)/2``; a chunk of ``n`` after
    ``c`` cached tokens: ``(n-1)c + n(n+1)/2``. Without ``attention_pairs`` (a plan reading a lone
    request's time off the cost) the prefill tokens are one fresh prompt. 0 without prefill tokens.
    """
    if prefill_tokens <= 0:
        return 0.0
    if attention_pairs <= 0:
        return prefill_tokens * (prefill_tokens + 1) / 2.0
    return max(attention_pairs - kv_tokens_read - decode_tokens, 0.0)


def prompts_started(
    prefill_tokens: float, decode_tokens: float, kv_tokens_read: float, attention_pairs: float = 0.0
) -> float:
    """How many prompts a step prefills, from its load (0 for a step without prefill tokens).

    The engine counts tokens, not requests, so the count is read off the attention pairs: a decode
    step's request contributes ``context + 1`` pairs (``context`` of them KV reads), a fresh prompt of
    ``n`` tokens ``n(n+1)/2``. Take the decodes out, and ``k`` prompts of ``n_i`` tokens leave
    ``S = sum n_i(n_i+1)/2``; then ``(sum n_i)^2 / (2S - sum n_i) = (sum n_i)^2 / sum n_i^2``, exactly
    ``k`` when the prompts are of one length and fewer when they differ (the effective count). A
    chunk after cached tokens (chunked prefill, a prefix-cache hit) counts as one prompt, and without
    ``attention_pairs`` every prefilling step counts as one.
    """
    if prefill_tokens <= 0:
        return 0.0
    own_pairs = attention_pairs - kv_tokens_read - decode_tokens
    squares = 2.0 * own_pairs - prefill_tokens
    if own_pairs <= 0 or squares <= 0:
        return 1.0
    return max(1.0, prefill_tokens * prefill_tokens / squares)


_MASK64 = (1 << 64) - 1


def _unit(seed: int, step: int) -> float:
    """A uniform number in [0, 1) from ``seed`` and a step's index: splitmix64's finalizer over each.

    A pure function of its inputs (no generator state), so a simulation with a spread gives the same
    result every time it runs with the same seed, whatever ran before it; and keyed by the step's
    index, not its load, so that steps of the same load (every lone prefill of a prompt size, the
    k-th decode step of every lone request) draw apart.
    """
    h = seed & _MASK64
    for value in (step, 0x5EED):
        h = ((h ^ (value & _MASK64)) + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h / 2.0**64


def spread_draw(cost) -> Callable[[int, bool], float] | None:
    """The function that draws a simulated step's time ratio, ``draw(step index, prefills) -> ratio``
    (the step takes its cost's seconds times the ratio), or None for a cost without a spread: its
    ``spread_draw`` attribute (:attr:`LinearCost.spread_draw`; a wrapper forwards its inner cost's).
    The simulator applies it, not the cost, because only the simulator knows which step it is."""
    return getattr(cost, "spread_draw", None)


@dataclass(frozen=True)
class LinearCost:
    """``a + b*prefill_tokens + c*decode_tokens + d*kv_tokens_read + e*prompts + f*prefill_pairs``, plus
    ``g`` when the step computes two or more tokens, seconds per step, times ``1 + r`` with ``r`` drawn
    from the step's spread when the cost has one.

    Attributes:
        a: fixed seconds per step (launches, Python, reading the weights when that does not grow).
        b: seconds per prefill token.
        c: seconds per decode token; on a server measured from outside it includes what the server
            spends per streamed token outside the forward pass (sampling, detokenizing, writing the
            chunk), since every decode token is streamed.
        d: seconds per cached KV token read by attention.
        e: seconds per prompt the step starts (:func:`prompts_started`): the front end's work per
            request where it shares the engine's CPU (parsing, tokenizing, the hand-off to the
            engine, the first token's way out), so running requests wait for it too.
        f: seconds per attention pair among the step's prefill tokens (:func:`prefill_pairs`; a fresh
            prompt of ``n`` tokens has ``n(n+1)/2``): the attention's scores and weighted sums, which grow
            with the square of a prompt where everything in ``b`` grows with its length.
        g: seconds more for a step that computes two or more tokens (token rows) than the line gives: a
            lone decode token multiplies each weight matrix by a vector, more rows go through a
            matrix-matrix kernel with a fixed cost of its own (the course's server on a CPU sends one
            row to PyTorch's matrix-vector product and more to oneDNN's packed-weight kernel,
            ``course.serving.runner``; cuBLAS too picks a matrix-vector kernel for one row).
        before_engine: seconds of the front end's work on each request before the engine can schedule
            it (reading, parsing and tokenizing it), where the front end shares the engine's core: the
            request reaches the queue that long after it arrives, twice that long when it arrives
            during a step, which then lasts that much longer (the two share the core:
            :class:`course.sim.rules.FrontDoor`; iteration-level schedulers). With
            ``e``, what a lone request's TTFT costs beyond the forward pass; ``e`` is the part the
            step that prefills it pays (the hand-off, the first token's way out).
        latency: seconds every request spends off the engine's steps (a front end in another
            process: tokenizing, the hand-off to the engine core, the output path). It delays every
            token of a request alike, so it moves TTFT and E2E, not the gaps; the simulator does not
            see it: :meth:`delivered` adds it to simulated traces.
        idle_wake: seconds more that a request waits when it finds the whole server idle (no step running,
            no request at the front door): the machine waking up (a virtual CPU the hypervisor had
            descheduled, caches other programs took over). Measured as the first request of a
            microbenchmark after a pause against the ones that follow it
            (:class:`course.sim.rules.FrontDoor`).
        front_end_slowdown: how many times longer ``before_engine`` takes for a request that arrives while
            a step runs (2: the front end and the engine share the core evenly; more where the engine
            keeps the core, or Python's GIL, for longer stretches). Measured as lone prefills that
            arrive while one request decodes (``benchmarks/sim_fidelity.py``).
        spread: quantiles of a decode step's relative deviation from its expected time (0.5 = 50 %
            longer), at the evenly spaced probabilities 0, ..., 1 (:data:`SPREAD_PROBABILITIES` when
            fitted); () = none. Relative, because a step shares its core with other work for its
            whole length: on a busy machine a longer step is stretched by more.
        prefill_spread: the same for steps that prefill (their scatter includes the front end's).
        seed: picks the deviations: each simulated step draws one from a hash of ``seed`` and its index.
    """

    a: float
    b: float
    c: float
    d: float
    e: float = 0.0
    f: float = 0.0
    g: float = 0.0
    before_engine: float = 0.0
    latency: float = 0.0
    idle_wake: float = 0.0
    front_end_slowdown: float = SHARED_CORE_SLOWDOWN
    spread: tuple[float, ...] = ()
    prefill_spread: tuple[float, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("e", "f", "g", "before_engine", "latency", "idle_wake"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"LinearCost.{name} must be >= 0 seconds, got {value!r}")
        if not self.front_end_slowdown >= 1:
            raise ValueError(f"LinearCost.front_end_slowdown must be >= 1 (2: an even share of the core), "
                             f"got {self.front_end_slowdown!r}")  # fmt: skip
        for name in ("spread", "prefill_spread"):
            quantiles = tuple(float(v) for v in getattr(self, name))
            if len(quantiles) == 1 or any(not np.isfinite(v) or v < -1 for v in quantiles):
                raise ValueError(f"{name} needs at least 2 finite quantiles >= -1, got {getattr(self, name)!r}")
            if any(later < earlier for earlier, later in zip(quantiles, quantiles[1:])):
                raise ValueError(f"{name} must list quantiles in increasing order (probabilities 0 to 1)")
            object.__setattr__(self, name, quantiles)

    def expected_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        """The step's time without its drawn deviation (s)."""
        seconds = self.a + self.b * prefill_tokens + self.c * decode_tokens + self.d * kv_tokens_read
        if self.e and prefill_tokens > 0:
            seconds += self.e * prompts_started(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs)
        if self.f and prefill_tokens > 0:
            seconds += self.f * prefill_pairs(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs)
        if self.g and prefill_tokens + decode_tokens >= 2:
            seconds += self.g
        return seconds

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        """The step's expected time (s), :meth:`expected_seconds`. A simulation draws each step's
        deviation from the spread on top (:attr:`spread_draw`)."""
        return self.expected_seconds(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs)

    @property
    def spread_draw(self) -> Callable[[int, bool], float] | None:
        """:meth:`ratio` when the cost has a spread, else None (every step takes its expected time)."""
        return self.ratio if self.spread or self.prefill_spread else None

    def ratio(self, step: int, prefills: bool) -> float:
        """Simulated step ``step``'s time over its expected time: ``1 + r`` with ``r`` its :meth:`deviation`,
        at least :data:`MIN_STEP_FRACTION`."""
        return max(1.0 + self.deviation(step, prefills), MIN_STEP_FRACTION)

    def deviation(self, step: int, prefills: bool) -> float:
        """Simulated step ``step``'s drawn relative deviation: the quantile function of its spread (the
        prefill steps' when it ``prefills``) at a probability hashed from ``self.seed`` and the step's index.

        Each step draws independently of the others, whatever its load; the same step of the same
        seed draws the same deviation (the draw has no state).
        """
        quantiles = self.prefill_spread if prefills else self.spread
        if not quantiles:
            return 0.0
        position = _unit(self.seed, step) * (len(quantiles) - 1)
        index = int(position)
        low = quantiles[index]
        return low + (position - index) * (quantiles[min(index + 1, len(quantiles) - 1)] - low)

    def delivered(self, traces: Sequence) -> list:
        """Simulated :class:`course.trace.RequestTrace` records as a client would see them: every chunk
        ``latency`` seconds later (the front end's time off the engine's steps). Returns new records."""
        import dataclasses

        if not self.latency:
            return list(traces)
        return [dataclasses.replace(t, chunk_times=[x + self.latency for x in t.chunk_times]) for t in traces]

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return (self.a, self.b, self.c, self.d)

    def describe(self) -> str:
        text = (
            f"linear: {self.a * 1e3:.3g} ms + {self.b * 1e6:.3g} us/prefill token + "
            f"{self.c * 1e6:.3g} us/decode token + {self.d * 1e9:.3g} ns/KV token read"
        )
        if self.f:
            text += f" + {self.f * 1e9:.3g} ns/prefill attention pair"
        if self.g:
            text += f" + {self.g * 1e3:.3g} ms/step of 2+ token rows"
        if self.e:
            text += f" + {self.e * 1e3:.3g} ms/prompt started"
        if self.before_engine:
            text += f"; {self.before_engine * 1e3:.3g} ms of front-end work before the engine sees a request"
        if self.latency:
            text += f"; {self.latency * 1e3:.3g} ms front-end latency per request"
        if self.idle_wake:
            text += f"; {self.idle_wake * 1e3:.3g} ms to wake an idle server"
        if self.before_engine and self.front_end_slowdown != SHARED_CORE_SLOWDOWN:
            text += f"; that work {self.front_end_slowdown:.3g}x as long beside a step"
        for name, quantiles in (("decode", self.spread), ("prefill", self.prefill_spread)):
            if quantiles:
                low, high = np.interp([0.05, 0.95], np.linspace(0, 1, len(quantiles)), quantiles)
                text += f"; {name} steps' spread p5 {low:+.0%}, p95 {high:+.0%}"
        if self.spread or self.prefill_spread:
            text += f" (seed {self.seed})"
        return text

    def predict(self, samples: Sequence[StepSample]) -> np.ndarray:
        """What each sample's microbenchmark should measure (s): the expected step, plus ``latency``
        and ``before_engine`` for a prefill (a lone request's TTFT includes the front end's time)."""
        return np.array(
            [
                self.expected_seconds(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read, s.attention_pairs)
                + (self.latency + self.before_engine if s.prefill_tokens > 0 else 0.0)
                for s in samples
            ]
        )

    @classmethod
    def fit(
        cls,
        samples: Sequence[StepSample],
        relative: bool = True,
        front_end: str = "step",
        spread: bool = True,
        seed: int = 0,
        before_engine_share: float = 0.0,
        shape: bool = True,
    ) -> LinearCost:
        """Least-squares fit with every coefficient >= 0, and the spread of the samples' deviations.

        ``relative=True`` minimises relative errors (each sample weighted by 1/seconds), so a
        2 ms decode step counts as much as a 200 ms prefill. The non-negative solution is exact:
        every subset of the coefficients is solved and the best feasible one kept. Features that
        never vary in the samples get 0 (a constant column is the intercept's job), and so does the
        per-prompt term when the samples cannot tell it from the others (prefills only).

        The per-prompt term is what a prefill measured from outside costs on top of a step that
        the decodes' intercept predicts. ``front_end`` says where it goes: "step" (``e``: the
        front end shares the engine's CPU, as in the course's server, where the event loop and the
        engine thread share a core) or "latency" (``latency``: a front end in another process, as
        vLLM's API server, that delays the request without stalling the steps) or "none" (the plain
        four-term line, which spreads the front end's work over every step's intercept).

        ``before_engine_share`` (front_end "step"): the fraction of the per-prompt term that the front
        end spends before the engine sees the request (``before_engine``), measured on the server
        (``benchmarks/sim_fidelity.py`` reads it off its ``/metrics``); the rest stays ``e``. A lone
        request's TTFT is the same either way; under load the share waits for the front end.

        ``shape=True`` fits the two terms that follow the kernels rather than a line: ``f``, the cost of
        the prefill's attention pairs, when the samples hold prompts of at least :data:`CURVE_LENGTHS`
        lengths (the prefill's intercept, ``b`` and ``f`` go exactly through any three, noise and all),
        and ``g``, the step of two or more token rows, when the samples hold decode steps of one row
        and of more. ``False`` leaves both 0 (the plain line of ``a`` to ``e``).

        ``spread=True`` with samples that carry ``deviations``: :func:`fit_spread` over the decode
        samples and over the prefill samples gives ``spread`` and ``prefill_spread``.
        """
        if front_end not in FRONT_END:
            raise ValueError(f"front_end must be one of {', '.join(FRONT_END)}; got {front_end!r}")
        if not 0.0 <= before_engine_share <= 1.0:
            raise ValueError(f"before_engine_share is a fraction from 0 to 1, got {before_engine_share!r}")
        if before_engine_share and front_end != "step":
            raise ValueError(
                "before_engine_share splits the per-prompt term of front_end='step'; "
                f"with front_end={front_end!r} there is none to split"
            )
        if len(samples) < 2:
            raise ValueError(f"fitting a linear cost needs at least 2 measured steps, got {len(samples)}")
        x = np.array(
            [
                [
                    1.0,
                    s.prefill_tokens,
                    s.decode_tokens,
                    s.kv_tokens_read,
                    float(s.prefill_tokens > 0),
                    prefill_pairs(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read, s.attention_pairs),
                    float(s.prefill_tokens + s.decode_tokens >= 2),
                ]
                for s in samples
            ]
        )
        y = np.array([s.seconds for s in samples], dtype=float)
        if np.any(y <= 0):
            raise ValueError("measured step times must be positive")
        weights = 1.0 / y if relative else np.ones_like(y)
        xw, yw = x * weights[:, None], y * weights
        usable = [j for j in range(x.shape[1]) if j == 0 or np.ptp(x[:, j]) > 0]
        if front_end == "none":
            usable = [j for j in usable if j != 4]
        if not shape or len({s.prefill_tokens for s in samples if s.prefill_tokens > 0}) < CURVE_LENGTHS:
            usable = [j for j in usable if j != 5]
        decode_rows = {s.decode_tokens >= 2 for s in samples if s.decode_tokens and not s.prefill_tokens}
        if not shape or decode_rows != {False, True}:  # g is told apart by decode steps of one row and of more
            usable = [j for j in usable if j != 6]
        best, best_error = np.zeros(x.shape[1]), np.inf
        # A larger subset must do better, not tie: by more than rounding, which on exact data (an error
        # near 0) would otherwise hand a term a coefficient of 1e-19 s.
        rounding = 1e-12 * float(np.sum(yw**2))
        for size in range(1, len(usable) + 1):
            for subset in itertools.combinations(usable, size):
                columns = xw[:, subset]
                if np.linalg.matrix_rank(columns) < size:  # the data cannot separate these terms
                    continue
                coef, *_ = np.linalg.lstsq(columns, yw, rcond=None)
                if np.any(coef < 0):
                    continue
                error = float(np.sum((columns @ coef - yw) ** 2))
                if error < best_error * (1 - 1e-12) - rounding:
                    best_error = error
                    best = np.zeros(x.shape[1])
                    best[list(subset)] = coef
        a, b, c, d, per_prompt, f, g = (float(v) for v in best)
        if front_end == "latency":
            terms = {"latency": per_prompt}
        else:
            terms = {"e": per_prompt * (1.0 - before_engine_share), "before_engine": per_prompt * before_engine_share}
        if spread:
            terms["spread"] = fit_spread([s for s in samples if s.prefill_tokens == 0])
            terms["prefill_spread"] = fit_spread([s for s in samples if s.prefill_tokens > 0])
        return cls(a, b, c, d, f=f, g=g, **terms, seed=seed)


def fit_spread(samples: Sequence[StepSample], probabilities: Sequence[float] = SPREAD_PROBABILITIES) -> tuple:
    """Quantiles of a step's relative deviation from its expected time, from the samples' ``deviations``.

    Each sample with at least 2 deviations gives the quantiles of ``deviation / seconds`` at
    ``probabilities``; their mean (quantile averaging keeps the shape of the distributions; every
    sample counts alike, a prefill of 8 repeats as much as a decode wave of 500 gaps) is shifted to
    mean 0, so the expected step stays the fitted line, and kept at -1 or above. () when no sample
    carries deviations.
    """
    rows = [
        np.quantile(np.asarray(s.deviations, dtype=float) / s.seconds, probabilities)
        for s in samples
        if len(s.deviations) > 1
    ]
    if not rows:
        return ()
    quantiles = np.mean(rows, axis=0)
    steps = np.diff(np.asarray(probabilities, dtype=float))
    quantiles -= float(np.sum(steps * (quantiles[1:] + quantiles[:-1]) / 2))  # the quantile function's mean
    return tuple(float(v) for v in np.maximum(quantiles, -1.0))


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
