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
  least squares to step times measured on a real runtime (:mod:`course.sim.calibration`). This is the
  latency model of simulators such as BLIS/inference-sim (``L = b0 + b1*X + b2*Y``) with a KV term,
  and an ``f`` per attention pair among a step's prefill tokens (:func:`prefill_pairs`), because a
  prompt's attention grows with its square while the rest of its pass grows with its length: the
  ``n_ctx`` term of the forward FLOPs per token in Kaplan et al., "Scaling Laws for Neural Language
  Models" (2020, table 1), and the roofline's ``attention_pairs`` below; a ``g`` per step of two
  or more token rows, because a single decode row multiplies every weight matrix by one vector
  (a matrix-vector kernel) and more rows take a matrix-matrix kernel with a fixed cost of its own;
  an ``e`` for every request whose prompt a step starts (the hand-off to the engine and the first
  token's way out, where they share the engine's CPU); and the step-time spread, the measured steps'
  relative deviations from their mean (decode steps and prefill steps apart), which the simulator
  draws for each step from a seeded hash of the step's index (:func:`spread_draw`), so a simulation
  stays deterministic.

The rest of what a server spends outside the forward pass is its front end's, not a step's
(:class:`course.sim.frontend.FrontEnd`): :class:`ServerCost` holds a step cost and a front end, as a
calibration fits them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from course import roofline
from course.geometry import ModelGeometry
from course.hardware import HardwareSpec
from course.sim.frontend import NO_FRONT_END, FrontEnd

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

    @functools.cached_property
    def reached_flops(self) -> float:
        """FLOP/s the step's kernels reach: the peak times ``flops_efficiency``."""
        return self.hardware.flops * self.flops_efficiency

    @functools.cached_property
    def reached_bandwidth(self) -> float:
        """Bytes/s the step's kernels reach: the peak times ``bandwidth_efficiency``."""
        return self.hardware.bandwidth * self.bandwidth_efficiency

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        compute = self.flops(prefill_tokens, decode_tokens, attention_pairs) / self.reached_flops
        memory = self.bytes_moved(kv_tokens_read, prefill_tokens + decode_tokens) / self.reached_bandwidth
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


