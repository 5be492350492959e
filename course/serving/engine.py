"""The in-process engine: an engine core stepped on a background thread of this process.

:class:`Engine` is the in-process client of an :class:`~course.serving.engine_core.EngineCore` (where the
continuous-batching step lives: scheduling, prefill, decode, sampling; see that module). It adds what a
core does not have: a thread that steps it (``_run``), requests made from any thread or event loop
(:meth:`Engine.submit`: the prompt checked, an id given), and the engine's health. vLLM splits its engine
the same way (``vllm/v1/engine/core_client.py``, 0.32: ``InprocClient`` wraps an ``EngineCore`` in the
caller's process, the ``MPClient`` family talks to one in a process of its own);
:class:`~course.serving.engine_process.EngineProcess` is this course's multiprocess client, whose child
steps the same core.

With ``background=False`` no thread runs: the caller steps the core with :meth:`Engine.step`, one iteration
at a time, as tests and benchmarks do (vLLM's ``LLMEngine.step()`` over its ``InprocClient``).

The core's settings and parts read through the client (``engine.max_model_len``, ``engine.scheduler``,
``engine.prefix_cache``, ...), and so do its counters (``engine.counters.steps``: a
:class:`~course.serving.counters.StepCounters`); ``engine.core`` is the core itself.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from course.models import LanguageModel
from course.serving import engine_core
from course.serving.config import EngineConfig
from course.serving.engine_client import checked_prompt
from course.serving.engine_core import EngineCore
from course.serving.request import (
    EngineRequest,
    EngineStopped,
    FinishReason,
    TokenEvent,
    deliver,
    failed,
    wait_for_tokens,
)
from course.serving.sampler import SamplingParams

__all__ = ["Engine", "EngineCore", "EngineRequest", "EngineStopped", "FinishReason", "SamplingParams", "TokenEvent"]

# The reference engine is this client and its core: course.grading.forbid_reference(course.serving.engine), module
# 2's guard, watches both, so an answer that steps an EngineCore itself is refused as one that uses Engine is.
REFERENCE_MODULES = (engine_core,)


class _OfCore:
    """An attribute of the engine's core, read and written through the :class:`Engine` that wraps it."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Engine | None, owner: type | None = None) -> Any:
        return self if engine is None else getattr(engine.core, self.name)

    def __set__(self, engine: Engine, value: Any) -> None:
        setattr(engine.core, self.name, value)


