"""course.rules: each scheduling rule on its own, and the proof that it has one home: a rule changed
in course.rules changes the readable reference and the fast engine alike (they still agree with
each other, and no longer with the unchanged rule), and module 2's engine with them."""

from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import reference

from course import rules
from course.sim import BlockManager, LinearCost, SimConfig, simulate
from course.sim.results import StepLogBuilder, request_table, token_runs
from course.workload import RequestSpec, Workload

COST = LinearCost(a=0.01, b=0.001, c=0.002, d=1e-5)


def test_the_rules_live_on_the_ground_floor_and_keep_their_old_name():
    import subprocess
    import sys

    # importing the rules loads no simulator, nor does module 2's engine, which follows them
    for module in ("course.rules", "course.serving.engine"):
        code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.startswith('course.')))"
        loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert "course.sim" not in loaded and "course.rules" in loaded, (module, loaded)
    # course.sim.rules is the same module (module 3's tests watch it to keep answers off the rules)
    from course.sim import rules as old_name

    assert old_name is rules and old_name.__file__ == rules.__file__


def test_chunk_size_takes_what_is_left_capped_and_clipped_to_the_budget():
    assert rules.chunk_size(1, 100) == 1  # a decode
    assert rules.chunk_size(300, 100) == 100  # a prompt cut to the budget left
    assert rules.chunk_size(300, 100, cap=48) == 48  # the long-prefill cap binds first
    assert rules.chunk_size(30, 100, cap=48) == 30
    assert rules.chunk_size(300, 100, chunked=False) == 0, "without chunked prefill it must fit whole"
    assert rules.chunk_size(60, 100, chunked=False) == 60


def test_admission_goes_on_while_someone_waits_budget_is_left_and_a_row_is_free():
    assert rules.admits_more(deque([1]), 1, 7, 8)
    assert not rules.admits_more(deque(), 100, 0, 8), "nobody waits"
    assert not rules.admits_more([1], 0, 0, 8), "no budget left"
    assert not rules.admits_more([1], 100, 8, 8), "max_num_seqs reached"


def test_attention_pairs_count_each_new_token_against_the_cache_and_itself():
    assert rules.attention_pairs(4, 0) == 4 + 3 + 2 + 1  # a 4-token prompt: a causal triangle
    assert rules.attention_pairs(1, 9) == 10  # a decode at context 9
    assert rules.attention_pairs(3, 5) == 3 * 5 + 6  # a chunk after 5 cached tokens
    work = [(SimpleNamespace(computed=5, generated=0, num_tokens=8), 3)]
    decode = [(SimpleNamespace(computed=9, generated=2, num_tokens=10), 1)]
    assert rules.step_load(work + decode) == (3, 1, 14, 21 + 10)
    assert rules.step_load(decode, joined=True) == (1, 0, 9, 10), "a request joining from the queue is a prefill"


def test_the_victim_is_the_newest_request_of_running_and_finishing():
    order = {"a": 1, "b": 2, "c": 3, "f": 4}.get
    running = ["a", "b", "c"]
    assert rules.pop_victim(running) == "c" and running == ["a", "b"]
    finishing = ["f"]
    assert rules.pop_victim(running, finishing, order) == "f" and finishing == [] and running == ["a", "b"]
    assert rules.pop_victim(running, ["a0"], {"a0": 0, "a": 1, "b": 2}.get) == "b"
    blocks = BlockManager(4, 2)
    victim = SimpleNamespace(request_id="v", computed=5)
    blocks.allocate("v", 5)
    waiting = deque(["w"])
    rules.preempt(victim, waiting, blocks)
    assert victim.computed == 0 and waiting[0] is victim and blocks.num_free_blocks == 4, "recompute"


def test_v0_keeps_the_watermark_free_and_module_2s_loop_decodes_after_a_prefill():
    blocks = BlockManager(10, 1)
    assert rules.v0_can_admit(blocks, 8, [], 2) and not rules.v0_can_admit(blocks, 9, [], 2)
    assert rules.decode_only(True, ["running"]) and not rules.decode_only(True, [])
    assert not rules.decode_only(False, ["running"])


