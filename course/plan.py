"""A capacity plan as a decision, and the simulator's verdict on it (module 5's capstone).

A :class:`Scenario` is what a service owner hands an engineer: a model, traffic classes (each with its
arrival rate, prompt and output lengths, the longest answer it must be allowed and its latency SLO), a
menu of GPUs with prices, and the cost margin a plan may exceed the cheapest plan the course found by.
A :class:`Plan` is the engineer's answer: the traffic classes split into pools of replicas, and for
every pool its GPU, vLLM's ``gpu_memory_utilization``, ``max_num_seqs`` and output cap (``max_tokens``);
settings given on the plan apply to every pool that does not give its own. :func:`check_plan` returns a
:class:`PlanVerdict`:

* **static checks** first, as vLLM and a reviewer would make them: the GPU is on the menu; every class
  is in exactly one pool; the output cap does not truncate what a class needs; the utilization leaves
  room outside vLLM's share (:data:`MAX_UTILIZATION`, :data:`MIN_HEADROOM_GIB`); the model starts
  (weights, activations and one ``max_model_len`` request fit, :func:`course.kv.budget`);
* then **the simulator**: each pool's replicas (round-robin, :func:`course.sim.fleet.simulate_fleet`)
  serve its classes' Poisson traffic at the target rates (seeded: the same plan always gets the same
  verdict). Only requests that arrive after the warm-up and before the end of the measured window
  count, and the traffic keeps arriving for a drain period after the window, so the measured requests
  see the steady load, neither an empty engine nor one whose queue is emptying. The verdict holds when
  every class meets its SLO at its percentile with no failed request. It names the **binding**
  constraint (the class and metric closest to, or furthest past, its target, and by how much) and the
  limits each pool ran into (a full KV cache and its preemptions; ``max_num_seqs`` holding requests back);
* its **cost**: GPUs x the menu's price per GPU-hour, against the cheapest plan the course's search
  found for the scenario (:data:`REFERENCE_COSTS`; the search itself lives with the tests,
  ``tests/fixtures/capstone_plans.py``, and is not part of the library: a plan is the learner's to find).
  :meth:`PlanVerdict.describe` shows that cost only once the plan holds every SLO within the margin.

The verdict does not depend on the run's length once warm-up and window are long enough; the tests
check that (``tests/test_plan.py``: the same verdicts at the scenario's window and at twice it).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from course import hardware, workload
from course.capacity import SLO, SLOCheck, SteadyWindow, window_latencies
from course.kv import vllm
from course.workload import RequestSpec, Workload

GiB = 2**30

# On-demand prices in US dollars per GPU-hour, one place for the whole course. Source: Lambda's public
# on-demand price list, https://lambda.ai/instances (8-GPU SXM instances, price per GPU per hour,
# read 2026-09-20): "8x NVIDIA H100 SXM $3.99", "8x NVIDIA A100 SXM 80 GB $2.79", "8x NVIDIA A100 SXM
# 40 GB $1.99". Prices move and differ 2-4x between providers: put in your own contract's.
GPU_PRICES: dict[str, float] = {"A100-40GB": 1.99, "A100-80GB": 2.79, "H100-SXM": 3.99}
PRICE_SOURCE = "Lambda on-demand, https://lambda.ai/instances, per GPU-hour of 8-GPU SXM instances, read 2026-09-20"

# vLLM 0.32's budget takes gpu_memory_utilization x total memory and keeps the rest outside its share
# (module 5, section 8): CUDA graphs, activation spikes beyond the profiled peak and any co-located
# process live there. A plan must leave at least this much of the card outside the share, and never
# give more than MAX_UTILIZATION: above it a plan counts on every byte vLLM did not measure.
MIN_HEADROOM_GIB = 1.0
MAX_UTILIZATION = 0.95
# The pool settings a plan may give per pool, and their defaults when neither the pool nor the plan does.
POOL_SETTINGS = ("gpu", "tensor_parallel", "gpu_memory_utilization", "max_num_seqs", "max_output_tokens")


@dataclass(frozen=True)
class TrafficClass:
    """One kind of request a service receives.

    Attributes:
        name: "chat", "reports", ...
        rate: arrival rate at the target load (req/s), Poisson.
        prompt_median, prompt_sigma, prompt_max: log-normal prompt lengths (tokens), capped.
        output_median, output_sigma, output_max: log-normal answer lengths (tokens), capped at
            ``output_max``, the longest answer this class needs: an output cap below it truncates.
        slo: the class's latency targets.
    """

    name: str
    rate: float
    prompt_median: int
    prompt_sigma: float
    prompt_max: int
    output_median: int
    output_sigma: float
    output_max: int
    slo: SLO

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"traffic class {self.name!r}: rate must be positive req/s, got {self.rate!r}")
        if not 1 <= self.prompt_median <= self.prompt_max or not 1 <= self.output_median <= self.output_max:
            raise ValueError(f"traffic class {self.name!r}: need 1 <= median <= max for prompts and outputs")

    def workload(self, seconds: float, seed: int) -> Workload:
        """``seconds`` of this class's arrivals; request ids ``<class>/<n>``."""
        n = max(1, round(self.rate * seconds))
        raw = workload.poisson(
            self.rate,
            n,
            workload.lognormal(self.prompt_median, self.prompt_sigma, low=16, high=self.prompt_max),
            workload.lognormal(self.output_median, self.output_sigma, low=8, high=self.output_max),
            seed=seed,
        )
        specs = [replace(s, request_id=f"{self.name}/{s.request_id}") for s in raw]
        return Workload(specs, name=self.name)


