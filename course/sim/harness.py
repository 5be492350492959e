"""The readable side of the simulator: any step function plugs in here.

Module 3's learners write the scheduling decision of one engine step; the harness does the rest:
requests arrive, the step function picks who computes how many tokens, the cost model says how long
the step took, and every request whose KV cache caught up with its tokens emits one output token at
the end of the step. :class:`ReadableLedger` keeps the books (one Python object per request, one step
number per emitted token, fine for hundreds of requests); the clock is the simulator's one loop
(:mod:`course.sim.loop`), which :func:`course.sim.simulate` drives with counters instead, for a hundred
thousand (the tests check that both agree exactly). :func:`run` is the harness module 3 calls;
:meth:`ReadableLedger.from_config` and :func:`run_config` give a :class:`course.sim.SimConfig`'s scheduler
the same way. The rules both follow are :mod:`course.rules`; both record their results with the same
builders (:mod:`course.sim.results`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from course import rules
from course.sim import loop, steps
from course.sim.blocks import BlockManager, prompt_block_hashes
from course.sim.config import SimConfig
from course.sim.frontend import front_end_of
from course.sim.loop import ScheduledStep
from course.sim.request import SimRequest, StepFunction
from course.sim.results import RequestRecord, SimResult, StepLog, StepLogBuilder, request_table, token_runs
from course.trace import RequestTrace
from course.workload import RequestSpec, Workload


@dataclass
class HarnessRun:
    """What :func:`run` returns: the requests (with their token steps), the step log and the rejected ids."""

    requests: list[SimRequest]
    log: StepLogBuilder = field(default_factory=StepLogBuilder)
    rejected: list[str] = field(default_factory=list)

    @property
    def steps(self) -> StepLog:
        """The step log (a new copy at each call)."""
        return self.log.freeze()

    @property
    def traces(self) -> list[RequestTrace]:
        """Every request as a streaming client would have recorded it (one chunk per token)."""
        return [record.trace() for record in self._records(self.steps)]

    @property
    def preemptions(self) -> int:
        return sum(request.preemptions for request in self.requests)

    def result(self, name: str, num_blocks: int, block_size: int) -> SimResult:
        """The run as a :class:`course.sim.SimResult`, for its summary, goodput and plots."""
        steps = self.steps
        return SimResult(name, self._records(steps), steps, num_blocks, block_size)

    def _records(self, steps: StepLog) -> list[RequestRecord]:
        """The requests' records, built as the fast engine builds them (:func:`course.sim.results.request_table`)."""
        requests = request_table(
            (r.request_id, r.arrival_time, r.prompt_tokens, r.output_tokens, token_runs(r.token_steps),
             r.scheduled_steps, r.preempted_steps, r.prefix_hit_tokens, r.queried_tokens, r.error)
            for r in self.requests
        )  # fmt: skip
        return [requests.record(i, steps) for i in range(len(requests))]


# The step-log columns that say what a step did, and what to call them in a message.
_STEP_FIELDS = {
    "num_seqs": "requests in the batch",
    "prefill_tokens": "prompt tokens computed",
    "decode_tokens": "decode tokens",
    "used_blocks": "KV blocks in use",
    "waiting": "requests waiting",
}


def first_difference(mine: HarnessRun | SimResult, expected: SimResult, atol: float = 1e-9) -> str | None:
    """Where a run first departs from an expected one, in words; None when every step and token time agrees.

    Compares the step logs step by step (what each step computed, then when it ended), then the requests'
    token times: the message names the first step that differs, with both values, so a scheduler that goes
    wrong says where (module 3, Exercise 3.4's tests).
    """
    got, want = mine.steps, expected.steps
    for i in range(min(len(got.end), len(want.end))):
        for name, label in _STEP_FIELDS.items():
            a, b = getattr(got, name)[i], getattr(want, name)[i]
            if a != b:
                return (
                    f"step {i} (starting at t = {want.start[i]:.6f} s) differs first: {label} {a}, expected {b} "
                    f"(that step expected {want.num_seqs[i]} requests, {want.prefill_tokens[i]} prompt and "
                    f"{want.decode_tokens[i]} decode tokens)"
                )
        if abs(got.end[i] - want.end[i]) > atol:
            return f"step {i} ends at t = {got.end[i]:.6f} s, expected {want.end[i]:.6f} s (same batch, other time)"
    if len(got.end) != len(want.end):
        agree = min(len(got.end), len(want.end))
        return f"the run took {len(got.end)} steps, expected {len(want.end)} (the first {agree} agree)"
    return first_token_difference(mine.traces, expected.traces, atol)


