"""The engine's token-budget rule, tested without a model, and read beside the simulator's model of it.

``course/sim/steps.py``'s ``continuous_step`` (vLLM V1's scheduler, chunked prefill on) is the rule
:func:`~course.serving.scheduler.split_budget` follows: running requests take one token each, partly
prefilled prompts go on, and waiting prompts are admitted and cut to what is left of the budget.
Driven with the same arrivals, the engine's scheduler and the simulator's step must give every
request the same number of tokens at the same iterations.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from course.serving.request import ABORTED, EngineRequest
from course.serving.sampler import SamplingParams
from course.serving.scheduler import Scheduler, split_budget
from course.sim.blocks import BlockManager
from course.sim.harness import SimRequest
from course.sim.steps import continuous_step


def _request(i: int, prompt: int) -> EngineRequest:
    return EngineRequest(f"r{i}", [1] * prompt, SamplingParams(max_tokens=1))


def _ids(chunks) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in chunks]


def test_the_budget_goes_to_decodes_then_partial_prompts_then_new_ones():
    waiting = deque(_request(i, n) for i, n in enumerate([30, 30, 10, 5]))
    assert _ids(split_budget(waiting, [], 0, 8, 64)) == [("r0", 30), ("r1", 30), ("r2", 4)]  # r2 cut to fit
    assert [r.request_id for r in waiting] == ["r3"]
    # Seven decodes leave 57 tokens; one free row admits one request.
    assert _ids(split_budget(waiting, [], 7, 8, 64)) == [("r3", 5)]
    full = deque([_request(9, 5)])
    assert split_budget(full, [], 8, 8, 64) == [] and len(full) == 1  # a full batch admits nothing
    # A prompt longer than the budget starts with a chunk and goes on, oldest first, before new ones.
    long, short = _request(10, 500), _request(11, 3)
    waiting = deque([long, short])
    assert _ids(split_budget(waiting, [], 2, 8, 64)) == [("r10", 62)]
    long.num_computed_tokens = 62
    assert _ids(split_budget(waiting, [long], 2, 8, 64)) == [("r10", 62)]
    long.num_computed_tokens = 480
    assert _ids(split_budget(waiting, [long], 2, 8, 64)) == [("r10", 20), ("r11", 3)]
    assert split_budget(deque([_request(12, 5)]), [], 64, 128, 64) == []  # decodes used the whole budget


def test_an_aborted_partial_prompt_gets_no_chunk():
    scheduler = Scheduler(max_batch_size=4, token_budget=16)
    long = _request(0, 100)
    long.num_computed_tokens = 16
    scheduler.requests[long.request_id] = long
    scheduler.add(_request(1, 4))
    scheduler.abort(["r0"], ABORTED, step=0)
    plan = scheduler.schedule(1, [long], block=False)
    assert plan.aborts == {"r0": ABORTED} and _ids(plan.chunks) == [("r1", 4)]


@pytest.mark.parametrize("seed", range(6))
def test_engine_budget_split_matches_the_simulators_continuous_step(seed):
    rng = random.Random(seed)
    max_batch, budget, iterations = rng.choice([(6, 64), (4, 16), (8, 8)]) + (60,)
    arrivals = [[rng.randint(1, 3 * budget) for _ in range(rng.choice([0, 0, 1, 2, 5]))] for _ in range(iterations)]
    lifetimes = {}  # request index -> output tokens, the same on both sides

    # The engine side: its Scheduler, no model. A request's prefill ends with its first token, and
    # it decodes in the same iteration (one token per iteration) until it has its output: one
    # iteration ahead of vLLM, which decodes it from the next step on. So an engine request of L
    # output tokens holds its row as long as a simulated one of L - 1.
    scheduler = Scheduler(max_batch, budget)
    decoding: dict[str, int] = {}  # request id -> output tokens still to come
    prefilling: list[EngineRequest] = []
    engine_steps = []
    chunked = set()  # requests whose prompt took more than one iteration
    index = 0
    for prompts in arrivals:
        for prompt in prompts:
            lifetimes[index] = rng.randint(1, 12)
            scheduler.add(_request(index, prompt))
            index += 1
        chunked.update(r.request_id for r in prefilling)
        plan = scheduler.schedule(len(decoding), prefilling, block=False)
        engine_steps.append(sorted([(rid, 1) for rid in decoding] + _ids(plan.chunks)))
        for request, n in plan.chunks:  # the prefill: the engine moves num_computed_tokens on
            if request.num_computed_tokens == 0:
                prefilling.append(request)
            request.num_computed_tokens += n
            if request.prompt_tokens_left == 0:
                prefilling.remove(request)
                if lifetimes[int(request.request_id[1:])] > 1:  # its first token came with the prefill
                    decoding[request.request_id] = lifetimes[int(request.request_id[1:])] - 1
        for rid in list(decoding):  # the decode step, joined rows included
            decoding[rid] -= 1
            if decoding[rid] == 0:
                del decoding[rid]

    # The simulator side: continuous_step with blocks enough for everything.
    blocks = BlockManager(num_blocks=100_000, block_size=16)
    running: list[SimRequest] = []
    waiting: deque = deque()
    sim_steps = []
    index = 0
    for prompts in arrivals:
        for prompt in prompts:
            waiting.append(SimRequest(f"r{index}", 0.0, prompt, max(lifetimes[index] - 1, 1)))
            index += 1
        scheduled = continuous_step(running, waiting, blocks, budget, max_batch)
        sim_steps.append(sorted((r.request_id, n) for r, n in scheduled))
        for request, n in scheduled:
            request.computed += n
            if request.computed >= request.num_tokens:
                request.generated += 1
        for request in [r for r in running if r.finished]:
            running.remove(request)
            blocks.free(request.request_id)

    assert sum(1 for step in engine_steps for _, n in step if n > 1) > 10, "the workload should prefill prompts"
    assert len(chunked) > 3, "some prompts should be prefilled in chunks"
    assert engine_steps == sim_steps
