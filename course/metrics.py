"""Serving latency metrics over request traces, defined exactly as vLLM's benchmark does.

Definitions (``vllm/benchmarks/serve.py`` and ``vllm/benchmarks/lib/endpoint_request_func.py``):

* TTFT = first chunk's arrival - send time (the first chunk counts even when it carries no text).
* ITL  = gaps between consecutive chunks, pooled over all requests (one value per chunk gap).
* TPOT = (E2E - TTFT) / (output tokens - 1), one value per request, only for requests with
  more than one output token.
* E2E  = last chunk's arrival - send time (a trailing usage-only chunk is not a chunk).
* Percentiles with ``numpy.percentile``'s default linear interpolation; a metric with no
  values reports 0, as vLLM does (``np.percentile(values or 0, p)``). ``n`` says how many
  values there were, so a 0 from "no data" is never mistaken for a measurement.
* Failed requests (an error, or no chunk at all) are left out.

This module is the course's reference; module 1's exercises rebuild it, and the graded tests
make sure a learner's answer computes rather than calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from course.trace import RequestTrace

DEFAULT_PERCENTILES = (50, 95, 99)

# The same quantity under different names (see the module-1 notebook for the sources).
TOOL_NAMES: dict[str, dict[str, str]] = {
    "ttft": {"vLLM": "TTFT", "SGLang": "TTFT", "GuideLLM": "TTFT", "AIPerf": "TTFT", "LLMPerf": "ttft"},
    "itl": {"vLLM": "ITL", "SGLang": "ITL", "GuideLLM": "(not recorded)", "AIPerf": "ICL", "mini-sglang": "TPOT"},
    "tpot": {"vLLM": "TPOT", "SGLang": "TPOT", "GuideLLM": "ITL", "AIPerf": "ITL", "GenAI-Perf": "ITL"},
    "e2e": {"vLLM": "E2EL", "SGLang": "E2E latency", "GuideLLM": "request latency", "AIPerf": "request latency"},
}


def _require_chunks(trace: RequestTrace) -> None:
    if not trace.chunk_times:
        raise ValueError(f"trace {trace.request_id!r} has no chunks: a failed request has no TTFT or E2E.")


def ttft(trace: RequestTrace) -> float:
    """Time to first token (s): first chunk's arrival minus the send time."""
    _require_chunks(trace)
    return trace.chunk_times[0] - trace.send_time


def e2e(trace: RequestTrace) -> float:
    """End-to-end latency (s): last chunk's arrival minus the send time."""
    _require_chunks(trace)
    return trace.chunk_times[-1] - trace.send_time


def itl(trace: RequestTrace) -> list[float]:
    """Inter-token latencies (s): the gaps between consecutive chunks of one request."""
    times = trace.chunk_times
    return [later - earlier for earlier, later in zip(times, times[1:])]


def itl_by_streams(traces: Sequence[RequestTrace], width: int = 4) -> dict[int, list[float]]:
    """The ITL gaps (s) of ``traces`` pooled by how many requests were streaming during each gap.

    A request streams from its first chunk to its last; a gap counts the requests streaming at its
    midpoint, itself included. Gaps go to bins ``width`` counts wide, keyed by the bin's lowest
    count: with ``width=4``, key 1 holds the gaps at 1-4 streams, key 5 those at 5-8. Failed
    requests are left out. Where a server's steps grow with the batch, so do the gaps, bin by bin;
    comparing two runs' bins (a server's and a simulation of it) shows at which load they part.
    """
    if width < 1:
        raise ValueError(f"width must be at least 1 stream, got {width}")
    streaming = [t for t in traces if t.succeeded]
    starts = np.sort([t.chunk_times[0] for t in streaming])
    ends = np.sort([t.chunk_times[-1] for t in streaming])
    bins: dict[int, list[float]] = {}
    for trace in streaming:
        times = np.asarray(trace.chunk_times)
        middles = (times[1:] + times[:-1]) / 2
        # started at or before the midpoint, less those that had already ended before it
        counts = np.searchsorted(starts, middles, side="right") - np.searchsorted(ends, middles, side="left")
        for gap, count in zip(np.diff(times), counts):
            low = (max(int(count), 1) - 1) // width * width + 1
            bins.setdefault(low, []).append(float(gap))
    return dict(sorted(bins.items()))


