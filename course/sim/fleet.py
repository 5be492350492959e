"""Replicas behind a router: data-parallel copies of one deployment, and the policy that picks one.

A fleet is ``replicas`` identical engines (each its own :func:`course.sim.simulate` run, with its own
KV cache and prefix cache) and a router that sends every arriving request to one of them:

* ``round-robin``: in turn, blind to load and content (vLLM's ``--data-parallel-size`` front end and
  most HTTP load balancers by default).
* ``least-outstanding``: to the replica with the fewest requests sent and not yet finished (Envoy's
  and AWS ALB's "least outstanding requests"; SGLang's router's shortest-queue fallback).
* ``prefix-aware``: SGLang's cache-aware router (``sgl-router/src/policies/cache_aware.rs``, defaults
  ``cache_threshold`` 0.5, ``balance_abs_threshold`` 32, ``balance_rel_threshold`` 1.0001): when the
  loads are imbalanced (max - min > 32 and max > 1.0001 x min) the least-loaded replica; otherwise the
  replica whose record of past prompts shares the longest prefix with this one, if that prefix is more
  than half the prompt, else the replica with the smallest record (the most cache to spare). The router
  keeps its own approximate record of what it sent where, never asking the replicas; here the record
  holds prompt blocks (the engine's chained block hashes, :func:`course.sim.prompt_block_hashes`)
  where SGLang's holds characters.

**What the router sees.** Least-outstanding and the prefix-aware balance check need each replica's
outstanding requests at every arrival, which depends on when earlier requests finish, which depends on
the routing. The fleet is therefore simulated in passes: the first routes round-robin; each later pass
routes with every request's time in the system as the passes so far simulated it (their mean), then
simulates the replicas again. Passes stop when the routing stops changing (``converged``) or after
``max_passes``. Round-robin needs no feedback and is exact in one pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from course import metrics
from course.rate_search import highest_rate, replicas_needed
from course.sim.blocks import prompt_block_hashes
from course.sim.config import SimConfig
from course.sim.results import SimResult
from course.sim.simulator import simulate
from course.trace import RequestTrace
from course.workload import Workload

ROUTERS = ("round-robin", "least-outstanding", "prefix-aware")
# SGLang router's cache-aware defaults (sgl-router, CacheAwareConfig; python launch_router defaults).
CACHE_THRESHOLD = 0.5
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.0001


@dataclass
class _PrefixRecord:
    """The router's record of one replica: the prompt blocks it sent there (a set of chained hashes,
    so a matching block implies every block before it matched too)."""

    blocks: set = field(default_factory=set)

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` this replica was sent before."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n


def route(
    workload: Workload,
    replicas: int,
    policy: str,
    finish_times: Sequence[float] | None = None,
    block_size: int = 16,
    cache_threshold: float = CACHE_THRESHOLD,
    balance_abs: int = BALANCE_ABS_THRESHOLD,
    balance_rel: float = BALANCE_REL_THRESHOLD,
) -> np.ndarray:
    """The replica (0-based) each request goes to, in the workload's order.

    Args:
        workload: the requests, in arrival order.
        replicas: how many replicas.
        policy: one of :data:`ROUTERS`.
        finish_times: the time (s) each request finishes, as the router expects it (the previous
            pass's); needed by "least-outstanding" and "prefix-aware". A request counts as outstanding
            on its replica from its arrival until then.
        block_size: tokens per prompt block for the prefix record (the engine's block size).
        cache_threshold, balance_abs, balance_rel: the prefix-aware policy's thresholds (SGLang's).
    """
    if policy not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {policy!r}")
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive integer, got {replicas!r}")
    n = len(workload)
    if policy == "round-robin":
        return np.arange(n) % replicas
    if finish_times is None or len(finish_times) != n:
        raise ValueError(f"the {policy} router needs the expected finish time of each of the {n} requests")
    assignment = np.empty(n, dtype=int)
    # per replica: the finish times of its outstanding requests (a min-heap would be faster; a
    # sorted-on-demand list keeps it plain and the fleets here are small)
    pending: list[list[float]] = [[] for _ in range(replicas)]
    records = [_PrefixRecord() for _ in range(replicas)]
    for i, spec in enumerate(workload):
        now = spec.arrival_time
        for queue in pending:
            queue[:] = [t for t in queue if t > now]
        loads = [len(queue) for queue in pending]
        least = _first_min(loads, i)
        if policy == "least-outstanding":
            choice = least
        else:
            hashes = prompt_block_hashes(spec.request_id, spec.prompt_tokens, block_size, spec.prompt_segments)
            imbalanced = max(loads) - min(loads) > balance_abs and max(loads) > min(loads) * balance_rel
            if imbalanced or not hashes:
                choice = least if imbalanced else _first_min([len(r.blocks) for r in records], i)
            else:
                matches = [record.match(hashes) for record in records]
                best = int(np.argmax(matches))
                if matches[best] / len(hashes) > cache_threshold:
                    choice = best
                else:
                    choice = _first_min([len(r.blocks) for r in records], i)
            records[choice].blocks.update(hashes)
        assignment[i] = choice
        pending[choice].append(finish_times[i])
    return assignment


def _first_min(values: Sequence[float], turn: int) -> int:
    """Index of the smallest value; ties go to the first at or after ``turn`` (mod the length), so an
    idle fleet is filled in turn rather than always from replica 0 (Envoy and NGINX break ties at random)."""
    n = len(values)
    low = min(values)
    return next((turn + k) % n for k in range(n) if values[(turn + k) % n] == low)


def _finish_times(workload: Workload, runs: Sequence[SimResult], assignment: np.ndarray) -> np.ndarray:
    """Each request's finish time (s) in the runs it was simulated in (its arrival when it failed)."""
    finish = np.array([spec.arrival_time for spec in workload], dtype=float)
    positions = [np.flatnonzero(assignment == r) for r in range(len(runs))]
    for r, run in enumerate(runs):
        for index, record in zip(positions[r], run.requests, strict=True):
            if len(record.token_times):
                finish[index] = float(record.token_times[-1])
    return finish


@dataclass
class FleetResult:
    """A simulated fleet: every replica's run, the routing, and fleet-wide metrics.

    Attributes:
        runs: one :class:`SimResult` per replica (its requests in arrival order).
        assignment: the replica of each request of the workload (arrival order).
        router: the policy.
        passes: simulation passes it took (1 for round-robin).
        converged: the last pass routed exactly as the one before (always True for round-robin).
        duration: the workload's span (s), first arrival to last finish.
    """

    runs: list[SimResult]
    assignment: np.ndarray
    router: str
    passes: int
    converged: bool
    name: str = "fleet"

    @property
    def replicas(self) -> int:
        return len(self.runs)

    @property
    def traces(self) -> list[RequestTrace]:
        """Every request of the fleet, as a client in front of the router would have recorded it."""
        return [trace for run in self.runs for trace in run.traces]

    def summary(self) -> metrics.BenchmarkSummary:
        """Fleet-wide TTFT / TPOT / ITL statistics and throughput (course.metrics, vLLM's definitions)."""
        return metrics.summarize(self.traces)

    def goodput(self, ttft_slo: float | None = None, tpot_slo: float | None = None) -> metrics.Goodput:
        return metrics.goodput(self.traces, ttft_slo=ttft_slo, tpot_slo=tpot_slo)

    @property
    def requests_per_replica(self) -> np.ndarray:
        return np.bincount(self.assignment, minlength=self.replicas)

    @property
    def imbalance(self) -> float:
        """Busiest replica's engine time over the mean replica's (1.0 = perfectly even)."""
        busy = np.array([run.busy_seconds for run in self.runs])
        return float(busy.max() / busy.mean()) if busy.mean() > 0 else 1.0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the replicas' prefix caches over tokens looked up, fleet-wide."""
        queried = sum(r.queried_tokens for run in self.runs for r in run.requests)
        hits = sum(r.prefix_hit_tokens for run in self.runs for r in run.requests)
        return hits / queried if queried else 0.0

    def replica_rows(self, ttft_slo: float | None = None, tpot_slo: float | None = None) -> list[dict]:
        """One dict per replica: requests, busy seconds, TTFT/TPOT p50/p95 (s), prefix hit rate,
        output tokens/s, and the goodput attainment under the SLOs when given."""
        rows = []
        for r, run in enumerate(self.runs):
            s = run.summary()
            row = {
                "replica": r,
                "requests": len(run.requests),
                "busy_s": run.busy_seconds,
                "ttft_p50": s.ttft.percentiles.get(50.0, math.nan) if s.completed else math.nan,
                "ttft_p95": _p(s.ttft, 95.0),
                "tpot_p95": _p(s.tpot, 95.0),
                "prefix_hit_rate": run.prefix_hit_rate,
                "output_tok_s": s.output_throughput,
                "preemptions": run.preemptions,
            }
            if ttft_slo is not None or tpot_slo is not None:
                row["attainment"] = run.goodput(ttft_slo=ttft_slo, tpot_slo=tpot_slo).attainment
            rows.append(row)
        return rows

    def table(self, ttft_slo: float | None = None, tpot_slo: float | None = None) -> str:
        """Per-replica lines, then the fleet's latency table."""
        rows = self.replica_rows(ttft_slo, tpot_slo)
        header = f"{'replica':>7s} {'requests':>8s} {'busy s':>8s} {'TTFT p95 ms':>11s} {'TPOT p95 ms':>11s} "
        header += f"{'prefix hits':>11s} {'tok/s':>8s}" + (" attained" if "attainment" in rows[0] else "")
        lines = [
            f"{self.router} router over {self.replicas} replicas ({self.passes} pass"
            + ("es" if self.passes > 1 else "")
            + ("" if self.converged else ", routing still changing at the last pass")
            + ")",
            header,
        ]
        for row in rows:
            line = (
                f"{row['replica']:7d} {row['requests']:8d} {row['busy_s']:8.2f} {row['ttft_p95'] * 1e3:11.1f} "
                f"{row['tpot_p95'] * 1e3:11.1f} {row['prefix_hit_rate']:11.1%} {row['output_tok_s']:8.0f}"
            )
            if "attainment" in row:
                line += f" {row['attainment']:8.1%}"
            lines.append(line)
        lines.append(f"imbalance (busiest / mean engine time) {self.imbalance:.2f}; fleet prefix hit rate "
                     f"{self.prefix_hit_rate:.1%}")  # fmt: skip
        lines.append(self.summary().table())
        if ttft_slo is not None or tpot_slo is not None:
            g = self.goodput(ttft_slo, tpot_slo)
            slos = ", ".join(f"{name.upper()} <= {value * 1e3:g} ms" for name, value in g.slos.items())
            lines.append(f"fleet goodput ({slos}): {g.rate:.2f} req/s, {g.attainment:.1%} of requests met the SLOs")
        return "\n".join(lines)

    def to_dict(self, ttft_slo: float | None = None, tpot_slo: float | None = None) -> dict:
        out = {
            "name": self.name,
            "router": self.router,
            "replicas": self.replicas,
            "passes": self.passes,
            "converged": self.converged,
            "requests_per_replica": self.requests_per_replica.tolist(),
            "imbalance": self.imbalance,
            "prefix_cache_hit_rate": self.prefix_hit_rate,
            **self.summary().to_dict(),
            "per_replica": self.replica_rows(ttft_slo, tpot_slo),
            "config": self.runs[0].config if self.runs else {},
        }
        if ttft_slo is not None or tpot_slo is not None:
            g = self.goodput(ttft_slo, tpot_slo)
            out["goodput"] = {"slos_s": g.slos, "good": g.good, "rate_req_s": g.rate, "attainment": g.attainment}
        return out


def _p(stats: metrics.Stats, q: float) -> float:
    value = stats.percentiles.get(q)
    return math.nan if value is None else float(value)


def _split(workload: Workload, assignment: np.ndarray, replicas: int) -> list[Workload]:
    return [
        Workload(
            [spec for spec, a in zip(workload, assignment, strict=True) if a == r],
            name=f"{workload.name}, replica {r}",
            metadata=workload.metadata,
        )
        for r in range(replicas)
    ]


def simulate_fleet(
    workload: Workload,
    replicas: int,
    config: SimConfig,
    cost: Any,
    router: str = "round-robin",
    *,
    max_passes: int = 6,
    name: str | None = None,
    **router_args: Any,
) -> FleetResult:
    """Simulate ``replicas`` copies of one deployment (``config`` and ``cost`` each) behind ``router``.

    See the module docstring for the passes that give the load-aware routers their view of the
    replicas. ``router_args`` go to :func:`route` (the prefix-aware thresholds).
    """
    if not len(workload):
        raise ValueError("the workload has no requests")
    if max_passes < 2 and router != "round-robin":
        raise ValueError("max_passes must be >= 2: the load-aware routers need a pass to learn finish times from")
    block_size = router_args.pop("block_size", config.block_size)
    assignment = route(workload, replicas, "round-robin")
    runs = [simulate(part, config, cost) for part in _split(workload, assignment, replicas)]
    passes, converged = 1, True
    if router != "round-robin":
        converged = False
        arrivals = np.array([spec.arrival_time for spec in workload], dtype=float)
        latency = np.zeros(len(workload))
        while passes < max_passes:
            # the router's expectation of each request's time in the system: the mean over the passes
            # so far (a plain "last pass" view oscillates: a replica that looked busy gets nothing, then
            # looks idle and gets everything)
            latency += (_finish_times(workload, runs, assignment) - arrivals - latency) / passes
            new = route(workload, replicas, router, arrivals + latency, block_size=block_size, **router_args)
            passes += 1
            if np.array_equal(new, assignment):
                converged = True
                break
            assignment = new
            runs = [simulate(part, config, cost) for part in _split(workload, assignment, replicas)]
    return FleetResult(runs, assignment, router, passes, converged, name or f"{router} x {replicas}: {workload.name}")


# --- capacity search over GPUs, TP, PP and replicas --------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """One way to serve a traffic mix: ``replicas`` replicas of ``tp x pp`` GPUs of ``gpu``.

    ``per_replica_rate`` is the highest rate (req/s) one replica holds the SLO at; ``holds`` whether the
    whole fleet, simulated behind its router at the target rate, held it; ``dollars_per_hour`` the
    fleet's rent at the given GPU price.
    """

    gpu: str
    tp: int
    pp: int
    replicas: int
    per_replica_rate: float
    holds: bool
    dollars_per_hour: float
    fleet_ttft_p95: float = math.nan
    fleet_tpot_p95: float = math.nan
    note: str = ""

    @property
    def gpus(self) -> int:
        return self.replicas * self.tp * self.pp

    def describe(self) -> str:
        shape = f"{self.replicas} x (TP {self.tp}" + (f" x PP {self.pp}" if self.pp > 1 else "") + ")"
        verdict = "holds" if self.holds else "MISSED"
        return (
            f"{self.gpu:9s} {shape:20s} {self.gpus:4d} GPUs  {self.per_replica_rate:7.2f} req/s per replica  "
            f"${self.dollars_per_hour:8.2f}/h  fleet p95 TTFT {self.fleet_ttft_p95 * 1e3:7.1f} ms, TPOT "
            f"{self.fleet_tpot_p95 * 1e3:5.1f} ms: {verdict}" + (f" ({self.note})" if self.note else "")
        )


def plan_capacity(
    model: Any,
    make_workload: Callable[[float], Workload],
    target_rate: float,
    slo: Any,
    gpu_prices: dict[str, float],
    *,
    tp_sizes: Sequence[int] | None = None,
    pp_sizes: Sequence[int] = (1,),
    router: str = "least-outstanding",
    headroom: float = 0.0,
    rate_bracket: tuple[float, float] = (0.05, 200.0),
    rel_tol: float = 0.1,
    max_extra_replicas: int = 2,
    max_gpus: int = 64,
    deployment: Callable[..., tuple[SimConfig, Any]] | None = None,
    **deployment_args: Any,
) -> list[Plan]:
    """The cheapest ways to serve ``target_rate`` req/s of ``make_workload``'s traffic within ``slo``.

    For every GPU of ``gpu_prices`` (name -> $ per GPU-hour), TP size and PP size at which the model
    starts (:func:`course.sim.parallel.parallel_budget`): the highest rate one replica holds the SLO at
    (:func:`course.rate_search.highest_rate`, each probe a simulation of ``make_workload(rate)``), the
    replicas that rate calls for (:func:`course.rate_search.replicas_needed`), then the whole fleet
    simulated behind ``router`` at the target rate; replicas are added (up to ``max_extra_replicas``)
    while the fleet misses the SLO, since a router never splits load as evenly as the division assumes.
    Returns the plans sorted by price, cheapest first; plans over ``max_gpus`` GPUs are skipped.

    ``deployment(model, gpu, tp, pp, **deployment_args)`` -> ``(SimConfig, cost)`` builds one replica
    (default :func:`course.sim.parallel.deployment`, vLLM's defaults and budget; ``max_model_len=8192``
    and the like go through ``deployment_args``).
    """
    from course.sim import parallel

    build = deployment or parallel.deployment
    search = _ShapeSearch(
        make_workload, target_rate, slo, router, headroom, rate_bracket, rel_tol, max_extra_replicas, max_gpus
    )
    plans = []
    for gpu, price in gpu_prices.items():
        sizes = tp_sizes or [t for t in parallel.valid_tp_sizes(parallel.get_geometry(model), 8)]
        for pp in pp_sizes:
            for tp in sizes:
                if tp * pp > max_gpus:
                    continue
                try:
                    config, cost = build(model, gpu, tp, pp, **deployment_args)
                except parallel.DoesNotFit:
                    continue
                plans.append(search.plan(gpu, price, tp, pp, config, cost))
    return sorted(plans, key=lambda p: (not p.holds, p.dollars_per_hour))


@dataclass(frozen=True)
class _ShapeSearch:
    """What :func:`plan_capacity` asks of every shape (GPU, TP, PP) that starts: its arguments of the same names."""

    make_workload: Callable[[float], Workload]
    target_rate: float
    slo: Any
    router: str
    headroom: float
    rate_bracket: tuple[float, float]
    rel_tol: float
    max_extra_replicas: int
    max_gpus: int

    def plan(self, gpu: str, price: float, tp: int, pp: int, config: SimConfig, cost: Any) -> Plan:
        """The plan for replicas of ``tp x pp`` GPUs of ``gpu`` (``price`` $ per GPU-hour) that run ``config``
        and ``cost``: the highest rate one replica holds the SLO at, the replicas the target rate calls for,
        then the fleet that holds it (:meth:`fleet`)."""

        def holds(rate: float) -> bool:
            return self.slo.holds(simulate(self.make_workload(rate), config, cost).traces)

        found = highest_rate(holds, *self.rate_bracket, rel_tol=self.rel_tol)
        if found.rate <= 0:
            return Plan(gpu, tp, pp, 0, 0.0, False, math.inf, note="holds the SLO at no rate")
        replicas = replicas_needed(self.target_rate, found.rate, self.headroom)
        if replicas * tp * pp > self.max_gpus:
            return Plan(gpu, tp, pp, replicas, found.rate, False, replicas * tp * pp * price,
                        note=f"needs more than max_gpus={self.max_gpus} GPUs; not simulated")  # fmt: skip
        n, extra, check = self.fleet(replicas, tp * pp, config, cost)
        return Plan(gpu, tp, pp, n, found.rate, check.holds, n * tp * pp * price, check.ttft, check.tpot,
                    note=f"{extra} replica(s) more than rate / per-replica rate" if extra else "")  # fmt: skip

    def fleet(self, replicas: int, gpus_per_replica: int, config: SimConfig, cost: Any) -> tuple[int, int, Any]:
        """The whole fleet simulated behind the router at the target rate, from ``replicas`` replicas, one
        more (up to ``max_extra_replicas``) while it misses the SLO, since a router never splits load as
        evenly as the division assumes: (replicas, replicas added, the SLO check of the last fleet simulated).

        When the next fleet would exceed ``max_gpus`` the search stops at the last fleet simulated (``replicas``
        fit ``max_gpus``: :meth:`plan` checks that first), so the count, its price and its check belong together.
        """
        traffic = self.make_workload(self.target_rate)
        n, extra, check = replicas, 0, None
        for more in range(self.max_extra_replicas + 1):
            if (replicas + more) * gpus_per_replica > self.max_gpus:
                break
            n, extra = replicas + more, more
            check = self.slo.check(simulate_fleet(traffic, n, config, cost, self.router).traces)
            if check.holds:
                break
        return n, extra, check


# --- traffic whose prompts share prefixes across requests ------------------------------------------------


def conversations(
    rate: float,
    n_conversations: int,
    turns: int,
    question_tokens: int,
    answer_tokens: int,
    think_seconds: float = 20.0,
    system_tokens: int = 0,
    seed: int = 0,
) -> Workload:
    """Multi-turn chats: each turn's prompt is the conversation so far plus a new question.

    Conversations start as a Poisson stream at ``rate`` per second; turn ``t`` of a conversation
    arrives an exponential gap of mean ``think_seconds`` after turn ``t - 1`` (waiting for and reading the
    answer included), and its prompt holds the shared system prompt (``system_tokens``), every earlier
    question and answer, and its own question: turn ``t``'s prompt starts with turn ``t - 1``'s, so a
    replica that served the previous turn finds it in its prefix cache, and any other replica does not.
    Arrival times do not wait for the real answers (an open loop): the think time stands in for them.
    """
    from course.workload import RequestSpec

    if rate <= 0 or n_conversations < 1 or turns < 1 or question_tokens < 1 or answer_tokens < 1:
        raise ValueError("rate, n_conversations, turns, question_tokens and answer_tokens must be positive")
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1 / rate, n_conversations))
    requests = []
    for c, start in enumerate(starts):
        segments: list[tuple[str, int]] = [("system prompt", system_tokens)] if system_tokens else []
        t = float(start)
        for turn in range(turns):
            segments.append((f"conversation {c} question {turn}", question_tokens))
            prompt = sum(tokens for _, tokens in segments)
            requests.append(RequestSpec(f"c{c}-t{turn}", t, prompt, answer_tokens, prompt_segments=tuple(segments)))
            segments = [*segments, (f"conversation {c} answer {turn}", answer_tokens)]
            t += float(rng.exponential(think_seconds))
    requests.sort(key=lambda spec: spec.arrival_time)
    return Workload(
        requests,
        name=f"{n_conversations} conversations of {turns} turns at {rate:g}/s",
        metadata={"kind": "conversations", "rate": rate, "turns": turns},
    )
