"""Prefill/decode disaggregation: a prefill pool and a decode pool, the KV cache sent between them.

Colocated serving runs every request's prefill and decode on the same GPUs, so a long prompt's prefill
shares steps with everyone's decodes: TTFT and ITL interfere. DistServe (Zhong et al., "DistServe:
Disaggregating Prefill and Decoding for Goodput-optimized Large Language Model Serving", OSDI 2024,
https://arxiv.org/abs/2401.09670) puts them on different GPUs: a prefill instance computes the prompt
and the first token, its KV cache is sent to a decode instance, which generates the rest. vLLM 0.32
does this with two servers and a KV connector (docs: "Disaggregated Prefilling (experimental)",
https://docs.vllm.ai/en/v0.32.0/features/disagg_prefill.html; ``vllm/distributed/kv_transfer/``).

The model here is two sets of :func:`course.sim.simulate` runs (replicas behind round-robin,
:func:`course.sim.fleet.simulate_fleet`):

1. the prefill pool serves every request with one output token: its first token time is the TTFT;
2. the KV of the prompt then travels ``latency + prompt_tokens x kv_bytes_per_token / bandwidth``
   over the link (:class:`course.hardware.Interconnect`: NVLink inside a server, InfiniBand between);
3. the decode pool receives the request when the transfer ends, with its prompt already computed: the
   request takes its prompt's KV blocks, and the cost model is asked for the decode work only (a step
   that admits transferred requests counts as one more decode reading their KV: their first decode).

What it leaves out: the transfer does not slow the steps of either pool (vLLM overlaps it with
compute, layer by layer, in the best case), the decode pool's memory for KV in flight, and any queue on
the link itself (each transfer has the link to itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from course import metrics
from course.hardware import Interconnect
from course.sim.config import SimConfig
from course.trace import RequestTrace
from course.workload import RequestSpec, Workload


@dataclass(frozen=True)
class TransferredPrompts:
    """A cost model for a decode instance whose prompts arrive computed: prefill tokens cost nothing but
    the first decode of the requests they belong to (one more decode token, reading their KV)."""

    inner: Any

    def step_seconds(
        self, prefill_tokens: int, decode_tokens: int, kv_tokens_read: int, attention_pairs: float = 0.0
    ) -> float:
        decode = decode_tokens + (1 if prefill_tokens else 0)
        kv = kv_tokens_read + prefill_tokens
        return self.inner.step_seconds(0, decode, kv, kv + decode)

    @property
    def spread_draw(self):
        """The inner cost's step-time spread, its decode steps' (every step here is one)."""
        draw = getattr(self.inner, "spread_draw", None)
        return None if draw is None else lambda step, prefills: draw(step, False)

    def describe(self) -> str:
        inner = self.inner.describe() if hasattr(self.inner, "describe") else repr(self.inner)
        return f"decode instance (prompts arrive computed); {inner}"


def transfer_seconds(prompt_tokens: int, kv_bytes_per_token: float, link: Interconnect) -> float:
    """Seconds to send one prompt's KV cache over ``link`` (latency + bytes / one direction's bandwidth)."""
    if prompt_tokens < 0 or kv_bytes_per_token <= 0:
        raise ValueError("prompt_tokens must be >= 0 and kv_bytes_per_token positive")
    return link.latency + prompt_tokens * kv_bytes_per_token / link.bandwidth


@dataclass
class DisaggResult:
    """A disaggregated run: each request's trace (first token from the prefill pool, the rest from the
    decode pool), the two pools' runs and every transfer's seconds (workload order)."""

    traces: list[RequestTrace]
    prefill: Any  # FleetResult of the prefill pool
    decode: Any  # FleetResult of the decode pool (None when no request had a second token)
    transfers: np.ndarray

    def summary(self, percentiles: Sequence[float] = metrics.DEFAULT_PERCENTILES) -> metrics.BenchmarkSummary:
        return metrics.summarize(self.traces, percentiles=percentiles)


def simulate_disaggregated(
    workload: Workload,
    prefill: tuple[SimConfig, Any, int],
    decode: tuple[SimConfig, Any, int],
    kv_bytes_per_token: float,
    link: Interconnect,
) -> DisaggResult:
    """Serve ``workload`` on a prefill pool and a decode pool (see the module docstring).

    Args:
        workload: the requests.
        prefill, decode: each pool's ``(SimConfig, cost model, replicas)``.
        kv_bytes_per_token: KV bytes one prompt token sends (all layers; ``course.kv.bytes_per_token``).
        link: what the KV travels over (``course.hardware.interconnect``).
    """
    from course.sim.fleet import simulate_fleet

    if not len(workload):
        raise ValueError("the workload has no requests")
    specs = list(workload)
    first = Workload([replace(s, output_tokens=1) for s in specs], name=f"{workload.name}, prefill pool")
    config, cost, replicas = prefill
    pre = simulate_fleet(first, replicas, config, cost, "round-robin")
    first_token = {r.request_id: r for run in pre.runs for r in run.requests}
    transfers = np.array([transfer_seconds(s.prompt_tokens, kv_bytes_per_token, link) for s in specs])
    handed = []
    for spec, seconds in zip(specs, transfers, strict=True):
        record = first_token[spec.request_id]
        if record.error is None and len(record.token_times) and spec.output_tokens > 1:
            handed.append(
                RequestSpec(spec.request_id, float(record.token_times[0]) + seconds, spec.prompt_tokens,
                            spec.output_tokens - 1)
            )  # fmt: skip
    dec = None
    rest: dict[str, Any] = {}
    if handed:
        config, cost, replicas = decode
        dec = simulate_fleet(
            Workload(handed, name=f"{workload.name}, decode pool"), replicas, config, TransferredPrompts(cost)
        )
        rest = {r.request_id: r for run in dec.runs for r in run.requests}
    traces = []
    for spec in specs:
        record = first_token[spec.request_id]
        error = record.error
        times = list(record.token_times[:1])
        later = rest.get(spec.request_id)
        if later is not None:
            error = error or later.error
            times += list(later.token_times)
        traces.append(RequestTrace.from_token_times(spec.request_id, spec.arrival_time, times, spec.prompt_tokens,
                                                    error=error))  # fmt: skip
    return DisaggResult(traces, pre, dec, transfers)
