"""What each engine iteration does, decided without a model: aborts first, then the token budget.

The budget rule (:func:`split_budget`) is vLLM V1's (``vllm/v1/core/sched/scheduler.py``,
``Scheduler.schedule()``, 0.11), the one ``course/sim/steps.py``'s ``continuous_step`` models with
chunked prefill on: one token budget per iteration (vLLM's ``max_num_batched_tokens``, this engine's
``max_prefill_tokens``). Running requests come first: every decoding request takes one token of it,
then partly prefilled prompts, oldest first, take what they still need, clipped to what is left;
then waiting requests are admitted first come first served while the batch has a free row and
budget is left, the last one cut to fit. A prompt longer than the budget is therefore prefilled
over several iterations, a chunk per iteration, while the running requests keep decoding; no
iteration's decodes and chunks together exceed the budget, so no prompt, however long, stalls the
running streams for longer than one chunk. (A prompt needs at least one token of the budget to
start, so at most ``max_prefill_tokens`` requests decode together. The engine also decodes a
request in the iteration that completes its prompt, one iteration before vLLM would count that
token.) ``tests/test_serving_admission.py`` runs this rule beside the simulator's.

Where this engine follows the simulator's rule it calls it (:mod:`course.rules`, the scheduling rules on the
library's ground floor: the engine loads no simulator): a request's chunk (:func:`~course.rules.chunk_size`:
what it has left, clipped to the budget; this engine has no long-prefill cap) and when admission goes on
(:func:`~course.rules.admits_more`: someone waits,
budget is left, a row is free). The simulator's other rules do not apply here: this engine's KV cache
is not paged (a request's cache grows with it; no block reservation, watermark or preemption), and
its decodes take their token before any prompt does, where vLLM serves its running requests in
admission order.

:class:`Scheduler` holds the waiting queue and the pending aborts under one lock, the state that
other threads touch. Aborts are taken, and aborted waiting requests leave the queue, *before*
admission and under the same lock, so a request aborted before it ran is never prefilled.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from course import rules
from course.serving.request import EngineRequest, EngineStopped, TokenEvent


def split_budget(
    waiting: deque, prefilling: Sequence, num_decoding: int, max_batch_size: int, token_budget: int
) -> list[tuple]:
    """One iteration's prompt chunks: ``[(request, tokens to prefill), ...]`` (see the module docstring).

    ``num_decoding`` requests decode this iteration (one token each); ``prefilling`` holds the
    partly prefilled requests, oldest first (each with ``prompt_tokens_left``); ``waiting`` holds
    requests not started, oldest first: those admitted are popped from it.
    """
    budget = token_budget - num_decoding
    chunks = []
    for request in prefilling:
        if budget <= 0:
            break
        n = rules.chunk_size(request.prompt_tokens_left, budget)
        chunks.append((request, n))
        budget -= n
    rows = num_decoding + len(prefilling)
    while rules.admits_more(waiting, budget, rows, max_batch_size):
        request = waiting.popleft()
        n = rules.chunk_size(request.prompt_tokens_left, budget)
        chunks.append((request, n))
        budget -= n
        rows += 1
    return chunks


@dataclass
class Schedule:
    """One iteration's plan. ``stop``: the engine is shut down and has nothing left to abort."""

    aborts: dict[str, TokenEvent] = field(default_factory=dict)  # request id -> the final event it ends with
    aborted_waiting: list[EngineRequest] = field(default_factory=list)  # already out of the queue
    chunks: list[tuple[EngineRequest, int]] = field(default_factory=list)  # (request, prompt tokens to prefill)
    stop: bool = False


class Scheduler:
    """The waiting queue, pending aborts and every unfinished request, shared with other threads."""

    def __init__(self, max_batch_size: int, token_budget: int) -> None:
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.lock = threading.Condition()
        self.waiting: deque[EngineRequest] = deque()
        self.aborts: dict[str, TokenEvent] = {}  # request id -> the final event it ends with
        self.requests: dict[str, EngineRequest] = {}  # every unfinished request, by id
        self.stopping = False

    def add(self, request: EngineRequest) -> None:
        with self.lock:
            if self.stopping:
                raise EngineStopped("the engine is shut down")
            if request.request_id in self.requests:
                raise ValueError(f"request id {request.request_id!r} is already running")
            self.requests[request.request_id] = request
            self.waiting.append(request)
            self.lock.notify()

    def abort(self, request_ids: Iterable[str] | None, last: TokenEvent, step: int) -> None:
        """Ask for ``request_ids`` (None: every unfinished request) to end with the final event ``last``
        (no token: an abort's or an error's)."""
        with self.lock:
            ids = list(self.requests) if request_ids is None else request_ids
            for rid in ids:
                request = self.requests.get(rid)
                if request is None or request.finished or rid in self.aborts:
                    continue
                request.abort_requested_step = step
                self.aborts[rid] = last
            self.lock.notify()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()

    def schedule(self, num_decoding: int, prefilling: Sequence[EngineRequest] = (), block: bool = True) -> Schedule:
        """The next iteration's plan; with ``block``, wait until there is something to do.

        ``num_decoding``: requests that decode this iteration; ``prefilling``: the partly prefilled
        ones, oldest first (both held by the engine thread).
        """
        if num_decoding and not (self.waiting or self.aborts or self.stopping or prefilling):
            # The common decode-only iteration: nothing to take, so no lock (reading a deque's or a
            # dict's length is atomic; a request added meanwhile is taken by the next iteration).
            return Schedule()
        with self.lock:
            while block and not (self.waiting or num_decoding or prefilling or self.aborts or self.stopping):
                self.lock.wait()
            if self.stopping and not self.aborts:
                return Schedule(stop=True)
            aborts, self.aborts = self.aborts, {}
            aborted = [r for r in self.waiting if r.request_id in aborts]
            for request in aborted:
                self.waiting.remove(request)
            if self.stopping:
                return Schedule(aborts, aborted)
            going_on = [r for r in prefilling if r.request_id not in aborts]
            chunks = split_budget(self.waiting, going_on, num_decoding, self.max_batch_size, self.token_budget)
            return Schedule(aborts, aborted, chunks)

    def forget(self, request_id: str) -> None:
        """A request finished: it is no longer unfinished, nor to be aborted."""
        with self.lock:
            self.requests.pop(request_id, None)
            self.aborts.pop(request_id, None)

    def drain(self) -> list[EngineRequest]:
        """Remove and return every waiting request."""
        with self.lock:
            waiting = list(self.waiting)
            self.waiting.clear()
        return waiting

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_unfinished(self) -> int:
        with self.lock:
            return len(self.requests)
