"""What a simulation returns: per-request traces, per-step log, and the serving numbers derived from them.

Per-request results are :class:`course.trace.RequestTrace` records, the same records module 2's
client writes for a real server, so :func:`course.metrics.summarize` computes TTFT, ITL, TPOT and
E2E for simulated and measured runs with the same code. A simulated request "is sent" when it
arrives and "receives" each output token at the end of the engine step that produced it: there is
no network, tokenizer or detokenizer in the simulation.

The fast engine does not keep a time per token: a request's tokens are runs of consecutive steps, and
:class:`RequestTable` holds every request's runs, admissions and preemptions as flat numpy arrays
(compressed rows, as in a sparse matrix). :meth:`SimResult.summary` and :meth:`SimResult.goodput`
compute vLLM's metrics from those arrays and the step log, with the same numbers as
:func:`course.metrics.summarize` over the traces (the tests compare them), without making a Python
float per token: the pooled ITLs inside a run are step-to-step gaps, so each step's gap is counted
once with the number of requests that emitted tokens in it and the step before. ``requests`` and
``traces`` are built from the arrays the first time they are asked for.

Both simulators (the readable harness, :func:`course.sim.harness.run`, and the fast engine,
:func:`course.sim.simulate`) record their steps with one :class:`StepLogBuilder` and their requests with
:func:`request_table`; :meth:`RequestTable.record` is the one place a :class:`RequestRecord` is made.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain

import numpy as np

from course import metrics
from course.trace import RequestTrace


@dataclass
class StepLog:
    """One entry per engine step (numpy arrays of equal length).

    Attributes:
        start, end: when the step started and ended (s).
        prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs: the step's load (see course.sim.cost).
        num_seqs: requests that computed tokens in the step.
        used_blocks: KV blocks held during the step (after its allocations).
        waiting: requests waiting in the queue when the step was scheduled.
    """

    start: np.ndarray
    end: np.ndarray
    prefill_tokens: np.ndarray
    decode_tokens: np.ndarray
    kv_tokens_read: np.ndarray
    attention_pairs: np.ndarray
    num_seqs: np.ndarray
    used_blocks: np.ndarray
    waiting: np.ndarray

    @classmethod
    def from_columns(
        cls,
        start,
        end,
        prefill_tokens,
        decode_tokens,
        kv_tokens_read,
        attention_pairs,
        num_seqs,
        used_blocks,
        waiting,
    ) -> StepLog:
        """A log from per-step sequences of equal length (lists or arrays), in the fields' dtypes."""

        def counts(values) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        return cls(
            start=np.array(start, dtype=float),
            end=np.array(end, dtype=float),
            prefill_tokens=counts(prefill_tokens),
            decode_tokens=counts(decode_tokens),
            kv_tokens_read=counts(kv_tokens_read),
            attention_pairs=np.array(attention_pairs, dtype=float),
            num_seqs=counts(num_seqs),
            used_blocks=counts(used_blocks),
            waiting=counts(waiting),
        )

    def __len__(self) -> int:
        return len(self.start)

    @property
    def duration(self) -> np.ndarray:
        return self.end - self.start

    def time_weighted_mean(self, values: np.ndarray) -> float:
        """Mean of a per-step quantity over the time the engine was busy."""
        busy = self.duration
        return float(np.sum(values * busy) / np.sum(busy)) if len(self) and np.sum(busy) > 0 else 0.0