def test_a_static_batch_forms_from_what_arrived_and_what_its_kv_can_hold():
    specs = [RequestSpec(str(i), 0.1 * i, 4 + i, 2) for i in range(5)]
    assert rules.static_batch(specs, 0, 0.25, 8, None, 16) == (3, 6, 2), "three have arrived at 0.25 s"
    assert rules.static_batch(specs, 0, 1.0, 2, None, 16) == (2, 5, 2), "batch size 2"
    # 2 blocks of 4 tokens: the first request alone needs cdiv(4 + 2, 4) = 2 blocks; two would need 4
    assert rules.static_batch(specs, 0, 1.0, 8, 2, 4) == (1, 4, 2)
    assert rules.static_batch(specs, 4, 1.0, 8, 1, 4) == (5, 8, 2), "the first request always joins"
    loads = list(rules.static_batch_loads(2, 6, 3))
    assert loads == [(12, 0, 0, 42), (0, 2, 12, 14), (0, 2, 14, 16)], "a 2 x 6 prefill, then 2 decode steps"


def test_the_builders_make_the_records_both_simulators_return():
    assert token_runs([3, 4, 5, 9, 11, 12]) == [3, 5, 9, 9, 11, 12] and token_runs([]) == []
    log = StepLogBuilder()
    for k in range(4):
        log.add(float(k), k + 1.0, 8 if k == 0 else 0, 0 if k == 0 else 2, 2 * k, 3 * k, 2, 5, 0)
    steps = log.freeze()
    assert len(steps) == 4 and steps.end.tolist() == [1.0, 2.0, 3.0, 4.0] and steps.attention_pairs.dtype == float
    built = request_table(
        [
            ("a", 0.0, 4, 3, token_runs([0, 1, 3]), [0, 3], [2], 4, 8, None),
            ("b", 0.5, 9, 2, [], [], [], 0, 0, "rejected"),
        ]
    )
    a, b = built.record(0, steps), built.record(1, steps)
    assert a.token_times.tolist() == [1.0, 2.0, 4.0] and a.scheduled == [0.0, 3.0] and a.preempted == [2.0]
    assert (a.prefix_hit_tokens, a.queried_tokens, a.error) == (4, 8, None)
    assert len(b.token_times) == 0 and b.error == "rejected" and built.errors == {1: "rejected"}
    assert len(request_table([])) == 0 and request_table([]).run_offsets.tolist() == [0]


# --- one home: a changed rule changes both simulators ---------------------------------------------


def _work(seed: int, n: int = 40, shared: int = 0) -> Workload:
    """``n`` requests arriving within 0.4 s; ``shared``: tokens of a system prompt they all start with."""
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        own = rng.randint(1, 120)
        segments = ((("system", shared),) if shared else ()) + ((f"own {i}", own),)
        specs.append(RequestSpec(str(i), 0.01 * i * rng.random(), shared + own, rng.randint(1, 40), segments))
    return Workload(specs)


def _runs(work: Workload, config: SimConfig) -> tuple[list, list]:
    """(the fast engine's token times, the reference's) per request."""
    fast = simulate(work, config, COST)
    slow, _ = reference(work, config, COST)
    return [t.chunk_times for t in fast.traces], [t.chunk_times for t in slow]


_original = {name: getattr(rules, name) for name in dir(rules) if not name.startswith("_")}

