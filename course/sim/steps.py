"""The scheduling policies, written to be read: one engine step at a time, one request at a time.

* :func:`continuous_step`: vLLM V1's scheduler (``vllm/v1/core/sched/scheduler.py``, ``schedule()``).
  One token budget per step. RUNNING requests first, in admission order, each asking for all its
  uncomputed tokens (a decode asks for 1, a partly prefilled prompt for the rest of it), clipped to
  what is left of the budget. When the KV cache has no block for one of them, the most recently
  admitted running request is preempted by recompute (its blocks are freed, ``computed`` drops to 0,
  it goes to the FRONT of the waiting queue), until the request fits or is itself the victim.
  Then, only if nothing was preempted in this step, WAITING requests are admitted in order while
  ``max_num_seqs`` and the budget allow; a request is admitted only when the blocks of its whole
  sequence are free (vLLM 0.32's ``scheduler_reserve_full_isl``; 0.11 checked the first chunk) and,
  with the optional watermark, a headroom stays free while others run (:mod:`course.rules`); the
  first that does not fit stops admission (head-of-line blocking). With chunked prefill a prompt
  larger than the remaining budget is cut to fit; without it, admission stops at a prompt that does
  not fit whole (with chunked prefill off vLLM sets the budget to ``max_model_len``, so only an
  oversized resumed request can meet this). ``long_prefill_token_threshold`` caps one request's
  tokens per step unless it is the only request. With async scheduling (vLLM's default on GPUs) a
  request that produced its last token in the previous step is still in ``running`` when this
  step is scheduled: it gets no tokens, but it holds its blocks and its slot and can be the
  preemption victim (:mod:`course.rules`; :func:`course.sim.harness.run` frees it after the step).
* :func:`prefill_first_step`: vLLM V0's default scheduler (``vllm/core/scheduler.py`` in 0.6.x,
  chunked prefill off): "it batches as many prefill requests as possible. And it schedules
  decodes." A step is all prefill or all decode, never mixed, so every new prompt stalls every
  running stream for a whole prefill: the generation stalls that Sarathi-Serve (OSDI'24) removed.
* :func:`run_static`: static batching, the FasterTransformer-style baseline of Orca (OSDI'22).
  When the engine is idle it takes up to ``batch_size`` requests that have arrived and runs them as
  one padded batch to the end: every slot prefills the longest prompt and decodes until the longest
  output is done; nobody joins until the batch is over.

These are the library's reference implementations: module 3's exercises rebuild the continuous step
and the static baseline, and :func:`course.sim.simulate` runs the same policies fast (the tests
check that both give identical traces). Each rule (how many tokens a request gets, who may join,
who is preempted, what a step costs) is a function of :mod:`course.rules` that both call.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable

from course import rules
from course.limits import rejection
from course.sim.config import SimConfig
from course.sim.cost import spread_draw, step_time
from course.sim.request import SimRequest, StepFunction
from course.trace import RequestTrace
from course.workload import RequestSpec, Workload


def preempt(request: SimRequest, waiting: deque, blocks) -> None:
    """Preemption by recompute (:func:`course.rules.preempt`), counted on the request.

    It keeps the tokens it already generated (the client has them); when it is admitted again it
    prefills prompt + generated tokens and then continues where it stopped.
    """
    rules.preempt(request, waiting, blocks)
    request.preemptions += 1


def _prefix_hits(request: SimRequest, blocks) -> list[int]:
    """Cached blocks of the request's prompt prefix; never all its tokens (the last one is recomputed)."""
    if not getattr(blocks, "enable_prefix_caching", False) or not request.block_hashes:
        return []
    return blocks.lookup(request.block_hashes, (request.num_tokens - 1) // blocks.block_size)


def _allocate(blocks, request: SimRequest, num_tokens: int, hits: list[int]) -> bool:
    # Without hits, call allocate(request_id, num_tokens) only, so any block manager with the
    # basic interface (exercise 3.2's) works with these steps.
    if hits:
        return blocks.allocate(request.request_id, num_tokens, hits)
    return blocks.allocate(request.request_id, num_tokens)


def _register(request: SimRequest, n: int, blocks) -> None:
    if getattr(blocks, "enable_prefix_caching", False):
        blocks.cache_full_blocks(request.request_id, request.block_hashes, request.computed + n)


def _admit(request: SimRequest, n: int, computed: int, running: list[SimRequest], waiting: deque, blocks) -> None:
    """Move the head of ``waiting`` to the end of ``running``: ``computed`` tokens cached, ``n`` to compute."""
    waiting.popleft()
    running.append(request)
    request.computed = computed
    request.prefix_hit_tokens += computed
    request.queried_tokens += request.num_tokens
    _register(request, n, blocks)


def schedule_running(
    running: list[SimRequest], waiting: deque, blocks, token_budget: int, long_prefill_token_threshold: int = 0
) -> tuple[list[tuple[SimRequest, int]], int, bool]:
    """The first half of a V1 step: give running requests their tokens, preempting when blocks run out.

    Returns (scheduled, budget left, whether anything was preempted).
    """
    scheduled: list[tuple[SimRequest, int]] = []
    budget, preempted = token_budget, False
    index = 0
    while index < len(running) and budget > 0:
        request = running[index]
        if request.finished:  # async scheduling: its last token is still in flight; it holds its slot
            index += 1
            continue
        n = rules.chunk_size(request.remaining, budget, long_prefill_token_threshold)
        fits = True
        while not blocks.append(request.request_id, n):
            victim = rules.pop_victim(running)  # the most recently admitted request
            preempt(victim, waiting, blocks)
            preempted = True
            if victim is request:
                fits = False
                break
        if not fits:
            break
        _register(request, n, blocks)
        scheduled.append((request, n))
        budget -= n
        index += 1
    return scheduled, budget, preempted


def continuous_step(
    running: list[SimRequest],
    waiting: deque,
    blocks,
    token_budget: int,
    max_num_seqs: int,
    *,
    chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    long_prefill_token_threshold_adaptive: bool = False,
    reserve_full_isl: bool = True,
    watermark_blocks: int = 0,
) -> list[tuple[SimRequest, int]]:
    """One step of vLLM V1's scheduler; returns ``[(request, num_new_tokens), ...]`` in batch order.

    The admission rules of vLLM 0.32 (whole-sequence reservation, the optional watermark, the
    long-prefill cap) are :mod:`course.rules`; ``reserve_full_isl=False`` is vLLM 0.11's rule
    (only the first chunk's blocks must be free).
    """
    threshold = rules.long_prefill_threshold(
        long_prefill_token_threshold, token_budget, len(running) + len(waiting), long_prefill_token_threshold_adaptive
    )
    scheduled, budget, preempted = schedule_running(running, waiting, blocks, token_budget, threshold)
    if preempted:  # V1 admits nobody in a step that had to preempt
        return scheduled
    while rules.admits_more(waiting, budget, len(running), max_num_seqs):
        request = waiting[0]
        hits = _prefix_hits(request, blocks)
        computed = len(hits) * blocks.block_size
        n = rules.chunk_size(request.num_tokens - computed, budget, threshold, chunked_prefill)
        if not n:  # without chunked prefill, a prompt that does not fit the budget whole
            break
        if not rules.can_admit(
            blocks, request.num_tokens, computed + n, hits, reserve_full_isl=reserve_full_isl,
            watermark_blocks=watermark_blocks, others_running=bool(running),
        ):  # fmt: skip
            break  # head-of-line blocking: later requests wait too
        if not _allocate(blocks, request, computed + n, hits):
            break
        _admit(request, n, computed, running, waiting, blocks)
        scheduled.append((request, n))
        budget -= n
    return scheduled


def prefill_first_step(
    running: list[SimRequest],
    waiting: deque,
    blocks,
    token_budget: int,
    max_num_seqs: int,
    *,
    watermark_blocks: int = 0,
) -> list[tuple[SimRequest, int]]:
    """One step of vLLM V0's default scheduler: prefill whole prompts if any can start, else decode.

    A waiting request is admitted only if its whole prompt fits the remaining budget and, after its
    blocks, at least ``watermark_blocks`` blocks stay free (V0's ``watermark=0.01`` of the blocks).
    """
    scheduled: list[tuple[SimRequest, int]] = []
    budget = token_budget
    while rules.admits_more(waiting, budget, len(running), max_num_seqs):
        request = waiting[0]
        hits = _prefix_hits(request, blocks)
        computed = len(hits) * blocks.block_size
        n = rules.chunk_size(request.num_tokens - computed, budget, chunked=False)  # whole prompts only
        if not n or not rules.v0_can_admit(blocks, computed + n, hits, watermark_blocks):
            break
        if not _allocate(blocks, request, computed + n, hits):
            break
        _admit(request, n, computed, running, waiting, blocks)
        scheduled.append((request, n))
        budget -= n
    if scheduled:  # "Don't schedule decodes if prefills are scheduled."
        return scheduled
    return schedule_running(running, waiting, blocks, token_budget)[0]


class PrefillThenDecode:
    """:func:`prefill_first_step` with one decode step after every prefill step.

    This is the loop of module 2's reference server (``course/serving/engine_core.py``) and of many
    simple engines: each iteration prefills the requests it admitted, then decodes every running
    request once. V0 instead starts another prefill step as long as a prompt can start.
    """

    def __init__(self, token_budget: int, max_num_seqs: int, watermark_blocks: int = 0) -> None:
        self.token_budget, self.max_num_seqs, self.watermark_blocks = token_budget, max_num_seqs, watermark_blocks
        self.prefilled = False  # was the last step a prefill step?

    def __call__(self, running: list[SimRequest], waiting: deque, blocks) -> list[tuple[SimRequest, int]]:
        if rules.decode_only(self.prefilled, running):
            self.prefilled = False
            return schedule_running(running, waiting, blocks, self.token_budget)[0]
        was_waiting = {id(request) for request in waiting}
        scheduled = prefill_first_step(
            running, waiting, blocks, self.token_budget, self.max_num_seqs, watermark_blocks=self.watermark_blocks
        )
        self.prefilled = any(id(request) in was_waiting for request, _ in scheduled)
        return scheduled


def step_function(config: SimConfig) -> StepFunction:
    """The step function of ``config``'s iteration-level scheduler, with every setting it has (the readable
    ledger's, :meth:`course.sim.harness.ReadableLedger.from_config`)."""
    limits = {"token_budget": config.token_budget, "max_num_seqs": config.max_num_seqs}
    if config.scheduler == "continuous":
        return functools.partial(
            continuous_step,
            **limits,
            chunked_prefill=config.chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=config.long_prefill_token_threshold_adaptive,
            reserve_full_isl=config.reserve_full_isl,
            watermark_blocks=config.watermark_blocks,
        )
    if config.scheduler == "prefill-first" and config.decode_after_prefill:
        return PrefillThenDecode(config.token_budget, config.max_num_seqs, config.watermark_blocks)
    if config.scheduler == "prefill-first":
        return functools.partial(prefill_first_step, **limits, watermark_blocks=config.watermark_blocks)
    raise ValueError(f"{config.scheduler!r} has no step function; static batching is run_static")


def run_static(
    workload: Workload | Iterable[RequestSpec],
    batch_size: int,
    cost,
    *,
    num_blocks: int | None = None,
    block_size: int = 16,
    max_model_len: int | None = None,
) -> list[RequestTrace]:
    """Static batching: padded batches of up to ``batch_size`` requests, each run to its end.

    When the engine is idle it takes the requests that have arrived, first come first served, up to
    ``batch_size`` (and, with ``num_blocks``, while every slot can reserve KV for the batch's longest
    prompt plus longest output). The batch prefills as a ``B x P`` rectangle (``P`` = longest
    prompt), then runs ``O - 1`` decode steps (``O`` = longest output) with all ``B`` slots; decode
    step ``k`` reads ``B x (P + k - 1)`` cached tokens. Each request streams one token at the end of
    the prefill and of each decode step until it has its ``output_tokens``; the next batch starts
    when the last step ends. If nothing has arrived, the engine waits for the next arrival.
    Requests that could never run (more KV blocks than ``num_blocks``, or longer than
    ``max_model_len``) are rejected on arrival (:func:`course.limits.rejection`).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    every = sorted(workload, key=lambda spec: spec.arrival_time)
    traces: dict[str, RequestTrace] = {}
    specs = []  # the requests that fit in the KV cache at all; the others are rejected on arrival
    for spec in every:
        error = rejection(spec.prompt_tokens, spec.output_tokens, num_blocks, block_size, max_model_len)
        if error:
            traces[spec.request_id] = RequestTrace.from_token_times(
                spec.request_id, spec.arrival_time, [], spec.prompt_tokens, error=error
            )
        else:
            specs.append(spec)
    now, index, step = 0.0, 0, 0
    draw = spread_draw(cost)  # the step-time spread, drawn by the step's index in the run (None: none)
    while index < len(specs):
        now = max(now, specs[index].arrival_time)
        end, longest_prompt, longest_output = rules.static_batch(specs, index, now, batch_size, num_blocks, block_size)
        batch, index = specs[index:end], end
        times: dict[str, list[float]] = {s.request_id: [] for s in batch}
        for k, load in enumerate(rules.static_batch_loads(len(batch), longest_prompt, longest_output)):
            now += step_time(cost.step_seconds(*load), draw, step, load[0] > 0)
            step += 1
            for s in batch:
                if s.output_tokens > k:  # step k (0: the prefill) gives the requests that want it a token
                    times[s.request_id].append(now)
        for s in batch:
            traces[s.request_id] = RequestTrace.from_token_times(
                s.request_id, s.arrival_time, times[s.request_id], s.prompt_tokens
            )
    return [traces[spec.request_id] for spec in every]
