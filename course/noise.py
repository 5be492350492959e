"""How far a live measurement can be trusted: repeats, their spread, and the machine's load.

Every live measurement in modules 1-3 repeats, prints its n and spread, and ends with a
:func:`check`: the widest spread across repeats (range over median) against a tolerance, and
the load average per core where the platform has one (Linux, macOS). When the figures are too
noisy for the sentence that follows them, the check says so plainly and says what to do,
instead of leaving contradicting numbers under confident prose.

Percentiles of a handful of samples are not tails: :func:`percentile_label` says how many
samples lie above a percentile, so a p99 of 12 samples is printed as what it is.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# A spread (max - min) / median above this fraction makes a figure too noisy to compare with
# another one that differs by less than about the same amount.
DEFAULT_TOLERANCE = 0.25
# Load average per core above which other programs compete for the cores being measured.
BUSY_LOAD_PER_CORE = 1.0
# Share of a core's busy time that the hypervisor may take (steal time: the virtual CPU had work and the host
# ran something else) before a measurement on that core is the host's noise: a step that loses 5 % of its core
# is about 5 % longer, half of a 10 % target.
STEAL_LIMIT = 0.05
# Busy time below which a steal share is not told: the kernel counts in ticks (10 ms on Linux), so over a
# tenth of a second one stolen tick is 10 %.
STEAL_LEAST_BUSY_SECONDS = 0.5
PROC_STAT = Path("/proc/stat")


class Repeated(Protocol):
    """Anything with the median, extremes and count of repeated timings (seconds)."""

    median: float
    low: float
    high: float
    n: int


@dataclass(frozen=True)
class Spread:
    """Median, extremes and count of repeated measurements of one quantity."""

    median: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one measured value")
        return cls(statistics.median(values), min(values), max(values), len(values))


def relative_spread(r: Repeated) -> float:
    """(max - min) / median of repeated measurements: 0.1 means the repeats span ±5 %."""
    return (r.high - r.low) / r.median if r.median > 0 else float("inf")


def spread_text(r: Repeated, unit: str = "ms", scale: float = 1e3) -> str:
    """'12.3 ms (n=5, 11.9-13.0)': the median with its count and range, in ``unit``."""
    return f"{r.median * scale:.3g} {unit} (n={r.n}, {r.low * scale:.3g}-{r.high * scale:.3g})"


def load_per_core() -> float | None:
    """The 1-minute load average divided by the CPU count; None where the OS has none (Windows)."""
    try:
        one_minute = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return one_minute / (os.cpu_count() or 1)


@dataclass(frozen=True)
class CoreTicks:
    """One CPU's time so far, in clock ticks (``/proc/stat``): all of it, its idle part (idle and I/O
    wait) and what the hypervisor stole."""

    total: int
    idle: int
    steal: int


def core_ticks(core: int, stat: Path = PROC_STAT) -> CoreTicks | None:
    """CPU ``core``'s ticks so far, from ``stat`` (Linux's ``/proc/stat``: user, nice, system, idle, iowait,
    irq, softirq, steal, ... after the ``cpuN`` name); None where there is no such file or core (macOS,
    Windows, a container without it)."""
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        name, *fields = line.split()
        if name == f"cpu{core}" and len(fields) >= 8:
            ticks = [int(v) for v in fields[:8]]  # guest time (fields 9-10) is already inside user and nice
            return CoreTicks(total=sum(ticks), idle=ticks[3] + ticks[4], steal=ticks[7])
    return None


def steal_share(before: CoreTicks | None, after: CoreTicks | None) -> float | None:
    """The share of the core's busy time between two readings that the hypervisor stole (0.1: the core had
    work for 10 s and ran it for 9); None when either reading is missing or the core was busy for less than
    :data:`STEAL_LEAST_BUSY_SECONDS` (too few ticks to tell a share)."""
    if before is None or after is None:
        return None
    busy = (after.total - before.total) - (after.idle - before.idle)
    if busy <= 0 or busy < STEAL_LEAST_BUSY_SECONDS * _ticks_per_second():
        return None
    return (after.steal - before.steal) / busy


def _ticks_per_second() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, OSError, ValueError):  # /proc/stat's unit everywhere Linux runs
        return 100


@dataclass(frozen=True)
class NoiseCheck:
    """The verdict of :func:`check`: may the figures carry the claim that follows them?"""

    ok: bool
    widest_spread: float  # the largest (max - min) / median among the checked timings
    fewest_repeats: int
    load: float | None  # load average per core when checked, None where unknown
    message: str

    def __str__(self) -> str:
        return self.message


def check(
    timings: Iterable[Repeated],
    claim: str,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    load: float | None | str = "measure",
) -> NoiseCheck:
    """Check repeated timings for noise before ``claim`` (the sentence they must support).

    Args:
        timings: each with ``median``, ``low``, ``high`` and ``n`` (e.g. :class:`course.measure.Timing`).
        claim: what the figures are about to support, e.g. "the step time at batch 8 vs batch 1".
        tolerance: the widest spread (max - min) / median still accepted.
        load: load average per core; "measure" reads it now, None means unknown.
    """
    timings = list(timings)
    if not timings:
        raise ValueError("check needs at least one timing")
    if load == "measure":
        load = load_per_core()
    widest = max(relative_spread(t) for t in timings)
    fewest = min(t.n for t in timings)
    busy = load is not None and load > BUSY_LOAD_PER_CORE
    load_text = "load average unknown on this platform" if load is None else f"load average {load:.2f} per core"
    facts = f"n >= {fewest} repeats per point, widest spread {widest:.0%} of the median, {load_text}"
    problems = []
    if fewest < 3:
        problems.append(f"only {fewest} repeat(s) per point: the spread itself is unknown")
    if widest > tolerance:
        problems.append(f"repeats differ by up to {widest:.0%} (the check allows {tolerance:.0%})")
    if busy:
        problems.append("other programs are using the CPU")
    if problems:
        message = (
            f"NOISE CHECK FAILED ({facts}): {'; '.join(problems)}. These figures are too noisy to support "
            f"{claim}. Close other work (or wait for a quiet moment) and rerun this cell; the sentence "
            "below is about what a quiet runtime shows, not necessarily what was printed above."
        )
    else:
        message = f"Noise check passed ({facts}): the figures can support {claim}."
    return NoiseCheck(not problems, widest, fewest, load, message)


def tail_samples(n: int, q: float) -> float:
    """How many of ``n`` samples lie above the q-th percentile (q in 0-100), on average."""
    return n * (1 - q / 100)


def percentile_label(q: float, n: int) -> str:
    """'p95' with its n, and a warning when fewer than 1 sample lies above it (q in 0-100).

    With n = 10, p95 and p99 are interpolated between the two largest samples: they describe
    the maximum, not a tail the next 100 requests will see.
    """
    if q > 50 and tail_samples(n, q) < 1:
        return f"p{q:g} (n={n}: too few for a p{q:g}, read it as the max)"
    return f"p{q:g} (n={n})"


def check_load(claim: str, *, load: float | None | str = "measure") -> NoiseCheck:
    """The load-average half of :func:`check`, for runs whose spread is the subject (a load test's latencies)."""
    if load == "measure":
        load = load_per_core()
    if load is None:
        message = f"Load average unknown on this platform: make sure nothing else runs while measuring {claim}."
        return NoiseCheck(True, 0.0, 0, None, message)
    if load > BUSY_LOAD_PER_CORE:
        message = (
            f"NOISE CHECK FAILED (load average {load:.2f} per core): other programs are using the CPU, so these "
            f"figures are too noisy to support {claim}. Close other work and rerun this cell."
        )
        return NoiseCheck(False, 0.0, 0, load, message)
    return NoiseCheck(True, 0.0, 0, load, f"Noise check passed (load average {load:.2f} per core) for {claim}.")
