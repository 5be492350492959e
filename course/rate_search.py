"""The capacity search: the highest arrival rate at which a service holds its SLOs, and the replicas a target
rate then calls for (module 5's Exercise on the rate search rebuilds :func:`highest_rate`).

:mod:`course.capacity` plans with these, and :mod:`course.sim.fleet` searches every GPU and parallel layout with
them; they depend on nothing but the standard library, so both can import them from below.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RateSearch:
    """The result of :func:`highest_rate`: the answer and every rate that was tried."""

    rate: float  # highest rate found to hold (req/s); 0.0 when even ``low`` failed
    tried: tuple[tuple[float, bool], ...] = field(default=())


def highest_rate(
    holds: Callable[[float], bool], low: float, high: float, rel_tol: float = 0.05, max_steps: int = 30
) -> RateSearch:
    """Highest arrival rate in [low, high] at which ``holds(rate)`` is True, by bisection.

    Assumes ``holds`` is monotone: true up to some rate, false above it (queueing only gets worse
    with load). Returns ``high`` when it holds there, 0.0 when even ``low`` fails; otherwise a rate
    that holds, within ``rel_tol`` (relative) of the lowest rate that was found to fail.

    Args:
        holds: runs the service at a rate (req/s) and says whether the SLOs held.
        low, high: the bracket (req/s), 0 < low < high.
        rel_tol: stop when (failing - holding) <= rel_tol x holding.
        max_steps: most calls of ``holds`` in the bisection.
    """
    if not 0 < low < high:
        raise ValueError(f"highest_rate needs 0 < low < high, got low={low!r}, high={high!r}")
    if not rel_tol > 0:
        raise ValueError(f"rel_tol must be positive, got {rel_tol!r}")
    tried: list[tuple[float, bool]] = []

    def test(rate: float) -> bool:
        ok = bool(holds(rate))
        tried.append((rate, ok))
        return ok

    if test(high):
        return RateSearch(high, tuple(tried))
    if not test(low):
        return RateSearch(0.0, tuple(tried))
    good, bad = low, high
    for _ in range(max_steps):
        if bad - good <= rel_tol * good:
            break
        middle = math.sqrt(good * bad)  # geometric: rates span orders of magnitude
        if test(middle):
            good = middle
        else:
            bad = middle
    return RateSearch(good, tuple(tried))


def replicas_needed(target_rate: float, per_replica_rate: float, headroom: float = 0.0) -> int:
    """Replicas that serve ``target_rate`` req/s when each holds the SLOs up to ``per_replica_rate``.

    ``headroom`` (0..1) is the share of each replica's capacity kept free for bursts and failures:
    each replica is planned at ``per_replica_rate x (1 - headroom)``. Whole replicas, rounded up.
    """
    if not target_rate >= 0:
        raise ValueError(f"target_rate must be >= 0 req/s, got {target_rate!r}")
    if not per_replica_rate > 0:
        raise ValueError(
            f"per_replica_rate must be positive, got {per_replica_rate!r}: a replica that holds the SLOs at no "
            "rate cannot be planned with; relax the SLOs, shorten prompts or use a faster GPU"
        )
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom is a fraction in [0, 1), got {headroom!r}")
    planned = per_replica_rate * (1 - headroom)
    # a float ratio such as 3.0000000000000004 is still 3 replicas
    return max(0, math.ceil(round(target_rate / planned, 9)))