def tpot(trace: RequestTrace) -> float | None:
    """Time per output token after the first (s), or None for outputs of one token or fewer."""
    if trace.output_tokens <= 1:
        return None
    return (e2e(trace) - ttft(trace)) / (trace.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile with linear interpolation (numpy's default); 0.0 for no values (vLLM)."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    return float(np.percentile(values, q)) if len(values) else 0.0


def run_duration(traces: Sequence[RequestTrace]) -> float:
    """A run's wall-clock length (s): first send to last chunk of the successful requests; 0 if none.

    vLLM's benchmark divides by its own wall clock around the whole run; a trace file has no such
    clock, so this is the span the successful requests cover (failed ones have no chunks).
    """
    ok = [t for t in traces if t.succeeded]
    if not ok:
        return 0.0
    return max(t.chunk_times[-1] for t in ok) - min(t.send_time for t in ok)


@dataclass(frozen=True)
class Stats:
    """Summary of one metric: count, mean and chosen percentiles (same unit as the inputs)."""

    n: int
    mean: float
    percentiles: dict[float, float]

    def __getitem__(self, name: str) -> float:
        """``stats["p95"]``, ``stats["median"]`` (= p50) or ``stats["mean"]``."""
        if name == "mean":
            return self.mean
        try:
            q = 50.0 if name == "median" else float(name.removeprefix("p"))
        except ValueError:
            q = None
        if q in self.percentiles:
            return self.percentiles[q]
        available = ", ".join(["mean"] + [f"p{q:g}" for q in self.percentiles])
        raise KeyError(f"{name!r} was not computed; available: {available}")


def stats_of(values: Sequence[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Stats:
    """Count, mean and percentiles of ``values`` (vLLM's conventions for empty input)."""
    mean = float(np.mean(values)) if len(values) else 0.0
    return Stats(n=len(values), mean=mean, percentiles={float(q): percentile(values, q) for q in percentiles})


@dataclass(frozen=True)
class BenchmarkSummary:
    """TTFT, ITL, TPOT and E2E statistics of a run, plus throughput (seconds, tokens/s)."""

    completed: int
    failed: int
    duration: float
    output_tokens: int
    ttft: Stats
    itl: Stats
    tpot: Stats
    e2e: Stats
    extra: dict = field(default_factory=dict)

    @property
    def output_throughput(self) -> float:
        """Generated tokens per second of wall-clock duration."""
        return self.output_tokens / self.duration if self.duration > 0 else 0.0

    @property
    def request_throughput(self) -> float:
        """Completed requests per second."""
        return self.completed / self.duration if self.duration > 0 else 0.0

    def to_dict(self) -> dict:
        """The summary as plain JSON-ready numbers: counts, seconds (``*_s``) and throughputs.

        ``course bench --json``, ``course summarize --json`` and ``course simulate --json`` all
        print these keys, so their outputs can be compared field by field.
        """
        out: dict = {
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration,
            "output_tokens": self.output_tokens,
            "output_throughput_tok_s": self.output_throughput,
            "request_throughput_req_s": self.request_throughput,
        }
        for name in ("ttft", "itl", "tpot", "e2e"):
            stats: Stats = getattr(self, name)
            out[name] = {"n": stats.n, "mean_s": stats.mean, **{f"p{q:g}_s": v for q, v in stats.percentiles.items()}}
        return out

    def table(self) -> str:
        """A fixed-width table in milliseconds, one row per metric."""
        qs = list(self.ttft.percentiles)
        header = f"{'metric':<6} {'n':>6} {'mean ms':>10} " + " ".join(f"{f'p{q:g} ms':>10}" for q in qs)
        rows = [header]
        for name in ("ttft", "itl", "tpot", "e2e"):
            s: Stats = getattr(self, name)
            cells = " ".join(f"{s.percentiles[q] * 1e3:>10.2f}" for q in qs)
            rows.append(f"{name.upper():<6} {s.n:>6} {s.mean * 1e3:>10.2f} {cells}")
        rows.append(
            f"completed {self.completed}, failed {self.failed}, {self.output_tokens} output tokens in "
            f"{self.duration:.2f} s: {self.output_throughput:.1f} tok/s, {self.request_throughput:.2f} req/s"
        )
        return "\n".join(rows)


def summarize(
    traces: Sequence[RequestTrace],
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    duration: float | None = None,
) -> BenchmarkSummary:
    """Summarize a run the way vLLM's benchmark does.

    Args:
        traces: every request of the run, failed ones included (they are counted, not measured).
        percentiles: which percentiles to report (0..100).
        duration: wall-clock length of the run (s); by default :func:`run_duration` (first send
            to last chunk of the successful requests).
    """
    ok = [t for t in traces if t.succeeded]
    ttfts = [ttft(t) for t in ok]
    e2es = [e2e(t) for t in ok]
    itls = [gap for t in ok for gap in itl(t)]  # pooled: one value per gap, not per request
    tpots = [value for t in ok if (value := tpot(t)) is not None]
    return BenchmarkSummary(
        completed=len(ok),
        failed=len(traces) - len(ok),
        duration=run_duration(ok) if duration is None else duration,
        output_tokens=sum(t.output_tokens for t in ok),
        ttft=stats_of(ttfts, percentiles),
        itl=stats_of(itls, percentiles),
        tpot=stats_of(tpots, percentiles),
        e2e=stats_of(e2es, percentiles),
    )


def naive_latency_per_token(traces: Sequence[RequestTrace]) -> float:
    """The measurement mistake: total latency over total output tokens (s/token).

    It blends prefill (TTFT) into a per-token number, so it moves whenever the output
    length or the prompt length changes, even when neither TTFT nor ITL did.
    """
    ok = [t for t in traces if t.succeeded]
    tokens = sum(t.output_tokens for t in ok)
    if tokens == 0:
        raise ValueError("no successful request produced tokens; the average is undefined")
    return sum(e2e(t) for t in ok) / tokens


# --- goodput -----------------------------------------------------------------------------------

GOODPUT_METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Goodput:
    """Requests that met every latency SLO, as DistServe and vLLM's ``--goodput`` count them.

    ``rate`` is good requests per second of the run (vLLM's ``request_goodput``); ``attainment`` is
    the fraction of all requests that were good (failed requests count as missing their SLOs).
    """

    good: int
    total: int
    duration: float
    slos: dict[str, float]

    @property
    def rate(self) -> float:
        """Good requests per second."""
        return self.good / self.duration if self.duration > 0 else 0.0

    @property
    def attainment(self) -> float:
        """Fraction of requests that met every SLO (0..1)."""
        return self.good / self.total if self.total else 0.0


def goodput(
    traces: Sequence[RequestTrace],
    *,
    ttft_slo: float | None = None,
    tpot_slo: float | None = None,
    e2e_slo: float | None = None,
    duration: float | None = None,
) -> Goodput:
    """Goodput under latency SLOs given in seconds (any of TTFT, TPOT, E2E; at least one).

    Definitions: DistServe (arXiv 2401.09670) counts completed requests per second that meet both
    the TTFT and the TPOT SLO; vLLM's benchmark (``vllm/benchmarks/serve.py``, ``--goodput
    ttft:<ms> tpot:<ms> e2el:<ms>``) calls a request good when every given metric is <= its SLO,
    treats TPOT as 0 for outputs of one token, and divides the good count by the run's duration.
    ``duration`` defaults to :func:`run_duration` (first send to last chunk of the successful requests).
    """
    given = (("ttft", ttft_slo), ("tpot", tpot_slo), ("e2e", e2e_slo))
    slos = {name: value for name, value in given if value is not None}
    if not slos:
        raise ValueError("goodput needs at least one SLO: pass ttft_slo=, tpot_slo= or e2e_slo= in seconds")
    for name, value in slos.items():
        if value <= 0:
            raise ValueError(f"the {name} SLO must be positive (seconds), got {value}")
    ok = [t for t in traces if t.succeeded]
    good = 0
    for trace in ok:
        measured = {"ttft": ttft(trace), "e2e": e2e(trace), "tpot": tpot(trace) or 0.0}
        if all(measured[name] <= limit for name, limit in slos.items()):
            good += 1
    if duration is None:
        duration = run_duration(ok)
    return Goodput(good=good, total=len(traces), duration=duration, slos=slos)
