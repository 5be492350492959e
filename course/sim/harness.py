"""A small, readable simulation loop that any step function can drive.

Module 3's learners write the scheduling decision of one engine step; this harness does the rest:
requests arrive, the step function picks who computes how many tokens, the cost model says how long
the step took, and every request whose KV cache caught up with its tokens emits one output token at
the end of the step. It keeps one Python object per request and one float per emitted token, which
is fine for hundreds of requests; :func:`course.sim.simulate` runs the same policies with counters
instead and handles a hundred thousand (the tests check that both agree exactly).

The request record follows vLLM V1 (``vllm/v1/request.py``): a request has ``num_tokens`` =
prompt + generated tokens and ``computed`` tokens whose KV is in the cache. Each step the scheduler
gives it ``n`` new tokens to compute; when ``computed`` reaches ``num_tokens`` the step also
samples one new output token. A prefill is just a request with many uncomputed tokens; a request
preempted by recompute keeps its generated tokens, gets ``computed = 0`` and prefills them again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from course.limits import rejection
from course.sim import rules
from course.sim.results import RequestRecord, SimResult, StepLog
from course.trace import RequestTrace
from course.workload import RequestSpec, Workload


@dataclass(eq=False)
class SimRequest:
    """One request inside a simulation (compared by identity, so ``victim is request`` works).

    Attributes:
        request_id, arrival_time (s), prompt_tokens, output_tokens: from the workload.
        computed: tokens whose KV is in the cache.
        generated: output tokens produced so far.
        preemptions: how often it was preempted.
        token_times: when each output token was produced (s, simulated clock).
        block_hashes: chained hashes of its full prompt blocks (prefix caching only).
    """

    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    computed: int = 0
    generated: int = 0
    preemptions: int = 0
    token_times: list[float] = field(default_factory=list)
    block_hashes: list = field(default_factory=list)
    prefix_hit_tokens: int = 0
    error: str | None = None
    scheduled_times: list[float] = field(default_factory=list)  # admissions to the batch (s)
    preempted_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next output token."""
        return self.num_tokens - self.computed

    @property
    def finished(self) -> bool:
        return self.generated >= self.output_tokens

    @classmethod
    def from_spec(cls, spec: RequestSpec) -> SimRequest:
        return cls(spec.request_id, spec.arrival_time, spec.prompt_tokens, spec.output_tokens)

    def trace(self) -> RequestTrace:
        """What a streaming client would have recorded: one chunk per token."""
        error = self.error or (None if self.finished else "not finished")
        return RequestTrace.from_token_times(
            self.request_id, self.arrival_time, self.token_times, self.prompt_tokens, error=error
        )


# The step functions that the harness drives: (running, waiting, blocks) -> [(request, tokens)].
StepFunction = Callable[[list, deque, object], list]


@dataclass
class HarnessRun:
    """What :func:`run` returns: the requests (with their token times), traces and the step log."""

    requests: list[SimRequest]
    step_starts: list[float]
    step_ends: list[float]
    step_loads: list[tuple[int, int, int, int]]  # (prefill, decode, kv read, attention pairs)
    used_blocks: list[int]
    rejected: list[str]
    step_seqs: list[int] = field(default_factory=list)
    step_waiting: list[int] = field(default_factory=list)

    @property
    def traces(self) -> list[RequestTrace]:
        return [request.trace() for request in self.requests]

    @property
    def preemptions(self) -> int:
        return sum(request.preemptions for request in self.requests)

    def result(self, name: str, num_blocks: int, block_size: int) -> SimResult:
        """The run as a :class:`course.sim.SimResult`, for its summary, goodput and plots."""
        import numpy as np

        loads = np.array(self.step_loads, dtype=float).reshape(-1, 4)
        steps = StepLog.from_columns(
            self.step_starts,
            self.step_ends,
            *loads.T,  # prefill, decode, KV read, attention pairs
            self.step_seqs,
            self.used_blocks,
            self.step_waiting,
        )
        records = [
            RequestRecord(
                request_id=r.request_id,
                arrival_time=r.arrival_time,
                prompt_tokens=r.prompt_tokens,
                output_tokens=r.output_tokens,
                token_times=np.array(r.token_times, dtype=float),
                scheduled=list(r.scheduled_times),
                preempted=list(r.preempted_times),
                prefix_hit_tokens=r.prefix_hit_tokens,
                error=r.error,
            )
            for r in self.requests
        ]
        return SimResult(name, records, steps, num_blocks, block_size)


