"""The messages between the API server and the engine core process, one typed record each.

As in vLLM V1 (``vllm/v1/engine/__init__.py``: ``EngineCoreRequest`` and ``EngineCoreOutputs`` cross
its process boundary as typed structs) and mini-sglang's ``message`` package, every message that
crosses the process boundary has a type of its own, and the receiving side dispatches on that type,
never on a string. All of them travel with ``Connection.send`` / ``recv`` (pickle, and the standard
library's framing):

* commands, server to core (a few per request): :class:`AddRequest`, :class:`AbortRequest`,
  :class:`AbortAll`, :class:`Shutdown`;
* outputs, core to server: :class:`CoreReady` or :class:`CoreFailed` once at start, then one
  :class:`StepOutputs` per engine step while busy, so on every token's path. A
  :class:`~course.serving.request.TokenEvent` pickles several times slower than the plain tuple of
  its fields (a named tuple is rebuilt through Python code), so :class:`StepOutputs` pickles its
  events as tuples and rebuilds them on arrival: the wire format stays inside the message type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from course.serving.request import FinishReason, TokenEvent
from course.serving.sampler import SamplingParams

# --- commands: API server -> engine core ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request (its prompt checked by ``EngineProcess.submit``: the core queues it as it is)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # the prefix cache's salt (vLLM's cache_salt), None: unsalted


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop one request before the core's next decode step; ``reason`` becomes its finish reason."""

    request_id: str
    reason: FinishReason = FinishReason.ABORT


@dataclass(frozen=True, slots=True)
class AbortAll:
    """Fail every waiting and running request with a 503 error event saying ``reason``."""

    reason: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort everything and end the core's loop."""


Command = AddRequest | AbortRequest | AbortAll | Shutdown


# --- outputs: engine core -> API server -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CoreReady:
    """The core built its engine: the limits it resolved, its runner's name and its first counters."""

    max_batch_size: int
    max_model_len: int
    runner: str
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The core could not build its engine (a bad argument, a model its runner cannot run)."""

    error: str


@dataclass(slots=True)
class StepOutputs:
    """One engine step's events, ``(request id, event)`` in order, and a snapshot of the engine's
    counters when one is due (None otherwise)."""

    events: list[tuple[str, TokenEvent]]
    stats: dict[str, Any] | None = None

    def __reduce__(self):
        return _rebuild_step_outputs, ([(request_id, tuple(event)) for request_id, event in self.events], self.stats)


def _rebuild_step_outputs(rows: list[tuple[str, tuple]], stats: dict[str, Any] | None) -> StepOutputs:
    return StepOutputs([(request_id, TokenEvent(*fields)) for request_id, fields in rows], stats)


CoreOutput = CoreReady | CoreFailed | StepOutputs
