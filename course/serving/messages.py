"""The messages between the API server and the engine core process, one typed record each.

As in vLLM V1 (``vllm/v1/engine/__init__.py``: ``EngineCoreRequest``, ``EngineCoreOutputs``, msgspec
structs sent over ZMQ) and mini-sglang's ``message`` package, every message that crosses the process
boundary has a type of its own, and the receiving side dispatches on that type, never on a string:

* commands, server to core (a few per request): :class:`AddRequest`, :class:`AbortRequest`,
  :class:`AbortAll`, :class:`Shutdown`; frozen dataclasses sent with ``Connection.send`` (pickle: the
  sampling parameters travel as they are);
* outputs, core to server (one per engine step while busy, so on every token's path):
  :class:`CoreReady` or :class:`CoreFailed` once at start, then :class:`StepOutputs`; msgspec structs
  encoded as MessagePack and framed by ``Connection.send_bytes`` / ``recv_bytes``. msgspec encodes and
  decodes them in C, and decodes each event straight into a :class:`~course.serving.request.TokenEvent`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from course.serving.request import TokenEvent
from course.serving.sampler import SamplingParams

# --- commands: API server -> engine core ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request (its prompt already checked on the server's side)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop one request before the core's next decode step; ``reason`` becomes its finish reason."""

    request_id: str
    reason: str = "abort"


@dataclass(frozen=True, slots=True)
class AbortAll:
    """Fail every waiting and running request with a 503 error event saying ``reason``."""

    reason: str


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Abort everything and end the core's loop."""


Command = AddRequest | AbortRequest | AbortAll | Shutdown


# --- outputs: engine core -> API server -----------------------------------------------------------


class CoreReady(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The core built its engine: the limits it resolved, its runner's name and its first counters."""

    max_batch_size: int
    max_model_len: int
    runner: str
    stats: dict[str, Any]


class CoreFailed(msgspec.Struct, tag=True, array_like=True, frozen=True):
    """The core could not build its engine (a bad argument, a model its runner cannot run)."""

    error: str


class StepOutputs(msgspec.Struct, tag=True, array_like=True, gc=False):
    """One engine step's events, ``(request id, event)`` in order, and a snapshot of the engine's
    counters when one is due (None otherwise)."""

    events: list[tuple[str, TokenEvent]]
    stats: dict[str, Any] | None = None


CoreOutput = CoreReady | CoreFailed | StepOutputs

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(CoreOutput)


def encode_output(message: CoreOutput) -> bytes:
    """The bytes of one output message (for ``Connection.send_bytes``)."""
    return _ENCODER.encode(message)


def decode_output(data: bytes) -> CoreOutput:
    """The output message in ``data`` (from ``Connection.recv_bytes``), its events as TokenEvents."""
    return _DECODER.decode(data)
