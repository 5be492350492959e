"""The fast simulator: the policies of :mod:`course.sim.steps`, step by step, with counters.

:func:`simulate` runs the one clock (:mod:`course.sim.loop`) over a fast ledger: :class:`FastLedger` for
the iteration-level schedulers (vLLM V1's continuous batching and V0's prefill-first), :class:`StaticLedger`
for static batching. What makes them fast is what they do *not* keep:

* no object per token: a request is a handful of integers (computed, generated, blocks' capacity),
  and its output tokens are remembered as runs of consecutive steps ``(first, last)``, turned into
  times only at the end by indexing the array of step end times;
* no block-manager call per token: a request asks for blocks only when its next tokens cross its
  last block's boundary (every ``block_size`` decode steps);
* no Python work per decode token (V1 without prefix caching): a request that decodes becomes
  *lazy*, its counters frozen at the step it started and advanced by arithmetic when needed. A step
  whose running requests fit the token budget and the free blocks serves them in any order with
  the same result, so it counts the lazy decodes in bulk (their number, summed context, and, by
  the step number modulo ``block_size``, how many cross into a new block, which are held unnamed);
  only the decodes that emit their last token in it (a heap by step) and the prompts being chunked
  are touched. Any other step (the budget binds, blocks run short, preemption) first gives every
  lazy decode its counters and blocks back and runs the exact per-request loop;
* no collector passes: the run makes no reference cycles, so the cyclic garbage collector is off
  while it runs;
* static batches are closed-form: one prefill and ``O - 1`` decode steps per batch, each request's
  tokens one run of steps.

It produces exactly what the readable ledger (:class:`course.sim.harness.ReadableLedger` driving
``course.sim.steps``) produces under the same clock: the tests compare the two on random workloads. Both call
the rules of :mod:`course.rules` and record their results with the builders of :mod:`course.sim.results`.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import time
from collections import deque

from course import rules
from course.sim import loop
from course.sim.blocks import BlockManager, prompt_block_hashes
from course.sim.config import SimConfig
from course.sim.frontend import NO_FRONT_END, front_end_of
from course.sim.loop import ScheduledStep
from course.sim.results import RequestTable, SimResult, request_table
from course.units import cdiv
from course.workload import RequestSpec, Workload


class _FastRequest:
    """A request's counters inside the engine (see :class:`course.sim.request.SimRequest`)."""

    __slots__ = (
        "spec",
        "request_id",
        "arrival_time",
        "prompt_tokens",
        "output_tokens",
        "num_tokens",
        "computed",
        "generated",
        "capacity",
        "hashes",
        "registered",
        "runs",
        "run_start",
        "last_step",
        "scheduled_steps",
        "preempted_steps",
        "hit_tokens",
        "queried_tokens",
        "error",
        "order",
        "lazy",
        "sync",
        "phase",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.arrival_time = spec.arrival_time
        self.prompt_tokens = spec.prompt_tokens
        self.output_tokens = spec.output_tokens
        self.num_tokens = spec.prompt_tokens  # prompt + generated
        self.computed = 0
        self.generated = 0
        self.capacity = 0  # tokens its blocks can hold
        self.hashes: list = []
        self.registered = 0  # leading prompt blocks registered in the prefix cache
        self.runs: list[int] = []  # closed runs of token steps, flattened: first, last, first, last, ...
        self.run_start = -1
        self.last_step = -2
        self.scheduled_steps: list[int] = []
        self.preempted_steps: list[int] = []
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.error: str | None = None
        self.order = 0  # when it (last) joined the batch: the running list's order, for preemption victims
        # a decode the fast path advances without touching it: its counters are those of the start of step
        # `sync`, and it has computed one token in every step since (FastLedger._fast_running)
        self.lazy = False
        self.sync = 0
        self.phase = 0  # it needs a new block in the steps s with (s + phase) % block_size == 0

    def start_run(self, step: int) -> None:
        """Begin a new run of consecutive token steps at ``step``, closing the current one (if any)."""
        if self.run_start >= 0:
            self.runs.append(self.run_start)
            self.runs.append(self.last_step)
        self.run_start = step


def simulate(workload: Workload, config: SimConfig | None = None, cost=None, name: str | None = None) -> SimResult:
    """Simulate serving ``workload`` with ``config``'s scheduler and ``cost``'s step times.

    Args:
        workload: the requests (``course.workload``: generated, or replayed from ``course bench`` traces).
        config: scheduler settings (default: vLLM V1 with its API-server defaults and 16384 blocks).
        cost: a cost model with ``step_seconds(prefill_tokens, decode_tokens, kv_tokens_read,
            attention_pairs)`` (``course.sim.RooflineCost``, ``course.sim.LinearCost``, ...), and a
            ``spread_draw`` when its steps scatter (:func:`course.sim.cost.spread_draw`).
        name: a label for tables and plots.

    Requests that can never run (their prompt + output needs more KV blocks than exist, exceeds
    ``max_model_len``, or with chunked prefill off exceeds the token budget) fail with an error
    instead of blocking the queue forever.
    """
    if cost is None:
        raise ValueError("simulate() needs a cost model, e.g. course.sim.RooflineCost(geometry, gpu)")
    config = config or SimConfig()
    requests = [_FastRequest(spec) for spec in sorted(workload, key=lambda spec: spec.arrival_time)]
    started = time.perf_counter()
    # The run allocates no reference cycles; without this the cyclic collector would walk every live
    # request again and again (a million requests: a third of the run's time).
    collecting = gc.isenabled()
    gc.disable()
    try:
        if config.scheduler == "static":  # a padded batch takes requests as they arrive: no front end modelled
            ledger, front_end = StaticLedger(requests, config), NO_FRONT_END
        else:
            ledger, front_end = FastLedger(requests, config), front_end_of(cost)
        steps = loop.run(ledger, cost, loop.Admission.from_config(config), front_end).freeze()
        table = _table(requests)
    finally:
        if collecting:
            gc.enable()
    wall = time.perf_counter() - started
    label = name or f"{config.scheduler}, {getattr(workload, 'name', 'workload')}"
    settings = config.to_dict()
    settings["cost"] = cost.describe() if hasattr(cost, "describe") else repr(cost)
    return SimResult(label, None, steps, config.num_blocks, config.block_size, settings, wall, columns=table)


def _table(requests: list[_FastRequest]) -> RequestTable:
    """The requests' results as columns, made as the readable harness makes them (one builder)."""
    # Close each open run of token steps in place: copying the lists instead costs memory at a million requests
    # for a negligible saving (benchmarks/RESULTS.md, "Why the fast loop is written as it is").
    for r in requests:
        if r.run_start >= 0:
            r.runs += (r.run_start, r.last_step)
    return request_table(
        (r.request_id, r.arrival_time, r.prompt_tokens, r.output_tokens, r.runs, r.scheduled_steps,
         r.preempted_steps, r.hit_tokens, r.queried_tokens, r.error)
        for r in requests
    )  # fmt: skip


def _admission_order(r: _FastRequest) -> int:
    return r.order


def _sample(r: _FastRequest, step: int) -> bool:
    """The step computed all of ``r``'s tokens, so it samples the next one; True when that was the last.

    The token is remembered in ``r``'s runs of consecutive steps (see the module docstring). Every path that
    computes tokens calls this, the exact loop (:meth:`FastLedger._schedule_running`) included: one call per
    sampled token there cost 3 % of the instructions where that loop runs most (benchmarks/RESULTS.md, "Why the
    fast loop is written as it is").
    """
    r.generated += 1
    r.num_tokens += 1
    if r.last_step != step - 1:
        r.start_run(step)
    r.last_step = step
    return r.generated == r.output_tokens


class FastLedger:
    """The counters of an iteration-level scheduler's run (vLLM V1, V0), as the clock (:mod:`course.sim.loop`)
    drives them: the state between steps and one method per phase.

    A step (:meth:`schedule`) is: V0 admits whole prompts (:meth:`_admit_whole_prompts`); if it admitted
    nobody, the running requests get their tokens, preempting when blocks run out
    (:meth:`_schedule_running`), and V1 then admits from the queue, cutting prompts to the budget
    (:meth:`_admit_chunks`); the admitted requests compute their tokens (:meth:`_compute_admitted`).
    Once the clock has timed and logged it, finished requests leave (:meth:`finish`).
    """

    def __init__(self, requests: list[_FastRequest], config: SimConfig) -> None:
        self.requests = requests
        self.bs = bs = config.block_size
        self.caching = config.enable_prefix_caching
        self.blocks = BlockManager(config.num_blocks, bs, self.caching)
        if self.caching:
            for r in requests:
                spec = r.spec
                r.hashes = prompt_block_hashes(spec.request_id, spec.prompt_tokens, bs, spec.prompt_segments)
        self.token_budget = config.token_budget
        self.prefill_first = config.scheduler == "prefill-first"
        self.threshold = 0 if self.prefill_first else config.long_prefill_token_threshold
        self.adaptive = config.long_prefill_token_threshold_adaptive
        self.cap = self.threshold  # this step's long-prefill cap (rules.long_prefill_threshold)
        self.reserve_full_isl = config.reserve_full_isl
        self.chunked = config.chunked_prefill
        self.max_seqs = config.max_num_seqs
        self.watermark = config.watermark_blocks
        self.decode_after_prefill = self.prefill_first and config.decode_after_prefill
        # vLLM V1's async scheduling (rules module docstring): requests that finished in the last step
        # keep their blocks and slots until this step is scheduled. They leave self.running at once
        # (the hot loop never meets them); self.finishing holds them, in the order they finished.
        self.async_scheduling = config.async_scheduling and config.scheduler == "continuous"
        self.finishing: list[_FastRequest] = []
        self.admissions = 0
        self.preemptions = 0  # victims so far (_preempt_for): a step that preempted admits nobody
        self.prefilled = False  # the last step admitted (prefilled) requests: module 2's loop decodes next
        self.finished: list[_FastRequest] = []  # who finished in the step just scheduled
        self.slow = False  # the step just scheduled took the exact path (the fast path's lists need rebuilding)
        self.waiting: deque[_FastRequest] = deque()
        self.running: list[_FastRequest] = []
        self.step = 0  # index of the step being scheduled
        # The decode fast path (module docstring): V1 without prefix caching, where block ids do not matter.
        self.fast = not self.prefill_first and not self.caching
        self.decoders = 0  # lazy decodes (in self.running)
        self.context = 0  # their computed tokens, summed, at the start of the step being scheduled
        self.phases = [0] * bs  # lazy decodes by phase: (step + phase) % bs == 0 takes them a block
        self.ends: list[tuple[int, int, _FastRequest]] = []  # heap: (step of a lazy decode's last token, order, it)
        self.held = 0  # blocks the lazy decodes took, held unnamed by the BlockManager
        self.active: list[_FastRequest] = []  # the running requests that are not lazy, in running order

    # --- the ledger, as the clock sees it (course.sim.loop.Ledger) ------------------------------------

    def queue(self, r: _FastRequest) -> None:
        self.waiting.append(r)

    def reject(self, r: _FastRequest, error: str) -> None:
        r.error = error

    def unfinished(self) -> int:
        return len(self.running) + len(self.finishing) + len(self.waiting)

    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def settle(self) -> None:
        if self.finishing:  # an empty scheduling pass frees them; no step runs
            self._free_finishing()

    def schedule(self, index: int, now: float) -> ScheduledStep | None:
        """Schedule and compute step ``index``; its load, or None for an empty pass (async scheduling)."""
        self.step = index
        queued = len(self.waiting)
        finished: list[_FastRequest] = []
        # The batch as (request, tokens) for requests admitted from the queue; running requests are
        # computed inside _schedule_running, because that loop is where the simulator spends its time.
        admitted: list[tuple[_FastRequest, int]] = []
        load, slow = self._plan(queued, admitted, finished)
        if admitted:
            load = self._compute_admitted(admitted, load, finished)
        self.prefilled = bool(admitted)
        if self.finishing:  # async: the previous step's output is processed once this one is scheduled
            self._free_finishing()
            if not load[4]:  # an empty pass: no step runs, no time passes
                if slow:  # the exact path may have preempted active requests: rebuild the fast path's lists
                    self._lazify(self.running)
                return None
        if not load[4]:
            raise RuntimeError(
                f"the scheduler found nothing to run at t={now:.6g} s ({len(self.running)} running, "
                f"{len(self.waiting)} waiting, {self.blocks.num_free_blocks} free blocks); "
                "this is a bug in the simulator"
            )
        self.finished, self.slow = finished, slow
        return (*load, self.blocks.num_used_blocks, queued)

    def _plan(self, queued: int, admitted: list, finished: list) -> tuple[tuple, bool]:
        """Who computes in this step: V0's whole prompts if any can start; else the running requests (in bulk
        on the fast path when nothing can be preempted or cut) and then, without a preemption, V1's admissions.

        Appends the admitted requests to ``admitted`` and those that finish to ``finished``. Returns (the
        running requests' load: prefill tokens, decode tokens, KV tokens read, attention pairs, requests;
        whether the exact path ran while the fast path was on).
        """
        budget = self.token_budget
        if self.threshold:
            self.cap = rules.long_prefill_threshold(
                self.threshold, self.token_budget, len(self.running) + len(self.finishing) + queued, self.adaptive
            )
        # V0 decodes only when no prompt can start; module 2's loop also right after a prefill step
        decode_only = self.decode_after_prefill and rules.decode_only(self.prefilled, self.running)
        if self.prefill_first and not decode_only:
            budget = self._admit_whole_prompts(admitted, budget)
            if admitted:
                return (0, 0, 0, 0, 0), False
        fast = self.fast and self._fast_running(budget, finished)
        if fast:
            (load, budget), preempted, slow = fast, False, False
        else:
            slow = self.fast and self._materialize()
            load, budget, preempted = self._schedule_running(budget, finished)
        if not preempted and not self.prefill_first and self.waiting:  # V1 admits only without preemption
            self._admit_chunks(admitted, budget)
        return load, slow

    def finish(self, index: int) -> int:
        """Step ``index`` ran: its finished requests leave, and its decodes become lazy for the next one.
        Returns how many finished."""
        self.step = index + 1
        finished = self.finished
        if finished:
            self._retire(finished)
        if self.fast and (self.slow or self.active):  # nobody active: every running request is lazy already
            self._lazify(self.running if self.slow else self.active)
        return len(finished)

    # --- the decode fast path --------------------------------------------------------------------

    def _fast_running(self, budget: int, finished: list[_FastRequest]) -> tuple[tuple, int] | None:
        """The running part of a step in which nothing can be preempted or cut: lazy decodes in bulk.

        When the running requests' tokens fit the budget and their new blocks fit the free blocks,
        the order in which they are served changes nothing: each lazy decode computes one token, the
        step's decode load is their count and their summed context, the blocks they cross into are
        held in bulk, and only the decodes that emit their last token now are touched (a heap by
        step). The other running requests (prompts in chunks) take the usual path. Returns
        (the step's load so far, budget left), or None when the step needs the exact path.
        """
        step, bs, decoders = self.step, self.bs, self.decoders
        crossings = self.phases[-step % bs] if decoders else 0
        tokens, new_blocks = self._active_demand()
        tokens += decoders
        new_blocks += crossings
        if tokens > budget or new_blocks > self.blocks.num_free_blocks:
            return None
        if crossings:
            self.blocks.hold(crossings)
            self.held += crossings
        context, cap = self.context, self.cap
        prefill, decode, kv_read, pairs, seqs = 0, decoders, context, context + decoders, decoders
        reserve = self.blocks.reserve
        for r in self.active:  # _schedule_running's loop, without preemption (the blocks were counted)
            c = r.computed
            num_tokens = r.num_tokens
            n = num_tokens - c  # rules.chunk_size, inlined: they fit the budget
            if 0 < cap < n:
                n = cap
            after = c + n
            if after > r.capacity:
                reserve(r.request_id, after)
                r.capacity = cdiv(after, bs) * bs
            if n == 1 and r.generated and c == num_tokens - 1:  # rules.step_load, inlined
                decode += 1
                pairs += c + 1  # rules.attention_pairs(1, c)
            else:
                prefill += n
                pairs += n * c + n * (n + 1) // 2  # rules.attention_pairs(n, c)
            kv_read += c
            seqs += 1
            r.computed = after
            if after == num_tokens and _sample(r, step):
                finished.append(r)
        ends = self.ends
        while ends and ends[0][0] == step:  # lazy decodes whose last token this step is
            r = heapq.heappop(ends)[2]
            self._catch_up(r, step + 1)
            self._name_blocks(r)
            r.lazy = False
            self.decoders -= 1
            self.context -= r.computed - 1
            self.phases[r.phase] -= 1
            finished.append(r)
        self.context += self.decoders  # every other lazy decode computed one more token
        return (prefill, decode, kv_read, pairs, seqs), budget - tokens

    def _active_demand(self) -> tuple[int, int]:
        """(tokens, new blocks) the active (not lazy) running requests ask for in this step, uncut by the budget."""
        bs, cap = self.bs, self.cap
        tokens = new_blocks = 0
        for r in self.active:
            n = r.num_tokens - r.computed  # rules.chunk_size, inlined (see _schedule_running)
            if 0 < cap < n:
                n = cap
            tokens += n
            if r.computed + n > r.capacity:
                new_blocks += cdiv(r.computed + n, bs) - r.capacity // bs
        return tokens, new_blocks

    def _catch_up(self, r: _FastRequest, step: int) -> None:
        """Bring a lazy decode's counters to the start of ``step``: one token per step since ``r.sync``."""
        k = step - r.sync
        if k:
            if r.last_step != r.sync - 1:  # its first lazy token did not follow its last token
                r.start_run(r.sync)
            r.computed += k
            r.num_tokens += k
            r.generated += k
            r.last_step = step - 1

    def _name_blocks(self, r: _FastRequest) -> None:
        """Move the blocks a lazy decode crossed into from the held pool to its own table."""
        after = r.computed
        if after > r.capacity:
            more = cdiv(after, self.bs) - r.capacity // self.bs
            self.blocks.release(more)
            self.held -= more
            self.blocks.reserve(r.request_id, after)
            r.capacity = cdiv(after, self.bs) * self.bs

    def _materialize(self) -> bool:
        """Before an exact step: every lazy decode gets its counters and its blocks by name. Returns True."""
        if self.decoders:
            self.blocks.release(self.held)
            self.held = 0
            step, bs = self.step, self.bs
            for r in self.running:
                if r.lazy:
                    self._catch_up(r, step)
                    if r.computed > r.capacity:
                        self.blocks.reserve(r.request_id, r.computed)
                        r.capacity = cdiv(r.computed, bs) * bs
                    r.lazy = False
            self.decoders = self.context = 0
            self.phases = [0] * bs
            self.ends = []
        return True

    def _lazify(self, candidates: list[_FastRequest]) -> None:
        """After a step: the running ``candidates`` that now decode become lazy; the rest stay active."""
        step, bs, active = self.step, self.bs, []
        for r in candidates:
            if r.generated >= r.output_tokens or r.lazy:  # finished (and gone), or lazy already
                continue
            if r.generated and r.num_tokens - r.computed == 1:
                r.lazy = True
                r.sync = step
                r.phase = (r.computed - step) % bs
                self.phases[r.phase] += 1
                self.decoders += 1
                self.context += r.computed
                heapq.heappush(self.ends, (step + r.output_tokens - r.generated - 1, r.order, r))
            else:
                active.append(r)
        self.active = active

    def _free_finishing(self) -> None:
        """Async scheduling: free the blocks of the requests that finished in the last step."""
        for r in self.finishing:  # those preempted meanwhile left the list (_preempt_for)
            self.blocks.free(r.request_id)
        self.finishing = []

    # --- admission -------------------------------------------------------------------------------

    def _cached_prefix(self, r: _FastRequest) -> tuple[list, int]:
        """(prefix-cache hits, tokens they hold) for the head of the queue; never all its tokens."""
        if not self.caching:
            return [], 0
        hits = self.blocks.lookup(r.hashes, (r.num_tokens - 1) // self.bs)
        return hits, len(hits) * self.bs

    def _admit_whole_prompts(self, admitted: list[tuple[_FastRequest, int]], budget: int) -> int:
        """V0: admit queued requests whose whole prompt fits the budget and leaves the watermark free.

        Appends them to ``admitted``; returns the budget left.
        """
        waiting, running, blocks = self.waiting, self.running, self.blocks
        while rules.admits_more(waiting, budget, len(running), self.max_seqs):
            r = waiting[0]
            hits, computed = self._cached_prefix(r)
            n = rules.chunk_size(r.num_tokens - computed, budget, chunked=False)  # whole prompts only
            if not n or not rules.v0_can_admit(blocks, computed + n, hits, self.watermark):
                break
            if not blocks.allocate(r.request_id, computed + n, hits):
                break
            self._admit(r, n, computed, hits)
            admitted.append((r, n))
            budget -= n
        return budget

    def _admit_chunks(self, admitted: list[tuple[_FastRequest, int]], budget: int) -> None:
        """V1: admit queued requests in order while the budget and ``max_num_seqs`` allow.

        With chunked prefill a prompt is cut to the budget left; without it admission stops at a
        prompt that does not fit whole, as it does at the first request that gets no blocks
        (head-of-line blocking).
        """
        waiting, running, blocks, threshold = self.waiting, self.running, self.blocks, self.cap
        full, watermark, finishing = self.reserve_full_isl, self.watermark, self.finishing
        while rules.admits_more(waiting, budget, len(running) + len(finishing), self.max_seqs):
            r = waiting[0]
            hits, computed = self._cached_prefix(r)
            n = rules.chunk_size(r.num_tokens - computed, budget, threshold, self.chunked)
            if not n:  # without chunked prefill, a prompt that does not fit the budget whole
                break
            if not rules.can_admit(
                blocks, r.num_tokens, computed + n, hits, reserve_full_isl=full, watermark_blocks=watermark,
                others_running=bool(running) or bool(finishing),
            ):  # fmt: skip
                break
            if not blocks.allocate(r.request_id, computed + n, hits):
                break
            self._admit(r, n, computed, hits)
            admitted.append((r, n))
            budget -= n

    def _admit(self, r: _FastRequest, n: int, computed: int, hits: list) -> None:
        """Move the head of the queue into the batch with ``n`` tokens after ``computed`` cached ones."""
        self.waiting.popleft()
        self.running.append(r)
        bs = self.bs
        r.computed = computed
        r.capacity = cdiv(computed + n, bs) * bs
        r.registered = len(hits)
        r.hit_tokens += computed
        r.queried_tokens += r.num_tokens
        r.scheduled_steps.append(self.step)
        self.admissions += 1
        r.order = self.admissions
        if self.fast:
            self.active.append(r)
        self._register(r, computed + n)  # later admissions in this step can hit these blocks

    def _register(self, r: _FastRequest, after: int) -> None:
        """Put ``r``'s prompt blocks that are full after ``after`` tokens into the prefix cache."""
        if self.caching and after // self.bs > r.registered:
            self.blocks.cache_full_blocks(r.request_id, r.hashes, after)
            r.registered = min(after // self.bs, len(r.hashes))

    # --- the running batch -----------------------------------------------------------------------

    def _schedule_running(self, budget: int, finished: list[_FastRequest]) -> tuple[tuple, int, bool]:
        """Give running requests their tokens in admission order and compute them.

        Each asks for all its uncomputed tokens (a decode for 1), capped by the long-prefill
        threshold and the budget left; a request whose tokens cross into a new block reserves it,
        and when blocks run out :meth:`_preempt_for` makes room. Finished requests are appended to
        ``finished``. Returns (the step's load so far, budget left, whether anything was preempted).

        This loop is where the simulator spends its time when the fast path cannot run (once per scheduled
        token), so it keeps to locals, calls out only at block boundaries and to :func:`_sample`, and inlines
        three rules of :mod:`course.rules` (``chunk_size``, ``step_load``'s decode test, ``attention_pairs``), as
        :meth:`_fast_running` does, because measured instruction counts showed the gain
        (benchmarks/RESULTS.md, "Why the fast loop is written as it is").
        The property tests (``tests/test_sim_properties.py``) hold these copies equal to the rules.
        """
        threshold, caching, step, bs = self.cap, self.caching, self.step, self.bs
        reserve = self.blocks.reserve
        prefill = decode = kv_read = pairs = seqs = 0
        preemptions = self.preemptions
        # Preemption pops victims off the end of the list; iteration then stops before them, as
        # the for statement's internal index is checked against the list's current length.
        for r in self.running:
            if budget <= 0:
                break
            c = r.computed
            num_tokens = r.num_tokens
            n = num_tokens - c  # rules.chunk_size, inlined
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            after = c + n
            if after > r.capacity:  # crosses into a new block: reserve it, preempting others if blocks run out
                if not reserve(r.request_id, after) and not self._preempt_for(r, after):
                    break  # r was the last one left to preempt
                r.capacity = cdiv(after, bs) * bs
            if caching and r.registered < len(r.hashes):
                self._register(r, after)
            if n == 1 and r.generated and c == num_tokens - 1:  # rules.step_load, inlined
                decode += 1
                pairs += c + 1  # rules.attention_pairs(1, c)
            else:
                prefill += n
                pairs += n * c + n * (n + 1) // 2  # rules.attention_pairs(n, c)
            kv_read += c
            budget -= n
            seqs += 1
            r.computed = after
            if after == num_tokens and _sample(r, step):  # caught up: this step samples the next token
                finished.append(r)
        return (prefill, decode, kv_read, pairs, seqs), budget, self.preemptions > preemptions

    def _preempt_for(self, r: _FastRequest, after: int) -> bool:
        """Preempt the most recently admitted requests until ``r`` gets blocks for ``after`` tokens.

        Preemption is by recompute: the victim's blocks are freed, it forgets its computed tokens
        and goes to the front of the queue. Returns whether ``r`` got its blocks; it does not when
        it was itself the last one left to preempt.
        """
        running, blocks, waiting, finishing = self.running, self.blocks, self.waiting, self.finishing
        while True:
            # vLLM's victim is the last of its running list, where finishing requests (async) keep their place
            held = len(finishing)
            victim = rules.pop_victim(running, finishing, _admission_order)
            victim.preempted_steps.append(self.step)
            self.preemptions += 1
            if len(finishing) < held:
                # finishing: vLLM preempts it, then finishes it from the waiting queue when its last token
                # arrives (rules module docstring); the step admits nobody, so it never joins the queue here
                blocks.free(victim.request_id)
            else:
                rules.preempt(victim, waiting, blocks)
                victim.capacity = victim.registered = 0
                if victim is r:
                    return False
            if blocks.reserve(r.request_id, after):
                return True

    def _compute_admitted(
        self, admitted: list[tuple[_FastRequest, int]], load: tuple, finished: list[_FastRequest]
    ) -> tuple[int, int, int, int, int]:
        """Add the admitted requests' tokens to the step's ``load`` and compute them; returns the new load.

        Their load is the reference's :func:`course.rules.step_load`, computed before they advance;
        all of them are prefills, even one that the prefix cache leaves a single token to compute.
        """
        prefill, decode, kv_read, pairs, seqs = load
        more_prefill, more_decode, more_kv_read, more_pairs = rules.step_load(admitted, joined=True)
        step = self.step
        for r, n in admitted:
            r.computed += n
            if r.computed == r.num_tokens and _sample(r, step):
                finished.append(r)
        return (
            prefill + more_prefill,
            decode + more_decode,
            kv_read + more_kv_read,
            pairs + more_pairs,
            seqs + len(admitted),
        )

    def _retire(self, finished: list[_FastRequest]) -> None:
        """Free the finished requests' blocks (in the order they finished) and drop them from the batch.

        Under async scheduling their blocks and slots are held until the next step is scheduled.
        """
        if self.async_scheduling:
            self.finishing = finished
        else:
            for r in finished:
                self.blocks.free(r.request_id)
        if len(finished) < 16:  # a few: list.remove finds each by identity in C, without a Python loop
            for r in finished:
                self.running.remove(r)
        else:  # a request has finished when it generated all its tokens (a lazy decode's count lags: not finished)
            self.running = [r for r in self.running if r.generated < r.output_tokens]


class StaticLedger:
    """Static batching's books (see :func:`course.sim.steps.run_static`), closed-form: padded batches of up to
    ``max_num_seqs`` requests run to completion, and each request's tokens are one run of the batch's steps.

    When the engine is idle it takes the requests that have arrived (:func:`course.rules.static_batch`); the
    batch then runs one prefill and ``O - 1`` decode steps (:func:`course.rules.static_batch_loads`), and
    nobody joins until it ends.
    """

    def __init__(self, requests: list[_FastRequest], config: SimConfig) -> None:
        self.requests = requests
        self.block_size, self.batch_size, self.num_blocks = config.block_size, config.max_num_seqs, config.num_blocks
        self.waiting: deque[_FastRequest] = deque()
        self.size = 0  # requests in the batch that runs (0: none)
        self.steps_left = 0
        self.loads = iter(())  # the batch's steps' loads, the next one first
        self.used = 0  # KV blocks the batch reserved
        self.queued = 0  # requests that waited when the batch formed (none joins until it ends)

    def queue(self, r: _FastRequest) -> None:
        self.waiting.append(r)

    def reject(self, r: _FastRequest, error: str) -> None:
        r.error = error

    def unfinished(self) -> int:
        return self.size + len(self.waiting)

    def busy(self) -> bool:
        return bool(self.size or self.waiting)

    def settle(self) -> None:
        pass

    def schedule(self, index: int, now: float) -> ScheduledStep:
        """The next step of the batch that runs, forming one from the waiting requests first if none does."""
        if not self.size:
            self._form(index)
        return (*next(self.loads), self.size, self.used, self.queued)

    def finish(self, index: int) -> int:
        """Step ``index`` of the batch ran; returns how many requests finished (the whole batch, at its end:
        a static batch answers together)."""
        self.steps_left -= 1
        if self.steps_left:
            return 0
        size, self.size = self.size, 0
        return size

    def _form(self, index: int) -> None:
        """The batch that forms at step ``index``: its requests get their token steps and the batch its loads."""
        head = list(itertools.islice(self.waiting, self.batch_size))  # every waiting request has arrived
        end, longest_prompt, longest_output = rules.static_batch(
            head, 0, float("inf"), self.batch_size, self.num_blocks, self.block_size
        )
        self.queued = len(self.waiting) - end
        for _ in range(end):
            r = self.waiting.popleft()
            r.scheduled_steps.append(index)
            r.run_start, r.last_step = index, index + r.output_tokens - 1
            r.generated = r.output_tokens
        self.size, self.steps_left = end, longest_output
        self.used = end * cdiv(longest_prompt + longest_output, self.block_size)
        self.loads = rules.static_batch_loads(end, longest_prompt, longest_output)
