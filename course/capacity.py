"""Capacity planning under latency SLOs (module 5): how many GPUs a service needs and what it costs.

The pieces, each small enough to check by hand:

* :class:`SLO`: a traffic class's latency targets (TTFT and TPOT at a percentile, in seconds) with
  where they came from, and :meth:`SLO.check` / :meth:`SLO.holds` over a run's request traces.
* :func:`highest_rate`: the highest arrival rate at which a run still holds its SLOs, by bisection
  over a monotone "holds at this rate?" test (a simulation or a measured run).
* :class:`SteadyWindow`: which requests of a run measure its steady state (warm-up and drain left out),
  so that a capacity does not depend on the run's length.
* :func:`replicas_needed` and :func:`dollars_per_million_tokens`: the two lines of arithmetic that
  turn a per-replica capacity into a fleet and a price.
* :func:`server_sim_config` and :func:`calibration_samples`: the simulator settings that mirror
  module 2's reference server, and step-time samples measured against any running server, each
  with the spread of the requests it is the median of (for :func:`course.noise.check`).
* :func:`quantize_kv` and :func:`kv_quantization_quality`: a KV cache stored in fewer bits, simulated
  by quantizing and dequantizing the cached tensors, and what that does to a model's predictions.

Module 5's exercises rebuild goodput and the rate search, and its capstone (:mod:`course.plan`) the
replicas and the price; the graded tests forbid calling this module.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from course import metrics, rate_search
from course import slo as slo_targets
from course.noise import Spread
from course.rate_search import RateSearch, highest_rate, replicas_needed  # noqa: F401  (names of this module too)
from course.sim.cost import StepSample
from course.slo import SLO, SLOCheck, WindowLatencies  # noqa: F401  (names of this module too)
from course.trace import RequestTrace

REFERENCE_MODULES = (rate_search, slo_targets)  # course.grading.forbid_reference watches it with this module

# --- SLOs ---------------------------------------------------------------------------------------
# SLO and SLOCheck live in course.slo (``course simulate`` reads SLOs too, from below this module); they are this
# module's names as well, and part of its reference for the graded tests.


# Reading speed (Brysbaert 2019, "How many words do we read per minute? A review and meta-analysis of
# reading rate", Journal of Memory and Language 109, 104047): adults read English non-fiction silently
# at 238 words per minute on average (most between 175 and 300).
READING_WORDS_PER_MINUTE = 238
# OpenAI's rule of thumb for English text: one token is about 3/4 of a word
# (help.openai.com, "What are tokens and how to count them?").
TOKENS_PER_WORD = 4 / 3


def reading_speed_tpot(
    words_per_minute: float = READING_WORDS_PER_MINUTE, tokens_per_word: float = TOKENS_PER_WORD
) -> float:
    """Seconds per token at which a stream keeps pace with a reader (s/token)."""
    if words_per_minute <= 0 or tokens_per_word <= 0:
        raise ValueError("words_per_minute and tokens_per_word must be positive")
    return 60.0 / (words_per_minute * tokens_per_word)


# --- capacity search ---------------------------------------------------------------------------
# highest_rate, RateSearch and replicas_needed live in course.rate_search (the simulator's fleet search uses them
# too, from below this module); they are this module's names as well, and its reference for the graded tests.


@dataclass(frozen=True)
class SteadyWindow:
    """Which requests of an open-loop run measure a steady state (seconds from the first arrival).

    A run that starts empty is fast at first (no queue, a small batch) and, once arrivals stop, drains
    with less and less company: requests that arrive in either stretch see a lighter load than the
    rate promises, so a capacity found from every request of a short run depends on the run's length.
    Measure only the requests that arrive after ``warmup`` and within ``window``, and keep the traffic
    coming for ``drain`` seconds after it.
    """

    warmup: float
    window: float
    drain: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.window <= 0 or self.drain < 0:
            raise ValueError(f"need warmup >= 0, window > 0 and drain >= 0 seconds, got {self}")

    @property
    def seconds(self) -> float:
        """How long the arrivals must last (s)."""
        return self.warmup + self.window + self.drain

    def requests(self, rate: float) -> int:
        """Requests a Poisson stream at ``rate`` req/s brings over :attr:`seconds` (at least 1)."""
        return max(1, round(rate * self.seconds))

    def select(self, traces: Sequence[RequestTrace]) -> list[RequestTrace]:
        """The traces whose request arrived inside the window (``send_time`` relative to the first)."""
        if not traces:
            return []
        start = min(t.send_time for t in traces)
        return [t for t in traces if self.warmup <= t.send_time - start < self.warmup + self.window]


def window_latencies(runs: Any, window: SteadyWindow, keep: Callable[[str], bool] | None = None) -> WindowLatencies:
    """The latencies of the requests that arrived inside ``window`` in simulated runs that share one clock.

    ``runs``: a :class:`course.sim.SimResult`, a fleet's result (its ``runs``), or a sequence of them: the
    replicas of one fleet, whose window starts at the first arrival over all of them (as
    :meth:`SteadyWindow.select` over the fleet's traces). ``keep``: which request ids count (a traffic
    class's), default all. The same numbers as ``window.select(traces)``, from the runs' columns.
    """
    runs = list(getattr(runs, "runs", None) or ([runs] if hasattr(runs, "steps") else runs))
    if not runs:
        raise ValueError("window_latencies needs at least one simulated run")
    tables = [run.columns for run in runs]
    if any(table is None for table in tables):  # the readable harness keeps records, not columns
        records = [r for run in runs for r in run.requests]
        start = min(r.arrival_time for r in records)
        end = window.warmup + window.window
        picked = [
            r for r in records if window.warmup <= r.arrival_time - start < end and (keep is None or keep(r.request_id))
        ]
        ok = [t for t in (r.trace() for r in picked) if t.succeeded]
        tpot = [metrics.tpot(t) for t in ok]
        return WindowLatencies(
            np.array([metrics.ttft(t) for t in ok], dtype=float),
            np.array([np.nan if v is None else v for v in tpot], dtype=float),
            len(picked) - len(ok),
            sum(1 for r in picked if r.preempted),
        )
    start = min(float(table.arrival.min()) for table in tables if len(table))
    ttft, tpot, failed, preempted = [], [], 0, 0
    for run, table in zip(runs, tables):
        if not len(table):
            continue
        since = table.arrival - start
        inside = (since >= window.warmup) & (since < window.warmup + window.window)
        if keep is not None:
            inside &= np.fromiter((keep(rid) for rid in table.request_ids), dtype=bool, count=len(table))
        got = table.latencies(run.steps)
        mine = inside[got.ok]
        ttft.append(got.ttft[mine])
        tpot.append(got.tpot[mine])
        failed += int(np.count_nonzero(inside)) - int(np.count_nonzero(mine))
        preempted += int(np.count_nonzero(inside & (np.diff(table.preempted_offsets) > 0)))
    empty = [np.zeros(0)]
    return WindowLatencies(np.concatenate(ttft or empty), np.concatenate(tpot or empty), failed, preempted)


@dataclass(frozen=True)
class SteadyCapacity:
    """What :func:`steady_capacity` found: the rate, and how it was measured.

    Attributes:
        rate: the highest rate (req/s) whose pooled steady-state requests held the SLO; 0.0 if none.
        window: the warm-up left out, the window measured and the drain after it (s).
        seeds: the independent runs pooled at every rate.
        tried: every (rate, held) the search simulated.
    """

    rate: float
    window: SteadyWindow
    seeds: tuple[int, ...]
    tried: tuple[tuple[float, bool], ...] = field(default=())

    def describe(self) -> str:
        return (
            f"{self.rate:.2f} req/s ({self.window.warmup:g} s warm-up left out, {self.window.window:g} s of arrivals "
            f"measured, {len(self.seeds)} seeds pooled; {len(self.tried)} rates simulated)"
        )


def steady_capacity(
    run_at: Callable[[float, int, int], Any],
    slo: SLO,
    low: float,
    high: float,
    window: SteadyWindow,
    seeds: Sequence[int] = (0, 1, 2),
    rel_tol: float = 0.02,
) -> SteadyCapacity:
    """The highest arrival rate at which ``slo`` holds at steady state, measured so that the answer does not
    move with the window's length.

    A capacity from one run moves with how long the run is: an engine that starts empty serves its first
    requests in a light batch, and near capacity the tail of a short window depends on which bursts it
    happened to catch (the p95 of one window of a few hundred requests is biased low, since bursts are
    rare and each lasts a while). So at every rate this pools the requests that arrive inside ``window``
    (after its warm-up, with traffic still arriving for its drain) over several independent runs, one
    per seed, and checks the SLO over all of them together; :func:`highest_rate` bisects the rate. With a
    warm-up longer than the longest request takes (the engine's batch has filled) and three seeds, the
    module-5 chat traffic's capacity agrees within 5 % at windows of 30, 60 and 120 s
    (``tests/test_capacity.py``).

    Args:
        run_at: ``run_at(rate, requests, seed)`` simulates ``requests`` arrivals at ``rate`` req/s (Poisson,
            with that seed) and returns the simulation's result (or a fleet's).
        slo: the targets.
        low, high: the bracket (req/s).
        window: the warm-up, window and drain (s); each run has ``window.requests(rate)`` arrivals.
        seeds: one independent run per seed at every rate.
        rel_tol: the search stops when the failing and the holding rate are within this (relative).
    """
    if not seeds:
        raise ValueError("steady_capacity needs at least one seed")

    def holds(rate: float) -> bool:
        pooled = WindowLatencies(np.zeros(0), np.zeros(0))
        for seed in seeds:
            pooled = pooled + window_latencies(run_at(rate, window.requests(rate), seed), window)
        if not pooled.requests:
            raise ValueError(
                f"at {rate:g} req/s no request arrived inside the {window.window:g} s window of any seed: raise the "
                "bracket's low end or lengthen the window"
            )
        return slo.check_latencies(pooled).holds

    search = highest_rate(holds, low, high, rel_tol=rel_tol)
    return SteadyCapacity(search.rate, window, tuple(seeds), search.tried)


def chat_traffic(rate: float, n: int, seed: int = 0, prompt: int = 1024) -> Any:
    """Module 5's chat traffic (sections 4 to 6): ``n`` Poisson arrivals at ``rate`` req/s, log-normal prompts
    around ``prompt`` tokens (sigma 0.5, 16 to min(6 x prompt, 7,000)) and answers around 200 tokens (sigma 0.6,
    8 to 1,000), seeded. A :class:`course.workload.Workload`."""
    from course import workload

    return workload.poisson(
        rate,
        n,
        workload.lognormal(prompt, 0.5, low=16, high=min(6 * prompt, 7000)),
        workload.lognormal(200, 0.6, low=8, high=1000),
        seed=seed,
    )


def dollars_per_million_tokens(dollars_per_gpu_hour: float, tokens_per_second: float, gpus: int = 1) -> float:
    """Dollars per million tokens of ``gpus`` GPUs, rented at ``dollars_per_gpu_hour`` each, producing
    ``tokens_per_second`` tokens together."""
    if not dollars_per_gpu_hour >= 0:
        raise ValueError(f"dollars_per_gpu_hour must be >= 0, got {dollars_per_gpu_hour!r}")
    if not tokens_per_second > 0:
        raise ValueError(f"tokens_per_second must be positive, got {tokens_per_second!r}")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    return dollars_per_gpu_hour * gpus / (tokens_per_second * 3600) * 1e6


# --- the simulator as module 2's server ----------------------------------------------------------


def server_sim_config(max_batch_size: int, max_prefill_tokens: int, num_blocks: int | None = None, **changes: Any):
    """:class:`course.sim.SimConfig` that schedules like module 2's reference server.

    The server prefills what it admitted in a pass of its own and then decodes every running request
    (``course/serving/engine_core.py``): vLLM V0's prefill-first schedule with one decode step after every
    prefill step, at most ``max_batch_size`` requests, ``max_prefill_tokens`` prompt tokens per pass.
    Its cache grows as needed, so by default the KV blocks never run out: ``num_blocks`` defaults to room
    for ``max_batch_size`` requests of 131,072 tokens each (32 times the tiny model's context), not a fixed
    ten million blocks, which cost a third of a second to set up in every simulation.
    """
    if num_blocks is None:
        num_blocks = max_batch_size * 131_072 // 16
    from course.sim import SimConfig

    settings = dict(
        scheduler="prefill-first",
        decode_after_prefill=True,
        max_num_seqs=max_batch_size,
        max_num_batched_tokens=max_prefill_tokens,
        num_blocks=num_blocks,
    )
    settings.update(changes)
    return SimConfig(**settings)


@dataclass(frozen=True)
class FrontEndSplit:
    """Where a lone request's time outside its prefill pass goes, from one prefill microbenchmark
    (means over its requests, s).

    ``client_ttft``: at the client. ``server_ttft``: the server's own (``vllm:time_to_first_token_seconds``
    on its ``/metrics``: from its engine's arrival stamp to the event loop's handling of the first
    token). ``prefill_pass``: the pass inside the engine (``prefill_steps_by_tokens`` on ``/health``).
    """

    client_ttft: float
    server_ttft: float
    prefill_pass: float

    @property
    def before_engine(self) -> float:
        """Before the engine sees the request: the HTTP request, parsing, tokenizing, and the first
        chunk's way from the event loop to the client (s)."""
        return self.client_ttft - self.server_ttft

    @property
    def outside_pass(self) -> float:
        """All of the TTFT outside the prefill pass (s)."""
        return self.client_ttft - self.prefill_pass


@dataclass(frozen=True)
class CalibrationSample(StepSample):
    """A measured step for :meth:`course.sim.LinearCost.fit`, with the spread of the per-request
    values (s) whose median is ``seconds``: on a quiet runtime they agree, on a busy one they scatter;
    a prefill's ``front_end`` when the server reports its own TTFT and prefill passes (module 2's)."""

    spread: Spread | None = None
    front_end: FrontEndSplit | None = None


def before_engine_share(measured: Sequence[FrontEndSplit | CalibrationSample]) -> float:
    """The fraction of a lone request's time outside its prefill pass that comes before the engine
    sees it: ``LinearCost.fit(..., before_engine_share=...)``.

    ``measured``: :class:`FrontEndSplit` records, or calibration samples (those without one are
    skipped). Summed over them, clipped to [0, 1]; 0.0 when none was measured (a server that does not
    report its TTFT and prefill passes, whose front end is then all on the prefill step).
    """
    splits = [m.front_end if isinstance(m, CalibrationSample) else m for m in measured]
    splits = [split for split in splits if split is not None]
    outside = sum(split.outside_pass for split in splits)
    if outside <= 0:
        return 0.0
    return min(max(sum(split.before_engine for split in splits) / outside, 0.0), 1.0)


def server_prefill_counters(base_url: str) -> tuple[float, float, float, float] | None:
    """The server's TTFT so far (seconds summed, requests) from ``/metrics`` and its prefill passes
    (passes, seconds) from ``/health``; None when it reports either not (vLLM's /health is empty).
    Two readings around a run of lone requests give a :class:`FrontEndSplit`."""
    import httpx

    from course.metrics_text import metric_value, parse_metrics

    name = "vllm:time_to_first_token_seconds"
    try:
        health = httpx.get(f"{base_url}/health", timeout=10).json()
        snapshot = parse_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text)
        ttft = (metric_value(snapshot, name + "_sum"), metric_value(snapshot, name + "_count"))
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    if not isinstance(health, dict) or "prefill_steps_by_tokens" not in health:
        return None
    passes = health["prefill_steps_by_tokens"].values()
    return (*ttft, float(sum(n for n, _ in passes)), float(sum(seconds for _, seconds in passes)))


