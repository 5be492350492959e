"""What each engine iteration does, decided without a model: aborts first, then admission.

The admission rule (:func:`admit`) is the one ``course/sim/steps.py``'s ``PrefillThenDecode`` models:
waiting requests are admitted first come first served while the batch has a free row and their
whole prompts fit the iteration's prefill token budget; the admitted prompts are prefilled
together, then every running request (old and new) gets one decode step. One difference, by
design: the first waiting request is admitted even if its prompt alone exceeds the budget (this
engine has no chunked prefill, so it could never start otherwise), where the simulator's rule
would leave it waiting. ``tests/test_serving_admission.py`` runs both side by side.

:class:`Scheduler` holds the waiting queue and the pending aborts under one lock, the state that
other threads touch. Aborts are taken, and aborted waiting requests leave the queue, *before*
admission and under the same lock, so a request aborted before it ran is never prefilled.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from course.serving.request import EngineRequest, EngineStopped


def admit(waiting: deque, num_running: int, max_batch_size: int, max_prefill_tokens: int) -> list:
    """Pop and return the waiting requests this iteration prefills (see the module docstring).

    ``waiting`` holds requests with ``prompt_ids``, oldest first; ``num_running`` requests already
    hold a row of the batch.
    """
    admitted = []
    budget = max_prefill_tokens
    while waiting and num_running + len(admitted) < max_batch_size:
        prompt = len(waiting[0].prompt_ids)
        if admitted and prompt > budget:
            break
        admitted.append(waiting.popleft())
        budget -= prompt
    return admitted


@dataclass
class Schedule:
    """One iteration's plan. ``stop``: the engine is shut down and has nothing left to abort."""

    aborts: dict[str, str] = field(default_factory=dict)  # request id -> finish reason
    aborted_waiting: list[EngineRequest] = field(default_factory=list)  # already out of the queue
    admitted: list[EngineRequest] = field(default_factory=list)
    stop: bool = False


class Scheduler:
    """The waiting queue, pending aborts and every unfinished request, shared with other threads."""

    def __init__(self, max_batch_size: int, max_prefill_tokens: int) -> None:
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.lock = threading.Condition()
        self.waiting: deque[EngineRequest] = deque()
        self.aborts: dict[str, str] = {}
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

    def abort(self, request_ids: Iterable[str] | None, reason: str, step: int) -> None:
        """Ask for ``request_ids`` (None: every unfinished request) to end with ``reason``."""
        with self.lock:
            ids = list(self.requests) if request_ids is None else request_ids
            for rid in ids:
                request = self.requests.get(rid)
                if request is None or request.finished or rid in self.aborts:
                    continue
                request.abort_requested_step = step
                self.aborts[rid] = reason
            self.lock.notify()

    def stop(self) -> None:
        with self.lock:
            self.stopping = True
            self.lock.notify()

    def schedule(self, num_running: int, block: bool = True) -> Schedule:
        """The next iteration's plan; with ``block``, wait until there is something to do."""
        if num_running and not (self.waiting or self.aborts or self.stopping):
            # The common decode-only iteration: nothing to take, so no lock (reading a deque's or a
            # dict's length is atomic; a request added meanwhile is taken by the next iteration).
            return Schedule()
        with self.lock:
            while block and not (self.waiting or num_running or self.aborts or self.stopping):
                self.lock.wait()
            if self.stopping and not self.aborts:
                return Schedule(stop=True)
            aborts, self.aborts = self.aborts, {}
            aborted = [r for r in self.waiting if r.request_id in aborts]
            for request in aborted:
                self.waiting.remove(request)
            admitted = (
                [] if self.stopping else admit(self.waiting, num_running, self.max_batch_size, self.max_prefill_tokens)
            )
            return Schedule(aborts, aborted, admitted)

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