def step_load(scheduled: Iterable[tuple[SimRequest, int]], *, joined: bool = False) -> tuple[int, int, int, int]:
    """(prefill tokens, decode tokens, KV tokens read, attention pairs) of a step, before it runs.

    A scheduled request computes ``n`` tokens after ``c`` cached ones. It is a decode when it was
    already in the batch, already generated a token and only its newest token is left (``n == 1``,
    ``c == num_tokens - 1``); everything else (prompts, chunks, recomputation) is prefill work.
    ``joined=True`` says the requests joined the batch from the waiting queue in this step: they are
    all prefills, however few tokens the prefix cache left them to compute. vLLM V0 schedules them
    in ``_schedule_prefills`` as prompts ("treats PREEMPTED_FOR_RECOMPUTE as a new prefill") and
    then schedules no decode in that step; a preempted request whose prompt is cached up to its one
    generated token computes 1 token, and that is still a prefill.
    """
    prefill = decode = kv_read = pairs = 0
    for request, n in scheduled:
        c = request.computed
        if n == 1 and not joined and request.generated and c == request.num_tokens - 1:
            decode += 1
        else:
            prefill += n
        kv_read += c
        pairs += n * c + n * (n + 1) // 2
    return prefill, decode, kv_read, pairs


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
        cost: any object with ``step_seconds(prefill_tokens, decode_tokens, kv_tokens_read, attention_pairs)``.
        block_hashes: prompt block hashes per request, for prefix caching.
        max_model_len: the longest prompt + output a request may have (None: no limit).
        watermark_blocks: blocks the step keeps free when admitting (V0's watermark), so that a
            request it could never admit is rejected instead of waiting forever.
        max_num_queued_reqs: shed a request that arrives while this many are unfinished (HTTP 503 in
            vLLM, :func:`course.sim.rules.queue_full`); None: no limit.
        async_scheduling: vLLM's async scheduling (``AsyncScheduler``, the engine core's batch queue of 2):
            step k+1 is scheduled before step k's output is processed, so a request that produced its
            last token in step k stays in ``running``, holding its blocks and its ``max_num_seqs`` slot,
            while step k+1 is scheduled, and is freed right after (:mod:`course.sim.rules`). The step
            function must skip such requests (``request.finished``) as :func:`course.sim.steps.
            continuous_step` does. A scheduling pass that gives nobody tokens while such requests wait
            to be freed takes no time and logs no step. False (default): freed at the end of the step.
        max_steps: stop with an error after this many steps (a step function that never finishes).

    Requests that could never run (prompt + output tokens need more blocks than the whole KV cache
    has or than admission may use, or exceed ``max_model_len``) are rejected on arrival
    (:func:`course.limits.rejection`) and listed in ``rejected``.
    """
    specs = sorted(workload, key=lambda spec: spec.arrival_time)
    requests = [SimRequest.from_spec(spec) for spec in specs]
    if block_hashes is not None:
        for request, spec in zip(requests, specs):
            request.block_hashes = block_hashes(spec)
    result = HarnessRun(requests, [], [], [], [], [])
    waiting: deque[SimRequest] = deque()
    running: list[SimRequest] = []
    now, next_arrival = 0.0, 0
    finishing: list[SimRequest] = []  # async scheduling: finished in the last step, not yet freed
    for _ in range(max_steps):
        while next_arrival < len(requests) and requests[next_arrival].arrival_time <= now:
            request = requests[next_arrival]
            next_arrival += 1
            request.error = rejection(
                request.prompt_tokens,
                request.output_tokens,
                blocks.num_blocks,
                blocks.block_size,
                max_model_len,
                watermark_blocks,
            )
            if not request.error and rules.queue_full(len(running) + len(waiting), max_num_queued_reqs):
                request.error = rules.QUEUE_FULL
            if request.error:
                result.rejected.append(request.request_id)
            else:
                waiting.append(request)
        if not running and not waiting:
            if next_arrival == len(requests):
                return result
            now = max(now, requests[next_arrival].arrival_time)
            continue
        in_batch = {id(request): (request, request.preemptions) for request in running}
        queued = len(waiting)
        scheduled = step(running, waiting, blocks)
        for request, preemptions in in_batch.values():
            if request.preemptions > preemptions:
                request.preempted_times.append(now)
        for request, _ in scheduled:
            if id(request) not in in_batch:
                request.scheduled_times.append(now)
        if async_scheduling and finishing:  # the previous step's output is processed after this schedule
            retire(finishing, running, waiting, blocks)
            finishing = []
            if not scheduled:  # an empty pass: no step runs, no time passes
                continue
        if not scheduled:
            raise RuntimeError(
                f"the step scheduled nothing at t={now:.6g} s with {len(running)} running and {len(waiting)} "
                f"waiting requests and {blocks.num_free_blocks} free blocks: the simulation would never end"
            )
        # requests that joined from the queue (new, or preempted and re-admitted) are prefills
        stayed, joined = [], []
        for request, n in scheduled:
            before = in_batch.get(id(request))
            (stayed if before is not None and before[1] == request.preemptions else joined).append((request, n))
        load = tuple(a + b for a, b in zip(step_load(stayed), step_load(joined, joined=True)))
        result.step_starts.append(now)
        result.step_loads.append(load)
        result.used_blocks.append(blocks.num_blocks - blocks.num_free_blocks)
        result.step_seqs.append(len(scheduled))
        result.step_waiting.append(queued)
        now = now + cost.step_seconds(*load)
        result.step_ends.append(now)
        finished = []
        for request, n in scheduled:
            request.computed += n
            if request.computed == request.num_tokens:  # caught up: this step sampled a new token
                request.generated += 1
                request.token_times.append(now)
                if request.finished:
                    finished.append(request)
        if async_scheduling:
            finishing = finished
        else:
            retire(finished, running, waiting, blocks)
    raise RuntimeError(f"the simulation did not finish within {max_steps} steps")