def settled_prefill_counters(
    base_url: str, before: tuple[float, ...] | None, requests: int, timeout: float = 30.0
) -> tuple[float, float, float, float] | None:
    """:func:`server_prefill_counters` once they count ``requests`` more requests and prefill passes than
    ``before``, or as they are after ``timeout`` seconds.

    The server counts a request's TTFT when its stream has closed and a prefill pass just after its first
    token went out, so a reading taken the moment the client has its last chunk can miss the last
    request (on a busy machine, often). The wait ends as soon as they count: ``timeout`` is long because a
    server thread on a laptop at load 8 can take seconds to count a request it has answered.
    """
    deadline = time.monotonic() + timeout
    while True:
        after = server_prefill_counters(base_url)
        if after is None or before is None or time.monotonic() > deadline:
            return after
        if after[1] - before[1] >= requests and after[2] - before[2] >= requests:
            return after
        time.sleep(0.01)


def front_end_split(
    traces: Sequence[RequestTrace], before: tuple[float, ...] | None, after: tuple[float, ...] | None
) -> FrontEndSplit | None:
    """The :class:`FrontEndSplit` of a run of lone requests, from :func:`server_prefill_counters` read
    before and after it; None without both readings or without requests counted in between."""
    ttfts = [metrics.ttft(t) for t in traces if t.succeeded]
    if before is None or after is None or not ttfts:
        return None
    ttft_seconds, requests, passes, pass_seconds = (later - earlier for earlier, later in zip(before, after))
    if requests <= 0 or passes <= 0:
        return None
    return FrontEndSplit(statistics.fmean(ttfts), ttft_seconds / requests, pass_seconds / passes)


