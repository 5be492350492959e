"""course.sim.loop: the simulator's one clock, driven through its small ledger protocol, and the door it keeps
for both ledgers (rejection written once)."""

from __future__ import annotations

from collections import deque

import pytest
from helpers import reference

from course.sim import FrontEnd, LinearCost, ServerCost, SimConfig, harness, loop, simulate, steps
from course.workload import RequestSpec, Workload

ONE_SECOND = LinearCost(a=1.0, b=0.0, c=0.0, d=0.0)


class OneAtATime:
    """The smallest ledger: it serves the requests in arrival order, one token per step, one request at a time."""

    def __init__(self, workload: Workload) -> None:
        self.requests = [_Request(spec) for spec in workload]
        self.waiting: deque[_Request] = deque()
        self.tokens: dict[str, list[int]] = {}  # the steps that gave each request a token
        self.rejected: dict[str, str] = {}
        self.settled = 0

    def queue(self, request) -> None:
        self.waiting.append(request)

    def reject(self, request, error: str) -> None:
        self.rejected[request.request_id] = error

    def unfinished(self) -> int:
        return len(self.waiting)

    def busy(self) -> bool:
        return bool(self.waiting)

    def settle(self) -> None:
        self.settled += 1

    def schedule(self, index: int, now: float):
        head = self.waiting[0]
        return (0 if self.tokens.get(head.request_id) else head.prompt_tokens, 1, 0, 0, 1, 0, len(self.waiting) - 1)

    def finish(self, index: int) -> int:
        head = self.waiting[0]
        self.tokens.setdefault(head.request_id, []).append(index)
        if len(self.tokens[head.request_id]) == head.output_tokens:
            self.waiting.popleft()
            return 1
        return 0


class _Request:
    def __init__(self, spec: RequestSpec) -> None:
        self.request_id, self.arrival_time = spec.request_id, spec.arrival_time
        self.prompt_tokens, self.output_tokens = spec.prompt_tokens, spec.output_tokens


def test_any_ledger_runs_under_the_clock_which_jumps_over_idle_time_and_keeps_the_door():
    work = Workload([RequestSpec("a", 0.0, 8, 2), RequestSpec("b", 0.5, 8, 1), RequestSpec("c", 10.0, 8, 1),
                     RequestSpec("huge", 11.0, 4000, 1)])  # fmt: skip
    ledger = OneAtATime(work)
    log = loop.run(ledger, ONE_SECOND, loop.Admission(num_blocks=100, block_size=16)).freeze()
    assert ledger.tokens == {"a": [0, 1], "b": [2], "c": [3]}
    assert log.start.tolist() == [0.0, 1.0, 2.0, 10.0], "idle from t=3: the clock jumps to c's arrival"
    assert log.waiting.tolist() == [0, 1, 0, 0] and log.prefill_tokens.tolist() == [8, 0, 8, 8]
    assert "need 251 KV blocks of 16 tokens, more than the cache has (100)" in ledger.rejected["huge"]
    assert ledger.settled == 2, "the idle turns: after b, and after c (then nothing is left)"
    with pytest.raises(RuntimeError, match="did not finish within 2 steps"):
        loop.run(OneAtATime(work), ONE_SECOND, loop.Admission(num_blocks=100, block_size=16), max_steps=2)


def test_the_front_ends_work_and_its_share_of_the_core_apply_to_any_ledger():
    # 10 ms steps, 4 ms of front-end work: b arrives during a's first step, which loses those 4 ms of the core
    cost = ServerCost(LinearCost(a=0.010, b=0, c=0, d=0), FrontEnd(before_engine=0.004))
    ledger = OneAtATime(Workload([RequestSpec("a", 0.0, 8, 2), RequestSpec("b", 0.007, 8, 1)]))
    log = loop.run(ledger, cost, loop.Admission(num_blocks=100, block_size=16), cost.front_end).freeze()
    assert log.start.tolist() == pytest.approx([0.004, 0.018, 0.028])
    assert log.end.tolist() == pytest.approx([0.018, 0.028, 0.038]), "logged once, with the stretched end"


def test_a_finished_requests_work_after_the_engine_takes_the_core_from_the_next_step_not_from_idle_time():
    # 1 s steps, 0.25 s of work after the engine per request. a (2 tokens) finishes in step 1: step 2 (b's only
    # token) lasts 1.25 s. b finishes there too, and the engine idles until c arrives at 10 s: b's work is done
    # meanwhile, so c's step is not stretched.
    cost = ServerCost(ONE_SECOND, FrontEnd(after_engine=0.25))
    work = Workload([RequestSpec("a", 0.0, 8, 2), RequestSpec("b", 0.5, 8, 1), RequestSpec("c", 10.0, 8, 1)])
    log = loop.run(OneAtATime(work), cost, loop.Admission(num_blocks=100, block_size=16), cost.front_end).freeze()
    assert log.start.tolist() == pytest.approx([0.0, 1.0, 2.0, 10.0])
    assert log.end.tolist() == pytest.approx([1.0, 2.0, 3.25, 11.0])
    # c arrives 0.1 s after the engine fell idle: only what was left of b's work (0.15 s) goes into c's step
    close = Workload([*list(work)[:2], RequestSpec("c", 3.35, 8, 1)])
    log = loop.run(OneAtATime(close), cost, loop.Admission(num_blocks=100, block_size=16), cost.front_end).freeze()
    assert log.end.tolist()[-1] == pytest.approx(3.35 + 1.15)
    assert "250 ms of host work per request after the engine" in cost.describe()
    with pytest.raises(ValueError, match="after_engine must be >= 0"):
        FrontEnd(after_engine=-1e-3)