# (rule, a plausible wrong version of it, a configuration in which it matters)
MUTANTS = {
    "can_admit: vLLM 0.11's first-chunk reservation": (
        "can_admit",
        lambda blocks, whole, first, hits=(), **kw: _original["can_admit"](
            blocks, whole, first, hits, **{**kw, "reserve_full_isl": False}
        ),
        SimConfig(num_blocks=30, block_size=4, max_num_batched_tokens=64, max_num_seqs=8),
    ),
    "admits_more: one row fewer": (
        "admits_more",
        lambda waiting, budget, rows, max_num_seqs: _original["admits_more"](waiting, budget, rows + 1, max_num_seqs),
        SimConfig(num_blocks=400, block_size=4, max_num_batched_tokens=256, max_num_seqs=4),
    ),
    "chunk_size at admission: no chunked prefill": (
        "chunk_size",
        lambda remaining, budget, cap=0, chunked=True: _original["chunk_size"](remaining, budget, cap, False),
        SimConfig(num_blocks=400, block_size=4, max_num_batched_tokens=130, max_num_seqs=8),
    ),
    "long_prefill_threshold: never adaptive": (
        "long_prefill_threshold",
        lambda threshold, budget, requests, adaptive=False: _original["long_prefill_threshold"](
            threshold, budget, requests
        ),
        SimConfig(
            num_blocks=400,
            max_num_batched_tokens=1024,
            long_prefill_token_threshold=16,
            long_prefill_token_threshold_adaptive=True,
        ),
    ),
    "v0_can_admit: no watermark": (
        "v0_can_admit",
        lambda blocks, tokens, hits, watermark_blocks: _original["v0_can_admit"](blocks, tokens, hits, 0),
        SimConfig(scheduler="prefill-first", num_blocks=60, block_size=4, watermark=0.2),
    ),
    "decode_only: V0's loop instead of module 2's": (
        "decode_only",
        lambda last_step_admitted, running: False,
        SimConfig(scheduler="prefill-first", num_blocks=400, decode_after_prefill=True),
    ),
    "static_batch: no KV limit": (
        "static_batch",
        lambda specs, start, now, size, num_blocks, block_size: _original["static_batch"](
            specs, start, now, size, None, block_size
        ),
        SimConfig(scheduler="static", num_blocks=60, block_size=4, max_num_seqs=8),
    ),
    "static_batch_loads: decodes read no KV": (
        "static_batch_loads",
        lambda size, prompt, output: (
            (p, d, 0, a) for p, d, _, a in _original["static_batch_loads"](size, prompt, output)
        ),
        SimConfig(scheduler="static", num_blocks=10_000, max_num_seqs=8),
    ),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_rule_changed_in_its_one_home_changes_both_simulators(mutant, monkeypatch):
    name, wrong, config = MUTANTS[mutant]
    work = _work(3)
    right_fast, right_slow = _runs(work, config)
    assert right_fast == right_slow
    monkeypatch.setattr(rules, name, wrong)
    wrong_fast, wrong_slow = _runs(work, config)
    assert wrong_fast != right_fast, f"{mutant}: the workload should exercise the rule"
    assert wrong_fast == wrong_slow, f"{mutant}: the fast engine and the reference must follow the same rule"


def test_the_serving_engine_follows_the_same_chunk_and_admission_rules(monkeypatch):
    from course.serving.request import EngineRequest
    from course.serving.sampler import SamplingParams
    from course.serving.scheduler import split_budget

    def waiting():
        return deque(EngineRequest(f"r{i}", [1] * n, SamplingParams(max_tokens=1)) for i, n in enumerate([30, 30, 9]))

    assert [n for _, n in split_budget(waiting(), [], 2, 8, 64)] == [30, 30, 2]
    admits_more = rules.admits_more
    monkeypatch.setattr(
        rules, "admits_more", lambda queue, budget, rows, most: admits_more(queue, budget, rows + 4, most)
    )
    monkeypatch.setattr(rules, "chunk_size", lambda remaining, budget, cap=0, chunked=True: min(remaining, budget, 8))
    assert [n for _, n in split_budget(waiting(), [], 2, 8, 64)] == [8, 8], "the engine calls the simulator's rules"


def test_step_logs_and_records_of_both_simulators_are_equal_column_by_column():
    config = SimConfig(
        num_blocks=60, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, enable_prefix_caching=True
    )
    work = _work(5, shared=24)
    fast = simulate(work, config, COST)
    _, run = reference(work, config, COST)
    slow = run.result("reference", config.num_blocks, config.block_size)
    for column in ("start", "end", "prefill_tokens", "decode_tokens", "kv_tokens_read", "attention_pairs"):
        assert np.array_equal(getattr(fast.steps, column), getattr(slow.steps, column)), column
    assert fast.preemptions == slow.preemptions > 0
    assert fast.prefix_hit_rate == slow.prefix_hit_rate > 0, "both count the tokens looked up in the prefix cache"
