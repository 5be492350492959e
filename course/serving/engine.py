"""A continuous-batching inference engine: prefill once, then batched decode steps with the KV cache.

The engine owns the model and runs it on one background thread, the way vLLM's engine core runs
apart from its API server. Requests come in from any thread or event loop (:meth:`Engine.submit`);
each iteration of the engine loop

1. drops aborted requests (a client that went away) and frees their rows of the cache;
2. admits waiting requests while there is room in the batch: their prompts are prefilled
   together in one forward pass, and each gets its first token;
3. runs **one decode step for every running request at once** (one forward pass over a batch
   of one new token per request) and hands each request its next token.

New requests therefore join between two decode steps, and finished ones leave between two
steps: iteration-level ("continuous") batching as in Orca (OSDI'22) and vLLM. With
``max_batch_size=1`` the same engine serves one request at a time, first come first served.

**Batching sequences of different lengths.** All running requests share one
``transformers`` dynamic cache whose tensors are ``(batch, kv_heads, T, head_dim)``. A row
shorter than ``T`` is padded on the *left*; an attention mask hides the padding and explicit
position ids give every token its true position, so each row computes exactly what it would
compute alone (up to float rounding; ``tests/test_serving_engine.py`` checks that batched greedy
output equals one-at-a-time greedy output in float64). Rows join by concatenation along the
batch dimension and leave by index selection; columns that are padding in every row are
trimmed away. The dynamic cache already copies itself on every step (it appends with
``torch.cat``), so a join or a leave costs about one extra step's worth of copying.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from course.models import LanguageModel, forward, new_cache
from course.serving.sampler import Sampler, SamplingParams

__all__ = ["Engine", "EngineRequest", "EngineStopped", "SamplingParams", "TokenEvent"]


class EngineStopped(RuntimeError):
    """The engine was shut down while a request was waiting or running."""


@dataclass(frozen=True)
class TokenEvent:
    """What the engine hands a request after a step.

    ``token`` is the new token id (None for an event without a token: an abort or an error).
    ``finish_reason`` is set on the request's last event: "stop" (end-of-sequence or a stop
    token), "length" (max_tokens reached), "abort" (aborted by the caller) or "error" (then
    ``error`` says why and ``status`` is 500, or 503 when the engine is shutting down).
    """

    token: int | None
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None  # with an error: the HTTP status it means (500 a failure, 503 shutting down)


class EngineRequest:
    """One request inside the engine: its prompt, its output so far, and where events go.

    Iterate over it (``for event in request`` or ``async for event in request``) to receive its
    :class:`TokenEvent` objects as the engine produces them. The counters record, in engine
    steps, when things happened, so tests can check server-side that an aborted request stopped
    within one decode step.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.abort_requested_step: int | None = None  # engine step count when abort() was called
        self.freed_step: int | None = None  # engine step count when its cache rows were released
        self.steps_after_abort = 0  # decode steps run for it after abort() was called
        # Events go to a thread-safe queue until an `async for` attaches an event loop; from then on
        # they are handed to that loop (so one request works from plain code, threads and coroutines).
        self._sink_lock = threading.Lock()
        self._loop = None
        self._async_queue: asyncio.Queue | None = None
        self._sync_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.generator = None  # the seeded torch.Generator of its sampler (made on first use)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    # --- consuming events ------------------------------------------------------------------

    def __iter__(self) -> Iterator[TokenEvent]:
        if self._loop is not None:
            raise TypeError("this request is already consumed with `async for`")
        while True:
            event = self._sync_queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[TokenEvent]:
        with self._sink_lock:
            if self._loop is None:
                self._async_queue = asyncio.Queue()
                while not self._sync_queue.empty():  # events that came before we attached
                    self._async_queue.put_nowait(self._sync_queue.get())
                self._loop = asyncio.get_running_loop()
        while True:
            event = await self._async_queue.get()
            yield event
            if event.finish_reason is not None:
                return

    def _route(self, event: TokenEvent):
        """Engine thread: queue ``event`` for a plain consumer, or return the loop to hand it to."""
        with self._sink_lock:
            if self._loop is None:
                self._sync_queue.put(event)
                return None
            return self._loop

    def __repr__(self) -> str:
        state = self.finish_reason or ("running" if self.output_ids else "waiting")
        sizes = f"{len(self.prompt_ids)} prompt tokens, {len(self.output_ids)} out"
        return f"EngineRequest({self.request_id!r}, {sizes}, {state})"


