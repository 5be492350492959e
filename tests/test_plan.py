"""The capstone's plans (course.plan): static checks, the steady-state verdict, the reference search,
and the fixture plans: several different good plans pass, the typical bad ones fail for their reason."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import replace
from pathlib import Path

import pytest

from course import capacity, plan

_spec = importlib.util.spec_from_file_location(
    "capstone_plans", Path(__file__).parent / "fixtures" / "capstone_plans.py"
)
F = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(F)

SCENARIO = plan.capstone_scenario()


# --- plans as data --------------------------------------------------------------------------------------


def test_a_plan_reads_from_a_dict_in_every_pool_form():
    base = {"gpu": "H100-SXM", "gpu_memory_utilization": 0.9, "max_num_seqs": 128, "max_output_tokens": 3000}
    by_name = plan.as_plan({**base, "pools": {"chat": 2, "reports": 1}})
    listed = plan.as_plan(
        {**base, "pools": [{"classes": ["chat"], "replicas": 2}, {"classes": ["reports"], "replicas": 1}]}
    )
    assert by_name == listed and by_name.gpus == 3
    shared = plan.as_plan({**base, "pools": {"chat+reports": 4}})
    assert shared.pools == (plan.Pool(("chat", "reports"), 4),)
    assert plan.as_plan(shared) is shared
    assert by_name.dollars_per_hour(plan.GPU_PRICES) == pytest.approx(3 * plan.GPU_PRICES["H100-SXM"])
    assert replace(by_name, tensor_parallel=2).gpus == 6


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"pools": {}}, "pools"),
        ({"pools": {"chat": 0}}, "replicas"),
        ({"pools": {"chat": 1.5}}, "replicas"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"colour": "blue"}, "unknown plan fields"),
    ],
)
def test_a_malformed_plan_is_refused_with_a_clear_error(bad, message):
    good = {"gpu": "H100-SXM", "pools": {"chat+reports": 2}}
    with pytest.raises(ValueError, match=message):
        plan.as_plan({**good, **bad})
    with pytest.raises(ValueError, match="dict"):
        plan.as_plan(["H100-SXM"])


def test_the_prices_live_in_one_place_with_their_source():
    assert SCENARIO.prices == plan.GPU_PRICES
    assert "lambda.ai" in plan.PRICE_SOURCE and "2026" in plan.PRICE_SOURCE
    assert all(gpu in plan.hardware.GPUS for gpu in plan.GPU_PRICES)


# --- the static checks ----------------------------------------------------------------------------------


def good() -> plan.Plan:
    return plan.as_plan(F.GOOD[0])


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"gpu": "T4"}, "not on the menu"),
        ({"gpu": "B300"}, "not a catalogue GPU"),
        ({"gpu_memory_utilization": 0.97}, "out-of-memory"),
        ({"gpu_memory_utilization": 0.15}, "does not start"),
        ({"max_output_tokens": 1000}, "truncates reports"),
        ({"pools": (plan.Pool(("chat",), 3),)}, "'reports' is in 0 pools"),
        ({"pools": (plan.Pool(("chat", "reports"), 3), plan.Pool(("chat",), 1))}, "'chat' is in 2 pools"),
        ({"pools": (plan.Pool(("chat", "reports", "video"), 3),)}, "unknown class 'video'"),
    ],
)
def test_static_problems_name_their_reason_and_stop_the_simulation(change, reason):
    verdict = plan.check_plan(replace(good(), **change), SCENARIO, reference=False)
    assert any(reason in p for p in verdict.problems), verdict.problems
    assert not verdict.classes and not verdict.holds_slos and not verdict.holds


def test_a_card_the_model_does_not_fit_is_refused_even_when_priced():
    """Llama-3.1-8B's 16 GB of bf16 weights on a 16 GB T4: vLLM would not start, whatever the price."""
    menu = replace(SCENARIO, gpu_prices=(*SCENARIO.gpu_prices, ("T4", 0.35)))
    found = plan.problems(replace(good(), gpu="T4", gpu_memory_utilization=0.7), menu)
    assert any("does not start on T4" in p for p in found), found


# --- the verdict ------------------------------------------------------------------------------------------


def test_the_reference_plan_holds_and_one_replica_fewer_does_not():
    ref = plan.reference_plan(SCENARIO)
    verdict = plan.check_plan(ref, SCENARIO)
    assert verdict.holds and verdict.cost_ratio == pytest.approx(1.0)
    for k, pool in enumerate(ref.pools):
        if pool.replicas > 1:
            fewer = list(ref.pools)
            fewer[k] = replace(pool, replicas=pool.replicas - 1)
            assert not plan.check_plan(replace(ref, pools=tuple(fewer)), SCENARIO, reference=False).holds_slos


