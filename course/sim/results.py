"""What a simulation returns: per-request traces, per-step log, and the serving numbers derived from them.

Per-request results are :class:`course.trace.RequestTrace` records, the same records module 2's
client writes for a real server, so :func:`course.metrics.summarize` computes TTFT, ITL, TPOT and
E2E for simulated and measured runs with the same code. A simulated request "is sent" when it
arrives and "receives" each output token at the end of the engine step that produced it: there is
no network, tokenizer or detokenizer in the simulation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property

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


@dataclass
class SimResult:
    """A finished simulation.

    Attributes:
        name: a label for plots and tables (scheduler and workload).
        requests: one record per request, in arrival order.
        steps: the step log.
        num_blocks, block_size: the KV cache that was simulated.
        config: the settings (a dict, for reports and JSON).
        wall_seconds: how long the simulation itself took on this machine.
    """

    name: str
    requests: list[RequestRecord]
    steps: StepLog
    num_blocks: int
    block_size: int
    config: dict = field(default_factory=dict)
    wall_seconds: float = 0.0

    @cached_property
    def traces(self) -> list[RequestTrace]:
        """Every request as a streaming client would have recorded it (one chunk per token)."""
        return [record.trace() for record in self.requests]

    def summary(self, percentiles=metrics.DEFAULT_PERCENTILES) -> metrics.BenchmarkSummary:
        """TTFT / ITL / TPOT / E2E statistics and throughput, by course.metrics (vLLM's definitions)."""
        return metrics.summarize(self.traces, percentiles=percentiles)

    def goodput(
        self, ttft_slo: float | None = None, tpot_slo: float | None = None, e2e_slo: float | None = None
    ) -> metrics.Goodput:
        """Requests per second that met every given SLO (seconds); see :func:`course.metrics.goodput`."""
        return metrics.goodput(self.traces, ttft_slo=ttft_slo, tpot_slo=tpot_slo, e2e_slo=e2e_slo)

    # --- scheduler-side numbers -----------------------------------------------------------------

    @property
    def preemptions(self) -> int:
        """Preemptions in the whole run."""
        return sum(len(r.preempted) for r in self.requests)

    @property
    def preempted_requests(self) -> int:
        """Requests preempted at least once."""
        return sum(1 for r in self.requests if r.preempted)

    @property
    def failed(self) -> int:
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
        queried = sum(r.queried_tokens for r in self.requests)
        return sum(r.prefix_hit_tokens for r in self.requests) / queried if queried else 0.0

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
