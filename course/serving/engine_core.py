"""The engine core: a continuous-batching engine's step, with no thread of its own (vLLM V1's ``EngineCore``).

:class:`EngineCore` owns the model, the KV cache and the scheduler, and does one thing: :meth:`EngineCore.step`,
one engine iteration. It runs nothing by itself, as vLLM V1's ``EngineCore`` (``vllm/v1/engine/core.py``,
0.32: ``EngineCore.step``) runs nothing until a client steps it. Its clients, as vLLM's
(``vllm/v1/engine/core_client.py``: ``InprocClient`` and the ``MPClient`` family):

* :class:`~course.serving.engine.Engine`, the in-process client: it steps a core on a background thread of
  the caller's process (or lets the caller step it by hand, ``background=False``);
* :class:`~course.serving.engine_process.EngineProcess`, the multiprocess client: its child process steps a
  core and sends each step's events back over a pipe.

Each iteration of the core (:meth:`EngineCore.step`)

1. drops aborted requests (a client that went away) and frees their rows of the cache;
2. splits the iteration's token budget as vLLM V1 does (:func:`~course.serving.scheduler.split_budget`):
   one token for every running request, then prompt chunks for the partly prefilled and the
   newly admitted requests with what is left;
3. prefills the chunks: the prompts that fit whole are prefilled together in one forward pass;
   a prompt that does not fit is prefilled a chunk per iteration, each chunk one forward pass
   over its tokens with the KV cache of the earlier chunks, which the request keeps between
   iterations (chunked prefill). A request whose prompt is complete gets its first token and
   joins the running batch;
4. runs **one decode step for every running request at once** (one forward pass over a batch
   of one new token per request) and hands each request its next token.

A request that joined in step 3 is decoded in step 4 of the same iteration, as before chunked
prefill: its second token follows its first without waiting an iteration, and every running
stream gets exactly one token per iteration, so a stream's gap is one iteration. vLLM counts that
token in the next step's budget; this engine computes it one iteration early, outside the budget
(``tests/test_serving_admission.py`` runs the split beside the simulator's with that shift).

New requests therefore join between two decode steps, and finished ones leave between two
steps: iteration-level ("continuous") batching as in Orca (OSDI'22) and vLLM; and a long prompt
delays the running requests by one chunk per iteration, never by its whole prefill (Sarathi-Serve,
OSDI'24). With ``max_batch_size=1`` the same engine serves one request at a time, first come first
served.

A request ends with a :class:`~course.serving.request.FinishReason` (vLLM's ``FinishReason``): "stop" or
"length" with its last token, "abort" or "error" in a last event without one, whose ``error`` says what went
wrong and whose ``status`` is the HTTP status it means (:func:`~course.serving.request.failed`: 500,
:func:`~course.serving.request.unavailable`: 503).

The pieces, split as nano-vllm splits its engine (``engine/{scheduler,sequence,model_runner}.py``):

* :mod:`course.serving.scheduler`: the waiting queue, aborts and the token-budget rule (no model). The
  queue is the one place other threads touch: requests and aborts reach the core through it, under its
  lock, while the core's own state is touched only by whoever steps it;
* :mod:`course.serving.batch_cache`: the running rows' KV cache, left-padded (how sequences of
  different lengths share one batch);
* :mod:`course.serving.sampler`: the sampling parameters and the per-row sampler;
* :mod:`course.serving.request`: a request, its finish reasons and the sink that delivers its events;
* :mod:`course.serving.runner`: one forward pass over the batch (a lean Llama-family runner, or
  the ``transformers`` model's own forward pass);
* :mod:`course.serving.prefix_cache`: the keys and values of full prompt blocks, hashed as vLLM
  hashes them, for requests that start with a prompt prefix seen before;
* :mod:`course.serving.memory`: gives the C allocator's free memory back to the system, which the
  tensors of ever new sizes that the steps free would otherwise keep growing;
* this module: the step that ties them to the model (prefill, decode, finishing requests).

**Prefix caching** (``prefix_cache_bytes > 0``; off by default, where vLLM V1 turns it on: the course's
measurements send the same prompt prefixes again and time their prefill, module 5's calibration and module
2's concurrency sweep among them, and a cache would time a shorter prefill than they mean to): when a
request is admitted, the core looks up
the longest run of its prompt's leading full blocks in the prefix cache (never the whole prompt: the
last token is always computed, for its logits), copies their keys and values into the request's own
cache and prefills only the rest, on top of them, as a chunked prefill's later chunk does. Once a
prompt is prefilled, its full blocks go into the cache. A hit is counted where vLLM counts it, at
admission; the token budget of that iteration still counts the whole chunk the scheduler planned, so
the tokens a hit saves are not lent to other prompts in the same iteration (vLLM looks up before it
budgets).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from course.models import LanguageModel
from course.serving.batch_cache import BatchCache
from course.serving.config import EngineConfig
from course.serving.counters import StepCounters
from course.serving.memory import HeapTrimmer
from course.serving.prefix_cache import PrefixCache
from course.serving.request import (
    EngineRequest,
    FinishReason,
    TokenEvent,
    deliver,
    failed,
    unavailable,
)
from course.serving.runner import runner_for
from course.serving.sampler import Sampler
from course.serving.scheduler import Schedule, Scheduler

__all__ = ["EngineCore"]


class EngineCore:
    """One continuous-batching engine iteration at a time over a :class:`~course.models.LanguageModel`.

    Args:
        lm: the model and tokenizer.
        config: the engine's settings (:class:`~course.serving.config.EngineConfig`).
        on_events: where each step's ``(request, TokenEvent)`` pairs go; default
            :func:`~course.serving.request.deliver` (to each request's consumer).
            :mod:`course.serving.engine_process` sends them to another process instead.

    Requests come in with :meth:`add_request` (their prompt checked already:
    :func:`~course.serving.engine_client.checked_prompt`), from any thread; everything else is for the one
    thread that steps the core. A model whose cache cannot be reused (sliding-window layers) runs without
    prefix caching (``prefix_cache_off`` says why).
    """

    def __init__(
        self,
        lm: LanguageModel,
        config: EngineConfig,
        on_events: Callable[[list[tuple[EngineRequest, TokenEvent]]], None] = deliver,
    ) -> None:
        self.config = config
        self.lm = lm
        self.max_batch_size = config.max_batch_size
        self.max_model_len = config.model_len(lm)
        self.max_prefill_tokens = config.max_prefill_tokens
        self.eos_token_ids = _eos_ids(lm)
        self.pad_token_id = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
        self.runner = runner_for(lm.model, config.runner)
        self.scheduler = Scheduler(config.max_batch_size, config.max_prefill_tokens)
        self.batch = BatchCache(lm.device, self.runner.mask_4d)  # touched only by the stepping thread
        budget = config.prefix_cache_bytes
        self.prefix_cache_off = "turned off" if not budget else self.runner.prefix_reuse_unsupported
        # stepping thread only: lookups and insertions happen between forward passes
        self.prefix_cache = PrefixCache(budget) if self.prefix_cache_off is None else None
        self._to_cache: list[tuple[list[EngineRequest], list, list[int]]] = []  # prefills whose blocks to cache
        self.prefilling: list[EngineRequest] = []  # partly prefilled, oldest first (stepping thread only)
        self.sampler = Sampler()
        self._pending: list[tuple[EngineRequest, TokenEvent]] = []  # events to deliver after this step
        self._on_events = on_events

        self.counters = StepCounters()  # written by the stepping thread, read from any
        self.last_error: str | None = None
        self.wedged_after = config.wedged_after
        # gives the C allocator's free memory back after steps of new tensor sizes (course.serving.memory)
        self.heap = HeapTrimmer()
        self.progress = time.monotonic()  # the end of the last iteration, or when work came to an idle core

    # --- requests in (any thread) -----------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> EngineRequest:
        """Queue a request whose prompt was checked already (:func:`~course.serving.engine_client.checked_prompt`).

        EngineStopped once the core is stopped; ValueError for a request id that is already running."""
        if self.prefix_cache is not None:  # hashed here, on the caller's thread, not in the step
            request.block_hashes = self.prefix_cache.hashes(request.prompt_ids, request.cache_salt)
        if not self.scheduler.num_unfinished:
            self.progress = time.monotonic()  # an idle core's silence so far is not a stall
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request with ``reason`` (a :class:`~course.serving.request.FinishReason`: ValueError for
        anything else) before the next decode step, and free its cache rows. Unknown or finished ids are
        ignored."""
        self.scheduler.abort([request_id], TokenEvent(None, FinishReason(reason)), self.counters.steps)

    def abort_all(self, message: str) -> None:
        """End every waiting and running request with an error event of status 503 saying ``message``."""
        self.scheduler.abort(None, unavailable(message), self.counters.steps)

    def stop(self) -> None:
        """Refuse new requests; the next :meth:`step` ends what is left (503) and returns True."""
        self.scheduler.stop()

    # --- the step (the thread that steps the core) ----------------------------------------------------

    def step(self, block: bool = False) -> bool:
        """One engine iteration: aborts, prompt chunks (prefill), one decode step; True once the core is
        stopped (and every request it held has ended). With nothing to do it returns False at once, or, with
        ``block``, waits for a request, an abort or :meth:`stop`. The caller enters ``torch.inference_mode()``
        (once, around its loop: entering it costs a few microseconds every step)."""
        plan = self.scheduler.schedule(len(self.batch), self.prefilling, block)
        if plan.stop:
            self.fail_everything(unavailable("the engine is shut down"))
            return True
        started = time.perf_counter()
        if plan.aborts:
            self._apply_aborts(plan)
        budgeted = len(self.batch)  # the decodes the budget counted (rows joining now come on top)
        prompt_tokens = sum(n for _, n in plan.chunks)
        if plan.chunks:
            start = time.perf_counter()
            self._guarded(self._prefill, plan.chunks, [r for r, _ in plan.chunks])
            self.counters.count_prefill(prompt_tokens, time.perf_counter() - start)
        if self.batch.rows:
            start = time.perf_counter()
            rows = list(self.batch.rows)
            held = self.batch.tokens_held()  # rows x padded length: what the step's attention reads
            self._guarded(self._decode, rows, rows)
            self.counters.count_decode(len(rows), time.perf_counter() - start, held)
        self.counters.count_iteration(started, time.perf_counter() - started, budgeted, prompt_tokens)
        self.progress = time.monotonic()
        self.heap.maybe_trim(idle=not (self.batch.rows or self.prefilling or self.scheduler.waiting))
        return False

    # --- what the core holds (counters: any thread) -------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.batch)

    @property
    def num_waiting(self) -> int:
        """Requests without a token yet: waiting, or with their prompt partly prefilled."""
        return self.scheduler.num_waiting + len(self.prefilling)

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished (waiting, running, or being aborted)."""
        return self.scheduler.num_unfinished

    def cache_tokens(self) -> int:
        """Token slots held by the batch cache (rows x padded length) and by partly prefilled
        prompts; 0 when idle."""
        return self.batch.tokens_held() + sum(r.num_computed_tokens for r in self.prefilling)

    def stats(self) -> dict[str, Any]:
        """Counters for /health, tests and plots."""
        return {
            "running": self.num_running,
            "waiting": self.num_waiting,
            "unfinished": self.num_unfinished,
            **self.counters.as_stats(),
            "cache_tokens": self.cache_tokens(),
            "max_batch_size": self.max_batch_size,
            "max_model_len": self.max_model_len,
            "runner": self.runner.name,
            # the C allocator's free memory given back to the system (course.serving.memory)
            "heap_trims": self.heap.trims,
            "heap_released_bytes": self.heap.released_bytes,
            "heap_trim_seconds": self.heap.seconds,
            **self.prefix_cache_stats(),
        }

    def prefix_cache_stats(self) -> dict[str, Any]:
        """The prefix cache's counters (queries and hits in prompt tokens, as vLLM counts them; blocks
        and bytes held), zeros when it is off; ``prefix_caching`` is "on" or why it is off."""
        if self.prefix_cache is None:
            return {"prefix_caching": self.prefix_cache_off, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                    "prefix_cache_blocks": 0, "prefix_cache_bytes": 0, "prefix_cache_evictions": 0}  # fmt: skip
        return {"prefix_caching": "on", **self.prefix_cache.stats()}

    def stalled(self) -> str | None:
        """Why the core counts as wedged (requests open, no iteration finished for ``wedged_after``
        seconds), or None."""
        silent = time.monotonic() - self.progress
        if self.num_unfinished and silent > self.wedged_after:
            return (
                f"the engine has {self.num_unfinished} requests open and finished no iteration for {silent:.0f} s "
                f"(more than {self.wedged_after:g} s): it is wedged"
            )
        return None

    # --- inside the step ----------------------------------------------------------------------------

    def _apply_aborts(self, plan: Schedule) -> None:
        """Finish aborted requests: the waiting ones (already out of the queue), partly prefilled
        ones and running rows."""
        for request in plan.aborted_waiting:
            request.freed_step = self.counters.steps  # it never held cache rows
            self._finish(request, plan.aborts[request.request_id])
        for request in self._stop_prefilling([r for r in self.prefilling if r.request_id in plan.aborts]):
            self._finish(request, plan.aborts[request.request_id])
        leaving = [i for i, r in enumerate(self.batch.rows) if r.request_id in plan.aborts]
        for request in self._drop(leaving):  # free the cache before the requests hear about it
            self._finish(request, plan.aborts[request.request_id])

    def _guarded(self, work, argument, requests: list[EngineRequest]) -> None:
        """Run ``work(argument)``, forward passes for ``requests``; if it fails, fail those requests
        (not the engine) and free their cache."""
        try:
            work(argument)
        except Exception as err:  # an engine bug or out-of-memory must not kill the server
            message = f"generation failed: {type(err).__name__}: {err}"
            self.last_error = message
            self._drop([i for i, r in enumerate(self.batch.rows) if r in requests])
            self._stop_prefilling([r for r in self.prefilling if r in requests])
            last = failed(message)
            for request in requests:
                if not request.finished:
                    self._finish(request, last)

    def _prefill(self, chunks: list[tuple[EngineRequest, int]]) -> None:
        """Prefill this iteration's chunks: whole prompts together in one forward pass, each part
        of a longer prompt in a forward pass of its own over the cache of its earlier chunks (or of
        its prefix-cache hit)."""
        self._to_cache = []
        if self.prefix_cache is not None:
            chunks = [(r, self._reuse_prefix(r, n)) if r.num_computed_tokens == 0 else (r, n) for r, n in chunks]
        whole = [r for r, n in chunks if r.num_computed_tokens == 0 and n == r.num_prompt_tokens]
        for request, n in chunks:
            if request not in whole:
                self._prefill_chunk(request, n)
        if whole:
            self._prefill_whole(whole)
        self._flush()  # first tokens go out before the prompts' blocks are copied into the cache
        if self.prefix_cache is not None:
            self._cache_prompts()

    def _reuse_prefix(self, request: EngineRequest, n: int) -> int:
        """Admit ``request`` (planned to prefill ``n`` tokens now) through the prefix cache: with a
        hit, its cache starts as a copy of the cached blocks and it joins the partly prefilled
        requests. Returns the tokens left to prefill in this iteration."""
        import torch

        blocks = self.prefix_cache.lookup(request.block_hashes, request.num_prompt_tokens)
        if not blocks:
            return n
        # (blocks, layers, 2, kv_heads, block_size, head_dim) -> (layers, 2, kv_heads, hit tokens, head_dim)
        stacked = torch.stack(blocks).permute(1, 2, 3, 0, 4, 5)
        layers, _, heads, count, size, dim = stacked.shape
        kv = stacked.reshape(layers, 2, heads, count * size, dim)
        request.prefill_cache = self.runner.cache_from([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv])
        request.num_computed_tokens = count * size
        self.prefilling.append(request)
        return min(n, request.prompt_tokens_left)

    def _cache_prompts(self) -> None:
        """Put the full blocks of the prompts prefilled in this iteration into the prefix cache."""
        size = self.prefix_cache.block_size
        for requests, layers, lengths in self._to_cache:
            width = layers[0][0].shape[-2]
            for row, (request, length) in enumerate(zip(requests, lengths)):  # rows are left-padded to width
                block = functools.partial(_prompt_block, layers, row, width - length, size)
                self.prefix_cache.insert(request.block_hashes, block)
        self._to_cache = []

    def _prefill_chunk(self, request: EngineRequest, n: int) -> None:
        """The next ``n`` prompt tokens of ``request``, after the ones already in its cache."""
        import torch

        if request.num_computed_tokens == 0:
            request.prefill_cache = self.runner.new_cache()
            self.prefilling.append(request)
        start = request.num_computed_tokens
        ids = torch.tensor([request.prompt_ids[start : start + n]], device=self.lm.device)
        logits, request.prefill_cache = self.runner(ids, request.prefill_cache)
        self.counters.prefills += 1
        request.num_computed_tokens += n
        if request.prompt_tokens_left == 0:  # the last chunk: its cache moves into the batch
            cache, request.prefill_cache = request.prefill_cache, None
            self.prefilling.remove(request)
            self._first_tokens(logits, [request], cache, [request.num_prompt_tokens])

    def _prefill_whole(self, requests: list[EngineRequest]) -> None:
        """One forward pass over whole prompts (left-padded to a common length)."""
        import torch

        device = self.lm.device
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)
        for row, request in enumerate(requests):
            ids[row, width - lengths[row] :] = torch.tensor(request.prompt_ids)
        kwargs = {}
        if min(lengths) != width:  # ragged: hide the padding and give real positions
            mask = (torch.arange(width).unsqueeze(0) >= (width - torch.tensor(lengths)).unsqueeze(1)).long()
            kwargs["attention_mask"] = mask.to(device)
            kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(device)
        logits, prompt_cache = self.runner(ids.to(device), self.runner.new_cache(), **kwargs)
        self.counters.prefills += 1
        for request in requests:
            request.num_computed_tokens = request.num_prompt_tokens
        self._first_tokens(logits, requests, prompt_cache, lengths)

    def _first_tokens(self, logits, requests: list[EngineRequest], prompt_cache, lengths: list[int]) -> None:
        """Sample the first token of prompts just prefilled (``logits``: (rows, 1, vocab)); the
        requests that go on join the running batch with their rows of ``prompt_cache``."""
        if self.prefix_cache is not None:  # the prompts' keys and values, before the batch takes the cache over
            self._to_cache.append((requests, [(layer.keys, layer.values) for layer in prompt_cache.layers], lengths))
        tokens, logprobs, _ = self._sample(logits[:, -1, :], requests)
        now = time.perf_counter()
        keep = []
        for row, (request, token) in enumerate(zip(requests, tokens)):
            request.first_token_time = now
            if token is not None and not self._emit(request, token, logprobs[row]):
                keep.append(row)
        if keep:
            self.batch.join(prompt_cache, keep, [lengths[i] for i in keep], [tokens[i] for i in keep], requests)

    def _stop_prefilling(self, requests: list[EngineRequest]) -> list[EngineRequest]:
        """Take partly prefilled ``requests`` out of the engine and free their cache; returns them."""
        for request in requests:
            self.prefilling.remove(request)
            request.prefill_cache = None
            request.freed_step = self.counters.steps
        return requests

    def _decode(self, rows: list[EngineRequest]) -> None:
        """One decode step for every running request."""
        next_ids, kwargs = self.batch.decode_inputs()
        logits, grown = self.runner(next_ids, self.batch.cache, **kwargs)
        self.counters.steps += 1
        self.counters.batch_size_sum += len(rows)
        tokens, logprobs, next_ids = self._sample(logits[:, -1, :], rows)
        leaving = []
        for row, (request, token) in enumerate(zip(rows, tokens)):
            if request.abort_requested_step is not None:
                request.steps_after_abort += 1
            if token is None or self._emit(request, token, logprobs[row]):
                leaving.append(row)
        if next_ids is None:  # some row sampled (or failed, and leaves now): build the next inputs
            next_ids = [self.pad_token_id if t is None else t for t in tokens]
        self.batch.advance(grown, next_ids)
        self._drop(leaving)  # free the cache before the finished requests hear about it
        self._flush()

    def _sample(self, logits, requests: list[EngineRequest]) -> tuple[list[int | None], list, Any]:
        """(next tokens, logprobs or None per row, the tokens as a (rows, 1) tensor or None) of
        ``requests`` (logits: (rows, vocab)); a row whose sampling failed is failed here, alone,
        and gets None."""
        tokens, as_tensor = self.sampler(logits, requests)
        if as_tensor is None:  # only rows that did not take the argmax can have failed
            for i, (request, token) in enumerate(zip(requests, tokens)):
                if isinstance(token, Exception):
                    self._finish(request, failed(f"sampling failed: {type(token).__name__}: {token}"))
                    tokens[i] = None
        if any(r.params.logprobs is not None for r in requests):
            return tokens, self.sampler.logprobs(logits, requests, tokens), as_tensor
        return tokens, [None] * len(requests), as_tensor

    def _emit(self, request: EngineRequest, token: int, logprobs: tuple | None = None) -> bool:
        """Record a token and queue its event; True when the request is finished."""
        request.output_ids.append(token)
        self.counters.tokens_generated += 1
        params = request.params
        reason = None
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_set:
            reason = FinishReason.STOP
        elif len(request.output_ids) >= params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._close(request, reason)
        event = TokenEvent(token, reason) if logprobs is None else TokenEvent(token, reason, None, None, *logprobs)
        self._pending.append((request, event))
        return reason is not None

    def _finish(self, request: EngineRequest, last: TokenEvent) -> None:
        """End a request without a token and deliver ``last``, its final event (no token; an abort,
        :data:`~course.serving.request.ABORTED`, or an error: :func:`~course.serving.request.failed`, 500,
        or :func:`~course.serving.request.unavailable`, 503)."""
        request.error = last.error
        self._close(request, last.finish_reason)
        self._pending.append((request, last))
        self._flush()

    def _close(self, request: EngineRequest, reason: FinishReason) -> None:
        request.finish_reason = reason
        self.scheduler.forget(request.request_id)

    def _drop(self, rows: list[int]) -> list[EngineRequest]:
        dropped = self.batch.drop(rows)
        for request in dropped:
            request.freed_step = self.counters.steps
        return dropped

    def _flush(self) -> None:
        """Deliver queued events: one wake-up per event loop per step, not one per token."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._on_events(pending)

    def fail_everything(self, last: TokenEvent) -> None:
        """End every waiting and running request with the final event ``last`` (an error's)."""
        stopped = self._stop_prefilling(list(self.prefilling))
        for request in self.scheduler.drain() + stopped + self._drop(list(range(len(self.batch)))):
            if not request.finished:
                self._finish(request, last)


def _prompt_block(layers: list[tuple[Any, Any]], row: int, start: int, size: int, j: int) -> Any:
    """Block ``j`` of the prompt in ``row`` of a prefill's ``layers`` (``(keys, values)`` per layer,
    ``(rows, kv_heads, T, head_dim)``), whose first token is at column ``start``: a new tensor
    ``(layers, 2, kv_heads, size, head_dim)``, not a view (a view would keep the whole prefill alive)."""
    import torch

    at = start + j * size
    return torch.stack([torch.stack((k[row, :, at : at + size], v[row, :, at : at + size])) for k, v in layers])


def _eos_ids(lm: LanguageModel) -> frozenset[int]:
    ids = set()
    for source in (getattr(lm.model, "generation_config", None), lm.model.config, lm.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