def first_token_difference(traces: list[RequestTrace], expected: list[RequestTrace], atol: float = 1e-9) -> str | None:
    """The first token (in time) whose arrival differs between two runs of the same requests, in words; None if
    every request got the same token times (within ``atol`` seconds)."""
    if [t.request_id for t in traces] != [t.request_id for t in expected]:
        ids, want_ids = [t.request_id for t in traces], [t.request_id for t in expected]
        return f"requests {ids[:5]}... came back, expected {want_ids[:5]}... (one trace per request, in order)"
    first = None
    for got, want in zip(traces, expected):
        for k in range(max(len(got.chunk_times), len(want.chunk_times))):
            a = got.chunk_times[k] if k < len(got.chunk_times) else None
            b = want.chunk_times[k] if k < len(want.chunk_times) else None
            if a is None or b is None or abs(a - b) > atol:
                when = min(x for x in (a, b) if x is not None)
                if first is None or when < first[0]:
                    first = (when, got.request_id, k, a, b)
                break
    if first is None:
        return None
    _, rid, k, a, b = first
    shown = lambda x: "no token" if x is None else f"t = {x:.6f} s"  # noqa: E731
    return f"request {rid}'s token {k + 1} (the earliest that differs): {shown(a)}, expected {shown(b)}"


def retire(finished: list[SimRequest], running: list[SimRequest], waiting: deque, blocks) -> None:
    """Free finished requests' blocks, in the order they finished, and drop them from the batch.

    Under async scheduling a finished request may have been preempted meanwhile (its blocks are
    already free and it sits in ``waiting``): vLLM then finishes it from the waiting queue
    (``update_from_output``, ``stopped_preempted_reqs``).
    """
    for request in finished:
        if any(other is request for other in running):
            blocks.free(request.request_id)
            running.remove(request)
        else:
            waiting.remove(request)