class Engine:
    """Continuous-batching greedy/sampling generation over a :class:`~course.models.LanguageModel`.

    Args:
        lm: the model and tokenizer.
        config: the engine's settings (:class:`~course.serving.config.EngineConfig`: ``max_batch_size``,
            ``max_model_len``, ``max_prefill_tokens``, ``runner``, ``prefix_cache_bytes``, ``wedged_after``);
            or give them as keyword arguments (``Engine(lm, max_batch_size=8)``).
        background: run the engine loop on its own thread (the default). False: nothing runs
            until the caller calls :meth:`step`, one iteration at a time (tests drive it by hand,
            as with vLLM's ``LLMEngine.step()``).
        on_events: where each step's ``(request, TokenEvent)`` pairs go; default
            :func:`~course.serving.request.deliver` (to each request's consumer).

    A model whose cache cannot be reused (sliding-window layers) runs without prefix caching
    (``prefix_cache_off`` says why).
    """

    # The core's settings and parts (``runner`` may be swapped for a timed one, as benchmarks/engine_step.py does).
    config = _OfCore()
    lm = _OfCore()
    max_batch_size = _OfCore()
    max_model_len = _OfCore()
    max_prefill_tokens = _OfCore()
    wedged_after = _OfCore()
    eos_token_ids = _OfCore()
    pad_token_id = _OfCore()
    runner = _OfCore()
    scheduler = _OfCore()
    batch = _OfCore()
    sampler = _OfCore()
    prefix_cache = _OfCore()
    prefix_cache_off = _OfCore()
    heap = _OfCore()
    # Its state and counters (course.serving.counters.StepCounters), written by the thread that steps it.
    prefilling = _OfCore()
    counters = _OfCore()
    last_error = _OfCore()

    def __init__(
        self,
        lm: LanguageModel,
        config: EngineConfig | None = None,
        *,
        background: bool = True,
        on_events: Callable[[list[tuple[EngineRequest, TokenEvent]]], None] = deliver,
        **settings,
    ) -> None:
        if config is not None and settings:
            raise TypeError(f"give the engine's settings as config or as keyword arguments, not both: {settings}")
        self.core = EngineCore(lm, config or EngineConfig(**settings), on_events)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._thread_lock = threading.Lock()
        self._background = background

    # --- public API (any thread) --------------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> EngineRequest:
        """Queue a request; iterate over the returned request to receive its tokens.

        Consume the events with ``for`` (plain code, any thread) or ``async for`` (a coroutine).
        ValueError (:func:`~course.serving.engine_client.checked_prompt`) for a prompt this engine cannot run.
        ``cache_salt``: only requests with the same salt share prefix-cache blocks (None: unsalted).
        """
        prompt_ids = checked_prompt(prompt_ids, params, self.core.max_model_len, self.core.lm.vocab_size)
        request = EngineRequest(request_id or f"req-{next(self._ids)}", prompt_ids, params, cache_salt)
        return self.add_request(request)

    def add_request(self, request: EngineRequest) -> EngineRequest:
        """Queue a request whose prompt was checked already (:func:`checked_prompt`, in :meth:`submit`)."""
        self.core.add_request(request)
        self._ensure_started()
        return request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request (the client went away, or it hit a stop string) and free its cache rows.

        Takes effect before the engine's next decode step. Unknown or finished ids are ignored.
        """
        self.core.abort(request_id, reason)

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Fail every waiting and running request with an error event of status 503 (used at shutdown)."""
        self.core.abort_all(reason)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Generate synchronously (from plain code, not inside an event loop); returns the token ids."""
        return wait_for_tokens(self.submit(prompt_ids, params))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything, refuse new requests, and stop the engine thread (waiting ``timeout`` s for it)."""
        self.abort_all()
        self.core.stop()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def step(self) -> bool:
        """Run one engine iteration now, on this thread (only with ``background=False``).

        Returns True once the engine is stopped. Does not wait: with nothing to do it returns False.
        """
        import torch

        if self._background:
            raise RuntimeError("this engine runs its own loop; step() is for Engine(..., background=False)")
        if torch.is_inference_mode_enabled():  # a caller that steps in a loop enters it once
            return self.core.step()
        with torch.inference_mode():
            return self.core.step()

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        """Requests without a token yet: waiting, or with their prompt partly prefilled."""
        return self.core.num_waiting

    @property
    def num_unfinished(self) -> int:
        """Requests submitted and not yet finished (waiting, running, or being aborted)."""
        return self.core.num_unfinished

    def cache_tokens(self) -> int:
        """Token slots held by the batch cache (rows x padded length) and by partly prefilled
        prompts; 0 when idle."""
        return self.core.cache_tokens()

    def stats(self) -> dict[str, Any]:
        """Counters for /health, tests and plots (:meth:`EngineCore.stats`)."""
        return self.core.stats()

    def prefix_cache_stats(self) -> dict[str, Any]:
        """The prefix cache's counters (:meth:`EngineCore.prefix_cache_stats`)."""
        return self.core.prefix_cache_stats()

    def health(self) -> str | None:
        """None while the engine runs and makes progress; otherwise why not, in words: it is stopped, its
        thread died, or it has requests open and finished no iteration for ``wedged_after`` seconds."""
        if self.core.scheduler.stopping:
            return "the engine is shut down"
        if self._thread is not None and not self._thread.is_alive():
            return f"the engine thread exited ({self.core.last_error or 'no error recorded'})"
        return self.core.stalled()

    # --- the engine thread ----------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._background and self._thread is None:
            with self._thread_lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="course-engine", daemon=True)
                    self._thread.start()

    def _run(self) -> None:
        import torch

        core = self.core
        with torch.inference_mode():  # autograd is per thread: this is the thread that runs every step
            while True:
                try:
                    if core.step(block=True):
                        return
                except Exception as err:  # a bug outside a forward pass: fail what is in flight, keep serving
                    core.last_error = f"engine loop failed: {type(err).__name__}: {err}"
                    core.fail_everything(failed(core.last_error))