def prefill_sample(traces: Sequence[RequestTrace], prompt_tokens: int) -> CalibrationSample:
    """The prefill step of a ``prompt_tokens``-token prompt, from requests sent one at a time.

    ``seconds`` is the median TTFT (the request's way in, its prefill step and the first token's way
    out); ``deviations`` are each TTFT minus their mean, for the cost's step-time spread.
    """
    ttfts = [metrics.ttft(t) for t in traces if t.succeeded]
    if not ttfts:
        raise ValueError(f"prefill calibration ({prompt_tokens} tokens): no request succeeded")
    mean = statistics.fmean(ttfts)
    return CalibrationSample(
        prompt_tokens, 0, 0, statistics.median(ttfts), Spread.of(ttfts), deviations=tuple(v - mean for v in ttfts)
    )


def decode_sample(traces: Sequence[RequestTrace], batch: int, context: int, output: int) -> CalibrationSample:
    """The decode step of ``batch`` requests, from a wave of ``context``-token prompts that start
    together and generate ``output`` tokens each.

    Only the second half of each request's chunks counts: in a closed-loop wave the next requests'
    prompts are prefilled while the first ones already decode, so the early gaps hold prefill chunks.
    ``seconds`` is the median over requests of the mean gap there (a request's TPOT over its second
    half; unlike a single gap it does not shrink when a busy client reads chunks in bursts), at
    ``context + 3/4 output`` cached tokens per request on average; ``deviations`` are those gaps
    minus their mean (one per step), for the cost's step-time spread, leaving out every gap in which
    another request got its first token: that gap holds a prefill step, which a simulation schedules
    and times itself, so counting it in the decode steps' spread would count it twice.
    """
    first_tokens = sorted(t.chunk_times[0] for t in traces if t.succeeded and t.chunk_times)
    steady, gaps = [], []
    for t in traces:
        if not t.succeeded or len(t.chunk_times) < 3:
            continue
        half = len(t.chunk_times) // 2
        tokens = sum(t.chunk_tokens[half + 1 :])
        times = t.chunk_times[half:]
        if tokens > 0 and len(times) > 1:
            steady.append((times[-1] - times[0]) / tokens)
            gaps += [later - earlier for earlier, later in zip(times, times[1:])
                     if not holds_a_first_token(first_tokens, earlier, later)]  # fmt: skip
    if not steady:
        raise ValueError(
            f"decode calibration (batch {batch}, context {context}): no request streamed 3 chunks or more; "
            f"ask for more output tokens than {output}"
        )
    mean = statistics.fmean(gaps) if gaps else 0.0
    return CalibrationSample(
        0, batch, batch * (context + (3 * output) // 4), statistics.median(steady), Spread.of(steady),
        deviations=tuple(g - mean for g in gaps),
    )  # fmt: skip


def holds_a_first_token(first_tokens: Sequence[float], earlier: float, later: float) -> bool:
    """Whether a request's first token (sorted times, s) came in the gap (``earlier``, ``later``]."""
    index = bisect.bisect_right(first_tokens, earlier)
    return index < len(first_tokens) and first_tokens[index] <= later


def calibration_samples(
    base_url: str,
    prefill_lengths: Sequence[int] = (16, 64, 256),
    decode_batches: Sequence[int] = (1, 4, 8),
    decode_contexts: Sequence[int] = (32, 192),
    decode_output: int = 24,
    repeats: int = 3,
    seed: int = 101,
) -> list:
    """Step-time samples measured against a running server, for :meth:`course.sim.LinearCost.fit`.

    Prefill: one request at a time for each prompt length, 2 output tokens; the median TTFT over
    ``repeats`` requests is the prefill step (:func:`prefill_sample`). Decode: waves of ``batch``
    requests that start together, each with a ``context``-token prompt and ``decode_output`` tokens;
    the median TPOT over each request's second half is the decode step at that batch
    (:func:`decode_sample`). (The method of ``benchmarks/sim_fidelity.py``.) Each sample carries the
    spread of the TTFTs or TPOTs it is the median of: ``course.noise.check([s.spread for s in
    samples], claim)`` says whether the runtime was quiet enough for them (it needs ``repeats >= 3``
    to know a prefill's spread); the deviations of its single steps, from which
    :meth:`course.sim.LinearCost.fit` fits the step-time spread; and a prefill, on a server that
    reports its own TTFT and prefill passes (module 2's), where its time outside the pass goes
    (:class:`FrontEndSplit`): :func:`before_engine_share` of the samples is the share of it the
    request spends before the engine sees it.
    """
    import httpx

    from course.serving.client import run_load
    from course.workload import all_at_once

    if decode_output < 4:
        raise ValueError(
            f"decode_output must be >= 4 tokens (the second half of a request is timed), got {decode_output}"
        )
    try:  # one request first: a server that is not there is an error to report plainly
        run_load(base_url, all_at_once(1, 4, 1), progress=False, seed=seed)
    except (httpx.HTTPError, OSError) as err:
        raise RuntimeError(
            f"cannot reach a server at {base_url} ({type(err).__name__}: {err}); is it running?"
        ) from None
    samples = []
    for prompt in prefill_lengths:
        counted = server_prefill_counters(base_url)
        run = run_load(base_url, all_at_once(repeats, prompt, 2), concurrency=1, progress=False, seed=seed)
        _raise_failures(run.traces, f"prefill calibration ({prompt} tokens)")
        split = front_end_split(run.traces, counted, settled_prefill_counters(base_url, counted, len(run.traces)))
        samples.append(replace(prefill_sample(run.traces, prompt), front_end=split))
    for context in decode_contexts:
        for batch in decode_batches:
            wave = all_at_once(batch * max(1, repeats // 2 + 1), context, decode_output)
            run = run_load(base_url, wave, concurrency=batch, progress=False, seed=seed + 1)
            _raise_failures(run.traces, f"decode calibration (batch {batch}, context {context})")
            samples.append(decode_sample(run.traces, batch, context, decode_output))
    return samples


# The recorded calibration module 5 plans with when this runtime's own measurements are too noisy: module 2's
# server and the course's tiny model on the course's 2-core build machine (benchmarks/record_calibration.py).
RECORDED_CALIBRATION = "course/data/calibration_m5.json"
# The metrics the held-out check compares, simulated against measured.
HELD_OUT_METRICS = tuple(f"{name} {q}" for name in ("ttft", "itl", "tpot") for q in ("p50", "p95"))


@dataclass(frozen=True)
class Calibration:
    """The simulator fitted to a running server, and how far to trust it.

    Attributes:
        cost: the fitted step cost (:class:`course.sim.LinearCost`).
        samples: the microbenchmarks it was fitted to.
        held_out: a measured run the fit never saw (Poisson arrivals), and ``rate`` the rate it was sent at.
        errors: for each of :data:`HELD_OUT_METRICS`, the simulated replay of ``held_out`` over the
            measurement, minus 1 (+0.10: the simulator said 10 % more).
        noise: whether this runtime was quiet enough while the microbenchmarks ran (:func:`course.noise.check`).
        source: where the fit comes from: "measured on this runtime", or the recorded calibration's label.
    """

    cost: Any
    samples: tuple
    held_out: tuple[RequestTrace, ...]
    rate: float
    errors: dict[str, float]
    noise: Any
    source: str

    @property
    def recorded(self) -> bool:
        return self.source != "measured on this runtime"

    @property
    def worst(self) -> tuple[str, float]:
        """The metric the simulator missed by most, and by how much (relative, signed)."""
        name = max(self.errors, key=lambda k: abs(self.errors[k]))
        return name, self.errors[name]

    @property
    def margin(self) -> float:
        """The planning margin the held-out check implies: the largest error, as a share (0.18: plan 18 % low)."""
        return abs(self.worst[1])

    def describe(self) -> str:
        lines = [f"calibration: {self.source}", f"  step cost: {self.cost.describe()}"]
        lines.append(f"  held-out run: {len(self.held_out)} requests sent at {self.rate:.2f} req/s (Poisson)")
        lines += [f"  {name.upper():9s} simulated {error:+.0%} against measured" for name, error in self.errors.items()]
        name, error = self.worst
        lines.append(f"  largest error {name} {error:+.0%}: plan with a margin of at least {self.margin:.0%}")
        return "\n".join(lines)


def held_out_errors(traces: Sequence[RequestTrace], config: Any, cost: Any) -> dict[str, float]:
    """The simulator's replay of a measured run (same arrivals and lengths) against the measurement:
    simulated / measured - 1 for each of :data:`HELD_OUT_METRICS`."""
    from course import sim, workload

    replayed = sim.simulate(workload.from_traces(list(traces)), config, cost).summary()
    measured = metrics.summarize(list(traces))
    errors = {}
    for key in HELD_OUT_METRICS:
        name, q = key.split()
        got, want = getattr(replayed, name)[q], getattr(measured, name)[q]
        errors[key] = got / want - 1 if want > 0 else math.nan
    return errors


def calibrate(
    base_url: str,
    server: dict,
    prompts: Callable,
    outputs: Callable,
    *,
    quick: bool = False,
    recorded: str | None = RECORDED_CALIBRATION,
    seed: int = 11,
    rounds: int = 1,
) -> Calibration:
    """Fit the simulator to a running server (module 2's) and check it on a run it never saw: one call.

    Microbenchmarks (:func:`calibration_samples`: prefills one at a time, decode waves; each point repeated 4
    times so its spread is known) give :meth:`course.sim.LinearCost.fit` its samples; a Poisson run at a rate
    that keeps the server busy about half the time is the held-out check (:func:`held_out_errors`, with
    :func:`server_sim_config`'s scheduling). When the microbenchmarks' spread or the load average says this
    runtime was too busy (:func:`course.noise.check`), the fit would measure the machine, not the server: the
    recorded calibration of the same server and model (``recorded``, a path from the repository root) is used
    instead, its source saying so. ``docs/calibration.md`` explains the machinery (the front end, the rounds, the
    machine's drift).

    Args:
        base_url: the server.
        server: its settings, ``{"max_batch_size": ..., "max_prefill_tokens": ...}``.
        prompts, outputs: length samplers of the held-out run (``course.workload.uniform``).
        quick: fewer microbenchmarks and requests (the autograder's mode).
        recorded: the recorded calibration to fall back on; None never falls back.
        seed: the held-out run's arrivals.
        rounds: rounds of microbenchmarks, merged by :func:`merge_rounds` (the recorder uses several, spread over
            a minute; then the noise check judges how far the rounds agree).
    """
    from course import noise, sim, workload
    from course.serving import run_load

    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    measured = [
        calibration_samples(
            base_url,
            prefill_lengths=(16, 128) if quick else (16, 64, 192),
            decode_batches=(1, 4) if quick else (1, 4, 8),
            decode_contexts=(32, 128),
            decode_output=8 if quick else 12,
            repeats=4,  # >= 3 per point: the noise check needs each point's spread
        )
        for _ in range(rounds)
    ]
    samples = measured[0] if rounds == 1 else merge_rounds(measured)
    quiet = noise.check([sample.spread for sample in samples], "a simulator fitted to this server")
    config = server_sim_config(**server)
    if not quiet.ok and recorded is not None:
        found = load_calibration(recorded)
        return replace(found, noise=quiet)
    cost = sim.LinearCost.fit(samples, before_engine_share=before_engine_share(samples))
    alone = cost.step_seconds(96, 0, 0) + 28 * cost.step_seconds(0, 1, 110)  # a median request served alone
    rate = 0.5 / alone  # busy about half the time even if batching bought nothing
    n = max(4, min(12 if quick else 24, int(rate * (15 if quick else 20))))  # a slow runtime stays quick
    run = run_load(base_url, workload.poisson(rate, n, prompts, outputs, seed=seed), progress=False)
    errors = held_out_errors(run.traces, config, cost)
    return Calibration(cost, tuple(samples), tuple(run.traces), rate, errors, quiet, "measured on this runtime")


def merge_rounds(rounds: Sequence[Sequence[CalibrationSample]]) -> list[CalibrationSample]:
    """One sample per microbenchmark from several rounds of :func:`calibration_samples` spread through a run: the
    mean step over the rounds (a machine whose speed drifts is seen at its average, as ``benchmarks/sim_fidelity.py``
    does), every round's deviations, the spread of the rounds' steps, and the rounds' front ends averaged."""
    merged = []
    for same in zip(*rounds, strict=True):
        first = same[0]
        splits = [sample.front_end for sample in same if sample.front_end is not None]
        front = None
        if splits:
            front = FrontEndSplit(*(statistics.fmean(getattr(f, name) for f in splits) for name in
                                    ("client_ttft", "server_ttft", "prefill_pass")))  # fmt: skip
        merged.append(
            CalibrationSample(
                first.prefill_tokens, first.decode_tokens, first.kv_tokens_read,
                statistics.fmean(sample.seconds for sample in same),
                deviations=tuple(d for sample in same for d in sample.deviations),
                attention_pairs=first.attention_pairs,
                spread=Spread.of([sample.seconds for sample in same]),
                front_end=front,
            )
        )  # fmt: skip
    return merged


def _sample_dict(sample: Any) -> dict:
    data = {f: getattr(sample, f) for f in ("prefill_tokens", "decode_tokens", "kv_tokens_read", "seconds")}
    data["deviations"] = list(sample.deviations)
    data["attention_pairs"] = sample.attention_pairs
    data["spread"] = None if sample.spread is None else vars(sample.spread)
    data["front_end"] = None if sample.front_end is None else vars(sample.front_end)
    return data


def _sample_from(data: dict) -> CalibrationSample:
    return CalibrationSample(
        data["prefill_tokens"],
        data["decode_tokens"],
        data["kv_tokens_read"],
        data["seconds"],
        deviations=tuple(data["deviations"]),
        attention_pairs=data["attention_pairs"],
        spread=None if data["spread"] is None else Spread(**data["spread"]),
        front_end=None if data["front_end"] is None else FrontEndSplit(**data["front_end"]),
    )


def save_calibration(calibration: Calibration, path: str, label: str, server: dict) -> None:
    """Write a calibration's samples and held-out run as JSON, with ``label`` (where and when it was measured)
    and the server's settings; :func:`load_calibration` refits and replays them."""
    import json

    data = {
        "label": label,
        "server": server,
        "rate": calibration.rate,
        "samples": [_sample_dict(s) for s in calibration.samples],
        "held_out": [t.to_dict() for t in calibration.held_out],
    }
    with open(path, "w") as handle:
        json.dump(data, handle, indent=1)
        handle.write("\n")


def load_calibration(path: str = RECORDED_CALIBRATION) -> Calibration:
    """A recorded calibration (:func:`save_calibration`): the fit redone from its samples, its held-out run
    replayed; ``source`` is its label, starting "recorded". ``path`` is relative to the repository root."""
    import json
    from pathlib import Path

    from course import noise, sim

    file = Path(path) if Path(path).is_absolute() else Path(__file__).resolve().parents[1] / path
    data = json.loads(file.read_text())
    samples = tuple(_sample_from(s) for s in data["samples"])
    cost = sim.LinearCost.fit(samples, before_engine_share=before_engine_share(samples))
    traces = tuple(RequestTrace.from_dict(t) for t in data["held_out"])
    errors = held_out_errors(traces, server_sim_config(**data["server"]), cost)
    checked = noise.check([s.spread for s in samples], "the recorded calibration", load=None)
    return Calibration(cost, samples, traces, data["rate"], errors, checked, data["label"])


def _raise_failures(traces: Sequence[RequestTrace], what: str) -> None:
    failed = [t for t in traces if not t.succeeded]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} of {len(traces)} requests failed, first: {failed[0].error}")


# --- KV-cache quantization ----------------------------------------------------------------------

# vLLM's --kv-cache-dtype names (vllm/config/cache.py, CacheDType), as module 4 and `course kv` use them: the
# ones whose values this module stores and reads back (the per-token-head integers and fp8, per token-head or
# with vLLM's default scale of 1.0).
KV_SCHEMES = ("int8_per_token_head", "fp8_per_token_head", "fp8", "int4_per_token_head")
# vLLM's per-token-head kernels keep each scale at least this (vllm/v1/attention/ops/
# triton_reshape_and_cache_flash.py, _reshape_cache_per_token_head; int4_per_token_head.py, the same in 0.34).
_MIN_SCALE = 1e-6
FP8_MAX = 448.0  # float8 e4m3's largest value (torch.finfo(torch.float8_e4m3fn).max)


def kv_scheme(name: str) -> str:
    """The :data:`KV_SCHEMES` name of ``name``, which may also be the course's earlier short name ("int8", "int4")."""
    from course.kv.dtypes import get_kv_dtype

    try:
        scheme = get_kv_dtype(name).name
    except ValueError:
        scheme = name
    if scheme not in KV_SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(KV_SCHEMES)} (or int8, int4); got {name!r}")
    return scheme


def _round_half_away(x):
    """Round to the nearest integer, ties away from zero: what vLLM's Triton kernels do before an int store."""
    import torch

    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def hadamard_rotation(x, inverse: bool = False):
    """vLLM's randomized Hadamard transform of the last dimension (``single_rht`` in
    ``vllm/v1/attention/ops/int4_per_token_head.py``): deterministic +-1 signs, then the unnormalized
    Walsh-Hadamard transform in blocks of the largest power of two dividing the dimension; ``inverse`` undoes
    it exactly (vLLM divides the attention output by the block size)."""
    import torch

    d = x.shape[-1]
    block = d & -d  # the largest power of two dividing d
    if block < d:
        lead = x.shape[:-1]
        return hadamard_rotation(x.reshape(*lead, d // block, block), inverse).reshape(*lead, d)
    generator = torch.Generator(device="cpu").manual_seed(0x9E3779B9)  # vLLM's _get_rht_signs(d, 0)
    signs = (2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=generator) - 1.0).to(x.dtype)

    def transform(v):
        h = 1
        while h < d:
            pairs = v.reshape(*v.shape[:-1], d // (2 * h), 2, h)
            v = torch.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], dim=-2)
            v = v.reshape(x.shape)
            h <<= 1
        return v

    if inverse:
        return transform(x) * signs / d
    return transform(x * signs)


def quantize_kv(x, scheme: str):
    """``x`` stored in a low-precision KV format and read back (same shape and dtype as ``x``), as vLLM 0.32's
    kernels store it (the same code in 0.34).

    x: (batch, kv_heads, tokens, head_dim) keys or values.

    * "int8_per_token_head" ("int8"): one scale per cached vector (one head of one token), ``max|x| / 127``
      (at least 1e-6), values rounded half away from zero and clipped to [-128, 127]
      (``vllm/v1/attention/ops/triton_reshape_and_cache_flash.py``, ``_reshape_cache_per_token_head``).
    * "fp8_per_token_head": the same scale per vector with the e4m3 range, ``max|x| / 448``, values stored as
      float8 e4m3 (same kernel).
    * "fp8": float8 e4m3 with a scale of 1.0, what ``kv_cache_dtype="fp8"`` uses without calibrated scales
      (values beyond +-448 saturate).
    * "int4_per_token_head" ("int4"): the vector rotated by vLLM's randomized Hadamard transform
      (:func:`hadamard_rotation`), then *asymmetric* 4-bit integers: 16 levels from its minimum to its
      maximum, ``scale = (max - min) / 15`` and a 4-bit zero point ``round(-min / scale)``, read back and
      rotated back (``vllm/v1/attention/ops/int4_per_token_head.py``, ``_reshape_cache_int4_kernel``; vLLM
      hides the zero point in the fp32 scale's 4 lowest mantissa bits, a change of the scale below 2^-19
      that this leaves out).
    """
    import torch

    scheme = kv_scheme(scheme)
    if scheme == "fp8":
        return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    v = x.float()
    if scheme == "int4_per_token_head":
        v = hadamard_rotation(v)
        low, high = v.amin(dim=-1, keepdim=True), v.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15.0).clamp(min=_MIN_SCALE)
        zero = _round_half_away(-low / scale).clamp(0, 15)
        stored = _round_half_away(v / scale + zero).clamp(0, 15)
        return hadamard_rotation((stored - zero) * scale, inverse=True).to(x.dtype)
    top = 127.0 if scheme == "int8_per_token_head" else FP8_MAX
    scale = (v.abs().amax(dim=-1, keepdim=True) / top).clamp(min=_MIN_SCALE)
    if scheme == "int8_per_token_head":
        stored = _round_half_away(v / scale).clamp(-128, 127)
    else:
        stored = (v / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (stored * scale).to(x.dtype)


@dataclass(frozen=True)
class QuantizationQuality:
    """Predictions of one model with a quantized KV cache against the same model without.

    Attributes:
        scheme: "none" (the model's own dtype) or a :data:`KV_SCHEMES` name.
        perplexity: exp(mean negative log-likelihood) of the held-out tokens.
        agreement: fraction of positions where the top-1 next token equals the unquantized cache's.
        tokens: positions scored.
    """

    scheme: str
    perplexity: float
    agreement: float
    tokens: int


def kv_quantization_quality(
    lm,
    text: str,
    schemes: Sequence[str] = KV_SCHEMES,
    chunk: int = 8,
    window: int = 64,
    custom: dict[str, Callable] | None = None,
) -> list[QuantizationQuality]:
    """Score ``text`` with the KV cache kept in each scheme, against the full-precision cache.

    The text is cut into windows of ``window`` tokens, each scored as one request with a fresh cache (a
    small model is only good at the context lengths it was trained on), all windows in one batch. A
    window is fed ``chunk`` tokens at a time, as decode steps and chunked prefills feed a server: after
    each forward pass the new tokens' keys and values are quantized in place (and stay so), so every
    later chunk attends to the stored, low-precision cache. Within a chunk the tokens see each other at
    full precision, as a fused attention kernel does before it writes the cache.

    ``custom`` adds quantizers by name: functions from a (batch, kv_heads, tokens, head_dim) tensor to
    one of the same shape (a learner's own int8, say). The first row is always "none", the reference.
    """
    import torch

    from course.models import forward

    if chunk < 1 or window <= chunk:
        raise ValueError(f"need 1 <= chunk < window, got chunk={chunk}, window={window}")
    ids = lm.encode(text)[0]
    count = len(ids) // window
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens; give at least one window of {window} to score")
    windows = ids[: count * window].view(count, window)  # one batch row per window: (windows, window)
    quantizers: dict[str, Callable | None] = {"none": None}
    quantizers.update({kv_scheme(s): functools.partial(quantize_kv, scheme=kv_scheme(s)) for s in schemes})
    quantizers.update(custom or {})
    results = []
    reference_top = None
    for scheme, quantize in quantizers.items():
        parts, cache = [], None
        with torch.no_grad():
            for start in range(0, window, chunk):
                logits, cache = forward(lm.model, windows[:, start : start + chunk], cache)
                parts.append(logits)
                if quantize is not None:
                    for layer in cache.layers:
                        layer.keys[:, :, start:] = quantize(layer.keys[:, :, start:])
                        layer.values[:, :, start:] = quantize(layer.values[:, :, start:])
        # position t predicts token t + 1; a window's last position predicts past its end
        logits = torch.cat(parts, dim=1)[:, :-1].reshape(-1, parts[0].shape[-1]).float()
        target = windows[:, 1:].reshape(-1)
        nll = torch.nn.functional.cross_entropy(logits, target)
        top = logits.argmax(dim=-1)
        if reference_top is None:
            reference_top = top
        agreement = float((top == reference_top).float().mean())
        results.append(QuantizationQuality(scheme, float(torch.exp(nll)), agreement, int(target.numel())))
    return results
