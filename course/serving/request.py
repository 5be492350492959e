"""One request inside the engine, and the sink its events travel through (nano-vllm's ``Sequence``).

The engine thread produces :class:`TokenEvent` objects; the consumer is plain code (``for``), another
thread, or a coroutine on an event loop (``async for``). Each request's :class:`EventSink` holds
its events in a thread-safe queue until an ``async for`` attaches a loop, and from then on hands
them to that loop. :func:`deliver` sends one step's events with one wake-up per event loop, not
one per token: at 64 streams that is the difference between one ``call_soon_threadsafe`` and 64.

A sink consumed with ``async for`` may be given a bound (:meth:`EventSink.bound`): once more events
wait in its queue than that (its consumer, a stream whose client stopped reading, fell behind), a
callback runs once; the server aborts the request there, so a client that reads nothing holds neither
a batch slot nor an unbounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, NamedTuple

from course.serving.sampler import SamplingParams


class EngineStopped(RuntimeError):
    """The engine was shut down while a request was waiting or running."""


class FinishReason(enum.StrEnum):
    """Why a request finished, as vLLM V1 names it (``vllm/v1/engine/__init__.py``, ``FinishReason``, 0.32).

    vLLM's is an ``IntEnum`` (compact on its wire) whose ``str()`` is the OpenAI API's value; here the
    values are those strings themselves, so the server writes a reason into a response as it is.
    What went wrong travels beside it, never inside it: :class:`TokenEvent`'s ``error`` and ``status``.
    """

    STOP = "stop"  # end-of-sequence or a stop token (the server's stop strings end a stream as "stop" too)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller (its client went away)
    ERROR = "error"  # the engine failed the request, or is shutting down: see the event's error and status


class TokenEvent(NamedTuple):
    """What the engine hands a request after a step (a named tuple: one is made for every token,
    and a named tuple is about three times quicker to make than a frozen dataclass).

    ``token`` is the new token id (None for an event without a token: an abort or an error).
    ``finish_reason`` (a :class:`FinishReason`) is set on the request's last event; with
    ``FinishReason.ERROR``, ``error`` says why and ``status`` is the HTTP status it means: 500 a
    failure (:func:`failed`), 503 an engine that is shutting down (:func:`unavailable`).
    """

    token: int | None
    finish_reason: FinishReason | None = None
    error: str | None = None
    status: int | None = None  # with an error: the HTTP status it means (500 a failure, 503 shutting down)
    logprob: float | None = None  # with SamplingParams.logprobs: the token's log-probability
    top_logprobs: tuple[tuple[int, float], ...] = ()  # and the most likely (token id, logprob) pairs


ABORTED = TokenEvent(None, FinishReason.ABORT)
"""The last event of a request aborted by its caller."""


def failed(message: str) -> TokenEvent:
    """The last event of a request the engine failed (status 500), ``message`` saying why."""
    return TokenEvent(None, FinishReason.ERROR, message, 500)


def unavailable(message: str) -> TokenEvent:
    """The last event of a request ended because the engine is shutting down or gone (status 503)."""
    return TokenEvent(None, FinishReason.ERROR, message, 503)


class EventSink:
    """Where one request's events wait for their consumer: a queue, then an event loop once one attaches."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.async_queue: asyncio.Queue | None = None
        self._sync_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._limit = 0
        self._on_full: Callable[[], None] | None = None

    def bound(self, limit: int, on_full: Callable[[], None]) -> None:
        """Call ``on_full()`` once, on the consumer's event loop, when more than ``limit`` events wait
        for an ``async for`` consumer."""
        self._limit, self._on_full = limit, on_full

    def put(self, event: TokenEvent) -> None:
        """The consumer's event loop: queue ``event`` for it (and check the bound)."""
        self.async_queue.put_nowait(event)
        if self._on_full is not None and self.async_queue.qsize() > self._limit:
            on_full, self._on_full = self._on_full, None
            on_full()

    @property
    def backlog(self) -> int:
        """Events waiting for an ``async for`` consumer (0 before one attached)."""
        return self.async_queue.qsize() if self.async_queue is not None else 0

    def route(self, event: TokenEvent) -> asyncio.AbstractEventLoop | None:
        """Engine thread: queue ``event`` for a plain consumer, or return the loop to hand it to."""
        with self._lock:
            if self.loop is None:
                self._sync_queue.put(event)
                return None
            return self.loop

    def __iter__(self) -> Iterator[TokenEvent]:
        if self.loop is not None:
            raise TypeError("this request is already consumed with `async for`")
        while True:
            event = self._sync_queue.get()
            yield event
            if event.finish_reason is not None:
                return

    async def events(self) -> AsyncIterator[TokenEvent]:
        with self._lock:
            if self.loop is None:
                self.async_queue = asyncio.Queue()
                while not self._sync_queue.empty():  # events that came before we attached
                    self.async_queue.put_nowait(self._sync_queue.get())
                self.loop = asyncio.get_running_loop()
        while True:
            event = await self.async_queue.get()
            yield event
            if event.finish_reason is not None:
                return