class StepLogBuilder:
    """A :class:`StepLog` under construction, one :meth:`add` per step, in 8 bytes a value (a list would
    hold a Python object per value: 4x the memory at a million steps)."""

    def __init__(self) -> None:
        self.start, self.end, self.pairs = array("d"), array("d"), array("d")
        self.prefill, self.decode, self.kv = array("q"), array("q"), array("q")
        self.seqs, self.used, self.waiting = array("q"), array("q"), array("q")

    def __len__(self) -> int:
        return len(self.start)

    def add(
        self,
        start: float,
        end: float,
        prefill: int,
        decode: int,
        kv: int,
        pairs: int,
        seqs: int,
        used: int,
        waiting: int,
    ) -> None:
        """One step: its start and end (s), its load (:func:`course.rules.step_load`), the requests that
        computed in it, the KV blocks held and the requests waiting when it was scheduled."""
        self.start.append(start)
        self.end.append(end)
        self.prefill.append(prefill)
        self.decode.append(decode)
        self.kv.append(kv)
        self.pairs.append(pairs)
        self.seqs.append(seqs)
        self.used.append(used)
        self.waiting.append(waiting)

    def freeze(self) -> StepLog:
        """The log as numpy arrays (copied out of the array buffers: StepLog's dtypes)."""
        columns = (self.start, self.end, self.prefill, self.decode, self.kv, self.pairs, self.seqs, self.used)
        return StepLog.from_columns(
            *(np.frombuffer(c, dtype=c.typecode) if len(c) else [] for c in (*columns, self.waiting))
        )


@dataclass
class RequestRecord:
    """One request's life in the simulation (times in s on the simulated clock).

    Attributes:
        token_times: when each output token was produced.
        scheduled: when it was admitted to the running batch (once, plus once per resumption).
        preempted: when it was preempted.
        prefix_hit_tokens: prompt tokens served from the prefix cache, over all its admissions.
        queried_tokens: tokens it asked the prefix cache for, over all its admissions.
    """

    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    token_times: np.ndarray
    scheduled: list[float] = field(default_factory=list)
    preempted: list[float] = field(default_factory=list)
    prefix_hit_tokens: int = 0
    queried_tokens: int = 0
    error: str | None = None

    def trace(self) -> RequestTrace:
        """What a streaming client would have recorded: one chunk per token."""
        return RequestTrace.from_token_times(
            self.request_id, self.arrival_time, self.token_times.tolist(), self.prompt_tokens, error=self.error
        )


@dataclass(frozen=True)
class Latencies:
    """The succeeded requests of a :class:`RequestTable` (shape ``(m,)`` arrays, seconds).

    Attributes:
        ok: their indices in the table.
        ttft, e2e: first and last token time minus arrival.
        tpot: ``(e2e - ttft) / (output - 1)``; NaN for one output token (no TPOT).
        output: output tokens.
        duration: first arrival to last token among them (:func:`course.metrics.run_duration`).
    """

    ok: np.ndarray
    ttft: np.ndarray
    e2e: np.ndarray
    tpot: np.ndarray
    output: np.ndarray
    duration: float


def _csr(offsets: np.ndarray, values: np.ndarray, i: int) -> np.ndarray:
    return values[offsets[i] : offsets[i + 1]]


