"""What the API server needs from an engine: the one interface both engines implement.

:class:`~course.serving.engine.Engine` steps on a thread of the server's process;
:class:`~course.serving.engine_process.EngineProcess` steps in a process of its own and answers the
same calls from its side of the pipe. The server (:mod:`course.serving.api.server`) is typed against
:class:`EngineClient` and never asks which one it has, as vLLM's API server is typed against its
``EngineClient`` protocol (``vllm/engine/protocol.py``) whatever runs the engine core.

:func:`checked_prompt` is the one check of a prompt against the model (its context, its vocabulary),
which both engines' ``submit`` run before a request is queued; the server sends its refusal as the
400, and the engine core process queues what its :class:`EngineProcess` checked without a second look.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from course import vllm_release
from course.models import LanguageModel
from course.serving.request import EngineRequest, FinishReason
from course.serving.sampler import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """A continuous-batching engine as the server uses it.

    Counters, the same in both engines: ``num_waiting`` is the requests that have no token yet
    (queued, or with their prompt partly prefilled), ``num_running`` those that have at least one
    token and have not finished, ``num_unfinished`` both together plus any being aborted.
    """

    lm: LanguageModel
    max_batch_size: int
    max_model_len: int

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> EngineRequest:
        """Queue a request (its prompt checked by :func:`checked_prompt`: ValueError otherwise); iterate
        over the returned request, with ``for`` or ``async for``, for its events. ``cache_salt``: only
        requests with the same salt share prefix-cache blocks (vLLM's ``cache_salt``; None: unsalted)."""
        ...

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """Stop a request before the next decode step; unknown ids are ignored."""
        ...

    def abort_all(self, reason: str = "the server is shutting down") -> None:
        """Fail every waiting and running request with an error event of status 503."""
        ...

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """Generate synchronously (from plain code, not inside an event loop); the new token ids."""
        ...

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything (503 error events), refuse new requests, end the engine's loop."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_unfinished(self) -> int: ...

    def cache_tokens(self) -> int:
        """Token slots the KV cache holds now (or as of the engine's last snapshot)."""
        ...

    def stats(self) -> dict[str, Any]:
        """The engine's counters, for ``/health``, ``/metrics``, tests and plots."""
        ...

    def health(self) -> str | None:
        """None while the engine runs and makes progress; otherwise why not, in words (it stopped, its
        thread or process died and how, or it has requests open and has made no progress for a long
        while): the server's ``/health`` answers 503 with it."""
        ...


def checked_prompt(prompt_ids: Sequence[int], params: SamplingParams, max_model_len: int, vocab_size: int) -> list[int]:
    """``prompt_ids`` as a list of ints, or ValueError saying why the engine cannot run it.

    Refused: an empty prompt; a prompt longer than the whole context, in vLLM 0.32's words
    (:func:`course.vllm_release.prompt_too_long_error`: the server's 400 is this message); a prompt
    that leaves no room for ``params.max_tokens`` more tokens in ``max_model_len`` (the server never
    asks for that: it clamps ``max_tokens`` to the room left, as vLLM does); ids outside
    ``[0, vocab_size)``.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("the prompt must contain at least one token")
    if too_long := vllm_release.prompt_too_long_error(len(prompt_ids), max_model_len):
        raise ValueError(too_long)
    if len(prompt_ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"context of {max_model_len} tokens"
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    return prompt_ids