@dataclass(frozen=True)
class Scenario:
    """What a plan must serve, on what, for how much (see the module docstring).

    Attributes:
        name: a label.
        model: catalogue name (``course.kv.get_model``).
        classes: the traffic classes.
        gpu_prices: the menu, catalogue GPU name -> $ per GPU-hour (default :data:`GPU_PRICES`).
        margin: a plan may cost up to ``(1 + margin)`` x the cheapest plan the course found.
        warmup: seconds of traffic before the measured window (the engine fills up).
        window: seconds of arrivals that are measured.
        drain: seconds of traffic after the window, so the last measured requests still see the load.
        seed: the traffic's seed.
        release: the vLLM release whose KV budget, block size and defaults the replicas run with: "0.34.0",
            today's GPU release (the cache measured after warm-up, :mod:`course.vllm_release`), or "0.32.0"
            (the cache sized from the profiling estimate, as the course's lab engine and 0.34's fallback).
    """

    name: str
    model: str
    classes: tuple[TrafficClass, ...]
    gpu_prices: tuple[tuple[str, float], ...] = tuple(GPU_PRICES.items())
    margin: float = 0.25
    warmup: float = 60.0
    window: float = 120.0
    drain: float = 30.0
    seed: int = 0
    release: str = vllm.GPU_VLLM_VERSION

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names or len(set(names)) != len(names) or any("/" in n or "+" in n for n in names):
            raise ValueError(f"scenario {self.name!r}: give classes with distinct names, no '/' or '+', got {names}")
        if self.margin < 0 or self.warmup < 0 or self.window <= 0 or self.drain < 0:
            raise ValueError("margin, warmup and drain must be >= 0 and window > 0 (seconds)")
        vllm.rules(self.release)  # a release the course names, or a clear error

    @property
    def prices(self) -> dict[str, float]:
        return dict(self.gpu_prices)

    def traffic_class(self, name: str) -> TrafficClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise ValueError(f"unknown traffic class {name!r}; the scenario has {', '.join(c.name for c in self.classes)}")

    def traffic(self, classes: Sequence[str], warmup: float, window: float) -> Workload:
        """The arrivals of ``classes`` over warmup + window + drain seconds (each class its own seed)."""
        seconds = warmup + window + self.drain
        specs: list[RequestSpec] = []
        for i, c in enumerate(self.classes):
            if c.name in classes:
                specs += c.workload(seconds, self.seed + 101 * i).requests
        return Workload(specs, name=" + ".join(classes))

    def binding_options(self) -> dict[str, str]:
        """Every SLO and limit a plan can be bound by, as lettered options: {"a": "chat TTFT", "b": "chat TPOT",
        ..., "e": "KV cache", "f": "max_num_seqs"} (:attr:`PlanVerdict.binding`)."""
        names = [f"{c.name} {metric}" for c in self.classes for metric in ("TTFT", "TPOT")] + list(LIMITS)
        return {chr(ord("a") + i): name for i, name in enumerate(names)}

    def describe(self) -> str:
        menu = ", ".join(f"{g} ${p:.2f}/h" for g, p in self.gpu_prices)
        lines = [f"{self.name}: {self.model} on vLLM {self.release}; menu {menu}"]
        for c in self.classes:
            lines.append(
                f"  {c.name:8s} {c.rate:g} req/s, prompts ~{c.prompt_median:,} tokens (<= {c.prompt_max:,}), answers "
                f"~{c.output_median:,} (<= {c.output_max:,} needed); {c.slo.describe()}"
            )
        lines.append(
            f"  measured at steady state: {self.warmup:g} s of warm-up left out, {self.window:g} s of arrivals "
            f"measured; a plan may cost up to {1 + self.margin:g}x the cheapest plan the course found"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class Pool:
    """Replicas that serve some traffic classes together (round-robin among them).

    The settings left at None take the plan's (:data:`POOL_SETTINGS`); a pool may give its own GPU,
    tensor-parallel size, utilization, ``max_num_seqs`` and output cap.
    """

    classes: tuple[str, ...]
    replicas: int
    gpu: str | None = None
    tensor_parallel: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.classes, str) or not self.classes or not all(isinstance(c, str) for c in self.classes):
            raise ValueError(f"a pool's classes are a non-empty list of names, got {self.classes!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"a pool needs a whole number of replicas >= 1, got {self.replicas!r}")
        _check_settings(self, "a pool's ")

    @property
    def label(self) -> str:
        return "+".join(self.classes)


def _check_settings(owner: Any, who: str) -> None:
    """The settings a plan and a pool share: None (not given) or a valid value."""
    if owner.gpu is not None and not isinstance(owner.gpu, str):
        raise ValueError(f"{who}gpu is a catalogue name, got {owner.gpu!r}")
    for name in ("tensor_parallel", "max_num_seqs", "max_output_tokens"):
        value = getattr(owner, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{who}{name} must be a positive integer, got {value!r}")
    u = owner.gpu_memory_utilization
    if u is not None and (isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1):
        raise ValueError(f"{who}gpu_memory_utilization is a share in (0, 1], got {u!r}")


@dataclass(frozen=True)
class Plan:
    """How to serve a scenario: the pools, and the settings their replicas run with.

    Attributes:
        pools: the classes split into pools, each with its replica count (and any settings of its own).
        gpu: a catalogue GPU name (``course.hardware.GPUS``) on the scenario's menu, for every pool
            that does not name its own.
        tensor_parallel: GPUs per replica (vLLM's ``--tensor-parallel-size``; module 6).
        gpu_memory_utilization: vLLM's share of each GPU's memory, in (0, 1]; None leaves it unset: the
            release's default (vLLM 0.34 on a GPU: 1.0, its KV cache measured after warm-up; 0.32: 0.92).
        max_num_seqs: most requests a replica runs at once (vLLM's ``--max-num-seqs``).
        max_output_tokens: the output cap requests are served with (``max_tokens``).
        justification: why this plan, in a few sentences (checked for presence only).
    """

    pools: tuple[Pool, ...]
    gpu: str | None = None
    tensor_parallel: int = 1
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 256
    max_output_tokens: int = 4096
    justification: str = ""

    def __post_init__(self) -> None:
        if not self.pools or not all(isinstance(p, Pool) for p in self.pools):
            raise ValueError("pools must be a non-empty list of Pool(classes, replicas)")
        _check_settings(self, "")
        for name in ("tensor_parallel", "max_num_seqs", "max_output_tokens"):
            if getattr(self, name) is None:
                raise ValueError(f"the plan's {name} is its pools' default: give a value")
        unnamed = [p.label for p in self.pools if p.gpu is None and self.gpu is None]
        if unnamed:
            raise ValueError(f"name a GPU for the plan (gpu=...) or for every pool; {', '.join(unnamed)} has none")

    def resolved(self, pool: Pool) -> Pool:
        """``pool`` with every setting it leaves at None taken from the plan."""
        return replace(pool, **{name: getattr(self, name) for name in POOL_SETTINGS if getattr(pool, name) is None})

    @property
    def resolved_pools(self) -> tuple[Pool, ...]:
        return tuple(self.resolved(p) for p in self.pools)

    @property
    def gpus(self) -> int:
        return sum(p.tensor_parallel * p.replicas for p in self.resolved_pools)

    @property
    def gpu_names(self) -> tuple[str, ...]:
        """The GPUs the plan uses, each once, in pool order."""
        return tuple(dict.fromkeys(p.gpu for p in self.resolved_pools))

    def dollars_per_hour(self, prices: Mapping[str, float]) -> float:
        """The plan's rent: every GPU of every replica at the menu's price (inf when a GPU is not on it)."""
        total = 0.0
        for p in self.resolved_pools:
            price = prices.get(hardware.ALIASES.get(p.gpu, p.gpu))
            if price is None:
                return math.inf
            total += p.tensor_parallel * p.replicas * price
        return total

    def describe(self) -> str:
        parts = []
        for p in self.resolved_pools:
            tp = f" x TP {p.tensor_parallel}" if p.tensor_parallel > 1 else ""
            u = "unset" if p.gpu_memory_utilization is None else f"{p.gpu_memory_utilization:g}"
            parts.append(
                f"{p.label}: {p.replicas} x {p.gpu}{tp} (utilization {u}, max_num_seqs {p.max_num_seqs}, "
                f"max_tokens {p.max_output_tokens})"
            )
        return f"{'; '.join(parts)} = {self.gpus} GPUs"


def as_plan(value: Plan | Mapping[str, Any]) -> Plan:
    """A :class:`Plan` from itself or from a dict with the same keys.

    ``pools`` may be a list of ``Pool``s, of ``{"classes": [...], "replicas": n, ...}`` dicts, or a dict
    from a pool's classes joined by ``+`` to its replicas or to a dict of its replicas and own settings:
    ``{"chat": 3, "reports": {"replicas": 2, "gpu": "A100-80GB", "max_num_seqs": 64}}``.
    """
    if isinstance(value, Plan):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"a plan is a course.plan.Plan or a dict of its fields, got {type(value).__name__}")
    data = dict(value)
    unknown = set(data) - {f.name for f in fields(Plan)}
    if unknown:
        raise ValueError(f"unknown plan fields {sorted(unknown)}; known: {', '.join(f.name for f in fields(Plan))}")
    pools = data.get("pools")
    if isinstance(pools, Mapping):
        data["pools"] = tuple(_pool(tuple(str(name).split("+")), spec) for name, spec in pools.items())
    elif isinstance(pools, Sequence) and not isinstance(pools, str):
        data["pools"] = tuple(p if isinstance(p, Pool) else _pool_from_dict(p) for p in pools)
    return Plan(**data)


def _pool(classes: tuple[str, ...], spec: Any) -> Pool:
    if isinstance(spec, Mapping):
        return _pool_from_dict({**spec, "classes": classes})
    return Pool(classes, spec)


def _pool_from_dict(spec: Any) -> Pool:
    if not isinstance(spec, Mapping):
        raise ValueError(f"a pool is a Pool or a dict with classes and replicas, got {spec!r}")
    unknown = set(spec) - {f.name for f in fields(Pool)}
    if unknown:
        raise ValueError(f"unknown pool settings {sorted(unknown)}; known: replicas, {', '.join(POOL_SETTINGS)}")
    if "replicas" not in spec:
        raise ValueError(f"the pool {spec.get('classes')!r} needs its replicas")
    return Pool(**{**spec, "classes": tuple(spec.get("classes") or ())})


# --- the verdict ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassResult:
    """One traffic class under a plan: its pool, the steady-state requests measured, the SLO check over
    them, and how many of them were preempted (the KV cache ran out while they ran)."""

    name: str
    pool: int
    measured: int
    check: SLOCheck
    slo: SLO
    preempted: int = 0

    @property
    def holds(self) -> bool:
        """The SLO held and the cache never ran out for a measured request (see :func:`check_plan`)."""
        return self.check.holds and self.preempted == 0

    @property
    def ratios(self) -> dict[str, float]:
        """Each target's measured percentile over the target: {"TTFT": 0.82, "TPOT": 0.40} (1 = at it)."""
        return {"TTFT": self.check.ttft / self.slo.ttft, "TPOT": self.check.tpot / self.slo.tpot}

    def describe(self) -> str:
        text = self.check.verdict(self.slo)
        if self.preempted:
            text = text.rsplit(": ", 1)[0] + f"; {self.preempted} preempted: the KV cache ran out: MISSED"
        return f"{self.name:8s} pool {self.pool}: {self.measured} requests; " + text


@dataclass(frozen=True)
class PoolLimits:
    """What one pool's replicas ran into over the whole run (warm-up and drain included).

    Attributes:
        pool: the pool's index.
        peak_kv: the largest share of a replica's KV blocks in use at once (0..1).
        preempted: requests thrown out of the cache and recomputed (vLLM's recompute preemption), summed.
        peak_seqs: the largest batch a replica ran, as a share of its ``max_num_seqs`` (0..1).
        held_back: the share of steps in which a replica ran ``max_num_seqs`` requests while others waited.
    """

    pool: int
    peak_kv: float
    preempted: int
    peak_seqs: float
    held_back: float

    def describe(self) -> str:
        notes = [f"KV cache peak {self.peak_kv:.0%}, {self.preempted} requests preempted"]
        notes.append(f"largest batch {self.peak_seqs:.0%} of max_num_seqs")
        if self.held_back > 0.005:
            notes[-1] += f", full with requests waiting in {self.held_back:.0%} of steps"
        return f"pool {self.pool}: " + "; ".join(notes)


# What can bind a plan besides the SLOs: the two limits of a replica the learner sets.
LIMITS = ("KV cache", "max_num_seqs")


@dataclass(frozen=True)
class Binding:
    """What a plan is closest to (or furthest past): an SLO (``ratio`` = measured percentile / target) or a
    limit of a pool (``ratio`` = the peak share of its KV cache or of ``max_num_seqs`` in use)."""

    label: str  # "chat TTFT", "reports TPOT", "KV cache", "max_num_seqs"
    ratio: float
    detail: str

    def describe(self) -> str:
        how = (
            f"{1 - self.ratio:.0%} to spare"
            if self.ratio < 1
            else ("at the limit" if self.ratio == 1 else f"missed by {self.ratio - 1:.0%}")
        )
        return f"binding: {self.label}, {self.detail} ({how})"


@dataclass(frozen=True)
class PlanVerdict:
    """What :func:`check_plan` found.

    Attributes:
        plan: the plan checked.
        problems: what rules it out before any simulation (empty when none).
        classes: per traffic class, the steady-state SLO check (empty when problems stopped it).
        limits: per pool, what its replicas ran into (empty when problems stopped it).
        notes: what vLLM would log about the plan's memory (0.34's warning when an explicit utilization keeps
            free memory out of the KV cache).
        dollars_per_hour: the plan's rent at the menu's prices (inf for a GPU off the menu).
        reference_dollars_per_hour: the cheapest plan the course found (None when not asked for).
        margin: the scenario's cost margin.
        warmup, window: the seconds excluded and measured.
    """

    plan: Plan
    problems: tuple[str, ...]
    classes: tuple[ClassResult, ...]
    limits: tuple[PoolLimits, ...]
    notes: tuple[str, ...]
    dollars_per_hour: float
    reference_dollars_per_hour: float | None
    margin: float
    warmup: float
    window: float

    @property
    def holds_slos(self) -> bool:
        """No problem, and every class met its SLO over the steady-state window with no measured request
        preempted."""
        return not self.problems and bool(self.classes) and all(c.holds for c in self.classes)

    @property
    def binding(self) -> Binding | None:
        """What binds: the SLO whose measured percentile is the largest share of its target, or a pool's KV
        cache or ``max_num_seqs`` when that is fuller (None when nothing was simulated). A plan that misses
        an SLO is bound by it, whatever the limits say."""
        rows = []
        for c in self.classes:
            for metric, ratio in c.ratios.items():
                measured, target = (c.check.ttft, c.slo.ttft) if metric == "TTFT" else (c.check.tpot, c.slo.tpot)
                q = f"p{c.slo.percentile:g}"
                detail = f"{q} {measured * 1e3:,.0f} ms, {ratio:.0%} of its {target * 1e3:g} ms target"
                rows.append(Binding(f"{c.name} {metric}", ratio, detail))
        if not rows:
            return None
        for c in self.classes:
            if c.preempted:  # the cache ran out at steady state: a miss, ranked by how many it hit
                detail = f"ran out: {c.preempted} of {c.name}'s {c.measured} measured requests preempted"
                rows.append(Binding("KV cache", 1 + c.preempted / max(c.measured, 1), detail))
        worst = max(rows, key=lambda b: b.ratio)
        if worst.ratio > 1:
            return worst
        for limit in self.limits:
            kv = f"pool {limit.pool}'s peak {limit.peak_kv:.0%} of its blocks, {limit.preempted} requests preempted"
            rows.append(Binding("KV cache", limit.peak_kv, kv))
            seqs = f"pool {limit.pool}'s largest batch {limit.peak_seqs:.0%} of max_num_seqs"
            rows.append(Binding("max_num_seqs", limit.peak_seqs, seqs))
        return max(rows, key=lambda b: b.ratio)

    def binding_option(self, scenario: Scenario) -> str | None:
        """The letter of :meth:`Scenario.binding_options` that binds this plan (for ``course.predict``)."""
        binding = self.binding
        if binding is None:
            return None
        return next(k for k, v in scenario.binding_options().items() if v == binding.label)

    @property
    def cost_ratio(self) -> float:
        """The plan's rent over the cheapest plan the course found (nan without it)."""
        if not self.reference_dollars_per_hour:
            return math.nan
        return self.dollars_per_hour / self.reference_dollars_per_hour

    @property
    def within_margin(self) -> bool:
        return self.cost_ratio <= 1 + self.margin + 1e-9

    @property
    def holds(self) -> bool:
        """The plan is acceptable: it holds every SLO and costs at most (1 + margin) x the course's plan."""
        return self.holds_slos and (self.reference_dollars_per_hour is None or self.within_margin)

    def describe(self) -> str:
        lines = [self.plan.describe()]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines += [f"  {c.describe()}" for c in self.classes]
        lines += [f"  {limit.describe()}" for limit in self.limits]
        lines += [f"  NOTE: {note}" for note in self.notes]
        if self.binding is not None:
            lines.append(f"  {self.binding.describe()}")
        lines.append(f"  cost: {self._cost()}")
        lines.append(
            f"  verdict: {'holds' if self.holds else 'REJECTED'} (steady state: {self.warmup:g} s warm-up left out, "
            f"{self.window:g} s of arrivals measured)"
        )
        return "\n".join(lines)

    def _cost(self) -> str:
        cost = f"${self.dollars_per_hour:.2f}/h"
        if self.reference_dollars_per_hour is None:
            return cost
        if not self.holds_slos:
            return cost + " (compared with the course's plan once every SLO holds)"
        if not self.within_margin:
            return cost + (
                f": more than {1 + self.margin:g}x the cheapest plan the course found (its cost is shown once yours "
                "is within the margin): look for a cheaper plan that still holds"
            )
        return cost + (
            f": {self.cost_ratio:.2f}x the cheapest plan the course found (${self.reference_dollars_per_hour:.2f}/h; "
            f"margin {self.margin:.0%}: within)"
        )


def max_model_len(pool: Pool, scenario: Scenario) -> int:
    """The ``--max-model-len`` a pool's replicas need: the longest prompt of its classes plus its output cap."""
    known = [c for c in scenario.classes if c.name in pool.classes] or list(scenario.classes)
    return max(c.prompt_max for c in known) + pool.max_output_tokens


def pool_budget(pool: Pool, scenario: Scenario):
    """vLLM's KV budget on one GPU of a pool's replica, as the scenario's release sizes it (``course.kv.budget``
    through ``course.sim.parallel.parallel_budget``, with the reference startup log's activation peak and
    non-torch memory; under 0.34's extensible KV cache, measured after warm-up with vLLM's margin). The one
    place a plan's memory is sized."""
    from course.sim import parallel

    u = pool.gpu_memory_utilization
    return parallel.parallel_budget(
        scenario.model,
        pool.gpu,
        pool.tensor_parallel,
        utilization=None if u is None else float(u),
        max_model_len=max_model_len(pool, scenario),
        activation_bytes=vllm.REFERENCE_LOG.activation_bytes,
        non_torch_bytes=vllm.REFERENCE_LOG.non_torch_bytes,
        release=scenario.release,
    )


# The kinds of problem problems() looks for, in order; each problem's text starts with its kind's wording.
PROBLEM_KINDS = ("menu", "pools", "cap", "memory", "start")


def problems(plan: Plan | Mapping[str, Any], scenario: Scenario, kinds: Sequence[str] = PROBLEM_KINDS) -> list[str]:
    """What rules a plan out before simulating it; empty when nothing does.

    ``kinds`` picks the checks (:data:`PROBLEM_KINDS`): "menu" (a catalogue GPU on the menu), "pools" (every
    class in exactly one pool), "cap" (no class truncated), "memory" (room outside vLLM's share) and "start"
    (the model and one longest request fit). A GPU the catalogue does not know is the only problem reported.
    """
    plan = as_plan(plan)
    unknown = set(kinds) - set(PROBLEM_KINDS)
    if unknown:
        raise ValueError(f"unknown problem kinds {sorted(unknown)}; known: {', '.join(PROBLEM_KINDS)}")
    pools = plan.resolved_pools
    for p in pools:
        if _catalogue_gpu(p) not in hardware.GPUS:
            return [f"{p.gpu!r} is not a catalogue GPU ({', '.join(hardware.GPUS)})"]
    found = _menu_problems(pools, scenario) if "menu" in kinds else []
    if "pools" in kinds:
        found += _membership_problems(pools, scenario)
    for index, p in enumerate(pools):  # each pool's problems together, in PROBLEM_KINDS' order
        where = f"pool {index} ({p.label})" if len(pools) > 1 else "the pool"
        if "cap" in kinds:
            found += _truncation_problems(p, scenario, where)
        if "memory" in kinds:
            found += _headroom_problems(p, scenario, where)
        if "start" in kinds:
            found += _start_problems(p, scenario, where)
    return found


def _catalogue_gpu(pool: Pool) -> str:
    """The catalogue's name for a pool's GPU (an alias resolved; an unknown name as given)."""
    return hardware.ALIASES.get(pool.gpu, pool.gpu)


def _menu_problems(pools: Sequence[Pool], scenario: Scenario) -> list[str]:
    """The "menu" check: the pools' catalogue GPUs that the scenario does not price."""
    return [
        f"{gpu} is not on the menu ({', '.join(scenario.prices)})"
        for gpu in map(_catalogue_gpu, pools)
        if gpu not in scenario.prices
    ]


def _membership_problems(pools: Sequence[Pool], scenario: Scenario) -> list[str]:
    """The "pools" check: a class in no pool or in several, and a pool naming a class the scenario lacks."""
    named = [name for pool in pools for name in pool.classes]
    found = [
        f"class {c.name!r} is in {named.count(c.name)} pools; put every class in exactly one"
        for c in scenario.classes
        if named.count(c.name) != 1
    ]
    known = {c.name for c in scenario.classes}
    for name in sorted(set(named) - known):
        found.append(
            f"unknown class {name!r} in a pool; the scenario has {', '.join(c.name for c in scenario.classes)}"
        )
    return found


def _truncation_problems(pool: Pool, scenario: Scenario, where: str) -> list[str]:
    """The "cap" check: the pool's classes whose answers are longer than its ``max_output_tokens``."""
    return [
        f"max_output_tokens {pool.max_output_tokens} in {where} truncates {c.name}: its answers need up "
        f"to {c.output_max}"
        for c in scenario.classes
        if c.name in pool.classes and pool.max_output_tokens < c.output_max
    ]


def _headroom_problems(pool: Pool, scenario: Scenario, where: str) -> list[str]:
    """The "memory" check: a utilization that leaves too little of the GPU outside vLLM's share.

    Only where the cache is sized from the profiling estimate (0.32; 0.34 without the extensible KV cache):
    whatever vLLM did not profile must fit outside its share. Measured after warm-up, vLLM keeps its own margin.
    """
    gpu = _catalogue_gpu(pool)
    if vllm.extensible_kv_cache(hardware.gpu(gpu), release=scenario.release).on:
        return []
    u = pool.gpu_memory_utilization
    if u is None:
        u = vllm.rules(scenario.release).default_utilization(False)
    headroom = (1 - u) * hardware.gpu(gpu).total_memory / GiB
    if u > MAX_UTILIZATION or headroom < MIN_HEADROOM_GIB:
        return [
            f"gpu_memory_utilization {u:g} in {where} leaves {headroom:.1f} GiB of the {gpu} outside vLLM's "
            f"share (at most {MAX_UTILIZATION:g}, and at least {MIN_HEADROOM_GIB:g} GiB for CUDA graphs and "
            "activation spikes): an out-of-memory crash waiting for peak load"
        ]
    return []


def _start_problems(pool: Pool, scenario: Scenario, where: str) -> list[str]:
    """The "start" check: vLLM would refuse the pool's replica, or one longest request does not fit its KV
    cache. A pool serving none of the scenario's classes is not checked."""
    from course.sim import parallel

    if not set(pool.classes) & {c.name for c in scenario.classes}:
        return []
    g, gpu = parallel.get_geometry(scenario.model), _catalogue_gpu(pool)
    try:
        budget = pool_budget(pool, scenario)
    except ValueError as err:  # a TP size the model's heads do not divide, a length past the model's
        return [f"vLLM would not start {g.name} on {gpu} x TP {pool.tensor_parallel} in {where}: {err}"]
    if budget.fits_one_request:
        return []
    return [
        f"{g.name} does not start on {gpu} x TP {pool.tensor_parallel} at utilization "
        f"{budget.utilization:g} ({where}): {budget.weights / GiB:.1f} GiB of weights per GPU, "
        f"{budget.kv_memory / GiB:.1f} GiB left for the KV cache, and one {budget.max_model_len:,}-token "
        f"request needs {budget.blocks_per_request} blocks; pick a larger card, more TP or a higher "
        "utilization"
    ]


def _replica(pool: Pool, scenario: Scenario):
    """(SimConfig, cost) of one replica of a resolved pool: vLLM's settings on its GPU with its overrides."""
    from course.sim import SimConfig, parallel

    g = parallel.get_geometry(scenario.model)
    gpu = hardware.ALIASES.get(pool.gpu, pool.gpu)
    budget = pool_budget(pool, scenario)
    config = SimConfig.vllm_defaults(
        gpu,
        num_blocks=budget.num_blocks,
        block_size=budget.block_size,
        max_num_seqs=pool.max_num_seqs,
        max_model_len=max_model_len(pool, scenario),
    )
    return config, parallel.parallel_cost(g, gpu, pool.tensor_parallel)


def check_plan(
    plan: Plan | Mapping[str, Any],
    scenario: Scenario,
    *,
    reference: bool = True,
    warmup: float | None = None,
    window: float | None = None,
    static: bool = True,
) -> PlanVerdict:
    """Check a plan against a scenario with the simulator (see the module docstring).

    Args:
        plan: a :class:`Plan` or a dict of its fields (:func:`as_plan`).
        scenario: what it must serve.
        reference: compare the cost with the cheapest plan the course found (:func:`reference_cost`);
            False checks the SLOs and prices the plan only.
        warmup, window: override the scenario's (seconds); the verdict at the scenario's own is the one
            that counts, the overrides are there to show what a run off steady state says.
        static: False simulates a plan whose cap truncates a class or whose utilization leaves too little
            room (what a short trial on real GPUs would show); a plan whose GPU, pools or memory make a
            simulation impossible is never simulated.
    """
    plan = as_plan(plan)
    warmup = float(scenario.warmup if warmup is None else warmup)
    window = float(scenario.window if window is None else window)
    if warmup < 0 or window <= 0:
        raise ValueError(f"need warmup >= 0 and window > 0 seconds, got {warmup} and {window}")
    ref = reference_cost(scenario) if reference else None
    return replace(_check(replace(plan, justification=""), scenario, warmup, window, static), plan=plan,
                   reference_dollars_per_hour=ref)  # fmt: skip


@functools.lru_cache(maxsize=32)
def _check(plan: Plan, scenario: Scenario, warmup: float, window: float, static: bool) -> PlanVerdict:
    """:func:`check_plan` without the reference, kept for the session: the verdict of a plan is a function of
    the plan and the scenario (the traffic is seeded), so the demo cell and the tests share one simulation."""
    found = problems(plan, scenario)
    blocking = found if static else problems(plan, scenario, kinds=("menu", "pools", "start"))
    results: list[ClassResult] = []
    limits: list[PoolLimits] = []
    if not blocking:
        results, limits = _simulate_pools(plan, scenario, warmup, window)
    cost = plan.dollars_per_hour(scenario.prices)
    shown = tuple(found) if static else tuple(blocking)
    notes = []
    if not blocking:
        for index, pool in enumerate(plan.resolved_pools):
            warning = pool_budget(pool, scenario).warning
            if warning:
                notes.append(f"pool {index}: vLLM {scenario.release} warns: {warning.split('. ')[0]}")
    return PlanVerdict(
        plan, shown, tuple(results), tuple(limits), tuple(notes), cost, None, scenario.margin, warmup, window
    )


def _simulate_pools(
    plan: Plan, scenario: Scenario, warmup: float, window: float
) -> tuple[list[ClassResult], list[PoolLimits]]:
    from course.sim import fleet
    from course.sim.workload_variants import cap_output

    results, limits = [], []
    steady = SteadyWindow(warmup, window, scenario.drain)
    for index, pool in enumerate(plan.resolved_pools):
        config, cost = _replica(pool, scenario)
        traffic = cap_output(scenario.traffic(pool.classes, warmup, window), pool.max_output_tokens)
        run = fleet.simulate_fleet(traffic, pool.replicas, config, cost, "round-robin")
        for name in pool.classes:
            mine = window_latencies(run, steady, keep=lambda rid, name=name: rid.split("/", 1)[0] == name)
            slo = scenario.traffic_class(name).slo
            if not mine.requests:
                rate = scenario.traffic_class(name).rate
                raise ValueError(
                    f"class {name!r} ({rate:g} req/s): no request arrived in the {window:g} s measured window; "
                    "lengthen the scenario's window"
                )
            results.append(ClassResult(name, index, mine.requests, slo.check_latencies(mine), slo, mine.preempted))
        steps = [r.steps for r in run.runs if len(r.steps)]
        limits.append(
            PoolLimits(
                index,
                max(r.peak_kv_usage for r in run.runs),
                sum(r.preempted_requests for r in run.runs),
                max((int(s.num_seqs.max()) for s in steps), default=0) / config.max_num_seqs,
                max((float(np.mean((s.num_seqs >= config.max_num_seqs) & (s.waiting > 0))) for s in steps), default=0),
            )
        )
    order = [c.name for c in scenario.classes]
    return sorted(results, key=lambda r: order.index(r.name)), limits


# --- the course's plan: its cost only ---------------------------------------------------------------------


def fingerprint(scenario: Scenario) -> str:
    """A short hash of everything a scenario says (classes, SLOs, menu, margin, windows, seed)."""
    return hashlib.sha256(repr(scenario).encode()).hexdigest()[:16]


# The rent of the cheapest plan the course's search found for module 5's scenario (``capstone_scenario()``),
# by fingerprint: the search (over GPUs, pool splits and replica counts at vLLM's settings) takes minutes and
# lives with the tests (tests/fixtures/capstone_plans.py), which rerun it and check this figure. Only the cost
# is kept here: the plan is the learner's to find.
REFERENCE_COSTS: dict[str, float] = {
    "c2b43d6813fe3f22": 15.96,  # capstone_scenario(): 4 x H100-SXM at vLLM's settings, one shared pool
}


def reference_cost(scenario: Scenario) -> float:
    """The $/h of the cheapest plan the course found for ``scenario`` (:data:`REFERENCE_COSTS`)."""
    cost = REFERENCE_COSTS.get(fingerprint(scenario))
    if cost is None:
        raise ValueError(
            f"no course plan is known for scenario {scenario.name!r} (fingerprint {fingerprint(scenario)}); check "
            "the plan with reference=False, or run the search in tests/fixtures/capstone_plans.py and add its cost"
        )
    return cost


def default_settings(gpu: str, scenario: Scenario, classes: Sequence[str] | None = None) -> dict[str, Any]:
    """vLLM's settings for a pool on ``gpu`` at the scenario's release: ``gpu_memory_utilization`` unset (its
    default), ``max_num_seqs`` for the GPU (``course.kv.vllm.batch_defaults``), and the output cap the pool's
    classes need, no more."""
    chosen = [c for c in scenario.classes if classes is None or c.name in classes]
    return {
        "gpu_memory_utilization": None,
        "max_num_seqs": vllm.batch_defaults(hardware.gpu(gpu), release=scenario.release).max_num_seqs,
        "max_output_tokens": max(c.output_max for c in chosen),
    }


# --- module 5's scenario ---------------------------------------------------------------------------------


def capstone_scenario() -> Scenario:
    """Module 5's capstone: Llama-3.1-8B serving interactive chat and document reports on vLLM 0.34 (today's GPU
    release), menu :data:`GPU_PRICES`.

    Chat: 50 req/s of ~512-token prompts and ~300-token answers (up to 1,200), TTFT p95 <= 500 ms and TPOT p95
    <= 50 ms. Reports: 4 req/s of ~8,000-token documents summarised in ~600 tokens (up to 1,500), throughput
    work with loose targets (TTFT p95 <= 5 s, TPOT p95 <= 100 ms). Steady state: 120 s of warm-up, 60 s
    measured, 10 s of drain: a shorter warm-up passed a pool of A100-80GBs for the reports that fails at
    every longer one (``tests/fixtures/capstone_plans.py`` lists the plans tried).
    """
    chat_slo = SLO("chat", ttft=0.5, tpot=0.050, percentile=95, source="interactive: 500 ms to the first token")
    report_slo = SLO("reports", ttft=5.0, tpot=0.100, percentile=95, source="throughput work, read as it streams")
    return Scenario(
        "chat and document reports on Llama-3.1-8B",
        "Llama-3.1-8B",
        (
            TrafficClass("chat", 50.0, 512, 0.5, 4000, 300, 0.6, 1200, chat_slo),
            TrafficClass("reports", 4.0, 8000, 0.3, 14000, 600, 0.3, 1500, report_slo),
        ),
        warmup=120.0,
        window=60.0,
        drain=10.0,
    )


__all__ = [
    "GPU_PRICES",
    "PRICE_SOURCE",
    "Binding",
    "ClassResult",
    "Plan",
    "PlanVerdict",
    "Pool",
    "PoolLimits",
    "Scenario",
    "TrafficClass",
    "as_plan",
    "capstone_scenario",
    "check_plan",
    "default_settings",
    "problems",
    "reference_cost",
]