def step_time(seconds: float, draw, step: int, prefills: bool) -> float:
    """A simulated step's time (s): its cost's expected ``seconds``, times the cost's spread drawn for the
    step's index ``step`` (0 for the run's first step; ``prefills``: the step computes prompt tokens),
    where the cost has one (``draw``: :func:`spread_draw`; None: the expected time)."""
    return seconds if draw is None else seconds * draw(step, prefills)


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
            request where it shares the engine's CPU (the hand-off to the engine, the first token's way
            out), so running requests wait for it too. The work before the engine sees a request is
            the front end's own (:class:`course.sim.frontend.FrontEnd`).
        f: seconds per attention pair among the step's prefill tokens (:func:`prefill_pairs`; a fresh
            prompt of ``n`` tokens has ``n(n+1)/2``): the attention's scores and weighted sums, which grow
            with the square of a prompt where everything in ``b`` grows with its length.
        g: seconds more for a step that computes two or more tokens (token rows) than the line gives: a
            lone decode token multiplies each weight matrix by a vector, more rows go through a
            matrix-matrix kernel with a fixed cost of its own (the course's server on a CPU sends one
            row to PyTorch's matrix-vector product where that is faster on the host and more to oneDNN's
            packed-weight kernel, ``course.serving.runner``; cuBLAS too picks a matrix-vector kernel for
            one row).
        spread: quantiles of a decode step's relative deviation from its expected time (0.5 = 50 %
            longer), at the evenly spaced probabilities 0, ..., 1 (41 when fitted,
            :func:`course.sim.calibration.fit_spread`); () = none. Relative, because a step shares its
            core with other work for its whole length: on a busy machine a longer step is stretched by more.
        prefill_spread: the same for steps that prefill (their scatter includes the front end's).
        seed: picks the deviations: each simulated step draws one from a hash of ``seed`` and its index.

    Fitting it to measured steps is :func:`course.sim.calibration.fit` (:meth:`fit` is its old name).
    """

    a: float
    b: float
    c: float
    d: float
    e: float = 0.0
    f: float = 0.0
    g: float = 0.0
    spread: tuple[float, ...] = ()
    prefill_spread: tuple[float, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("e", "f", "g"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"LinearCost.{name} must be >= 0 seconds, got {value!r}")
        for name in ("spread", "prefill_spread"):
            object.__setattr__(self, name, _quantiles(name, getattr(self, name)))

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

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        return (self.a, self.b, self.c, self.d)

    def describe(self) -> str:
        return self.describe_line() + self.describe_spread()

    def describe_line(self) -> str:
        """The line's terms in words."""
        text = (
            f"linear: {self.a * 1e3:.3g} ms + {self.b * 1e6:.3g} us/prefill token + "
            f"{self.c * 1e6:.3g} us/decode token + {self.d * 1e9:.3g} ns/KV token read"
        )
        for value, words in ((self.f * 1e9, "ns/prefill attention pair"), (self.g * 1e3, "ms/step of 2+ token rows"),
                             (self.e * 1e3, "ms/prompt started")):  # fmt: skip
            if value:
                text += f" + {value:.3g} {words}"
        return text

    def describe_spread(self) -> str:
        """The step-time spread in words (its p5 and p95, and the random seed that draws it), each after a "; "; empty
        without one."""
        text = ""
        for name, quantiles in (("decode", self.spread), ("prefill", self.prefill_spread)):
            if quantiles:
                low, high = np.interp([0.05, 0.95], np.linspace(0, 1, len(quantiles)), quantiles)
                text += f"; {name} steps' spread p5 {low:+.0%}, p95 {high:+.0%}"
        if self.spread or self.prefill_spread:
            text += f" (seed {self.seed})"
        return text

    @classmethod
    def fit(cls, samples: Sequence[StepSample], **options) -> ServerCost:
        """The line and the front end fitted to measured steps: :func:`course.sim.calibration.fit`, with its
        options (``relative``, ``front_end``, ``spread``, ``seed``, ``before_engine_share``, ``shape``,
        ``weights``). Returns a :class:`ServerCost`: this line, with the front end beside it."""
        from course.sim import calibration  # calibration builds on this module

        return calibration.fit(samples, **options)


def _quantiles(name: str, values: Sequence[float]) -> tuple[float, ...]:
    """A spread's quantiles as floats, checked: none, or at least 2 finite ones >= -1 in increasing order."""
    quantiles = tuple(float(v) for v in values)
    if len(quantiles) == 1 or any(not np.isfinite(v) or v < -1 for v in quantiles):
        raise ValueError(f"{name} needs at least 2 finite quantiles >= -1, got {values!r}")
    if any(later < earlier for earlier, later in zip(quantiles, quantiles[1:])):
        raise ValueError(f"{name} must list quantiles in increasing order (probabilities 0 to 1)")
    return quantiles


@dataclass(frozen=True)
class ServerCost:
    """A server's timing as a calibration fits it: its engine's step cost and its front end's work.

    The simulator runs the steps with ``step`` (any cost model: :class:`LinearCost`, :class:`RooflineCost`)
    and passes each request through ``front_end`` (:class:`course.sim.frontend.FrontEnd`) before the
    scheduler sees it; :meth:`delivered` adds the front end's latency off the steps to simulated traces.
    """

    step: Any
    front_end: FrontEnd = NO_FRONT_END

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        return self.step.step_seconds(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs)

    @property
    def spread_draw(self) -> Callable[[int, bool], float] | None:
        """The step cost's spread (:func:`spread_draw`)."""
        return spread_draw(self.step)

    def delivered(self, traces: Sequence) -> list:
        """Simulated traces as a client sees them (:meth:`course.sim.frontend.FrontEnd.delivered`)."""
        return self.front_end.delivered(traces)

    def replace(self, **front_end) -> ServerCost:
        """The same steps behind a front end with these fields changed (``idle_wake=0.0``, ...)."""
        return ServerCost(self.step, dataclasses.replace(self.front_end, **front_end))

    def predict(self, samples: Sequence[StepSample]) -> np.ndarray:
        """What each sample's microbenchmark should measure (s): the expected step, plus the front end's
        time before the first token for a prefill (a lone request's TTFT includes it)."""
        before = self.front_end.before_first_token
        return np.array(
            [
                self.step.expected_seconds(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read, s.attention_pairs)
                + (before if s.prefill_tokens > 0 else 0.0)
                for s in samples
            ]
        )

    def describe(self) -> str:
        if not hasattr(self.step, "describe_line"):  # a step cost without a spread of its own
            return self.step.describe() + self.front_end.describe()
        # the front end's words between the line's and the spread's, as they read before the two were apart
        return self.step.describe_line() + self.front_end.describe() + self.step.describe_spread()