def test_the_stored_reference_is_what_the_search_finds():
    """The module-5 scenario's reference plan is stored (the search takes minutes); rerun the search and
    check it still finds the same GPU, TP size and pools, and that nothing on the menu is cheaper."""
    stored = plan.reference_plan(SCENARIO)
    assert plan.fingerprint(SCENARIO) in plan.KNOWN_REFERENCES, "capstone_scenario() changed: rerun the search"
    rows = plan.reference_search(SCENARIO)
    best = plan.best_row(rows)
    assert (best.gpu, best.tensor_parallel, best.pools) == (stored.gpu, stored.tensor_parallel, stored.pools)
    assert all(r.dollars_per_hour >= best.dollars_per_hour for r in rows)
    assert any("does not start" in r.note for r in rows)  # 70B on one card of every kind, or two A100-40GB


@pytest.mark.parametrize("name", sorted(F.GOOD_BY_NAME))
def test_several_different_good_plans_pass(name):
    verdict = plan.check_plan(F.GOOD_BY_NAME[name], SCENARIO)
    assert verdict.holds, verdict.describe()


def test_the_good_plans_really_differ():
    """Three distinct plans, in at least two shapes (replica size and pools), not one plan three times."""
    plans = [plan.as_plan(p) for p in F.GOOD]
    assert len(set(plans)) == len(plans) >= 3
    assert len({(p.tensor_parallel, p.pools) for p in plans}) >= 2


@pytest.mark.parametrize("name", sorted(F.BAD))
def test_typical_bad_plans_fail_for_their_reason(name):
    proposal, reason = F.BAD[name]
    verdict = plan.check_plan(proposal, SCENARIO)
    assert not verdict.holds, verdict.describe()
    assert reason(verdict), verdict.describe()


def test_a_plan_judged_off_steady_state_looks_fine_and_is_not():
    """The undersized pool of the fixtures passes a short run from an empty engine, warm-up included, and
    fails once the warm-up is left out and the window is long: why the verdict measures at steady state."""
    proposal = F.OFF_STEADY_STATE
    short = plan.check_plan(proposal, SCENARIO, reference=False, warmup=0.0, window=F.SHORT_WINDOW)
    assert short.holds_slos, short.describe()
    assert not plan.check_plan(proposal, SCENARIO, reference=False).holds_slos


@pytest.mark.parametrize("name", ["reference", *sorted(F.GOOD_BY_NAME), *sorted(F.BAD)])
def test_the_verdict_does_not_change_with_the_run_length(name):
    """At the scenario's warm-up, a window twice as long gives the same verdict for every fixture plan
    (and, for the plans that hold, the same verdict for every class): the window is a steady state. An
    overloaded plan's queue grows without bound, so which of its classes miss may differ."""
    if name == "reference":
        proposal = plan.reference_plan(SCENARIO)
    elif name in F.GOOD_BY_NAME:
        proposal = F.GOOD_BY_NAME[name]
    else:
        proposal = F.BAD[name][0]
    normal = plan.check_plan(proposal, SCENARIO, reference=False)
    longer = plan.check_plan(proposal, SCENARIO, reference=False, window=2 * SCENARIO.window)
    assert normal.holds_slos == longer.holds_slos, (normal.describe(), longer.describe())
    if normal.holds_slos:
        assert [c.check.holds for c in normal.classes] == [c.check.holds for c in longer.classes]


def test_a_verdict_describes_every_class_and_the_cost():
    text = plan.check_plan(F.GOOD[0], SCENARIO).describe()
    assert "chat" in text and "reports" in text and "reference plan" in text and "verdict: holds" in text


def test_the_steady_window_selects_by_arrival():
    from course.trace import RequestTrace

    traces = [RequestTrace(str(i), 100.0 + i, [101.0 + i], [1], output_tokens=1) for i in range(10)]
    window = capacity.SteadyWindow(warmup=2.0, window=5.0, drain=1.0)
    assert [t.request_id for t in window.select(traces)] == ["2", "3", "4", "5", "6"]
    assert window.seconds == 8.0 and window.requests(2.0) == 16
    with pytest.raises(ValueError):
        capacity.SteadyWindow(warmup=-1.0, window=1.0)
    assert math.isnan(plan.check_plan(F.GOOD[0], SCENARIO, reference=False).cost_ratio)
