"""Latency targets for a class of traffic (:class:`SLO`) and what a run achieved against them (:class:`SLOCheck`).

Module 5 plans capacity against them (:mod:`course.capacity`, which names them too) and ``course simulate`` checks
a simulated run with them; they read a run's request traces through :mod:`course.metrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from course import metrics
from course.trace import RequestTrace


@dataclass(frozen=True)
class WindowLatencies:
    """The requests of simulated runs that arrived inside a steady window (:class:`course.capacity.SteadyWindow`),
    as arrays: what :meth:`SLO.check_latencies` reads.

    Attributes:
        ttft: TTFT of each succeeded request (s), shape ``(n,)``.
        tpot: its TPOT (s), NaN for an answer of one token, shape ``(n,)``.
        failed: requests in the window that failed.
        preempted: requests in the window that were preempted at least once (the KV cache ran out).
    """

    ttft: np.ndarray
    tpot: np.ndarray
    failed: int = 0
    preempted: int = 0

    @property
    def requests(self) -> int:
        return len(self.ttft) + self.failed

    def __add__(self, other: WindowLatencies) -> WindowLatencies:
        """Pooled with another window's requests (another seed of the same traffic)."""
        return WindowLatencies(
            np.concatenate([self.ttft, other.ttft]),
            np.concatenate([self.tpot, other.tpot]),
            self.failed + other.failed,
            self.preempted + other.preempted,
        )


@dataclass(frozen=True)
class SLOCheck:
    """What a run achieved against an :class:`SLO` (seconds; ``attainment`` in 0..1)."""

    ttft: float  # TTFT at the SLO's percentile
    tpot: float  # TPOT at the SLO's percentile (0 when no request had more than one token)
    attainment: float  # fraction of all requests that met both per-request targets
    completed: int
    failed: int
    holds: bool

    def verdict(self, slo: SLO) -> str:
        """One line: what the run achieved against ``slo``'s targets, and whether they hold."""
        q = f"p{slo.percentile:g}"
        verdict = "holds" if self.holds else "MISSED"
        return (
            f"TTFT {q} {self.ttft * 1e3:.1f} ms (target {slo.ttft * 1e3:g}), TPOT {q} {self.tpot * 1e3:.1f} ms "
            f"(target {slo.tpot * 1e3:g}); {self.attainment:.1%} of requests met both; {self.failed} failed: {verdict}"
        )


@dataclass(frozen=True)
class SLO:
    """Latency targets for one class of traffic.

    Attributes:
        name: the traffic class ("interactive chat", "batch summaries", ...).
        ttft: time to first token target (s), at ``percentile``.
        tpot: time per output token after the first (s), at ``percentile``; per request, as vLLM's
            TPOT and GuideLLM's ITL (``course.metrics``).
        percentile: which percentile must meet the targets (95: "p95 TTFT <= 200 ms").
        source: where the numbers come from, in words (a product requirement, a citation).
    """

    name: str
    ttft: float
    tpot: float
    percentile: float = 95.0
    source: str = ""

    def __post_init__(self) -> None:
        for attr in ("ttft", "tpot"):
            value = getattr(self, attr)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"SLO {self.name!r}: {attr} must be a positive number of seconds, got {value!r}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"SLO {self.name!r}: percentile must be in (0, 100], got {self.percentile!r}")

    def check(self, traces: Sequence[RequestTrace]) -> SLOCheck:
        """Measure a run against the targets.

        The SLO holds when no request failed, the run's TTFT and TPOT at ``percentile`` are within
        the targets, and (equivalently for one class) at least ``percentile`` % of the requests met
        both targets on their own. Failed requests count against attainment.
        """
        if not traces:
            raise ValueError(f"SLO {self.name!r}: no requests to check; run some load first")
        summary = metrics.summarize(traces, percentiles=(self.percentile,))
        good = metrics.goodput(traces, ttft_slo=self.ttft, tpot_slo=self.tpot)
        ttft = summary.ttft.percentiles[float(self.percentile)]
        tpot = summary.tpot.percentiles[float(self.percentile)]
        holds = summary.failed == 0 and summary.completed > 0 and ttft <= self.ttft and tpot <= self.tpot
        return SLOCheck(ttft, tpot, good.attainment, summary.completed, summary.failed, holds)

    def holds(self, traces: Sequence[RequestTrace]) -> bool:
        """True when the run meets the targets (see :meth:`check`)."""
        return self.check(traces).holds

    def check_latencies(self, latencies: WindowLatencies) -> SLOCheck:
        """:meth:`check` from per-request latencies (:func:`window_latencies`) instead of traces: the same
        percentiles (``np.percentile``, TPOT over the requests of more than one token), attainment and
        verdict, without building a trace per request (a simulation's traces cost ten times its run)."""
        ttft, tpot = latencies.ttft, latencies.tpot
        multi = tpot[~np.isnan(tpot)]
        q = float(self.percentile)
        at_ttft = float(np.percentile(ttft, q)) if len(ttft) else 0.0
        at_tpot = float(np.percentile(multi, q)) if len(multi) else 0.0
        completed, failed = len(ttft), latencies.failed
        if not completed + failed:
            raise ValueError(f"SLO {self.name!r}: no requests to check; run some load first")
        good = int(np.count_nonzero((ttft <= self.ttft) & (np.nan_to_num(tpot, nan=0.0) <= self.tpot)))
        holds = failed == 0 and completed > 0 and at_ttft <= self.ttft and at_tpot <= self.tpot
        return SLOCheck(at_ttft, at_tpot, good / (completed + failed), completed, failed, holds)

    def describe(self) -> str:
        q = f"p{self.percentile:g}"
        return f"{self.name}: TTFT {q} <= {self.ttft * 1e3:g} ms, TPOT {q} <= {self.tpot * 1e3:g} ms ({self.source})"
