"""A capacity plan as a decision, and the simulator's verdict on it (module 5's capstone).

A :class:`Scenario` is what a service owner hands an engineer: a model, traffic classes (each with its
arrival rate, prompt and output lengths, the longest answer it must be allowed and its latency SLO), a
menu of GPUs with prices, and the cost margin a plan may exceed the cheapest known plan by. A
:class:`Plan` is the engineer's answer: one GPU type (and tensor-parallel size), vLLM's
``gpu_memory_utilization``, ``max_num_seqs`` and output cap (``max_tokens``), and the traffic classes
split into pools of replicas. :func:`check_plan` returns a :class:`PlanVerdict`:

* **static checks** first, as vLLM and a reviewer would make them: the GPU is on the menu; the model
  starts at that utilization (weights, activations and one ``max_model_len`` request fit,
  :func:`course.kv.budget`); the utilization leaves at least :data:`MIN_HEADROOM_GIB` of the card
  outside vLLM's share (module 5, section 9: CUDA graphs, activation spikes and co-located processes
  live there); the output cap does not truncate what a class needs; every class is in exactly one pool;
* then **the simulator**: each pool's replicas (round-robin, :func:`course.sim.fleet.simulate_fleet`)
  serve its classes' Poisson traffic at the target rates (seeded: the same plan always gets the same
  verdict). Only requests that arrive after the warm-up and before the end of the measured window
  count, and the traffic keeps arriving for a drain period after the window, so the measured requests
  see the steady load, neither an empty engine nor one whose queue is emptying. The verdict holds when
  every class meets its SLO at its percentile with no failed request;
* its **cost**: GPUs x the menu's price per GPU-hour, and the margin against the reference plan that
  :func:`reference_plan` finds by search (cheapest plan that holds, over GPUs, pool splits and replica
  counts, at vLLM-like settings).

The verdict does not depend on the run's length once warm-up and window are long enough; the tests
check that (``tests/test_plan.py``: the same verdicts at the scenario's window and at twice it).
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from course import hardware, workload
from course.capacity import SLO, SLOCheck, SteadyWindow
from course.kv import vllm
from course.workload import RequestSpec, Workload

GiB = 2**30

# On-demand prices in US dollars per GPU-hour, one place for the whole course. Source: Lambda's public
# on-demand price list, https://lambda.ai/instances (8-GPU SXM instances, price per GPU per hour,
# read 2026-09-20): "8x NVIDIA H100 SXM $3.99", "8x NVIDIA A100 SXM 80 GB $2.79", "8x NVIDIA A100 SXM
# 40 GB $1.99". Prices move and differ 2-4x between providers: put in your own contract's.
GPU_PRICES: dict[str, float] = {"A100-40GB": 1.99, "A100-80GB": 2.79, "H100-SXM": 3.99}
PRICE_SOURCE = "Lambda on-demand, https://lambda.ai/instances, per GPU-hour of 8-GPU SXM instances, read 2026-09-20"

# The least memory a plan must leave outside vLLM's share, (1 - utilization) x total: module 5's
# section 9 assumes 0.5 GiB of CUDA graphs and 0.5 GiB of activation spikes beyond the profiled peak
# (the capstone's GPUs run no other process). On top of it a plain upper bound, whatever the card:
# above 0.95 a plan counts on every byte vLLM did not measure, and validates nothing at peak load.
MIN_HEADROOM_GIB = 1.0
MAX_UTILIZATION = 0.95


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
        margin: a plan may cost up to ``(1 + margin)`` x the reference plan.
        warmup: seconds of traffic before the measured window (the engine fills up).
        window: seconds of arrivals that are measured.
        drain: seconds of traffic after the window, so the last measured requests still see the load.
        seed: the traffic's seed.
        tp_sizes: the tensor-parallel sizes :func:`reference_search` tries (a plan may use any).
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
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)  # one server of 8 GPUs at most (NVLink inside it)

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        if not names or len(set(names)) != len(names) or any("/" in n for n in names):
            raise ValueError(f"scenario {self.name!r}: give classes with distinct names without '/', got {names}")
        if self.margin < 0 or self.warmup < 0 or self.window <= 0 or self.drain < 0:
            raise ValueError("margin, warmup and drain must be >= 0 and window > 0 (seconds)")

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

    def describe(self) -> str:
        lines = [f"{self.name}: {self.model}; menu {', '.join(f'{g} ${p:.2f}/h' for g, p in self.gpu_prices)}"]
        for c in self.classes:
            lines.append(
                f"  {c.name:8s} {c.rate:g} req/s, prompts ~{c.prompt_median} tokens (<= {c.prompt_max}), answers "
                f"~{c.output_median} (<= {c.output_max} needed); {c.slo.describe()}"
            )
        return "\n".join(lines)


@dataclass(frozen=True)
class Pool:
    """Replicas that serve some traffic classes together (round-robin among them)."""

    classes: tuple[str, ...]
    replicas: int

    def __post_init__(self) -> None:
        if isinstance(self.classes, str) or not self.classes:
            raise ValueError(f"a pool's classes are a non-empty list of names, got {self.classes!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"a pool needs a whole number of replicas >= 1, got {self.replicas!r}")


@dataclass(frozen=True)
class Plan:
    """How to serve a scenario: the settings every replica runs with and the pools.

    Attributes:
        gpu: a catalogue GPU name (``course.hardware.GPUS``), one of the scenario's menu.
        pools: the classes split into pools, each with its replica count.
        tensor_parallel: GPUs per replica (vLLM's ``--tensor-parallel-size``).
        gpu_memory_utilization: vLLM's share of each GPU's memory, in (0, 1].
        max_num_seqs: most requests a replica runs at once (vLLM's ``--max-num-seqs``).
        max_output_tokens: the output cap every request is served with (``max_tokens``).
        justification: why this plan, in a few sentences (checked for presence only).
    """

    gpu: str
    pools: tuple[Pool, ...]
    tensor_parallel: int = 1
    gpu_memory_utilization: float = vllm.GPU_MEMORY_UTILIZATION
    max_num_seqs: int = 256
    max_output_tokens: int = 4096
    justification: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, str):
            raise ValueError(f"gpu is a catalogue name, got {self.gpu!r}")
        if not self.pools or not all(isinstance(p, Pool) for p in self.pools):
            raise ValueError("pools must be a non-empty list of Pool(classes, replicas)")
        for name in ("tensor_parallel", "max_num_seqs", "max_output_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization is a share in (0, 1], got {u!r}")

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * sum(p.replicas for p in self.pools)

    def dollars_per_hour(self, prices: Mapping[str, float]) -> float:
        """The plan's rent: every GPU of every replica at the menu's price (inf when not on the menu)."""
        price = prices.get(hardware.ALIASES.get(self.gpu, self.gpu))
        return math.inf if price is None else self.gpus * price

    def describe(self) -> str:
        pools = ", ".join(f"{'+'.join(p.classes)}: {p.replicas}" for p in self.pools)
        tp = f" x TP {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return (
            f"{self.gpu}{tp}, utilization {self.gpu_memory_utilization:g}, max_num_seqs {self.max_num_seqs}, "
            f"max_tokens {self.max_output_tokens}; replicas per pool {{{pools}}} = {self.gpus} GPUs"
        )


def as_plan(value: Plan | Mapping[str, Any]) -> Plan:
    """A :class:`Plan` from itself or from a dict with the same keys; ``pools`` may be a list of
    ``Pool``s, of ``{"classes": [...], "replicas": n}`` dicts, or a dict ``{"chat": 2, "chat+long": 1}``
    (pool name = its classes joined by ``+``, value = replicas)."""
    if isinstance(value, Plan):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"a plan is a course.plan.Plan or a dict of its fields, got {type(value).__name__}")
    data = dict(value)
    unknown = set(data) - {f for f in Plan.__dataclass_fields__}
    if unknown:
        raise ValueError(f"unknown plan fields {sorted(unknown)}; known: {', '.join(Plan.__dataclass_fields__)}")
    pools = data.get("pools")
    if isinstance(pools, Mapping):
        data["pools"] = tuple(Pool(tuple(name.split("+")), replicas) for name, replicas in pools.items())
    elif isinstance(pools, Sequence) and not isinstance(pools, str):
        data["pools"] = tuple(
            p if isinstance(p, Pool) else Pool(tuple(p["classes"]), p["replicas"]) for p in pools
        )  # fmt: skip
    return Plan(**data)


# --- the verdict ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClassResult:
    """One traffic class under a plan: its pool, the steady-state requests measured, the SLO check
    over them, and how many of them were preempted at least once."""

    name: str
    pool: int
    measured: int
    check: SLOCheck
    preempted: int
    slo: SLO

    def describe(self) -> str:
        return f"{self.name:8s} pool {self.pool}: {self.measured} requests, {self.preempted} preempted; " + (
            self.check.describe(self.slo)
        )


@dataclass(frozen=True)
class PlanVerdict:
    """What :func:`check_plan` found.

    Attributes:
        plan: the plan checked.
        problems: what rules it out before any simulation (empty when none).
        classes: per traffic class, the steady-state SLO check (empty when problems stopped it).
        dollars_per_hour: the plan's rent at the menu's prices (inf for a GPU off the menu).
        reference_dollars_per_hour: the reference plan's rent (None when not asked for).
        margin: the scenario's cost margin.
        warmup, window: the seconds excluded and measured.
    """

    plan: Plan
    problems: tuple[str, ...]
    classes: tuple[ClassResult, ...]
    dollars_per_hour: float
    reference_dollars_per_hour: float | None
    margin: float
    warmup: float
    window: float

    @property
    def holds_slos(self) -> bool:
        """No problem, and every class met its SLO over the steady-state window."""
        return not self.problems and bool(self.classes) and all(c.check.holds for c in self.classes)

    @property
    def cost_ratio(self) -> float:
        """The plan's rent over the reference plan's (nan without a reference)."""
        if not self.reference_dollars_per_hour:
            return math.nan
        return self.dollars_per_hour / self.reference_dollars_per_hour

    @property
    def within_margin(self) -> bool:
        return self.cost_ratio <= 1 + self.margin + 1e-9

    @property
    def holds(self) -> bool:
        """The plan is acceptable: it holds every SLO and costs at most (1 + margin) x the reference."""
        return self.holds_slos and (self.reference_dollars_per_hour is None or self.within_margin)

    def describe(self) -> str:
        lines = [self.plan.describe()]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines += [f"  {c.describe()}" for c in self.classes]
        cost = f"  ${self.dollars_per_hour:.2f}/h"
        if self.reference_dollars_per_hour is not None:
            cost += (
                f", {self.cost_ratio:.2f}x the reference plan's ${self.reference_dollars_per_hour:.2f}/h "
                f"(margin {self.margin:.0%}: {'within' if self.within_margin else 'OVER'})"
            )
        lines.append(cost)
        lines.append(f"  verdict: {'holds' if self.holds else 'REJECTED'} (steady state: {self.warmup:g} s warm-up "
                     f"excluded, {self.window:g} s of arrivals measured)")  # fmt: skip
        return "\n".join(lines)


def max_model_len(plan: Plan, scenario: Scenario) -> int:
    """The ``--max-model-len`` a plan's replicas need: the longest prompt plus the output cap."""
    return max(c.prompt_max for c in scenario.classes) + plan.max_output_tokens


def plan_budget(plan: Plan, scenario: Scenario):
    """vLLM's KV budget on one GPU of a replica (``course.kv.budget`` with the reference startup log's
    activation peak and non-torch memory, as ``course.sim.parallel.deployment``)."""
    from course.sim import parallel

    return parallel.parallel_budget(
        scenario.model,
        plan.gpu,
        plan.tensor_parallel,
        utilization=float(plan.gpu_memory_utilization),
        max_model_len=max_model_len(plan, scenario),
        activation_bytes=vllm.REFERENCE_LOG.activation_bytes,
        non_torch_bytes=vllm.REFERENCE_LOG.non_torch_bytes,
    )


def problems(plan: Plan, scenario: Scenario) -> list[str]:
    """What rules a plan out before simulating it (see the module docstring); empty when nothing does."""
    from course.sim import parallel

    found = []
    gpu = hardware.ALIASES.get(plan.gpu, plan.gpu)
    if gpu not in hardware.GPUS:
        return [f"{plan.gpu!r} is not a catalogue GPU ({', '.join(hardware.GPUS)})"]
    if gpu not in scenario.prices:
        found.append(f"{gpu} is not on the menu ({', '.join(scenario.prices)})")
    named = [name for pool in plan.pools for name in pool.classes]
    for c in scenario.classes:
        if named.count(c.name) != 1:
            found.append(f"class {c.name!r} is in {named.count(c.name)} pools; put every class in exactly one")
    for name in set(named) - {c.name for c in scenario.classes}:
        found.append(
            f"unknown class {name!r} in a pool; the scenario has {', '.join(c.name for c in scenario.classes)}"
        )
    for c in scenario.classes:
        if plan.max_output_tokens < c.output_max:
            found.append(
                f"max_output_tokens {plan.max_output_tokens} truncates {c.name}: its answers need up to {c.output_max}"
            )
    spec = hardware.gpu(gpu)
    headroom = (1 - plan.gpu_memory_utilization) * spec.total_memory / GiB
    if plan.gpu_memory_utilization > MAX_UTILIZATION or headroom < MIN_HEADROOM_GIB:
        found.append(
            f"gpu_memory_utilization {plan.gpu_memory_utilization:g} leaves {headroom:.1f} GiB of the {gpu} outside "
            f"vLLM's share (at most {MAX_UTILIZATION:g}, and at least {MIN_HEADROOM_GIB:g} GiB for CUDA graphs and "
            "activation spikes): an out-of-memory crash waiting for peak load"
        )
    g = parallel.get_geometry(scenario.model)
    try:
        budget = plan_budget(plan, scenario)
    except ValueError as err:  # a TP size the model's heads do not divide, a length past the model's
        found.append(f"vLLM would not start {g.name} on {gpu} x TP {plan.tensor_parallel}: {err}")
        return found
    if not budget.fits_one_request:
        weights = budget.weights / GiB
        found.append(
            f"{g.name} does not start on {gpu} x TP {plan.tensor_parallel} at utilization "
            f"{plan.gpu_memory_utilization:g}: {weights:.1f} GiB of weights per GPU, {budget.kv_memory / GiB:.1f} GiB "
            f"left for the KV cache, and one {budget.max_model_len:,}-token request needs "
            f"{budget.blocks_per_request} blocks; pick a larger card, more TP or a higher utilization"
        )
    return found


def _replica(plan: Plan, scenario: Scenario):
    """(SimConfig, cost) of one replica: vLLM's settings on the GPU with the plan's overrides."""
    from course.sim import SimConfig, parallel

    g = parallel.get_geometry(scenario.model)
    budget = plan_budget(plan, scenario)
    config = SimConfig.vllm_defaults(
        hardware.ALIASES.get(plan.gpu, plan.gpu),
        num_blocks=budget.num_blocks,
        max_num_seqs=plan.max_num_seqs,
        max_model_len=max_model_len(plan, scenario),
    )
    return config, parallel.parallel_cost(g, plan.gpu, plan.tensor_parallel)


def check_plan(
    plan: Plan | Mapping[str, Any],
    scenario: Scenario,
    *,
    reference: bool = True,
    warmup: float | None = None,
    window: float | None = None,
) -> PlanVerdict:
    """Check a plan against a scenario with the simulator (see the module docstring).

    Args:
        plan: a :class:`Plan` or a dict of its fields (:func:`as_plan`).
        scenario: what it must serve.
        reference: also find the reference plan (:func:`reference_plan`, cached per scenario) and
            compare the cost; False checks the SLOs and prices the plan only.
        warmup, window: override the scenario's (seconds); the verdict at the scenario's own is the one
            that counts, the overrides are there to show what a run off steady state says.
    """
    plan = as_plan(plan)
    warmup = scenario.warmup if warmup is None else warmup
    window = scenario.window if window is None else window
    if warmup < 0 or window <= 0:
        raise ValueError(f"need warmup >= 0 and window > 0 seconds, got {warmup} and {window}")
    ref = reference_plan(scenario).dollars_per_hour(scenario.prices) if reference else None
    found = problems(plan, scenario)
    cost = plan.dollars_per_hour(scenario.prices)
    results: list[ClassResult] = []
    if not found:
        results = _simulate_pools(plan, scenario, warmup, window)
    return PlanVerdict(plan, tuple(found), tuple(results), cost, ref, scenario.margin, warmup, window)


def _simulate_pools(plan: Plan, scenario: Scenario, warmup: float, window: float) -> list[ClassResult]:
    from course.sim import fleet
    from course.sim.workload_variants import cap_output

    config, cost = _replica(plan, scenario)
    results = []
    for index, pool in enumerate(plan.pools):
        traffic = cap_output(scenario.traffic(pool.classes, warmup, window), plan.max_output_tokens)
        run = fleet.simulate_fleet(traffic, pool.replicas, config, cost, "round-robin")
        preempted = {r.request_id for replica in run.runs for r in replica.requests if len(r.preempted)}
        traces = SteadyWindow(warmup, window, scenario.drain).select(run.traces)
        for name in pool.classes:
            mine = [t for t in traces if t.request_id.split("/", 1)[0] == name]
            slo = scenario.traffic_class(name).slo
            results.append(
                ClassResult(name, index, len(mine), slo.check(mine), sum(t.request_id in preempted for t in mine), slo)
            )
    order = [c.name for c in scenario.classes]
    return sorted(results, key=lambda r: order.index(r.name))


# --- the reference plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SearchRow:
    """One GPU, TP size and pool split the reference search tried: the fewest replicas per pool that hold."""

    gpu: str
    tensor_parallel: int
    pools: tuple[Pool, ...]
    dollars_per_hour: float
    note: str = ""


@functools.lru_cache(maxsize=8)
def reference_search(scenario: Scenario, max_replicas: int = 16) -> tuple[SearchRow, ...]:
    """Every GPU of the menu x every TP size of the scenario's ``tp_sizes`` at which the model starts x {all classes in
    one pool, each class in its own pool}, each pool with the fewest replicas that hold its classes' SLOs
    (doubling, then bisection over the replica count: more replicas never hurt a round-robin pool), at
    :func:`reference_settings`. Sorted by price; a row that holds nowhere under ``max_replicas`` per pool
    costs inf. Cached: a scenario is searched once per process (it takes minutes; :func:`reference_plan`
    reads the result for module 5's scenario from :data:`KNOWN_REFERENCES`)."""
    splits = [(tuple(c.name for c in scenario.classes),)]
    if len(scenario.classes) > 1:
        splits.append(tuple((c.name,) for c in scenario.classes))
    rows = []
    for gpu in scenario.prices:
        for tp in scenario.tp_sizes:
            base = Plan(gpu, (Pool(splits[0][0], 1),), tensor_parallel=tp, **reference_settings(gpu, scenario))
            found = problems(base, scenario)
            if found:
                rows.append(SearchRow(gpu, tp, (), math.inf, note="; ".join(found)))
                continue
            sized: dict[tuple[str, ...], int | None] = {}
            for split in splits:
                for classes in split:
                    if classes not in sized:
                        sized[classes] = _fewest_replicas(base, classes, scenario, max_replicas)
                if any(sized[c] is None for c in split):
                    rows.append(
                        SearchRow(gpu, tp, (), math.inf, note=f"a pool needs more than {max_replicas} replicas")
                    )
                    continue
                pools = tuple(Pool(c, sized[c]) for c in split)
                rows.append(SearchRow(gpu, tp, pools, replace(base, pools=pools).dollars_per_hour(scenario.prices)))
    return tuple(sorted(rows, key=lambda r: (r.dollars_per_hour, r.tensor_parallel * sum(p.replicas for p in r.pools))))


def _fewest_replicas(base: Plan, classes: tuple[str, ...], scenario: Scenario, most: int) -> int | None:
    def holds(n: int) -> bool:
        plan = replace(base, pools=(Pool(classes, n),))
        return all(c.check.holds for c in _simulate_pools(plan, scenario, scenario.warmup, scenario.window))

    failed, n = 0, 1
    while True:  # double until one holds, then bisect between the last failure and it
        if holds(n):
            return _bisect(holds, failed + 1, n)
        failed = n
        if n >= most:
            return None
        n = min(2 * n, most)


def _bisect(holds, low: int, high: int) -> int:
    """Smallest n in [low, high] that holds, given that ``high`` holds."""
    while low < high:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle + 1
    return high


def fingerprint(scenario: Scenario) -> str:
    """A short hash of everything a scenario says (classes, SLOs, menu, margin, windows, seed)."""
    return hashlib.sha256(repr(scenario).encode()).hexdigest()[:16]


# The search's answer for module 5's scenario (``capstone_scenario()``), stored because the search
# takes minutes; ``tests/test_plan.py`` reruns the search and checks that it still finds this.
# fingerprint -> (gpu, tensor_parallel, ((classes, replicas), ...))
KNOWN_REFERENCES: dict[str, tuple[str, int, tuple[tuple[tuple[str, ...], int], ...]]] = {
    "ceb21aad39a76049": ("H100-SXM", 4, ((("chat", "reports"), 2),)),
}


def best_row(rows: Sequence[SearchRow]) -> SearchRow:
    """The cheapest row (ties: fewer GPUs, then fewer pools)."""
    finite = [r for r in rows if math.isfinite(r.dollars_per_hour)]
    if not finite:
        raise ValueError("no GPU of the menu holds the SLOs within the search's replica limit")
    return min(
        finite, key=lambda r: (r.dollars_per_hour, r.tensor_parallel * sum(p.replicas for p in r.pools), len(r.pools))
    )


def reference_plan(scenario: Scenario) -> Plan:
    """The cheapest plan :func:`reference_search` finds (stored for module 5's scenario)."""
    known = KNOWN_REFERENCES.get(fingerprint(scenario))
    if known is not None:
        gpu, tp, pools = known
        row = SearchRow(gpu, tp, tuple(Pool(c, n) for c, n in pools), math.nan)
    else:
        row = best_row(reference_search(scenario))
    return Plan(
        row.gpu, row.pools, tensor_parallel=row.tensor_parallel, **reference_settings(row.gpu, scenario),
        justification="the library's search: the cheapest GPU, TP size and split at vLLM's settings",
    )  # fmt: skip


def reference_settings(gpu: str, scenario: Scenario) -> dict[str, Any]:
    """What the reference search runs every replica with: utilization 0.9 (the value of the public 80 GB
    startup log the course's budgets use, :data:`course.kv.vllm.REFERENCE_LOG`; vLLM 0.32's default is
    0.92), vLLM's ``max_num_seqs`` for the GPU (``course.kv.vllm.batch_defaults``), and the output cap
    the classes need, no more."""
    return {
        "gpu_memory_utilization": vllm.OLD_GPU_MEMORY_UTILIZATION,
        "max_num_seqs": vllm.batch_defaults(hardware.gpu(gpu)).max_num_seqs,
        "max_output_tokens": max(c.output_max for c in scenario.classes),
    }


# --- module 5's scenario ---------------------------------------------------------------------------------


def capstone_scenario() -> Scenario:
    """Module 5's capstone: Llama-3.1-70B serving interactive chat and long reports, menu :data:`GPU_PRICES`.

    Chat: 14 req/s of ~1,024-token prompts and ~200-token answers (up to 1,000), TTFT p95 <= 500 ms and
    TPOT p95 <= 50 ms. Reports: 1 req/s of ~1,500-token prompts and ~800-token answers (up to 2,000),
    throughput work with loose targets (TTFT p95 <= 5 s, TPOT p95 <= 100 ms). Steady state: 60 s of
    warm-up (the longest reports take about a minute), 60 s measured, 10 s of drain.
    """
    chat_slo = SLO("chat", ttft=0.5, tpot=0.050, percentile=95, source="interactive: 500 ms to the first token")
    report_slo = SLO("reports", ttft=5.0, tpot=0.100, percentile=95, source="throughput work, read as it streams")
    return Scenario(
        "chat and reports on Llama-3.1-70B",
        "Llama-3.1-70B",
        (
            TrafficClass("chat", 14.0, 1024, 0.5, 6000, 200, 0.6, 1000, chat_slo),
            TrafficClass("reports", 1.0, 1500, 0.3, 4000, 800, 0.3, 2000, report_slo),
        ),
        warmup=60.0,
        window=60.0,
        drain=10.0,
    )


__all__ = [
    "GPU_PRICES",
    "PRICE_SOURCE",
    "ClassResult",
    "Plan",
    "PlanVerdict",
    "Pool",
    "Scenario",
    "SearchRow",
    "TrafficClass",
    "as_plan",
    "capstone_scenario",
    "check_plan",
    "problems",
    "reference_plan",
    "reference_search",
    "reference_settings",
]
