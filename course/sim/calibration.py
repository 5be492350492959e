"""Calibration: a step cost and a front end fitted to steps measured on a real runtime.

Module 3 times prefills and decode steps with ``course.measure`` (:func:`samples_from_timings`); module 5
and ``benchmarks/sim_fidelity.py`` measure them against a running server (``course.capacity``). Either
way the result is a list of :class:`course.sim.cost.StepSample`, and :func:`fit` turns it into a
:class:`course.sim.cost.ServerCost`:

1. :func:`design_matrix`: one row per sample, one column per term of the line (:data:`FEATURES`);
2. :func:`usable_terms`: the columns the samples can tell apart (a term that never varies, a curve
   without enough prompt lengths, the step of two rows without decodes of one row and of more);
3. :func:`nonnegative_least_squares`: every subset of them solved, the best with every coefficient >= 0;
4. :func:`split_front_end`: the per-prompt term split between the step (``e``) and the front end
   (``before_engine`` or a ``latency`` off the steps);
5. :func:`fit_spread`: the step-time spread from the samples' single measurements.

A line fitted to every microbenchmark alike is a compromise over all of them; a run spends its time in a few
of them (its batch sizes, its contexts). :func:`run_weights` weighs each sample by the share of a simulated
run's time spent in steps like it, so that a second fit puts the line where the run lives.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from course.sim.cost import LinearCost, ServerCost, StepSample, prefill_pairs
from course.sim.frontend import FrontEnd

FEATURES = (
    "per step",
    "per prefill token",
    "per decode token",
    "per KV token read",
    "per prompt started",
    "per prefill attention pair",
    "per step of two or more token rows",
)
PER_PROMPT, PER_PAIR, PER_ROWS = 4, 5, 6  # the columns of FEATURES that need more than a line's data
FRONT_END = ("step", "latency", "none")
# Probabilities at which a fitted spread keeps its quantiles (every 2.5 %: p95 and p97.5 are points).
SPREAD_PROBABILITIES = tuple(np.linspace(0.0, 1.0, 41))
# Prompt lengths a fit needs before it fits the prefill's attention term f: one more than the prefill's
# three terms (intercept, per token, per pair), so that the curve is checked by a point it does not pass
# through by construction.
CURVE_LENGTHS = 4


def fit(
    samples: Sequence[StepSample],
    relative: bool = True,
    front_end: str = "step",
    spread: bool = True,
    seed: int = 0,
    before_engine_share: float = 0.0,
    shape: bool = True,
    weights: Sequence[float] | None = None,
) -> ServerCost:
    """Least-squares fit with every coefficient >= 0, and the spread of the samples' deviations.

    ``relative=True`` minimises relative errors (each sample weighted by 1/seconds), so a
    2 ms decode step counts as much as a 200 ms prefill. The non-negative solution is exact:
    every subset of the coefficients is solved and the best feasible one kept. Features that
    never vary in the samples get 0 (a constant column is the intercept's job), and so does the
    per-prompt term when the samples cannot tell it from the others (prefills only).

    The per-prompt term is what a prefill measured from outside costs on top of a step that
    the decodes' intercept predicts. ``front_end`` says where it goes: "step" (``e``: the
    front end shares the engine's CPU, as in the course's server, where the event loop and the
    engine thread share a core) or "latency" (the front end's ``latency``: a front end in another
    process, as vLLM's API server, that delays the request without stalling the steps) or "none"
    (the plain four-term line, which spreads the front end's work over every step's intercept).

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

    ``weights``: one per sample, how much its error counts (on top of ``relative``): :func:`run_weights`
    puts the line where a run spends its time. None: every sample alike.
    """
    _check(samples, front_end, before_engine_share)
    x = design_matrix(samples)
    y = np.array([s.seconds for s in samples], dtype=float)
    if np.any(y <= 0):
        raise ValueError("measured step times must be positive")
    rows = 1.0 / y if relative else np.ones_like(y)
    if weights is not None:
        rows = rows * _checked_weights(weights, len(samples))
    coefficients = nonnegative_least_squares(x * rows[:, None], y * rows,
                                             usable_terms(samples, x, front_end, shape))  # fmt: skip
    a, b, c, d, per_prompt, f, g = (float(v) for v in coefficients)
    e, front = split_front_end(per_prompt, front_end, before_engine_share)
    spreads = {}
    if spread:
        spreads = {"spread": fit_spread([s for s in samples if s.prefill_tokens == 0]),
                   "prefill_spread": fit_spread([s for s in samples if s.prefill_tokens > 0])}  # fmt: skip
    return ServerCost(LinearCost(a, b, c, d, e=e, f=f, g=g, **spreads, seed=seed), front)


def _check(samples: Sequence[StepSample], front_end: str, before_engine_share: float) -> None:
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


def _checked_weights(weights: Sequence[float], count: int) -> np.ndarray:
    array = np.asarray(weights, dtype=float)
    if array.shape != (count,) or not np.all(np.isfinite(array)) or np.any(array <= 0):
        raise ValueError(f"weights: one positive number per sample ({count}), got {list(weights)!r}")
    return array


def design_matrix(samples: Sequence[StepSample]) -> np.ndarray:
    """One row per sample, one column per term of :data:`FEATURES` (its count in the sample's step)."""
    return np.array(
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


def usable_terms(samples: Sequence[StepSample], x: np.ndarray, front_end: str, shape: bool) -> list[int]:
    """The columns of ``x`` the fit may use: the intercept and every term that varies in the samples, less
    the per-prompt term without a front end to put it in, ``f`` without :data:`CURVE_LENGTHS` prompt lengths
    and ``g`` without decode steps of one row and of more (or both without ``shape``)."""
    usable = [j for j in range(x.shape[1]) if j == 0 or np.ptp(x[:, j]) > 0]
    left_out = set()
    if front_end == "none":
        left_out.add(PER_PROMPT)
    if not shape or len({s.prefill_tokens for s in samples if s.prefill_tokens > 0}) < CURVE_LENGTHS:
        left_out.add(PER_PAIR)
    decode_rows = {s.decode_tokens >= 2 for s in samples if s.decode_tokens and not s.prefill_tokens}
    if not shape or decode_rows != {False, True}:  # g is told apart by decode steps of one row and of more
        left_out.add(PER_ROWS)
    return [j for j in usable if j not in left_out]


def nonnegative_least_squares(xw: np.ndarray, yw: np.ndarray, usable: Sequence[int]) -> np.ndarray:
    """The coefficients (one per column of ``xw``, 0 outside ``usable``) of the subset of ``usable`` columns
    whose least-squares solution has no negative coefficient and the smallest error.

    Subsets are tried from the smallest up; a larger one must do better, not tie: by more than rounding,
    which on exact data (an error near 0) would otherwise hand a term a coefficient of 1e-19 s.
    """
    best, best_error = np.zeros(xw.shape[1]), np.inf
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
                best = np.zeros(xw.shape[1])
                best[list(subset)] = coef
    return best


def split_front_end(per_prompt: float, front_end: str, before_engine_share: float) -> tuple[float, FrontEnd]:
    """(the step's ``e``, the front end) from the fitted per-prompt term: all of it a ``latency`` off the steps
    for "latency"; else ``before_engine_share`` of it before the engine and the rest on the step."""
    if front_end == "latency":
        return 0.0, FrontEnd(latency=per_prompt)
    return per_prompt * (1.0 - before_engine_share), FrontEnd(before_engine=per_prompt * before_engine_share)


def run_weights(samples: Sequence[StepSample], steps, floor: float = 0.1) -> list[float]:
    """One weight per sample: the share of a run's busy time spent in steps like it (for :func:`fit`'s ``weights``).

    ``steps``: the run's :class:`course.sim.results.StepLog` (a simulation of it: its arrivals and token counts
    are known before it runs). Each decode step goes to the decode sample nearest it in batch size and in
    context per request (on a log scale: 2 and 4 are as far apart as 8 and 16), each step that prefills to the
    prefill sample nearest its prompt tokens; a sample's weight is the time of the steps it got over the
    mean, at least ``floor`` (every term of the line still needs its samples to be told apart).
    """
    kinds = [_kind(s.prefill_tokens, s.decode_tokens, s.kv_tokens_read) for s in samples]
    times = np.zeros(len(samples))
    durations = steps.end - steps.start
    for index in range(len(steps)):
        step = _kind(steps.prefill_tokens[index], steps.decode_tokens[index], steps.kv_tokens_read[index])
        near = [j for j, kind in enumerate(kinds) if kind[0] == step[0]]
        if near:
            times[min(near, key=lambda j: _distance(kinds[j], step))] += durations[index]
    mean = times.mean() if times.any() else 1.0
    return [float(max(share / mean, floor)) for share in times]


def _kind(prefill: float, decode: float, kv_read: float) -> tuple[bool, float, float]:
    """(whether the step prefills, log2 of its size: prompt tokens or decode rows, log2 of the context per row)."""
    if prefill > 0:
        return True, float(np.log2(prefill)), 0.0
    rows = max(float(decode), 1.0)
    return False, float(np.log2(rows)), float(np.log2(max(kv_read / rows, 1.0)))


def _distance(a: tuple[bool, float, float], b: tuple[bool, float, float]) -> float:
    return abs(a[1] - b[1]) + abs(a[2] - b[2])


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
