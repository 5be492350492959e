"""The capstone's plans (course.plan): static checks, the steady-state verdict, the binding constraint, the
course's cost (not its plan) in the library, and the fixture plans: several different good plans pass, the
typical bad ones fail for their reason, and the ones the notebook's visible tests pass fail the hidden ones."""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from course import capacity, plan

_spec = importlib.util.spec_from_file_location(
    "capstone_plans", Path(__file__).parent / "fixtures" / "capstone_plans.py"
)
F = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = F
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


def test_a_pool_may_give_its_own_gpu_and_settings():
    mixed = plan.as_plan(
        {
            "gpu": "H100-SXM",
            "max_num_seqs": 256,
            "pools": {"chat": 2, "reports": {"replicas": 3, "gpu": "A100-80GB", "max_num_seqs": 32}},
        }
    )
    chat, reports = mixed.resolved_pools
    assert (chat.gpu, chat.max_num_seqs) == ("H100-SXM", 256)
    assert (reports.gpu, reports.max_num_seqs, reports.replicas) == ("A100-80GB", 32, 3)
    assert mixed.gpu_names == ("H100-SXM", "A100-80GB")
    prices = plan.GPU_PRICES
    assert mixed.dollars_per_hour(prices) == pytest.approx(2 * prices["H100-SXM"] + 3 * prices["A100-80GB"])
    assert "reports: 3 x A100-80GB" in mixed.describe()


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"pools": {}}, "pools"),
        ({"pools": {"chat": 0}}, "replicas"),
        ({"pools": {"chat": 1.5}}, "replicas"),
        ({"pools": {"chat": {"gpu": "H100-SXM"}}}, "needs its replicas"),
        ({"pools": {"chat": {"replicas": 1, "colour": "red"}}}, "unknown pool settings"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization"),
        ({"colour": "blue"}, "unknown plan fields"),
        ({"gpu": None}, "name a GPU"),
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


def test_problems_can_be_asked_by_kind():
    """The notebook's visible test asks for the checks a plan must pass to be simulated at all (menu, pools,
    start); the cap and the headroom are the hidden test's."""
    truncating = replace(good(), max_output_tokens=1000, gpu_memory_utilization=0.97)
    estimate = replace(SCENARIO, release="0.32.0")  # the headroom rule is the profiling estimate's
    assert not plan.problems(truncating, estimate, kinds=("menu", "pools", "start"))
    found = {p.split()[0] for p in plan.problems(truncating, estimate)}
    assert found == {"max_output_tokens", "gpu_memory_utilization"}
    with pytest.raises(ValueError, match="unknown problem kinds"):
        plan.problems(good(), SCENARIO, kinds=("price",))


def test_the_headroom_rule_is_the_estimates_and_vllm_034_warns_instead():
    """vLLM 0.32 (and 0.34 without the extensible KV cache) sizes the cache from a profiling estimate: what it
    did not profile must fit outside its share, so 0.97 of an H100 is an out-of-memory crash waiting for peak
    load. 0.34 measures the cache after warm-up and keeps its own margin: 0.97 is allowed, and an explicit 0.9
    keeps free memory out of the cache, which vLLM warns about and the verdict repeats."""
    high = replace(good(), gpu_memory_utilization=0.97)
    estimate = replace(SCENARIO, release="0.32.0")
    assert any("out-of-memory" in p for p in plan.problems(high, estimate))
    assert not plan.problems(high, SCENARIO)
    withheld = plan.check_plan(replace(good(), gpu_memory_utilization=0.9), SCENARIO, reference=False)
    assert any("keeping" in note and "out of the KV cache" in note for note in withheld.notes), withheld.notes
    assert not plan.check_plan(good(), SCENARIO, reference=False).notes
    unset = plan.pool_budget(good().resolved_pools[0], SCENARIO)
    assert unset.extensible and unset.utilization == 1.0 and unset.block_size == 64


def test_a_card_the_model_does_not_fit_is_refused_even_when_priced():
    """Llama-3.1-8B's 16 GB of bf16 weights on a 16 GB T4: vLLM would not start, whatever the price."""
    menu = replace(SCENARIO, gpu_prices=(*SCENARIO.gpu_prices, ("T4", 0.35)))
    found = plan.problems(replace(good(), gpu="T4", gpu_memory_utilization=0.7), menu)
    assert any("does not start on T4" in p for p in found), found


def test_each_pool_is_checked_with_its_own_settings():
    mixed = plan.as_plan(
        {
            "gpu": "H100-SXM",
            "max_output_tokens": 1500,
            "pools": {"chat": {"replicas": 2, "max_output_tokens": 900}, "reports": 3},
        }
    )
    found = plan.problems(mixed, SCENARIO)
    assert found == ["max_output_tokens 900 in pool 0 (chat) truncates chat: its answers need up to 1200"]
    assert plan.max_model_len(mixed.resolved_pools[1], SCENARIO) == 14000 + 1500


# --- the course's plan: only its cost is in the library ---------------------------------------------------


def test_the_library_keeps_the_courses_cost_not_its_plan():
    assert not hasattr(plan, "reference_plan") and not hasattr(plan, "reference_search")
    assert plan.reference_cost(SCENARIO) == plan.REFERENCE_COSTS[plan.fingerprint(SCENARIO)]
    with pytest.raises(ValueError, match="reference=False"):
        plan.reference_cost(replace(SCENARIO, seed=1))


def test_the_stored_cost_is_what_the_search_finds():
    """The search (in the fixtures, not the library) finds the cheapest plan at vLLM's settings; it must still
    cost what the library keeps, hold, and fail with one replica fewer in any pool."""
    best = F.best_plan(SCENARIO)
    assert best.dollars_per_hour(SCENARIO.prices) == pytest.approx(plan.reference_cost(SCENARIO))
    rows = F.reference_search(SCENARIO)
    assert any(r.replicas is not None for r in rows)
    verdict = plan.check_plan(best, SCENARIO)
    assert verdict.holds and verdict.cost_ratio == pytest.approx(1.0)
    for k, pool in enumerate(best.pools):
        if pool.replicas > 1:
            fewer = list(best.pools)
            fewer[k] = replace(pool, replicas=pool.replicas - 1)
            assert not plan.check_plan(replace(best, pools=tuple(fewer)), SCENARIO, reference=False).holds_slos


# --- the verdict ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(F.GOOD_BY_NAME))
def test_several_different_good_plans_pass(name):
    verdict = plan.check_plan(F.GOOD_BY_NAME[name], SCENARIO)
    assert verdict.holds, verdict.describe()


def test_the_good_plans_really_differ():
    """Three distinct plans, in at least three shapes (pool split and GPUs per replica), not one plan three times."""
    plans = [plan.as_plan(p) for p in F.GOOD]
    assert len(set(plans)) == len(plans) >= 3
    shapes = {tuple((p.classes, p.tensor_parallel, p.gpu) for p in chosen.resolved_pools) for chosen in plans}
    assert len(shapes) >= 3


@pytest.mark.parametrize("name", sorted(F.BAD))
def test_typical_bad_plans_fail_for_their_reason(name):
    proposal, reason = F.BAD[name]
    verdict = plan.check_plan(proposal, SCENARIO)
    assert not verdict.holds, verdict.describe()
    assert reason(verdict), verdict.describe()


@pytest.mark.parametrize("name", sorted(F.VISIBLE_ONLY))
def test_plans_that_pass_the_visible_checks_fail_the_hidden_ones(name):
    """What the notebook's visible tests check (a plan that can be simulated; 20 s of arrivals from an empty
    engine hold) passes; the steady-state verdict with every static check rejects it."""
    proposal, reason = F.VISIBLE_ONLY[name]
    assert not plan.problems(proposal, SCENARIO, kinds=("menu", "pools", "start"))
    short = plan.check_plan(proposal, SCENARIO, reference=False, warmup=0.0, window=F.SHORT_WINDOW, static=False)
    assert short.holds_slos, short.describe()
    verdict = plan.check_plan(proposal, SCENARIO)
    assert not verdict.holds and reason(verdict), verdict.describe()


@pytest.mark.parametrize("name", [*sorted(F.GOOD_BY_NAME), *sorted(F.BAD)])
def test_the_verdict_does_not_change_with_the_run_length(name):
    """At the scenario's warm-up, a window twice as long gives the same verdict for every fixture plan
    (and, for the plans that hold, the same verdict for every class): the window is a steady state. An
    overloaded plan's queue grows without bound, so which of its classes miss may differ."""
    proposal = F.GOOD_BY_NAME[name] if name in F.GOOD_BY_NAME else F.BAD[name][0]
    normal = plan.check_plan(proposal, SCENARIO, reference=False)
    longer = plan.check_plan(proposal, SCENARIO, reference=False, window=2 * SCENARIO.window)
    assert normal.holds_slos == longer.holds_slos, (normal.describe(), longer.describe())
    if normal.holds_slos:
        assert [c.holds for c in normal.classes] == [c.holds for c in longer.classes]


def test_a_preempted_request_is_a_miss_even_when_the_latencies_hold():
    """A pool whose cache runs out at steady state is on the way to a queue that never drains: the verdict
    counts a measured request that was preempted against its class, and names the KV cache as binding."""
    verdict = plan.check_plan(F.STARVED_CACHE, SCENARIO, reference=False)
    chat = next(c for c in verdict.classes if c.name == "chat")
    assert chat.preempted > 0 and not chat.holds
    assert replace(chat, preempted=0).holds == chat.check.holds
    assert "preempted" in chat.describe()


def test_the_verdict_names_what_binds_and_by_how_much():
    holding = plan.check_plan(F.GOOD[0], SCENARIO)
    assert holding.binding.label in SCENARIO.binding_options().values() and holding.binding.ratio <= 1
    assert "to spare" in holding.binding.describe()
    assert SCENARIO.binding_options()[holding.binding_option(SCENARIO)] == holding.binding.label
    missing = plan.check_plan(F.TOO_FEW_SEQS, SCENARIO, reference=False)
    assert missing.binding.label == "chat TTFT" and missing.binding.ratio > 1
    assert "missed by" in missing.binding.describe()
    assert plan.check_plan(replace(good(), gpu="T4"), SCENARIO, reference=False).binding is None


def test_the_courses_cost_is_shown_only_to_a_plan_that_passes():
    cost = f"${plan.reference_cost(SCENARIO):.2f}"
    passing = plan.check_plan(F.GOOD[0], SCENARIO).describe()
    assert cost in passing and "verdict: holds" in passing
    for proposal in (F.UNDERSIZED, F.BAD["over the cost margin"][0]):
        text = plan.check_plan(proposal, SCENARIO).describe()
        assert cost not in text and "REJECTED" in text, text


def test_a_verdict_describes_every_class_and_pool():
    text = plan.check_plan(F.GOOD[1], SCENARIO).describe()
    assert "chat" in text and "reports" in text and "pool 1:" in text and "binding:" in text
    assert math.isnan(plan.check_plan(F.GOOD[0], SCENARIO, reference=False).cost_ratio)


def test_the_steady_window_selects_by_arrival():
    from course.trace import RequestTrace

    traces = [RequestTrace(str(i), 100.0 + i, [101.0 + i], [1], output_tokens=1) for i in range(10)]
    window = capacity.SteadyWindow(warmup=2.0, window=5.0, drain=1.0)
    assert [t.request_id for t in window.select(traces)] == ["2", "3", "4", "5", "6"]
    assert window.seconds == 8.0 and window.requests(2.0) == 16
    with pytest.raises(ValueError):
        capacity.SteadyWindow(warmup=-1.0, window=1.0)