def deliver(pending: list[tuple[EngineRequest, TokenEvent]]) -> None:
    """Hand each event to its request's sink: one wake-up per event loop, and none for the loop
    this runs on (the engine core process's events are read on the server's loop)."""
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:  # the engine thread, or a reader thread
        here = None
    by_loop: dict[Any, list] = {}
    for request, event in pending:
        loop = request.sink.route(event)
        if loop is not None and loop is here:
            request.sink.put(event)
        elif loop is not None:
            by_loop.setdefault(loop, []).append((request.sink, event))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
            loop.call_soon_threadsafe(_put_all, items)


def wait_for_tokens(request: EngineRequest) -> list[int]:
    """Consume ``request``'s events in plain code (not inside an event loop) until it finishes;
    return its token ids. RuntimeError if it ended with an error."""
    for event in request:
        if event.error:
            raise RuntimeError(event.error)
    return list(request.output_ids)


def _put_all(items: list[tuple[EventSink, TokenEvent]]) -> None:
    for sink, event in items:
        sink.put(event)


class EngineRequest:
    """One request inside the engine: its prompt, its output so far, and where events go.

    Iterate over it (``for event in request`` or ``async for event in request``) to receive its
    :class:`TokenEvent` objects as the engine produces them. The counters record, in engine
    steps, when things happened, so tests can check server-side that an aborted request stopped
    within one decode step.
    """

    def __init__(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None  # with FinishReason.ERROR: why
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.abort_requested_step: int | None = None  # engine step count when abort() was called
        self.freed_step: int | None = None  # engine step count when its cache rows were released
        self.steps_after_abort = 0  # decode steps run for it after abort() was called
        self.generator = None  # the seeded torch.Generator of its sampler (made on first use)
        self.num_computed_tokens = 0  # prompt tokens in its KV cache (a chunked prefill's progress)
        self.prefill_cache = None  # the KV cache of its prompt while partly prefilled, kept between iterations
        self.block_hashes: list[bytes] = []  # chained hashes of its prompt's full blocks (with prefix caching)
        self.cache_salt = cache_salt  # salts those hashes: only requests with the same salt share cached blocks
        self.sink = EventSink()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def prompt_tokens_left(self) -> int:
        """Prompt tokens not yet prefilled (0 once it has its first token)."""
        return len(self.prompt_ids) - self.num_computed_tokens

    def __iter__(self) -> Iterator[TokenEvent]:
        return iter(self.sink)

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self.sink.events()

    def __repr__(self) -> str:
        state = self.finish_reason or ("running" if self.output_ids else "waiting")
        sizes = f"{len(self.prompt_ids)} prompt tokens, {len(self.output_ids)} out"
        return f"EngineRequest({self.request_id!r}, {sizes}, {state})"