@cache
def _forward_accepts(model_class: type, name: str) -> bool:
    return name in inspect.signature(model_class.forward).parameters


class Engine:
    """Continuous-batching greedy/sampling generation over a :class:`~course.models.LanguageModel`.

    Args:
        lm: the model and tokenizer.
        max_batch_size: most requests decoded together; 1 = one request at a time.
        max_model_len: most tokens (prompt + output) per request; default: the model's
            ``max_position_embeddings``.
        max_prefill_tokens: prompt tokens prefilled in one iteration at most (at least one
            request is always admitted). A burst of new requests is prefilled in groups between
            decode steps: the first of them get their first token sooner, and running requests
            stall for a bounded time.
        background: run the engine loop on its own thread (the default). False: nothing runs
            until the caller calls :meth:`step`, one iteration at a time (tests drive it by hand,
            as with vLLM's ``LLMEngine.step()``).
    """

    def __init__(
        self,
        lm: LanguageModel,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 512,
        background: bool = True,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.lm = lm
        self.max_batch_size = max_batch_size
        config_len = getattr(lm.model.config, "max_position_embeddings", None) or 4096
        self.max_model_len = int(max_model_len or config_len)
        if self.max_model_len > config_len:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {config_len} positions")
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = _eos_ids(lm)
        self.pad_token_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
        self._logits_kw = {"logits_to_keep": 1} if _forward_accepts(type(lm.model), "logits_to_keep") else {}
        # With SDPA attention a ready 4D boolean mask skips transformers' per-step mask building.
        self._mask_4d = getattr(lm.model.config, "_attn_implementation", None) == "sdpa"
        self.sampler = Sampler()

        self._lock = threading.Condition()
        self._waiting: deque[EngineRequest] = deque()
        self._abort: dict[str, str] = {}  # request id -> finish reason to report
        self._requests: dict[str, EngineRequest] = {}  # every unfinished request, by id
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._background = background
        self._stopping = False

        # Engine-thread state (touched only by the engine thread).
        self._rows: list[EngineRequest] = []  # running requests, in cache-row order
        self._cache = None  # one dynamic cache for all rows, left-padded to a common length
        self._lengths = None  # (rows,) real tokens held per row
        self._next = None  # (rows, 1) the token each row feeds into the next step
        self._padded = False  # any row shorter than the cache?

        # Counters (read from any thread; written by the engine thread).
        self.steps = 0  # decode steps run
        self.prefills = 0  # prefill forward passes run
        self.tokens_generated = 0
        self.batch_size_sum = 0  # sum over decode steps of the batch size (mean = / steps)
        self.decode_seconds = 0.0  # time spent in decode steps (forward + sampling + hand-off)
        self.prefill_seconds = 0.0
        self.last_error: str | None = None
        self.iterations: deque[tuple[float, float]] = deque(maxlen=4096)  # (start, seconds) of recent iterations
        self._pending: list[tuple[EngineRequest, TokenEvent]] = []  # events to deliver after this step

    # --- public API (any thread) --------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> EngineRequest:
        """Queue a request; iterate over the returned request to receive its tokens.

        Consume the events with ``for`` (plain code, any thread) or ``async for`` (a coroutine).
        """
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context of {self.max_model_len} tokens"
            )
        vocab = self.lm.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        rid = request_id or f"req-{next(self._ids)}"
        request = EngineRequest(rid, prompt_ids, params)
        with self._lock:
            if self._stopping:
                raise EngineStopped("the engine is shut down")
            if rid in self._requests:
                raise ValueError(f"request id {rid!r} is already running")
            self._requests[rid] = request
            self._waiting.append(request)
            self._lock.notify()
        self._ensure_started()
        return request

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request (the client went away, or it hit a stop string) and free its cache rows.

        Takes effect before the engine's next decode step. Unknown or finished ids are ignored.
        """
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.finished or request_id in self._abort:
                return
            request.abort_requested_step = self.steps
            self._abort[request_id] = reason
            self._lock.notify()

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Fail every waiting and running request with an error event of status 503 (used at shutdown)."""
        with self._lock:
            for rid, request in self._requests.items():
                if not request.finished and rid not in self._abort:
                    request.abort_requested_step = self.steps
                    self._abort[rid] = "unavailable:" + reason
            self._lock.notify()

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Generate synchronously (from plain code, not inside an event loop); returns the token ids."""
        request = self.submit(prompt_ids, params)
        for event in request:
            if event.error:
                raise RuntimeError(event.error)
        return list(request.output_ids)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything and stop the engine thread."""
        self.abort_all()
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished (waiting, running, or being aborted)."""
        with self._lock:
            return len(self._requests)

    def cache_tokens(self) -> int:
        """Token slots held by the batch cache (rows x padded length); 0 when idle."""
        cache_obj = self._cache
        if cache_obj is None:
            return 0
        keys = cache_obj.layers[0].keys
        return int(keys.shape[0] * keys.shape[-2])

    def stats(self) -> dict[str, Any]:
        """Counters for /health, tests and plots."""
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "unfinished": self.num_unfinished,
            "steps": self.steps,
            "prefills": self.prefills,
            "tokens_generated": self.tokens_generated,
            "mean_batch_size": self.batch_size_sum / self.steps if self.steps else 0.0,
            "mean_decode_step_ms": 1e3 * self.decode_seconds / self.steps if self.steps else 0.0,
            "prefill_seconds": self.prefill_seconds,
            "cache_tokens": self.cache_tokens(),
            "max_batch_size": self.max_batch_size,
            "max_model_len": self.max_model_len,
        }

    # --- the engine thread ----------------------------------------------------------------------

    def step(self) -> bool:
        """Run one engine iteration now, on this thread (only with ``background=False``).

        Returns True once the engine is stopped. Does not wait: with nothing to do it returns False.
        """
        import torch

        if self._background:
            raise RuntimeError("this engine runs its own loop; step() is for Engine(..., background=False)")
        with torch.inference_mode():
            return self._iteration(block=False)

    def _ensure_started(self) -> None:
        if self._background and self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="course-engine", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                try:
                    if self._iteration():
                        return
                except Exception as err:  # a bug outside a forward pass: fail what is in flight, keep serving
                    self.last_error = f"engine loop failed: {type(err).__name__}: {err}"
                    self._fail_everything(self.last_error)

    def _iteration(self, block: bool = True) -> bool:
        """One engine iteration: aborts, admissions (prefill), one decode step. True when stopped.

        Aborts are taken (and aborted waiting requests leave the queue) *before* admission, under
        the same lock: a request aborted before it ran is never prefilled.
        """
        with self._lock:
            while block and not (self._waiting or self._rows or self._abort or self._stopping):
                self._lock.wait()
            if self._stopping and not self._abort:
                self._fail_everything("the engine is shut down", unavailable=True)
                return True
            aborts, self._abort = self._abort, {}
            aborted_waiting = [r for r in self._waiting if r.request_id in aborts]
            for request in aborted_waiting:
                self._waiting.remove(request)
            admitted = [] if self._stopping else self._admit()
        started = time.perf_counter()
        self._apply_aborts(aborts, aborted_waiting)
        if admitted:
            start = time.perf_counter()
            self._guarded(self._prefill, admitted)
            self.prefill_seconds += time.perf_counter() - start
        if self._rows:
            start = time.perf_counter()
            self._guarded(self._decode, list(self._rows))
            self.decode_seconds += time.perf_counter() - start
        self.iterations.append((started, time.perf_counter() - started))
        return False

    def _admit(self) -> list[EngineRequest]:
        """Pop waiting requests that fit in the batch and the prefill budget (lock held)."""
        admitted: list[EngineRequest] = []
        budget = self.max_prefill_tokens
        while self._waiting and len(self._rows) + len(admitted) < self.max_batch_size:
            request = self._waiting[0]
            if admitted and len(request.prompt_ids) > budget:
                break
            self._waiting.popleft()
            admitted.append(request)
            budget -= len(request.prompt_ids)
        return admitted

    def _apply_aborts(self, aborts: dict[str, str], waiting: list[EngineRequest]) -> None:
        """Finish aborted requests: ``waiting`` ones (already out of the queue) and running rows."""
        if not aborts:
            return
        for request in waiting:
            request.freed_step = self.steps  # it never held cache rows
            self._finish(request, aborts[request.request_id])
        leaving = [i for i, r in enumerate(self._rows) if r.request_id in aborts]
        for i in leaving:
            self._finish(self._rows[i], aborts[self._rows[i].request_id])
        self._drop_rows(leaving)

    def _guarded(self, work, requests: list[EngineRequest]) -> None:
        """Run a forward pass; if it fails, fail its requests (not the engine) and drop their rows."""
        try:
            work(requests)
        except Exception as err:  # an engine bug or out-of-memory must not kill the server
            message = f"generation failed: {type(err).__name__}: {err}"
            self.last_error = message
            rows = [i for i, r in enumerate(self._rows) if r in requests]
            for request in requests:
                if not request.finished:
                    self._finish(request, "error:" + message)
            self._drop_rows(rows)

    def _prefill(self, requests: list[EngineRequest]) -> None:
        """One forward pass over the admitted prompts (left-padded to a common length)."""
        import torch

        device = self.lm.device
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, width - lengths[row] :] = torch.tensor(request.prompt_ids)
        kwargs = dict(self._logits_kw)
        if min(lengths) != width:  # ragged: hide the padding and give real positions
            mask = (torch.arange(width).unsqueeze(0) >= (width - torch.tensor(lengths)).unsqueeze(1)).long()
            kwargs["attention_mask"] = mask.to(device)
            kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(device)
        logits, prompt_cache = forward(self.lm.model, ids.to(device), new_cache(self.lm.model), **kwargs)
        self.prefills += 1
        tokens = self._sample(logits[:, -1, :], requests)
        now = time.perf_counter()
        keep = []
        for row, (request, token) in enumerate(zip(requests, tokens)):
            request.first_token_time = now
            if token is not None and not self._emit(request, token):
                keep.append(row)
        if keep:
            self._join(prompt_cache, keep, [lengths[i] for i in keep], [tokens[i] for i in keep], requests)
        self._flush()

    def _decode(self, rows: list[EngineRequest]) -> None:
        """One decode step for every running request."""
        import torch

        kwargs = {}
        if self._padded:
            width = self._cache.layers[0].keys.shape[-2]
            columns = torch.arange(width + 1, device=self._lengths.device).unsqueeze(0)
            visible = columns >= (width - self._lengths).unsqueeze(1)  # (rows, width + 1): not padding
            kwargs["attention_mask"] = visible[:, None, None, :] if self._mask_4d else visible.long()
            kwargs["position_ids"] = self._lengths.unsqueeze(1)
        logits, self._cache = forward(self.lm.model, self._next, self._cache, **kwargs)
        self._lengths += 1
        self.steps += 1
        self.batch_size_sum += len(rows)
        tokens = self._sample(logits[:, -1, :], rows)
        leaving = []
        for row, (request, token) in enumerate(zip(rows, tokens)):
            if request.abort_requested_step is not None:
                request.steps_after_abort += 1
            if token is None or self._emit(request, token):
                leaving.append(row)
        fed = [self.pad_token_id if t is None else t for t in tokens]  # a failed row leaves below
        self._next = torch.tensor(fed, dtype=torch.long, device=self._next.device).unsqueeze(1)
        self._drop_rows(leaving)  # free the cache before the finished requests hear about it
        self._flush()

    def _sample(self, logits, requests: list[EngineRequest]) -> list[int | None]:
        """Next tokens of ``requests`` (logits: (rows, vocab)); a row whose sampling failed is failed
        here, alone, and gets None."""
        tokens = self.sampler(logits, requests)
        for i, (request, token) in enumerate(zip(requests, tokens)):
            if isinstance(token, Exception):
                self._finish(request, f"error:sampling failed: {type(token).__name__}: {token}")
                tokens[i] = None
        return tokens

    def _emit(self, request: EngineRequest, token: int) -> bool:
        """Record a token and queue its event; True when the request is finished."""
        request.output_ids.append(token)
        self.tokens_generated += 1
        params = request.params
        reason = None
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"
        elif len(request.output_ids) >= params.max_tokens:
            reason = "length"
        if reason is not None:
            self._close(request, reason)
        self._pending.append((request, TokenEvent(token, reason)))
        return reason is not None

    def _finish(self, request: EngineRequest, reason: str) -> None:
        """End a request without a token and deliver that final event.

        ``reason``: "abort", "error:<message>" (status 500) or "unavailable:<message>" (503).
        """
        error = status = None
        kind, _, message = reason.partition(":")
        if kind in ("error", "unavailable"):
            reason, error, status = "error", message, 503 if kind == "unavailable" else 500
        request.error = error
        self._close(request, reason)
        self._pending.append((request, TokenEvent(None, reason, error, status)))
        self._flush()

    def _close(self, request: EngineRequest, reason: str) -> None:
        request.finish_reason = reason
        with self._lock:
            self._requests.pop(request.request_id, None)
            self._abort.pop(request.request_id, None)

    def _flush(self) -> None:
        """Deliver queued events: one wake-up per event loop per step, not one per token."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        by_loop: dict[Any, list] = {}
        for request, event in pending:
            loop = request._route(event)
            if loop is not None:
                by_loop.setdefault(loop, []).append((request._async_queue, event))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
                loop.call_soon_threadsafe(_deliver, items)

    # --- the batch cache --------------------------------------------------------------------

    def _join(self, prompt_cache, keep: list[int], lengths: list[int], tokens: list[int], requests) -> None:
        """Add prefilled rows to the running batch (both sides left-padded to a common width)."""
        import torch
        import torch.nn.functional as F

        device = self.lm.device
        index = torch.tensor(keep, device=device)
        new_layers = [(layer.keys, layer.values) for layer in prompt_cache.layers]
        if len(keep) != len(requests):
            new_layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in new_layers]
        new_width = new_layers[0][0].shape[-2]
        new_lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        new_next = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)
        if self._cache is None:
            self._cache = prompt_cache
            for layer, (k, v) in zip(self._cache.layers, new_layers):
                layer.keys, layer.values = k, v
            self._lengths, self._next = new_lengths, new_next
        else:
            old_width = self._cache.layers[0].keys.shape[-2]
            width = max(old_width, new_width)
            for layer, (k, v) in zip(self._cache.layers, new_layers):
                pad_old, pad_new = (0, 0, width - old_width, 0), (0, 0, width - new_width, 0)
                layer.keys = torch.cat([F.pad(layer.keys, pad_old), F.pad(k, pad_new)], dim=0)
                layer.values = torch.cat([F.pad(layer.values, pad_old), F.pad(v, pad_new)], dim=0)
            self._lengths = torch.cat([self._lengths, new_lengths])
            self._next = torch.cat([self._next, new_next])
        self._rows.extend(requests[i] for i in keep)
        self._update_padding()

    def _drop_rows(self, rows: list[int]) -> None:
        """Remove finished rows from the batch and trim columns that are padding in every row."""
        if not rows:
            return
        import torch

        for i in rows:
            self._rows[i].freed_step = self.steps
        keep = [i for i in range(len(self._rows)) if i not in set(rows)]
        self._rows = [self._rows[i] for i in keep]
        if not keep or self._cache is None:
            self._cache = self._lengths = self._next = None
            self._rows = []
            self._padded = False
            return
        index = torch.tensor(keep, device=self._lengths.device)
        self._lengths = self._lengths.index_select(0, index)
        self._next = self._next.index_select(0, index)
        width = self._cache.layers[0].keys.shape[-2]
        trim = width - int(self._lengths.max())
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, trim:, :]
            layer.values = layer.values.index_select(0, index)[:, :, trim:, :]
        self._update_padding()

    def _update_padding(self) -> None:
        width = self._cache.layers[0].keys.shape[-2]
        self._padded = bool((self._lengths != width).any())

    def _fail_everything(self, reason: str, unavailable: bool = False) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for request in waiting + list(self._rows):
            if not request.finished:
                self._finish(request, ("unavailable:" if unavailable else "error:") + reason)
        self._drop_rows(list(range(len(self._rows))))


def _deliver(items: list) -> None:
    for async_queue, event in items:
        async_queue.put_nowait(event)


def _eos_ids(lm: LanguageModel) -> frozenset[int]:
    ids = set()
    for source in (getattr(lm.model, "generation_config", None), lm.model.config, lm.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