class ReadableLedger:
    """The books of a step function's run, as the clock (:mod:`course.sim.loop`) drives them: one
    :class:`SimRequest` per request, a ``running`` list and a ``waiting`` queue the step function moves them
    between, and the block manager it allocates from.

    Args:
        workload: the requests (arrival times in seconds).
        step: ``step(running, waiting, blocks) -> [(request, num_new_tokens), ...]`` (:data:`StepFunction`).
        blocks: the block manager the step allocates from; the ledger frees finished requests.
        block_hashes: prompt block hashes per request, for prefix caching.
        async_scheduling: a request that produced its last token in step k stays in ``running`` while step
            k+1 is scheduled and is freed right after (:func:`run`).
    """

    def __init__(
        self,
        workload: Workload | Iterable[RequestSpec],
        step: StepFunction,
        blocks,
        *,
        block_hashes: Callable[[RequestSpec], list] | None = None,
        async_scheduling: bool = False,
    ) -> None:
        specs = sorted(workload, key=lambda spec: spec.arrival_time)
        self.requests = [SimRequest.from_spec(spec) for spec in specs]
        if block_hashes is not None:
            for request, spec in zip(self.requests, specs):
                request.block_hashes = block_hashes(spec)
        self.step_function, self.blocks, self.async_scheduling = step, blocks, async_scheduling
        self.running: list[SimRequest] = []
        self.waiting: deque[SimRequest] = deque()
        self.finishing: list[SimRequest] = []  # async scheduling: finished in the last step, not yet freed
        self.scheduled: list[tuple[SimRequest, int]] = []  # the step being run
        self.rejected: list[str] = []

    @classmethod
    def from_config(cls, workload: Workload | Iterable[RequestSpec], config: SimConfig, blocks=None) -> ReadableLedger:
        """``config``'s iteration-level scheduler as a readable ledger: its step function with every setting
        (:func:`course.sim.steps.step_function`), a block manager of its cache (unless ``blocks``), its prefix
        hashes when it caches prefixes, and its async scheduling."""
        if blocks is None:
            blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)

        def hashes(spec: RequestSpec) -> list:
            return prompt_block_hashes(spec.request_id, spec.prompt_tokens, config.block_size, spec.prompt_segments)

        return cls(
            workload,
            steps.step_function(config),
            blocks,
            block_hashes=hashes if config.enable_prefix_caching else None,
            async_scheduling=config.async_scheduling and config.scheduler == "continuous",
        )

    def queue(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def reject(self, request: SimRequest, error: str) -> None:
        request.error = error
        self.rejected.append(request.request_id)

    def unfinished(self) -> int:
        return len(self.running) + len(self.waiting)  # finishing requests are still in running

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def settle(self) -> None:
        pass  # finishing requests stay in running: the ledger is busy until a pass frees them

    def schedule(self, index: int, now: float) -> ScheduledStep | None:
        """Step number ``index`` as the step function schedules it; None for a pass that only freed the
        requests that finished in the last step (async scheduling: it takes no time and logs no step)."""
        blocks = self.blocks
        scheduled, load, queued = _schedule(self.step_function, self.running, self.waiting, blocks, index)
        if self.finishing:  # the previous step's output is processed after this schedule
            retire(self.finishing, self.running, self.waiting, blocks)
            self.finishing = []
            if not scheduled:
                return None
        if not scheduled:
            raise RuntimeError(
                f"the step scheduled nothing at t={now:.6g} s with {len(self.running)} running and "
                f"{len(self.waiting)} waiting requests and {blocks.num_free_blocks} free blocks: the simulation "
                "would never end"
            )
        self.scheduled = scheduled
        return (*load, len(scheduled), blocks.num_blocks - blocks.num_free_blocks, queued)

    def finish(self, index: int) -> int:
        """Step ``index`` ran: each request computed its tokens, and who finished leaves (or, under async
        scheduling, holds its blocks and slot until the next step is scheduled). Returns how many finished."""
        finished = _compute(self.scheduled, index)
        if self.async_scheduling:
            self.finishing = finished
        else:
            retire(finished, self.running, self.waiting, self.blocks)
        return len(finished)


def run(
    workload: Workload | Iterable[RequestSpec],
    step: StepFunction,
    blocks,
    cost,
    *,
    block_hashes: Callable[[RequestSpec], list] | None = None,
    max_model_len: int | None = None,
    watermark_blocks: int = 0,
    max_num_queued_reqs: int | None = None,
    async_scheduling: bool = False,
    max_steps: int = 1_000_000,
) -> HarnessRun:
    """Simulate ``workload`` with a step function, a block manager and a cost model.

    Args:
        workload: the requests (arrival times in seconds).
        step: ``step(running, waiting, blocks) -> [(request, num_new_tokens), ...]``. It may admit
            requests (move them from ``waiting`` to the end of ``running``, allocating blocks) and
            preempt them (free their blocks, set ``computed = 0``, put them at the front of
            ``waiting``), but must not change ``computed`` of the requests it schedules: the harness
            adds the tokens after the step.
        blocks: the block manager the step allocates from; the harness frees finished requests.
        cost: any object with ``step_seconds(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs)``,
            and a ``spread_draw`` when its steps scatter (:func:`course.sim.cost.spread_draw`); a
            :class:`course.sim.ServerCost` also passes each request through its front end.
        block_hashes: prompt block hashes per request, for prefix caching.
        max_model_len: the longest prompt + output a request may have (None: no limit).
        watermark_blocks: blocks the step keeps free when admitting (V0's watermark), so that a
            request it could never admit is rejected instead of waiting forever.
        max_num_queued_reqs: shed a request that arrives while this many are unfinished (HTTP 503 in
            vLLM, :func:`course.rules.queue_full`); None: no limit.
        async_scheduling: vLLM's async scheduling (``AsyncScheduler``, the engine core's batch queue of 2):
            step k+1 is scheduled before step k's output is processed, so a request that produced its
            last token in step k stays in ``running``, holding its blocks and its ``max_num_seqs`` slot,
            while step k+1 is scheduled, and is freed right after (:mod:`course.rules`). The step
            function must skip such requests (``request.finished``) as :func:`course.sim.steps.
            continuous_step` does. A scheduling pass that gives nobody tokens while such requests wait
            to be freed takes no time and logs no step. False (default): freed at the end of the step.
        max_steps: stop with an error after this many turns of the loop (a step function that never finishes).

    Requests that could never run (prompt + output tokens need more blocks than the whole KV cache
    has or than admission may use, or exceed ``max_model_len``) are rejected on arrival
    (:func:`course.limits.rejection`) and listed in ``rejected``. The loop is the simulator's one clock
    (:func:`course.sim.loop.run`); this ledger keeps the books readable.
    """
    ledger = ReadableLedger(workload, step, blocks, block_hashes=block_hashes, async_scheduling=async_scheduling)
    door = loop.Admission(blocks.num_blocks, blocks.block_size, max_model_len, watermark_blocks, max_num_queued_reqs)
    log = loop.run(ledger, cost, door, front_end_of(cost), max_steps)
    return HarnessRun(ledger.requests, log, ledger.rejected)


def run_config(workload: Workload | Iterable[RequestSpec], config: SimConfig, cost, blocks=None) -> HarnessRun:
    """``config``'s iteration-level scheduler through the readable ledger (:meth:`ReadableLedger.from_config`),
    under the same clock and door as :func:`course.sim.simulate`; ``blocks``: a block manager of its cache to
    use instead of a new one (a checked one, say)."""
    if config.scheduler == "static":
        raise ValueError("static batching has no step function: its readable version is course.sim.steps.run_static")
    ledger = ReadableLedger.from_config(workload, config, blocks)
    log = loop.run(ledger, cost, loop.Admission.from_config(config), front_end_of(cost))
    return HarnessRun(ledger.requests, log, ledger.rejected)


def _schedule(
    step: StepFunction, running: list[SimRequest], waiting: deque, blocks, index: int
) -> tuple[list[tuple[SimRequest, int]], tuple[int, int, int, int], int]:
    """Schedule step number ``index`` with the step function and note who joined and who was preempted.

    Returns (the batch, its load as :func:`course.rules.step_load` counts it, requests waiting before).
    Requests that joined from the queue (new, or preempted and re-admitted) are prefills.
    """
    in_batch = {id(request): (request, request.preemptions) for request in running}
    queued = len(waiting)
    scheduled = step(running, waiting, blocks)
    for request, preemptions in in_batch.values():
        if request.preemptions > preemptions:
            request.preempted_steps.append(index)
    stayed, joined = [], []
    for request, n in scheduled:
        before = in_batch.get(id(request))
        if before is None:
            request.scheduled_steps.append(index)
        (stayed if before is not None and before[1] == request.preemptions else joined).append((request, n))
    load = tuple(a + b for a, b in zip(rules.step_load(stayed), rules.step_load(joined, joined=True)))
    return scheduled, load, queued


def _compute(scheduled: list[tuple[SimRequest, int]], index: int) -> list[SimRequest]:
    """Step number ``index`` ran: each request computed its tokens, and one whose KV cache caught up with its
    tokens sampled a new one. Returns the requests that finished, in batch order."""
    finished = []
    for request, n in scheduled:
        request.computed += n
        if request.computed == request.num_tokens:
            request.generated += 1
            request.token_steps.append(index)
            if request.finished:
                finished.append(request)
    return finished