@dataclass
class RequestTable:
    """Every request of a run as columns, in arrival order (``n`` requests; steps index the StepLog).

    Attributes:
        request_ids: the ids (a sequence of ``n`` strings).
        arrival, prompt_tokens, output_tokens, prefix_hit_tokens, queried_tokens: shape ``(n,)``
            (seconds, token counts), as in :class:`RequestRecord`.
        run_offsets: shape ``(n + 1,)``: request ``i``'s token runs are entries
            ``run_offsets[i]:run_offsets[i + 1]`` of ``run_first`` and ``run_last``, the first and last
            step of each run of consecutive steps that emitted one of its tokens.
        scheduled_offsets, scheduled_steps, preempted_offsets, preempted_steps: the same layout for
            the steps at which it joined the batch and was preempted.
        errors: request index -> why it failed (rejected on arrival, shed).
    """

    request_ids: Sequence[str]
    arrival: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    run_offsets: np.ndarray
    run_first: np.ndarray
    run_last: np.ndarray
    scheduled_offsets: np.ndarray
    scheduled_steps: np.ndarray
    preempted_offsets: np.ndarray
    preempted_steps: np.ndarray
    prefix_hit_tokens: np.ndarray
    queried_tokens: np.ndarray
    errors: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.arrival)

    def token_steps(self, i: int) -> np.ndarray:
        """The steps at which request ``i`` emitted its tokens, in order."""
        first, last = _csr(self.run_offsets, self.run_first, i), _csr(self.run_offsets, self.run_last, i)
        if len(first) == 1:
            return np.arange(first[0], last[0] + 1)
        if not len(first):
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b + 1) for a, b in zip(first, last)])

    def record(self, i: int, steps: StepLog) -> RequestRecord:
        """Request ``i`` as a :class:`RequestRecord` (its token times from the step log)."""
        return RequestRecord(
            request_id=self.request_ids[i],
            arrival_time=float(self.arrival[i]),
            prompt_tokens=int(self.prompt_tokens[i]),
            output_tokens=int(self.output_tokens[i]),
            token_times=steps.end[self.token_steps(i)],
            scheduled=steps.start[_csr(self.scheduled_offsets, self.scheduled_steps, i)].tolist(),
            preempted=steps.start[_csr(self.preempted_offsets, self.preempted_steps, i)].tolist(),
            prefix_hit_tokens=int(self.prefix_hit_tokens[i]),
            queried_tokens=int(self.queried_tokens[i]),
            error=self.errors.get(i),
        )

    def latencies(self, steps: StepLog) -> Latencies:
        """The succeeded requests' latencies as :mod:`course.metrics` computes them from traces (the same
        float operations, elementwise)."""
        ok = np.flatnonzero(np.diff(self.run_offsets) > 0)  # a request succeeded when it has tokens and no error
        if self.errors:
            ok = ok[~np.isin(ok, np.fromiter(self.errors, dtype=np.int64, count=len(self.errors)))]
        send = self.arrival[ok]
        first = steps.end[self.run_first[self.run_offsets[ok]]]
        last = steps.end[self.run_last[self.run_offsets[ok + 1] - 1]]
        ttft, e2e = first - send, last - send
        owner = np.repeat(np.arange(len(self)), np.diff(self.run_offsets))
        tokens = np.bincount(owner, weights=self.run_last - self.run_first + 1, minlength=len(self))
        output = tokens[ok].astype(np.int64)
        with np.errstate(divide="ignore", invalid="ignore"):
            tpot = np.where(output > 1, (e2e - ttft) / (output - 1), np.nan)
        duration = float(last.max() - send.min()) if len(ok) else 0.0  # metrics.run_duration
        return Latencies(ok, ttft, e2e, tpot, output, duration)

    def itl_gaps(self, steps: StepLog, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The pooled inter-token gaps of the succeeded requests ``ok`` as (values, counts), shape ``(m,)``.

        Inside a run the gap before step ``t``'s token is ``end[t] - end[t - 1]``, the same for every
        request in that run; gaps across a preemption are listed one by one.
        """
        mask = np.zeros(len(self), dtype=bool)
        mask[ok] = True
        owner = np.repeat(np.arange(len(self)), np.diff(self.run_offsets))
        keep = mask[owner]
        first, last = self.run_first[keep], self.run_last[keep]
        inside = last > first
        size = len(steps) + 1
        starts = np.bincount(first[inside] + 1, minlength=size)  # np.add.at, but fast
        counts = np.cumsum(starts - np.bincount(last[inside] + 1, minlength=size))[:-1]
        gaps = np.empty(len(steps))
        gaps[1:] = steps.end[1:] - steps.end[:-1]
        used = np.flatnonzero(counts > 0)
        # a request with several runs (preempted and resumed): the gap from one run's last token to the next's first
        same = owner[keep][1:] == owner[keep][:-1]
        across = steps.end[first[1:][same]] - steps.end[last[:-1][same]]
        values = np.concatenate([gaps[used], across])
        weights = np.concatenate([counts[used], np.ones(len(across), dtype=np.int64)])
        return values, weights


def token_runs(token_steps: Sequence[int]) -> list[int]:
    """Increasing step indices as runs of consecutive steps, flattened: ``[first, last, first, last, ...]``."""
    runs: list[int] = []
    for step in token_steps:
        if runs and runs[-1] == step - 1:
            runs[-1] = step
        else:
            runs += (step, step)
    return runs


REQUEST_ROW = (
    "request_id",
    "arrival_time",
    "prompt_tokens",
    "output_tokens",
    "runs",
    "scheduled_steps",
    "preempted_steps",
    "prefix_hit_tokens",
    "queried_tokens",
    "error",
)


def request_table(rows: Iterable[tuple]) -> RequestTable:
    """The requests of a run as a :class:`RequestTable`, from one row per request in arrival order.

    A row holds the fields :data:`REQUEST_ROW` names: the request's id, arrival time (s), prompt and output
    tokens, its token steps as :func:`token_runs` gives them, the steps at which it joined the batch and was
    preempted, its prefix-cache hit and queried tokens, and its error (None: it ran). The readable harness
    and the fast engine both build their results with it; the columns are made by a transpose and
    flattening in C, without a Python loop per request and column.
    """
    columns = tuple(zip(*rows))
    n = len(columns[0]) if columns else 0
    ids, arrival, prompt, output, runs, scheduled, preempted, hits, queried, errors = columns or ((),) * 10

    def offsets(lists: tuple, per: int = 1) -> np.ndarray:
        out = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, lists), dtype=np.int64, count=n) // per, out=out[1:])
        return out

    def flat(lists: tuple) -> np.ndarray:
        return np.fromiter(chain.from_iterable(lists), dtype=np.int64)

    def column(values: tuple, dtype=np.int64) -> np.ndarray:
        return np.fromiter(values, dtype=dtype, count=n)

    pairs = flat(runs)
    return RequestTable(
        request_ids=list(ids),
        arrival=column(arrival, float),
        prompt_tokens=column(prompt),
        output_tokens=column(output),
        run_offsets=offsets(runs, 2),
        run_first=pairs[0::2].copy(),
        run_last=pairs[1::2].copy(),
        scheduled_offsets=offsets(scheduled),
        scheduled_steps=flat(scheduled),
        preempted_offsets=offsets(preempted),
        preempted_steps=flat(preempted),
        prefix_hit_tokens=column(hits),
        queried_tokens=column(queried),
        errors={i: error for i, error in enumerate(errors) if error is not None},
    )


def weighted_stats_of(
    values: np.ndarray, counts: np.ndarray, percentiles: Sequence[float] = metrics.DEFAULT_PERCENTILES
) -> metrics.Stats:
    """:func:`course.metrics.stats_of` the pool that holds ``counts[k]`` copies of ``values[k]``.

    Percentiles are numpy's linear interpolation between the two order statistics around
    ``(n - 1) * q / 100``, computed as ``numpy.percentile`` does; the mean is the weighted sum over
    ``n`` (it may differ from a sum over the pooled list in the last bits).
    """
    n = int(counts.sum())
    if n == 0:
        return metrics.stats_of([], percentiles)
    order = np.argsort(values, kind="stable")
    ranked, cumulative = values[order], np.cumsum(counts[order])
    mean = float(np.dot(values, counts.astype(float)) / n)
    out = {}
    for q in percentiles:
        if not 0 <= q <= 100:
            raise ValueError(f"percentile q must be within 0..100, got {q}")
        virtual = (n - 1) * np.true_divide(q, 100)
        below = np.floor(virtual)
        gamma = virtual - below
        a, b = ranked[np.searchsorted(cumulative, [below + 1, min(below + 2, n)])]
        diff = b - a
        out[float(q)] = float(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma)
    return metrics.Stats(n=n, mean=mean, percentiles=out)


@dataclass
class SimResult:
    """A finished simulation.

    Attributes:
        name: a label for plots and tables (scheduler and workload).
        requests: one record per request, in arrival order (built from ``columns`` when first asked for).
        steps: the step log.
        num_blocks, block_size: the KV cache that was simulated.
        config: the settings (a dict, for reports and JSON).
        wall_seconds: how long the simulation itself took on this machine.
        columns: the requests as a table of columns (the fast engine's results); the metrics use it.

    Give it the records (the readable harness) or the columns (:func:`course.sim.simulate`).
    """

    name: str
    _records: list[RequestRecord] | None
    steps: StepLog
    num_blocks: int
    block_size: int
    config: dict = field(default_factory=dict)
    wall_seconds: float = 0.0
    columns: RequestTable | None = None

    def __post_init__(self) -> None:
        if self._records is None and self.columns is None:
            raise ValueError("a SimResult needs its request records or a RequestTable")

    @property
    def requests(self) -> list[RequestRecord]:
        if self._records is None:
            self._records = [self.columns.record(i, self.steps) for i in range(len(self.columns))]
        return self._records

    @cached_property
    def traces(self) -> list[RequestTrace]:
        """Every request as a streaming client would have recorded it (one chunk per token)."""
        return [record.trace() for record in self.requests]

    def summary(self, percentiles=metrics.DEFAULT_PERCENTILES) -> metrics.BenchmarkSummary:
        """TTFT / ITL / TPOT / E2E statistics and throughput, by course.metrics (vLLM's definitions).

        From the columns when there are (no trace is built), else from the traces.
        """
        if self.columns is None:
            return metrics.summarize(self.traces, percentiles=percentiles)
        table, steps = self.columns, self.steps
        got = table.latencies(steps)
        return metrics.BenchmarkSummary(
            completed=len(got.ok),
            failed=len(table) - len(got.ok),
            duration=got.duration,
            output_tokens=int(got.output.sum()),
            ttft=metrics.stats_of(got.ttft, percentiles),
            itl=weighted_stats_of(*table.itl_gaps(steps, got.ok), percentiles),
            tpot=metrics.stats_of(got.tpot[~np.isnan(got.tpot)], percentiles),
            e2e=metrics.stats_of(got.e2e, percentiles),
        )

    def goodput(
        self, ttft_slo: float | None = None, tpot_slo: float | None = None, e2e_slo: float | None = None
    ) -> metrics.Goodput:
        """Requests per second that met every given SLO (seconds); see :func:`course.metrics.goodput`."""
        if self.columns is None:
            return metrics.goodput(self.traces, ttft_slo=ttft_slo, tpot_slo=tpot_slo, e2e_slo=e2e_slo)
        metrics.goodput([], ttft_slo=ttft_slo, tpot_slo=tpot_slo, e2e_slo=e2e_slo)  # the same checks of the SLOs
        got = self.columns.latencies(self.steps)
        good = np.ones(len(got.ok), dtype=bool)
        tpot = np.nan_to_num(got.tpot, nan=0.0)  # vLLM counts TPOT as 0 for one output token
        given = (("ttft", ttft_slo, got.ttft), ("tpot", tpot_slo, tpot), ("e2e", e2e_slo, got.e2e))
        for _, limit, values in given:
            if limit is not None:
                good &= values <= limit
        slos = {name: limit for name, limit, _ in given if limit is not None}
        return metrics.Goodput(good=int(good.sum()), total=len(self.columns), duration=got.duration, slos=slos)

    # --- scheduler-side numbers -----------------------------------------------------------------

    @property
    def preemptions(self) -> int:
        """Preemptions in the whole run."""
        if self.columns is not None:
            return len(self.columns.preempted_steps)
        return sum(len(r.preempted) for r in self.requests)

    @property
    def preempted_requests(self) -> int:
        """Requests preempted at least once."""
        if self.columns is not None:
            return int(np.count_nonzero(np.diff(self.columns.preempted_offsets)))
        return sum(1 for r in self.requests if r.preempted)

    @property
    def failed(self) -> int:
        if self.columns is not None:
            return len(self.columns.errors)
        return sum(1 for r in self.requests if r.error)

    def kv_usage(self) -> tuple[np.ndarray, np.ndarray]:
        """(step start times, fraction of KV blocks held during each step)."""
        return self.steps.start, self.steps.used_blocks / self.num_blocks

    @property
    def peak_kv_usage(self) -> float:
        return float(self.steps.used_blocks.max() / self.num_blocks) if len(self.steps) else 0.0

    @property
    def mean_kv_usage(self) -> float:
        """Time-weighted KV utilisation while the engine was busy (0..1)."""
        return self.steps.time_weighted_mean(self.steps.used_blocks / self.num_blocks)

    @property
    def mean_batch_size(self) -> float:
        """Time-weighted number of requests per step while the engine was busy."""
        return self.steps.time_weighted_mean(self.steps.num_seqs)

    @property
    def prefix_hit_rate(self) -> float:
        """Tokens served from the prefix cache over tokens looked up, at every admission (0..1)."""
        if self.columns is not None:
            queried, hits = int(self.columns.queried_tokens.sum()), int(self.columns.prefix_hit_tokens.sum())
        else:
            queried = sum(r.queried_tokens for r in self.requests)
            hits = sum(r.prefix_hit_tokens for r in self.requests)
        return hits / queried if queried else 0.0

    @property
    def busy_seconds(self) -> float:
        return float(np.sum(self.steps.duration))

    # --- reports ----------------------------------------------------------------------------------

    def table(self, ttft_slo: float | None = None, tpot_slo: float | None = None) -> str:
        """The latency table of ``course summarize`` plus the scheduler's numbers."""
        lines = [self.summary().table()]
        lines.append(
            f"steps {len(self.steps)}, mean batch {self.mean_batch_size:.1f} requests; "
            f"KV blocks {self.num_blocks} x {self.block_size} tokens: mean usage {self.mean_kv_usage:.1%}, "
            f"peak {self.peak_kv_usage:.1%}; preemptions {self.preemptions} "
            f"({self.preempted_requests} requests)"
            + (
                f"; prefix cache hit rate {self.prefix_hit_rate:.1%}"
                if self.config.get("enable_prefix_caching")
                else ""
            )
        )
        if ttft_slo is not None or tpot_slo is not None:
            g = self.goodput(ttft_slo=ttft_slo, tpot_slo=tpot_slo)
            slos = ", ".join(f"{name.upper()} <= {value * 1e3:g} ms" for name, value in g.slos.items())
            lines.append(f"goodput ({slos}): {g.rate:.2f} req/s, {g.attainment:.1%} of requests met the SLOs")
        return "\n".join(lines)

    def to_dict(self, ttft_slo: float | None = None, tpot_slo: float | None = None) -> dict:
        """Everything in :meth:`table` as plain numbers (seconds), for JSON.

        The latency and throughput keys are :meth:`course.metrics.BenchmarkSummary.to_dict`'s, the
        same as ``course bench --json`` prints for a real server.
        """
        out = {
            "name": self.name,
            "config": self.config,
            **self.summary().to_dict(),
            "steps": len(self.steps),
            "mean_batch_size": self.mean_batch_size,
            "kv_usage_mean": self.mean_kv_usage,
            "kv_usage_peak": self.peak_kv_usage,
            "preemptions": self.preemptions,
            "preempted_requests": self.preempted_requests,
            "prefix_cache_hit_rate": self.prefix_hit_rate,
            "wall_seconds": self.wall_seconds,
        }
        if ttft_slo is not None or tpot_slo is not None:
            g = self.goodput(ttft_slo=ttft_slo, tpot_slo=tpot_slo)
            out["goodput"] = {"slos_s": g.slos, "good": g.good, "rate_req_s": g.rate, "attainment": g.attainment}
        return out

    def to_json(self, **slos: float | None) -> str:
        return json.dumps(self.to_dict(**slos), indent=1)
