"""The simulation's one clock: requests arrive, pass the front end and the door, and the engine steps.

Every simulation in the library runs this loop, whichever ledger keeps its requests' books:

* the readable ledger (:class:`course.sim.harness.ReadableLedger`): one Python object per request and a
  step function (module 3's exercises, :mod:`course.sim.steps`) that picks who computes how many tokens;
* the fast ledgers (:mod:`course.sim.simulator`): counters instead of objects, for a million requests.

The loop owns what is the same for both, each written once, in the order an engine meets it:

1. **arrivals**: the requests that have arrived by now go to the front end (:class:`FrontDoor`: it reads and
   tokenizes them first, on the engine's core), then to the door;
2. **the door**: a request that could never run is rejected (:class:`Admission`), and with
   ``max_num_queued_reqs`` one that finds the queue full is shed (HTTP 503, :func:`course.rules.queue_full`);
   the rest wait in the ledger's queue;
3. **idle**: with nobody waiting or running, the clock jumps to the next arrival (or the next request the
   front end readies), and what finished in the last step is freed (async scheduling);
4. **a step**: the ledger schedules it and counts its load (:data:`ScheduledStep`; None when the pass
   scheduled nobody: under async scheduling it only freed what finished, and takes no time); the cost
   model times it, with its drawn spread, plus what the front end took from the core meanwhile; the step
   is logged once, its end final; the ledger then hands out its tokens and retires who finished (whose work
   after the engine, :attr:`FrontEnd.after_engine`, takes the core from the next step).

A ledger is the small protocol :class:`Ledger`; the loop knows nothing of blocks, prefixes or policies.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from course import rules
from course.limits import rejection
from course.sim.config import SimConfig
from course.sim.cost import spread_draw
from course.sim.frontend import NO_FRONT_END, FrontDoor, FrontEnd
from course.sim.results import StepLogBuilder

# What a scheduled step computes and holds, the columns of course.sim.results.StepLog after its times: (prefill
# tokens, decode tokens, KV tokens read, attention pairs, requests in the batch, KV blocks in use, requests waiting
# when it was scheduled). A plain tuple: a ledger makes one per step, and a named one cost the loop a tenth more.
ScheduledStep = tuple[int, int, int, int, int, int, int]


class Ledger(Protocol):
    """The books of a simulation's requests, as the loop drives them.

    ``requests``: every request in arrival order; each has ``arrival_time`` (s), ``prompt_tokens`` and
    ``output_tokens``.
    """

    requests: Sequence

    def queue(self, request) -> None:
        """``request`` passed the door: it waits for the scheduler."""

    def reject(self, request, error: str) -> None:
        """``request`` was turned away at the door, for ``error``."""

    def unfinished(self) -> int:
        """Requests waiting or running (those whose last token is in flight included): what sheds an arrival."""

    def busy(self) -> bool:
        """Whether anyone waits or runs (then the next step is scheduled; else the clock jumps)."""

    def settle(self) -> None:
        """The engine found nobody to schedule: free what finished in the last step (async scheduling)."""

    def schedule(self, index: int, now: float) -> ScheduledStep | None:
        """Schedule step number ``index``, starting at ``now`` (s); None for a pass that scheduled nobody."""

    def finish(self, index: int) -> None:
        """Step number ``index`` ran: hand out its tokens and retire the requests that finished."""


@dataclass(frozen=True)
class Admission:
    """What the door checks when a request reaches the scheduler's queue.

    Attributes:
        num_blocks, block_size: the KV cache (None blocks: no limit): a request whose prompt plus output
            need more blocks than it has could never run.
        max_model_len: the longest prompt + output a request may have (None: no limit).
        watermark_blocks: blocks admission keeps free (vLLM V0's watermark): a request that needs more than
            the rest could never be admitted.
        max_num_queued_reqs: shed a request that arrives while this many are unfinished (None: never).
        whole_prompt_budget: without chunked prefill, the step's token budget a (re)computed prompt must fit
            whole (None: chunked prefill, or a scheduler that never needs it).
    """

    num_blocks: int | None
    block_size: int
    max_model_len: int | None = None
    watermark_blocks: int = 0
    max_num_queued_reqs: int | None = None
    whole_prompt_budget: int | None = None

    @classmethod
    def from_config(cls, config: SimConfig) -> Admission:
        """The door of ``config``'s scheduler: V0's watermark for prefill-first, the whole-prompt budget where
        chunked prefill is off (static batching pads its prompts instead)."""
        iterative = config.scheduler != "static"
        chunks = config.scheduler == "continuous" and config.chunked_prefill
        return cls(
            config.num_blocks,
            config.block_size,
            config.max_model_len,
            config.watermark_blocks if config.scheduler == "prefill-first" else 0,
            config.max_num_queued_reqs,
            config.token_budget if iterative and not chunks else None,
        )

    def rejection(self, request) -> str | None:
        """Why ``request`` could never run (``"rejected: ..."``, :func:`course.limits.rejection`), or None."""
        prompt, output = request.prompt_tokens, request.output_tokens
        error = rejection(prompt, output, self.num_blocks, self.block_size, self.max_model_len, self.watermark_blocks)
        if error is None and self.whole_prompt_budget is not None and prompt + output - 1 > self.whole_prompt_budget:
            error = (
                f"rejected: without chunked prefill a (re)computed prompt of up to {prompt + output - 1} tokens "
                f"must fit the step's budget of {self.whole_prompt_budget} tokens"
            )
        return error


def run(
    ledger: Ledger,
    cost,
    admission: Admission,
    front_end: FrontEnd = NO_FRONT_END,
    max_steps: int | None = None,
) -> StepLogBuilder:
    """Run ``ledger``'s requests to the end under ``cost`` (``step_seconds``, and a ``spread_draw`` when its
    steps scatter); returns the step log.

    ``front_end``: the host's work on each request before the engine sees it (iteration-level schedulers).
    ``max_steps``: stop with an error after this many turns of the loop (a step function that never
    finishes); None: no limit.
    """
    return _Clock(ledger, cost, admission, front_end).run(sys.maxsize if max_steps is None else max_steps)


class _Clock:
    """The loop's state between turns: the time, the next arrival, the front door and the log."""

    def __init__(self, ledger: Ledger, cost, admission: Admission, front_end: FrontEnd) -> None:
        self.ledger = ledger
        self.requests = ledger.requests
        self.admission = admission
        self.step_seconds = cost.step_seconds
        self.draw = spread_draw(cost)  # the step-time spread, drawn by the step's index (None: none)
        self.door = FrontDoor(front_end)
        self.front_end_works = self.door.active  # whether requests pass through the front door at all
        self.log = StepLogBuilder()
        self.steps = 0  # steps logged: the index of the next one
        self.now = 0.0
        self.arrived = 0  # the requests before this index have arrived
        self.due = 0.0  # when the next request arrives or leaves the front door (s; inf: none will)
        self.busy_since: float | None = None  # start of the step that just ended (None after idling)

    def run(self, turns: int) -> StepLogBuilder:
        """Turn until every request is done: take the arrivals, then idle or run a step.

        A step is scheduled by the ledger, timed by the cost (its expected seconds, times its drawn spread,
        plus the core the front end took), logged once with its final end, then finished by the ledger.
        """
        log, door, front_end_works = self.log, self.door, self.front_end_works
        busy, schedule, finish = self.ledger.busy, self.ledger.schedule, self.ledger.finish
        step_seconds, draw = self.step_seconds, self.draw
        for _ in range(turns):
            if self.now >= self.due:
                self._arrivals()
            if not busy():
                if self._idle():
                    return log
                continue
            index, start = self.steps, self.now
            step = schedule(index, start)
            if step is None:  # a pass that only freed what finished: no time passes
                continue
            prefill, decode, kv_read, pairs, _, _, _ = step
            seconds = step_seconds(prefill, decode, kv_read, pairs)
            end = start + (seconds if draw is None else seconds * draw(index, prefill > 0))  # cost.step_time
            if front_end_works:  # its work shares the engine's core: the last step's leftover, then this one's
                end = door.stretch(start, end + door.taken(), self._upcoming())
            log.add(start, end, *step)
            self.steps = index + 1
            done = finish(index)
            if done and front_end_works:  # their work after the engine takes the core from the next step
                door.finished(done)
            self.busy_since, self.now = start, end
        raise RuntimeError(f"the simulation did not finish within {turns} steps")

    def _upcoming(self) -> Iterator[float]:
        """The arrival times of the requests that have not arrived yet, in order."""
        return (r.arrival_time for r in itertools.islice(self.requests, self.arrived, None))

    def _arrivals(self) -> None:
        """The requests that have arrived by now, through the front end (when it has work) to the door."""
        requests, now, door = self.requests, self.now, self.door
        arrived, total = self.arrived, len(requests)
        if not self.front_end_works:
            while arrived < total and requests[arrived].arrival_time <= now:
                self._door(requests[arrived])
                arrived += 1
            self.arrived = arrived
            self.due = requests[arrived].arrival_time if arrived < total else math.inf
            return
        since = self.busy_since
        while arrived < total and requests[arrived].arrival_time <= now:
            request = requests[arrived]
            door.arrive(request, request.arrival_time, since is not None and request.arrival_time > since)
            arrived += 1
        self.arrived = arrived
        for request in door.release(now):
            self._door(request)
        ready = door.next_ready()
        self.due = min(requests[arrived].arrival_time if arrived < total else math.inf,
                       math.inf if ready is None else ready)  # fmt: skip

    def _door(self, request) -> None:
        """Reject a request that could never run, shed one that finds the queue full, queue the rest."""
        error = self.admission.rejection(request)
        limit = self.admission.max_num_queued_reqs
        if error is None and limit is not None and rules.queue_full(self.ledger.unfinished(), limit):
            error = rules.QUEUE_FULL
        if error is None:
            self.ledger.queue(request)
        else:
            self.ledger.reject(request, error)

    def _idle(self) -> bool:
        """Nobody waits or runs: jump to the next arrival or the next request the front end readies.
        True when there is none: every request is done."""
        self.ledger.settle()
        upcoming = [self.requests[self.arrived].arrival_time] if self.arrived < len(self.requests) else []
        if self.door:
            upcoming.append(self.door.next_ready())
        if not upcoming:
            return True
        later = max(self.now, min(upcoming))
        if self.front_end_works:  # the front end's leftover work runs while the engine idles
            self.door.idle(later - self.now)
        self.now, self.busy_since = later, None
        return False
