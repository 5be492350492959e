"""The engine's admission rule, tested without a model, and read beside the simulator's model of it.

``course/sim/steps.py``'s ``PrefillThenDecode`` claims to be this engine's loop: each iteration
prefills the requests it admitted, then decodes every running request once. Driven with the same
arrivals, the engine's :func:`~course.serving.scheduler.admit` and the simulator's policy must admit
the same requests at the same iterations.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from course.serving.request import EngineRequest
from course.serving.sampler import SamplingParams
from course.serving.scheduler import Scheduler, admit
from course.sim.blocks import BlockManager
from course.sim.harness import SimRequest
from course.sim.steps import PrefillThenDecode


def _request(i: int, prompt: int) -> EngineRequest:
    return EngineRequest(f"r{i}", [1] * prompt, SamplingParams(max_tokens=1))


def test_admission_fills_free_rows_within_the_token_budget():
    waiting = deque(_request(i, n) for i, n in enumerate([30, 30, 10, 5]))
    assert [r.request_id for r in admit(waiting, 0, 8, 64)] == ["r0", "r1"]  # r2 would pass 64 tokens
    assert [r.request_id for r in admit(waiting, 7, 8, 64)] == ["r2"]  # one free row
    assert admit(waiting, 8, 8, 64) == [] and len(waiting) == 1  # a full batch admits nothing
    # The first request is admitted even when its prompt alone is over the budget (no chunked prefill).
    big = deque([_request(9, 500), _request(10, 1)])
    assert [r.request_id for r in admit(big, 0, 8, 64)] == ["r9"]


@pytest.mark.parametrize("seed", range(5))
def test_engine_admission_matches_the_simulators_prefill_then_decode(seed):
    rng = random.Random(seed)
    max_batch, budget, iterations = 6, 64, 40
    arrivals = [[rng.randint(1, budget) for _ in range(rng.choice([0, 0, 1, 2, 5]))] for _ in range(iterations)]
    lifetimes = {}  # request index -> iterations it runs (its output length), the same on both sides

    # The engine side: its Scheduler, no model. A request leaves after `lifetime` decode steps.
    scheduler = Scheduler(max_batch, budget)
    running: dict[str, int] = {}
    engine_admitted = []
    index = 0
    for prompts in arrivals:
        for prompt in prompts:
            lifetimes[index] = rng.randint(1, 12)
            scheduler.add(_request(index, prompt))
            index += 1
        plan = scheduler.schedule(len(running), block=False)
        engine_admitted.append([r.request_id for r in plan.admitted])
        running.update({r.request_id: lifetimes[int(r.request_id[1:])] for r in plan.admitted})
        for rid in list(running):  # the decode step
            running[rid] -= 1
            if running[rid] == 0:
                del running[rid]

    # The simulator side: PrefillThenDecode with blocks enough for everything.
    policy = PrefillThenDecode(token_budget=budget, max_num_seqs=max_batch)
    blocks = BlockManager(num_blocks=100_000, block_size=16)
    sim_running: list[SimRequest] = []
    waiting: deque = deque()
    sim_admitted = []
    index = 0

    def apply(scheduled):
        for request, n in scheduled:
            request.computed += n
            if request.computed >= request.num_tokens:
                request.generated += 1
        for request in [r for r in sim_running if r.generated >= r.output_tokens]:
            sim_running.remove(request)
            blocks.free(request.request_id)

    for prompts in arrivals:
        for prompt in prompts:
            waiting.append(SimRequest(f"r{index}", 0.0, prompt, lifetimes[index] + 1))
            index += 1
        was_waiting = set(id(r) for r in waiting)
        scheduled = policy(sim_running, waiting, blocks)
        prefilled = [r.request_id for r, _ in scheduled if id(r) in was_waiting]
        apply(scheduled)
        if prefilled:  # the engine's iteration also decodes: the policy's next step
            apply(policy(sim_running, waiting, blocks))
        sim_admitted.append(prefilled)

    assert sum(map(len, engine_admitted)) > 10, "the workload should admit requests"
    assert engine_admitted == sim_admitted
