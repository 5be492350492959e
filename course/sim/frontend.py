"""The server's front end: the host's work on each request outside the engine's steps.

A request does not reach the scheduler when it arrives. The server's front end reads it, parses and
tokenizes it first, and on the way out detokenizes and streams its tokens. How long that takes, and
whether it competes with the engine for the CPU, is a fact of the machine, not of the scheduling
rules (:mod:`course.rules`) or of a step's cost (:class:`course.sim.cost.LinearCost`); this module
holds it:

* :class:`FrontEnd`, the record: ``before_engine`` seconds of work before the engine can schedule a
  request, on the engine's core (module 2's server: its event loop and tokenizer thread share the
  engine's core); a ``latency`` off the engine's steps (vLLM's API server, another process); the
  ``idle_wake`` a request waits more when it finds the whole server idle; the ``slowdown`` of the
  front end's work while a step runs beside it on the same core; whether the front end is ``serial``
  (one thread, vLLM's API server: requests queue for it) or works on each request at once; and the
  ``after_engine`` work on each request that shares the engine's core but holds no request back.
* :class:`FrontDoor`, what the simulation loop (:mod:`course.sim.loop`) asks while it runs: which
  requests are ready for the scheduler's queue, and how much of the core their work took from the steps.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The front end's work takes this many times longer when it arrives while the engine is busy: two
# runnable threads on one core, each getting half of it (a measured FrontEnd.slowdown overrides it).
SHARED_CORE_SLOWDOWN = 2.0


@dataclass(frozen=True)
class FrontEnd:
    """The front end's timing per request (seconds), as a calibration measures it.

    Attributes:
        before_engine: the front end's work on each request before the engine can schedule it
            (reading, parsing and tokenizing it), where the front end shares the engine's core: the
            request reaches the queue that long after it arrives, ``slowdown`` times that long when it
            arrives during a step, which then lasts that much longer (the two share the core:
            :class:`FrontDoor`; iteration-level schedulers). With the step cost's ``e``, what a lone
            request's TTFT costs beyond the forward pass; ``e`` is the part the step that prefills it
            pays (the hand-off, the first token's way out).
        latency: seconds every request spends off the engine's steps (a front end in another
            process: tokenizing, the hand-off to the engine core, the output path). It delays every
            token of a request alike, so it moves TTFT and E2E, not the gaps; the simulator does not
            see it: :meth:`delivered` adds it to simulated traces.
        idle_wake: seconds more that a request waits when it finds the whole server idle (no step
            running, no request at the front door): the machine waking up (a virtual CPU the hypervisor
            had descheduled, caches other programs took over). Measured as the first request of a
            microbenchmark after a pause against the ones that follow it.
        slowdown: how many times longer ``before_engine`` takes for a request that arrives while a step
            runs (2: the front end and the engine share the core evenly; more where the engine keeps the
            core, or Python's GIL, for longer stretches). Measured as lone prefills that arrive while one
            request decodes (``benchmarks/sim_fidelity.py``).
        serial: the front end works on one request at a time, in the order they arrive, so under load a
            request waits for the work on those before it: a queue (vLLM's API server is one process with
            one event loop; pinned to the engine core's core it also shares that core with the steps).
            False: each request's work starts when it arrives (module 2's server hands each request to a
            tokenizer thread of its own).
        after_engine: seconds of the host's work on each request, on the engine's core, beyond
            ``before_engine`` and beyond its tokens' way out: the engine core's bookkeeping for it and the
            end of its response (vLLM's API server and engine core are processes of their own, pinned to the
            worker's core). It delays no request's own tokens; it takes the core from the step after the one
            the request finishes in. A calibration measures it as the front end's processes' CPU time per lone
            request, less its tokens' share and ``before_engine`` (``benchmarks/sim_fidelity.py
            --after-engine``; off by default there: on sixteen live vLLM runs it removed the ITL p50 bias and
            moved TTFT further off). A timeline of two vLLM runs (``benchmarks/host_timeline.py``) found vLLM's
            API server spending about 0.2 ms at a finish, and the engine core's CPU time partly a busy wait, so
            that measure overstates the work (``benchmarks/RESULTS.md``).
    """

    before_engine: float = 0.0
    latency: float = 0.0
    idle_wake: float = 0.0
    slowdown: float = SHARED_CORE_SLOWDOWN
    serial: bool = False
    after_engine: float = 0.0

    def __post_init__(self) -> None:
        for name in ("before_engine", "latency", "idle_wake", "after_engine"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"FrontEnd.{name} must be >= 0 seconds, got {value!r}")
        if not self.slowdown >= 1:
            raise ValueError(f"FrontEnd.slowdown must be >= 1 (2: an even share of the core), got {self.slowdown!r}")

    @property
    def before_first_token(self) -> float:
        """What a lone request's first token waits for the front end (s): its work before the engine and
        its latency off the steps (a calibration's prefill measures both)."""
        return self.before_engine + self.latency

    def delivered(self, traces: Sequence) -> list:
        """Simulated :class:`course.trace.RequestTrace` records as a client would see them: every chunk
        ``latency`` seconds later (the front end's time off the engine's steps). Returns new records."""
        if not self.latency:
            return list(traces)
        return [dataclasses.replace(t, chunk_times=[x + self.latency for x in t.chunk_times]) for t in traces]

    def describe(self) -> str:
        """The front end's terms in words, each after a "; " (empty for a front end that costs nothing)."""
        text = ""
        if self.before_engine:
            text += f"; {self.before_engine * 1e3:.3g} ms of front-end work before the engine sees a request"
        if self.latency:
            text += f"; {self.latency * 1e3:.3g} ms front-end latency per request"
        if self.idle_wake:
            text += f"; {self.idle_wake * 1e3:.3g} ms to wake an idle server"
        if self.before_engine and self.slowdown != SHARED_CORE_SLOWDOWN:
            text += f"; that work {self.slowdown:.3g}x as long beside a step"
        if self.before_engine and self.serial:
            text += "; one request at a time (requests queue for it)"
        if self.after_engine:
            text += f"; {self.after_engine * 1e3:.3g} ms of host work per request after the engine, beside the steps"
        return text


NO_FRONT_END = FrontEnd()


def front_end_of(cost) -> FrontEnd:
    """The front end a simulation's ``cost`` carries (:class:`course.sim.cost.ServerCost`), none otherwise."""
    return getattr(cost, "front_end", None) or NO_FRONT_END


class FrontDoor:
    """Requests the front end is still reading, parsing and tokenizing, released to the scheduler's
    queue in the order they are ready.

    A request that arrives while a step runs shares the core with it, so its work takes
    ``front_end.slowdown`` times longer and the step loses the work's length (:meth:`stretch`); one that
    arrives while the engine idles has the core to itself. A request that finds the whole server idle
    (no step running, nothing at the front door) waits ``front_end.idle_wake`` more for the machine to
    wake up. A ``serial`` front end starts a request's work only once the one before it is done. Each
    request that finishes leaves ``front_end.after_engine`` of work for the next step (:meth:`finished`).
    """

    def __init__(self, front_end: FrontEnd = NO_FRONT_END) -> None:
        self.seconds = front_end.before_engine
        self.wake = front_end.idle_wake
        self.slowdown = front_end.slowdown
        self.serial = front_end.serial
        self.after = front_end.after_engine
        self._free_at = 0.0  # a serial front end: when it is done with the requests it has taken (s)
        self._heap: list[tuple[float, int, object]] = []
        self._arrivals = 0  # tie-break: among requests ready at once, the earlier arrival goes first
        self._taken = 0.0  # seconds of the core the front end takes from the next step

    @property
    def active(self) -> bool:
        """Whether the front end has anything to model (work before or after the engine, a wake-up)."""
        return bool(self.seconds or self.wake or self.after)

    def arrive(self, request, arrival_time: float, busy: bool) -> None:
        """Take ``request``, which arrived at ``arrival_time`` (s) while a step ran (``busy``) or not."""
        work = self.seconds * (self.slowdown if busy else 1.0)
        if not busy and not self._heap:  # nothing running anywhere: the machine wakes up first
            work += self.wake
        if self.serial:  # it starts once the requests before it are done
            ready = self._free_at = max(arrival_time, self._free_at) + work
        else:
            ready = arrival_time + work
        heapq.heappush(self._heap, (ready, self._arrivals, request))
        self._arrivals += 1

    def stretch(self, start: float, end: float, arrival_times: Iterable[float]) -> float:
        """The end (s) of the step that ran from ``start`` to ``end`` once the front end's work on the
        requests that arrived during it has taken its share of the core.

        ``arrival_times``: the arrivals from the first one not yet taken in, in order. Each one that came
        during the step (after ``start``, before its end as stretched so far) shares the core with it:
        the step loses the work, or what was left of the step if that is less, and the next step
        loses the rest (:meth:`taken`). Every request's work is paid once.
        """
        for arrival in arrival_times:
            if arrival > end:
                break
            if arrival > start:
                shared = min(self.seconds, end - arrival)
                end += shared
                self._taken += self.seconds - shared
        return end

    def finished(self, count: int) -> None:
        """``count`` requests finished in the step that just ran: their work after the engine takes the core
        from the next step (:meth:`taken`)."""
        self._taken += count * self.after

    def idle(self, seconds: float) -> None:
        """The engine idles for ``seconds``: the work left for the next step is done meanwhile, as far as it fits."""
        self._taken = max(0.0, self._taken - seconds)

    def taken(self) -> float:
        """The engine's time the front end took from the next step since the last call (s)."""
        taken, self._taken = self._taken, 0.0
        return taken

    def release(self, now: float) -> list:
        """The requests whose front-end work is done by ``now``, in the order they became ready."""
        ready = []
        while self._heap and self._heap[0][0] <= now:
            ready.append(heapq.heappop(self._heap)[2])
        return ready

    def next_ready(self) -> float | None:
        """When the next request will be ready (s), or None when the front end holds none."""
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)
