"""course.sim.fleet: routers worked by hand, the fleet against one engine, the capacity search, the CLI."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from course import capacity, workload
from course.cli import main
from course.sim import LinearCost, SimConfig, prompt_block_hashes, simulate
from course.sim import fleet as F
from course.workload import RequestSpec, Workload

ONE_SECOND_PER_STEP = LinearCost(a=1.0, b=0.0, c=0.0, d=0.0)


def at(*arrivals: float, prompt: int = 4, output: int = 2, segments=None) -> Workload:
    return Workload(
        [
            RequestSpec(f"r{i}", t, prompt, output, tuple(segments[i]) if segments else ())
            for i, t in enumerate(arrivals)
        ]
    )


# --- routing decisions, by hand ---------------------------------------------------------------------


def test_round_robin_deals_in_turn():
    assert F.route(at(0, 0, 0, 0, 0), 3, "round-robin").tolist() == [0, 1, 2, 0, 1]


def test_least_outstanding_avoids_the_replica_still_busy():
    # r0 runs until t=10; r1 and r2 finish at once: everything after r0 avoids replica 0
    w = at(0, 1, 2, 3)
    finish = [10.0, 1.5, 2.5, 3.5]
    assert F.route(w, 2, "least-outstanding", finish).tolist() == [0, 1, 1, 1]


def test_least_outstanding_fills_an_idle_fleet_in_turn():
    # every request is done before the next arrives: all replicas tie at 0 outstanding; breaking the
    # tie always towards replica 0 would pile everything there
    w = at(0, 1, 2, 3, 4, 5)
    finish = [t + 0.5 for t in range(6)]
    assert F.route(w, 3, "least-outstanding", finish).tolist() == [0, 1, 2, 0, 1, 2]


def test_load_aware_routers_need_finish_times():
    with pytest.raises(ValueError, match="expected finish time"):
        F.route(at(0, 1), 2, "least-outstanding")
    with pytest.raises(ValueError, match="router must be one of"):
        F.route(at(0), 2, "random")
    with pytest.raises(ValueError, match="replicas must be a positive integer"):
        F.route(at(0), 0, "round-robin")


def conversation_turns() -> Workload:
    """Two conversations, alternating; turn k's prompt is a 64-token first question, then one 16-token
    question per later turn, so a turn shares 4 of its 5 (then 5 of 6) 16-token blocks with the last."""
    specs = []
    for turn in range(3):
        for c in "AB":
            segments = [(f"{c} q0", 64)] + [(f"{c} q{k}", 16) for k in range(1, turn + 1)]
            specs.append(RequestSpec(f"{c}{turn}", 10.0 * len(specs), 64 + 16 * turn, 2, tuple(segments)))
    return Workload(specs)


def test_prefix_aware_keeps_a_conversation_on_its_replica():
    w = conversation_turns()
    finish = [spec.arrival_time + 1 for spec in w]  # never busy: the balance check never fires
    prefix = F.route(w, 2, "prefix-aware", finish, block_size=16)
    # A0 -> 0, B0 -> 1 (the smaller record), then every later turn follows its own prefix
    assert prefix.tolist() == [0, 1, 0, 1, 0, 1]
    # with three replicas round-robin splits the conversations' turns across replicas
    assert F.route(w, 3, "round-robin").tolist() == [0, 1, 2, 0, 1, 2]
    assert F.route(w, 3, "prefix-aware", finish, block_size=16).tolist() == [0, 1, 0, 1, 0, 1]


def test_prefix_aware_ignores_a_match_under_the_threshold():
    # B shares 1 of its 4 blocks with A: 25 % <= 50 %, so B goes to the replica with the smaller record
    w = at(0, 10, prompt=64, segments=[[("shared", 16), ("A", 48)], [("shared", 16), ("B", 48)]])
    assert F.route(w, 2, "prefix-aware", [1, 11], block_size=16).tolist() == [0, 1]
    # sharing 3 of 4 blocks, B follows A
    w = at(0, 10, prompt=64, segments=[[("shared", 48), ("A", 16)], [("shared", 48), ("B", 16)]])
    assert F.route(w, 2, "prefix-aware", [1, 11], block_size=16).tolist() == [0, 0]


def test_prefix_aware_balances_when_one_replica_runs_away():
    # 40 requests share one prompt and never finish: they pile on replica 0 until it has 33 outstanding,
    # more than 32 over replica 1 (SGLang's balance_abs_threshold); then replica 1 gets one
    segments = [[("the same prompt", 64)]] * 40
    w = at(*range(40), prompt=64, segments=segments)
    choice = F.route(w, 2, "prefix-aware", [1e9] * 40, block_size=16)
    assert choice[:33].tolist() == [0] * 33 and choice[33] == 1
    # a lower threshold gives up on the cache sooner
    early = F.route(w, 2, "prefix-aware", [1e9] * 40, block_size=16, balance_abs=4)
    assert early[:5].tolist() == [0] * 5 and early[5] == 1


# --- the fleet simulation -------------------------------------------------------------------------------


def test_one_replica_is_the_engine_itself():
    w = workload.poisson(5.0, 60, workload.uniform(20, 200), workload.uniform(5, 40), seed=3)
    config = SimConfig(num_blocks=400)
    fleet = F.simulate_fleet(w, 1, config, ONE_SECOND_PER_STEP)
    alone = simulate(w, config, ONE_SECOND_PER_STEP)
    assert [t.chunk_times for t in fleet.traces] == [t.chunk_times for t in alone.traces]
    assert fleet.passes == 1 and fleet.converged


def test_round_robin_replicas_run_their_share_independently():
    w = workload.poisson(5.0, 60, workload.uniform(20, 200), workload.uniform(5, 40), seed=3)
    config = SimConfig(num_blocks=400)
    fleet = F.simulate_fleet(w, 3, config, ONE_SECOND_PER_STEP)
    assert fleet.requests_per_replica.tolist() == [20, 20, 20]
    assert sorted(t.request_id for t in fleet.traces) == sorted(s.request_id for s in w)
    third = Workload([s for i, s in enumerate(w) if i % 3 == 1])
    assert [t.chunk_times for t in fleet.runs[1].traces] == [
        t.chunk_times for t in simulate(third, config, ONE_SECOND_PER_STEP).traces
    ]
    rows = fleet.replica_rows(ttft_slo=5.0, tpot_slo=1.5)
    assert [row["requests"] for row in rows] == [20, 20, 20] and all(0 <= row["attainment"] <= 1 for row in rows)
    assert "round-robin router over 3 replicas" in fleet.table(5.0, 1.5)


def test_more_replicas_cut_the_queueing():
    w = workload.poisson(3.0, 80, workload.uniform(50, 200), workload.uniform(20, 60), seed=1)
    cost = LinearCost(a=0.02, b=1e-4, c=1e-3, d=0.0)
    config = SimConfig(num_blocks=2000, max_num_seqs=4)
    one = F.simulate_fleet(w, 1, config, cost).summary()
    four = F.simulate_fleet(w, 4, config, cost, "least-outstanding").summary()
    assert four.ttft.percentiles[95.0] < one.ttft.percentiles[95.0] / 2


def test_prefix_aware_routing_raises_the_fleet_hit_rate_on_conversations():
    w = F.conversations(0.5, 24, 4, 100, 30, think_seconds=5.0, seed=2)
    config = SimConfig(num_blocks=5000, enable_prefix_caching=True)
    cost = LinearCost(a=0.01, b=1e-4, c=1e-3, d=0.0)
    blind = F.simulate_fleet(w, 3, config, cost, "round-robin")
    aware = F.simulate_fleet(w, 3, config, cost, "prefix-aware", balance_abs=2)
    assert aware.prefix_hit_rate > blind.prefix_hit_rate + 0.2
    assert aware.summary().ttft.mean < blind.summary().ttft.mean
    assert aware.passes <= 6 and aware.to_dict()["router"] == "prefix-aware"


def test_conversation_turns_extend_the_previous_prompt():
    w = F.conversations(1.0, 3, 3, 40, 20, system_tokens=32, seed=0)
    assert [s.arrival_time for s in w] == sorted(s.arrival_time for s in w)
    by_id = {s.request_id: s for s in w}
    first, second = by_id["c1-t0"], by_id["c1-t1"]
    assert second.prompt_tokens == first.prompt_tokens + 20 + 40
    h1 = prompt_block_hashes(first.request_id, first.prompt_tokens, 16, first.prompt_segments)
    h2 = prompt_block_hashes(second.request_id, second.prompt_tokens, 16, second.prompt_segments)
    assert h2[: len(h1)] == h1
    other = by_id["c2-t0"]
    h3 = prompt_block_hashes(other.request_id, other.prompt_tokens, 16, other.prompt_segments)
    assert h3[:2] == h1[:2] and h3[2] != h1[2]  # only the 32-token system prompt is shared


# --- capacity search -------------------------------------------------------------------------------------


def test_plan_capacity_sizes_and_prices_every_fitting_shape():
    slo = capacity.SLO("chat", ttft=1.0, tpot=0.05)

    def traffic(rate: float) -> Workload:
        return workload.poisson(
            rate, max(20, int(rate * 8)), workload.uniform(100, 400), workload.uniform(20, 60), seed=4
        )

    prices = {"H100-SXM": 3.0, "L4": 0.8}
    plans = F.plan_capacity("Llama-3-8B", traffic, 6.0, slo, prices, tp_sizes=(1, 2), rate_bracket=(0.5, 64.0))
    assert {(p.gpu, p.tp) for p in plans} == {("H100-SXM", 1), ("H100-SXM", 2), ("L4", 1), ("L4", 2)}
    holding = [p for p in plans if p.holds]
    assert holding and plans[: len(holding)] == holding  # holding plans first, cheapest first
    assert [p.dollars_per_hour for p in holding] == sorted(p.dollars_per_hour for p in holding)
    for p in holding:
        assert p.replicas >= math.ceil(6.0 / p.per_replica_rate - 1e-9)
        assert p.dollars_per_hour == pytest.approx(p.gpus * prices[p.gpu])
        assert p.fleet_ttft_p95 <= slo.ttft and p.fleet_tpot_p95 <= slo.tpot
    assert "GPUs" in holding[0].describe()


def test_plan_capacity_reports_shapes_over_the_gpu_limit_without_simulating_them():
    slo = capacity.SLO("chat", ttft=1.0, tpot=0.05)
    plans = F.plan_capacity(
        "Llama-3-8B",
        lambda rate: workload.poisson(rate, 30, 200, 20, seed=0),
        50.0,
        slo,
        {"H100-SXM": 3.0},
        tp_sizes=(1,),
        rate_bracket=(0.5, 8.0),  # at most 8 req/s per replica: 50 req/s needs 7 replicas
        max_gpus=2,
    )
    assert len(plans) == 1 and not plans[0].holds and plans[0].replicas > 2
    assert "needs more than max_gpus=2" in plans[0].note


def test_plan_capacity_skips_shapes_that_do_not_fit():
    slo = capacity.SLO("chat", ttft=2.0, tpot=0.1)
    plans = F.plan_capacity(
        "Llama-2-70B",
        lambda rate: workload.poisson(rate, 20, 200, 20, seed=0),
        1.0,
        slo,
        {"H100-SXM": 3.0},
        tp_sizes=(1, 2),
        rate_bracket=(0.25, 16.0),
    )
    assert [p.tp for p in plans] == [2]  # one H100 cannot hold 70B in bf16


# --- course simulate --replicas ---------------------------------------------------------------------------


def test_cli_runs_a_fleet(capsys):
    args = ["simulate", "--requests", "40", "--rate", "8", "--replicas", "2", "--router", "least-outstanding"]
    assert main([*args, "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]) == 0
    out = capsys.readouterr().out
    assert "least-outstanding router over 2 replicas" in out and "fleet goodput" in out
    assert main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["replicas"] == 2 and sum(data["requests_per_replica"]) == 40 and data["completed"] == 40
    assert len(data["per_replica"]) == 2


def test_cli_fleet_of_70b_replicas(capsys):
    args = ["simulate", "--model", "Llama-2-70B", "--tp", "4", "--replicas", "3", "--requests", "30", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["requests_per_replica"] == [10, 10, 10] and "TP 4" in data["config"]["cost"]


def test_fleet_requests_arrive_in_order_per_replica():
    w = F.conversations(2.0, 10, 3, 50, 10, seed=1)
    fleet = F.simulate_fleet(w, 2, SimConfig(num_blocks=2000), ONE_SECOND_PER_STEP, "least-outstanding")
    for run in fleet.runs:
        arrivals = [r.arrival_time for r in run.requests]
        assert arrivals == sorted(arrivals)
    assert np.bincount(fleet.assignment, minlength=2).sum() == len(w)


def test_cli_capacity_search(capsys):
    args = ["simulate", "--model", "Llama-3-8B", "--requests", "40", "--prompt-tokens", "300", "--output-tokens", "40"]
    plan = ["--plan-rate", "6", "--plan-gpus", "H100-SXM=3,L4=0.8", "--plan-tp", "1,2"]
    assert main([*args, *plan, "--slo-ttft-ms", "1000", "--slo-tpot-ms", "60", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)
    assert {(p["gpu"], p["tp"]) for p in plans} == {("H100-SXM", 1), ("H100-SXM", 2), ("L4", 1), ("L4", 2)}
    holding = [p for p in plans if p["holds"]]
    assert holding and [p["dollars_per_hour"] for p in holding] == sorted(p["dollars_per_hour"] for p in holding)
    assert main([*args, *plan]) == 2  # the search needs the SLOs
    assert "give --slo-ttft-ms and --slo-tpot-ms" in capsys.readouterr().err
    assert main([*args, *plan[:2], "--plan-tp", "1,x", "--slo-ttft-ms", "1", "--slo-tpot-ms", "1"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_a_fleet_stopped_by_the_gpu_limit_reports_the_last_fleet_it_simulated():
    class NeverHolds:  # an SLO no fleet holds, so the search adds replicas until the limit stops it
        def check(self, traces):
            return SimpleNamespace(holds=False, ttft=9.0, tpot=9.0)

    search = F._ShapeSearch(lambda rate: at(0.0, 0.1), 1.0, NeverHolds(), "round-robin", 0.0, (0.5, 8.0), 0.1,
                            max_extra_replicas=2, max_gpus=3)  # fmt: skip
    n, extra, check = search.fleet(2, 1, SimConfig(max_num_seqs=4, num_blocks=64), ONE_SECOND_PER_STEP)
    assert (n, extra) == (3, 1) and not check.holds  # 4 replicas would need 4 GPUs: not simulated, not reported
