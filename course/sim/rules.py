"""vLLM 0.32's admission rules, each written once: the readable steps (:mod:`course.sim.steps`) and the
fast engine (:mod:`course.sim.simulator`) both call these.

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

from collections.abc import Sequence

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