def test_front_end_work_left_over_from_a_step_is_done_while_the_engine_waits_for_that_request_not_charged_again():
    # 10 ms steps, 4 ms of front-end work. b arrives at 13 ms, 1 ms before a's only step ends: the step loses 1 ms
    # (ends at 15), and b's work, slowed beside the step, is done at 13 + 8 = 21 ms. The engine idles until then,
    # while the front end does the other 3 ms: b's own step is not stretched by them again.
    cost = ServerCost(LinearCost(a=0.010, b=0, c=0, d=0), FrontEnd(before_engine=0.004))
    ledger = OneAtATime(Workload([RequestSpec("a", 0.0, 8, 1), RequestSpec("b", 0.013, 8, 1)]))
    log = loop.run(ledger, cost, loop.Admission(num_blocks=100, block_size=16), cost.front_end).freeze()
    assert log.start.tolist() == pytest.approx([0.004, 0.021])
    assert log.end.tolist() == pytest.approx([0.015, 0.031])


def test_both_ledgers_count_the_requests_that_finish_so_the_work_after_the_engine_is_the_same():
    # several requests finishing in one step, under chunked prefill, async scheduling and the course's server
    cost = ServerCost(LinearCost(a=0.010, b=1e-5, c=1e-4, d=0), FrontEnd(before_engine=0.002, after_engine=0.003))
    work = Workload([RequestSpec(f"r{i}", 0.001 * i, 16 + 8 * (i % 3), 1 + i % 4) for i in range(12)])
    plain = simulate(work, SimConfig(max_num_seqs=8, num_blocks=200), cost.replace(after_engine=0.0)).traces
    for config in (SimConfig(max_num_seqs=8, num_blocks=200), SimConfig(max_num_seqs=8, num_blocks=200,
                                                                        async_scheduling=True)):  # fmt: skip
        fast = simulate(work, config, cost).traces
        assert [t.chunk_times for t in fast] == [t.chunk_times for t in reference(work, config, cost)[0]]
    assert fast[-1].chunk_times[-1] > plain[-1].chunk_times[-1], "the finishes' work slows the later steps"


def test_a_prompt_that_can_never_fit_a_step_without_chunked_prefill_is_rejected_by_both_ledgers():
    # Without chunked prefill a (re)computed prompt must fit the step's budget whole: the door rejects one that
    # never can, for the readable ledger as for the fast one (the readable harness used to wait for it forever).
    config = SimConfig(chunked_prefill=False, max_num_batched_tokens=64, num_blocks=100, block_size=16)
    work = Workload([RequestSpec("ok", 0.0, 40, 4), RequestSpec("long", 0.0, 90, 4), RequestSpec("edge", 0.0, 62, 4)])
    fast = simulate(work, config, ONE_SECOND)
    slow, run = reference(work, config, ONE_SECOND)
    for traces in (fast.traces, slow):
        errors = {t.request_id: t.error for t in traces}
        assert errors["ok"] is None and "must fit the step's budget of 64 tokens" in errors["long"]
        assert "(re)computed prompt of up to 65 tokens" in errors["edge"], "prompt + output - 1 after a preemption"
    assert [t.chunk_times for t in fast.traces] == [t.chunk_times for t in slow]
    assert run.rejected == ["long", "edge"]


def test_the_readable_ledger_from_a_config_is_the_step_function_with_every_setting():
    config = SimConfig(max_num_batched_tokens=48, max_num_seqs=3, long_prefill_token_threshold=16,
                       num_blocks=40, block_size=4, enable_prefix_caching=True, async_scheduling=True)  # fmt: skip
    work = Workload([RequestSpec(str(i), 0.01 * i, 30, 5, (("system", 16), (f"own {i}", 14))) for i in range(8)])
    ledger = harness.ReadableLedger.from_config(work, config)
    assert ledger.step_function.keywords["long_prefill_token_threshold"] == 16 and ledger.async_scheduling
    assert ledger.requests[3].block_hashes, "prefix caching: each request knows its prompt's block hashes"
    run = harness.run_config(work, config, ONE_SECOND)
    assert [t.chunk_times for t in run.traces] == [t.chunk_times for t in simulate(work, config, ONE_SECOND).traces]
    assert isinstance(steps.step_function(SimConfig(scheduler="prefill-first", decode_after_prefill=True)),
                      steps.PrefillThenDecode)  # fmt: skip
    with pytest.raises(ValueError, match="static batching has no step function"):
        harness.run_config(work, SimConfig(scheduler="static"), ONE_SECOND)
