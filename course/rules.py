"""vLLM's scheduling rules, each written once, on the library's ground floor (they import nothing but
:mod:`course.units`): the simulator's step functions (:mod:`course.sim.steps`), its fast ledger
(:mod:`course.sim.simulator`) and, where it follows the same rule, module 2's engine
(:mod:`course.serving.scheduler`) all call these, and none of them has to load another's package to do so.
They decide who computes how many tokens; how long that takes is a cost model's (:mod:`course.sim.cost`) and
what the host does around it the front end's (:mod:`course.sim.frontend`).

* :func:`chunk_size`: the tokens a request computes in a step: all it has left (a decode: 1), at most
  the long-prefill cap, at most the budget left; without chunked prefill a waiting prompt that does not
  fit whole gets nothing (``Scheduler.schedule``, ``vllm/v1/core/sched/scheduler.py``).
* :func:`admits_more`: admission goes on while someone waits, budget is left and ``max_num_seqs`` has
  a free row; the first request that cannot join stops it (head-of-line blocking).
* :func:`pop_victim` and :func:`preempt`: when a running request gets no block, vLLM preempts the last
  of its running list (the most recently admitted) by recompute: its blocks are freed, it forgets its
  computed tokens and goes to the front of the waiting queue (``Scheduler.schedule``: under the FCFS policy
  ``self.running.pop()``, then ``_preempt_request``).
* :func:`attention_pairs` and :func:`step_load`: what a step costs the model (:mod:`course.sim.cost`).
* :func:`v0_can_admit`, :func:`decode_only`: vLLM V0's prefill-first admission (whole prompts, a
  free-block watermark) and module 2's loop (a decode step after every prefill step).
* :func:`static_batch`, :func:`static_batch_loads`: static batching (Orca's baseline): the batch that
  forms when the engine is idle, and its padded steps.

vLLM 0.32's admission rules for V1:

* :func:`can_admit`: a waiting request is admitted only if the blocks its *whole* sequence needs are
  free, not just those of its first chunk (``SchedulerConfig.scheduler_reserve_full_isl``, True by
  default; ``KVCacheManager.allocate_slots(full_sequence_must_fit=...)``), and, with a watermark,
  only while ``watermark x num_blocks`` blocks stay free beyond it, a headroom applied to waiting
  and preempted requests when some request is already running (``SchedulerConfig.watermark``,
  0.0 = off by default; ``KVCacheManager.watermark_blocks``).
* :func:`long_prefill_threshold`: ``long_prefill_token_threshold`` caps the tokens one request
  computes per step, except when it is the only request (nobody to starve); the adaptive variant
  never cuts below a fair share of the budget, ``max_num_batched_tokens // requests``
  (``Scheduler.schedule``, ``long_prefill_token_threshold_adaptive``).
* async scheduling (``SimConfig.async_scheduling``; on by default on GPUs, ``vllm/config/vllm.py``):
  the engine core keeps a batch queue of 2 (``EngineCore.step_with_batch_queue``,
  ``vllm/v1/engine/core.py``) and schedules step k+1 *before* it processes step k's output
  (``Scheduler.update_from_output``, which frees a finished request's blocks in ``_free_request``).
  A request that produced its last token in step k is therefore still in ``running`` when step
  k+1 is scheduled: ``AsyncScheduler`` (``vllm/v1/core/sched/async_scheduler.py``) counts the
  in-flight token in ``num_output_placeholders``, and ``Scheduler.schedule`` skips a request whose
  placeholders already reach ``max_tokens``, but it still counts toward ``max_num_seqs`` and the
  request counts of the long-prefill cap, makes the watermark apply (``bool(self.running)``), and
  holds its KV blocks until step k+1 is scheduled: a waiting request that needs its slot or blocks
  is admitted one step later than under synchronous scheduling. It can also be the preemption
  victim (the last of ``running``): its blocks are freed then, the step admits nobody (a step that
  preempts never does), and its last token still finishes it from the waiting queue. Other
  requests are scheduled as without it: a decode asks for ``num_tokens_with_spec +
  num_output_placeholders - num_computed_tokens`` = 1 token, the same blocks as synchronous.
  :func:`course.sim.harness.run` (``async_scheduling=True``) and :func:`course.sim.simulate`
  implement it; ``tests/oracle/test_scheduler.py`` drives ``AsyncScheduler`` step by step against them.
* :func:`queue_full`: load shedding in the API server: with ``max_num_queued_reqs`` a request that
  arrives while that many are unfinished is refused with HTTP 503 and counted in
  ``vllm:admission_rejections_total`` (``AsyncLLM``, ``QueueOverflowError``).

Paths are relative to the ``vllm`` package of the release :mod:`course.vllm_release` names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from course.units import cdiv

QUEUE_FULL = "rejected (HTTP 503): the queue is full (max_num_queued_reqs)"


def can_admit(
    blocks,
    whole_sequence: int,
    first_chunk: int,
    hits: Sequence[int] = (),
    *,
    reserve_full_isl: bool = True,
    watermark_blocks: int = 0,
    others_running: bool = False,
) -> bool:
    """Whether a waiting request of ``whole_sequence`` tokens (prompt + tokens generated before a
    preemption), about to compute up to ``first_chunk`` tokens (cached ones included), gets its blocks.

    ``blocks`` is a :class:`course.sim.blocks.BlockManager` (``hits``: its prefix-cache hits) or any block
    manager with ``num_free_blocks`` and ``block_size``, such as module 3's exercise 3.2.
    """
    headroom = watermark_blocks if others_running else 0
    free = blocks.num_free_blocks
    if reserve_full_isl and _to_allocate(blocks, whole_sequence, hits) + headroom > free:
        return False
    return _to_allocate(blocks, first_chunk, hits) + headroom <= free


def _to_allocate(blocks, num_tokens: int, hits: Sequence[int]) -> int:
    if hasattr(blocks, "blocks_to_allocate"):
        return blocks.blocks_to_allocate(num_tokens, hits)
    return -(-num_tokens // blocks.block_size)  # a basic manager: no prefix cache, every block is new


def long_prefill_threshold(threshold: int, token_budget: int, num_requests: int, adaptive: bool = False) -> int:
    """The per-request token cap of this step (0 = none); ``num_requests`` running + waiting at its start."""
    if threshold <= 0 or num_requests <= 1:
        return 0
    if adaptive:
        return max(threshold, token_budget // num_requests)
    return threshold


def queue_full(unfinished: int, max_num_queued_reqs: int | None) -> bool:
    """Whether an arriving request is shed: ``unfinished`` requests (waiting or running) already at the limit."""
    return max_num_queued_reqs is not None and unfinished + 1 > max_num_queued_reqs


# --- how many tokens, and who joins --------------------------------------------------------------


def chunk_size(remaining: int, budget: int, cap: int = 0, chunked: bool = True) -> int:
    """Tokens a request computes this step: its ``remaining`` uncomputed tokens (a decode: 1), at most
    ``cap`` (this step's long-prefill threshold, 0 = none) and at most the ``budget`` left.

    ``chunked=False`` (a waiting prompt with chunked prefill off, or vLLM V0's prefill step): a prompt
    that does not fit the budget whole gets 0 tokens, and admission stops there.
    """
    n = remaining
    if 0 < cap < n:
        n = cap
    if n > budget:
        return budget if chunked else 0
    return n


def admits_more(waiting: Sequence | int, budget: int, rows: int, max_num_seqs: int) -> bool:
    """Whether admission goes on: a request waits (``waiting``: the queue, or its length), ``budget``
    tokens are left and ``rows`` (requests in the batch, held slots included) is below ``max_num_seqs``."""
    return bool(waiting) and budget > 0 and rows < max_num_seqs


# --- preemption ----------------------------------------------------------------------------------


def pop_victim(running: list, finishing: list | None = None, order=None):
    """vLLM's preemption victim, taken off its list: the last of ``running`` (the most recently admitted).

    The fast engine keeps the requests whose last token is in flight (async scheduling) apart, in
    ``finishing``; vLLM keeps them in its running list, so the victim is then the newest of both lists
    by ``order(request)`` (the admission count).
    """
    if finishing:
        newest = max(finishing, key=order)
        if order(newest) > order(running[-1]):
            finishing.remove(newest)
            return newest
    return running.pop()


def preempt(victim, waiting, blocks) -> None:
    """Preemption by recompute: free the victim's blocks, forget its computed tokens, queue it first.

    It keeps the tokens it generated (the client has them); admitted again, it prefills prompt +
    generated tokens. ``victim`` has ``request_id`` and ``computed``; ``waiting`` is a deque.
    """
    blocks.free(victim.request_id)
    victim.computed = 0
    waiting.appendleft(victim)


# --- what a step costs ---------------------------------------------------------------------------


def attention_pairs(new: int, cached: int) -> int:
    """Causal attention's (query, key) pairs when ``new`` tokens follow ``cached`` ones: each new token
    attends to every cached token and to the new ones up to itself. A decode (``new=1``): ``cached + 1``."""
    return new * cached + new * (new + 1) // 2


def step_load(scheduled: Iterable[tuple], *, joined: bool = False) -> tuple[int, int, int, int]:
    """(prefill tokens, decode tokens, KV tokens read, attention pairs) of a step, before it runs.

    ``scheduled`` holds ``(request, n)``: the request (with ``computed``, ``generated`` and
    ``num_tokens``) computes ``n`` tokens after its ``c = computed`` cached ones. It is a decode when it
    was already in the batch, already generated a token and only its newest token is left (``n == 1``,
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
        pairs += attention_pairs(n, c)
    return prefill, decode, kv_read, pairs


# --- vLLM V0's prefill-first step and module 2's loop --------------------------------------------


def v0_can_admit(blocks, tokens: int, hits: Sequence[int], watermark_blocks: int) -> bool:
    """V0: a waiting prompt of ``tokens`` tokens (``hits``: its prefix-cache hits) is admitted only if,
    after the blocks it needs beyond its hits, ``watermark_blocks`` blocks stay free (vLLM 0.6.x,
    ``vllm/core/block_manager.py``, ``can_allocate``; ``watermark=0.01`` of the
    blocks)."""
    return blocks.num_free_blocks - (cdiv(tokens, blocks.block_size) - len(hits)) >= watermark_blocks


def decode_only(last_step_admitted: bool, running: Sequence) -> bool:
    """Module 2's loop (``SimConfig.decode_after_prefill``): after a step that admitted (prefilled)
    requests, the next step only decodes, if anyone is running; V0 instead prefills again while a
    prompt can start."""
    return last_step_admitted and bool(running)


# --- static batching -----------------------------------------------------------------------------


def static_batch(
    specs: Sequence, start: int, now: float, batch_size: int, num_blocks: int | None, block_size: int
) -> tuple[int, int, int]:
    """The static batch that forms at ``now``: ``specs[start:end]``; returns (end, longest prompt, longest output).

    The engine takes the requests (``RequestSpec``-like, in arrival order) that have arrived, first come
    first served, up to ``batch_size`` and, with ``num_blocks``, while every slot can reserve KV for the
    batch's longest prompt plus longest output. The first request always joins.
    """
    end, longest_prompt, longest_output = start, 0, 0
    while end < len(specs) and end - start < batch_size and specs[end].arrival_time <= now:
        candidate = specs[end]
        prompt = max(longest_prompt, candidate.prompt_tokens)
        output = max(longest_output, candidate.output_tokens)
        size = end - start + 1
        if num_blocks is not None and size > 1 and size * cdiv(prompt + output, block_size) > num_blocks:
            break
        longest_prompt, longest_output = prompt, output
        end += 1
    return end, longest_prompt, longest_output


def static_batch_loads(size: int, longest_prompt: int, longest_output: int) -> Iterator[tuple[int, int, int, int]]:
    """The (prefill, decode, KV read, attention pairs) load of each step of a padded static batch.

    The batch prefills as a ``size x P`` rectangle (``P`` = longest prompt), then runs ``O - 1`` decode
    steps (``O`` = longest output) with all ``size`` slots: decode step ``k`` reads ``size x (P + k - 1)``
    cached tokens.
    """
    yield size * longest_prompt, 0, 0, size * attention_pairs(longest_prompt, 0)
    for k in range(1, longest_output):
        context = longest_prompt + k - 1
        yield 0, size, size * context, size * attention_pairs(1, context)
