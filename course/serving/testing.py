"""Helpers for the tests of servers and generators (the course's and the learners').

* :func:`chatty_tiny_model`: the tiny model with wider random weights. The shipped tiny model's
  greedy output repeats one token forever, which cannot tell a correct decoder from one that
  mixes up positions or sequences; this one's output changes at every step.
* :class:`ForwardLog`: records the input length of every forward pass of a model, so a test
  can check "prefill once, then one token per step" and count decode steps server-side.
* :func:`greedy_reference`: greedy tokens computed the straightforward way, for comparison.
* :func:`sse_json`: the JSON payloads of a raw SSE body and whether it ended with ``[DONE]``,
  checking the framing on the way (:func:`sse_data` gives the raw payload strings).
* :func:`failing_decode`: make one decode step of an engine raise, to test error handling.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from fastapi import Request  # at module level: FastAPI resolves the handlers' string annotations here

from course.models import LanguageModel, build_tiny_model, forward, new_cache


def chatty_tiny_model(seed: int = 0, dtype=None, std: float = 0.15) -> LanguageModel:
    """The tiny model with every weight matrix redrawn from N(0, std) (seeded): varied greedy output."""
    import torch

    lm = build_tiny_model(seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in lm.model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * std)
    lm.source += f", weights redrawn with std {std}"
    return lm


class ForwardLog:
    """Record ``(batch, new_tokens)`` of every forward pass of ``lm.model`` while active.

    >>> with ForwardLog(lm) as log:               # doctest: +SKIP
    ...     list(generate(...))
    >>> log.shapes                                 # [(1, 12), (1, 1), (1, 1), ...]
    """

    def __init__(self, lm: LanguageModel) -> None:
        self.model = lm.model
        self.shapes: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._undo: list = []

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        with self._lock:
            self.shapes.append((int(ids.shape[0]), int(ids.shape[1])))

    @property
    def calls(self) -> int:
        return len(self.shapes)

    @property
    def decode_steps(self) -> int:
        """Forward passes that fed one new token per sequence."""
        return sum(1 for _, n in self.shapes if n == 1)

    def __enter__(self) -> ForwardLog:
        from course.forward_observers import observe_forward

        handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        stop_observing = observe_forward(self.model, lambda input_ids: self._hook(self.model, (input_ids,), {}))
        self._undo = [handle.remove, stop_observing]
        return self

    def __exit__(self, *exc) -> None:
        for undo in self._undo:
            undo()
        self._undo = []


@contextmanager
def failing_decode(engine, on_call: int, message: str) -> Iterator[None]:
    """Inside the block, the ``on_call``-th decode step of ``engine`` (an Engine or its core) raises
    RuntimeError(message)."""
    engine = getattr(engine, "core", engine)  # the core decodes
    original = engine._decode
    calls = 0

    def decode(rows):
        nonlocal calls
        calls += 1
        if calls == on_call:
            raise RuntimeError(message)
        return original(rows)

    engine._decode = decode
    try:
        yield
    finally:
        engine._decode = original


def greedy_reference(lm: LanguageModel, prompt_ids: Sequence[int], max_tokens: int, stop_ids=()) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (prefill, then cached decode steps), batch 1."""
    import torch

    tokens: list[int] = []
    with torch.inference_mode():
        logits, cache = forward(lm.model, torch.tensor([list(prompt_ids)], device=lm.device), new_cache(lm.model))
        for _ in range(max_tokens):
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token in stop_ids:
                break
            logits, cache = forward(lm.model, torch.tensor([[token]], device=lm.device), cache)
    return tokens


def sse_data(body: str) -> list[str]:
    """The payloads of ``data:`` events in an SSE body; raises AssertionError on bad framing.

    Events must be ``data: <payload>`` followed by a blank line (``\\n\\n``; ``\\r\\n`` tolerated).
    """
    text = body.replace("\r\n", "\n")
    assert text.endswith("\n\n"), f"an SSE body must end with a blank line; it ends with {text[-20:]!r}"
    payloads = []
    for event in text[:-2].split("\n\n"):
        lines = [line for line in event.split("\n") if line and not line.startswith(":")]
        assert len(lines) == 1 and lines[0].startswith("data:"), f"not a single data: line: {event[:80]!r}"
        payloads.append(lines[0][5:].strip())
    return payloads


def sse_json(body: str) -> tuple[list[dict], bool]:
    """(JSON payloads before [DONE], whether [DONE] came last)."""
    payloads = sse_data(body)
    done = bool(payloads) and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in (payloads[:-1] if done else payloads)], done


_shared_models: dict[tuple, LanguageModel] = {}


def shared_chatty_model(seed: int = 0) -> LanguageModel:
    """One :func:`chatty_tiny_model` per seed for the whole process (tests build it once)."""
    key = (seed,)
    if key not in _shared_models:
        _shared_models[key] = chatty_tiny_model(seed)
    return _shared_models[key]


def scripted_app(
    events: Sequence[str | dict],
    first_delay: float = 0.0,
    gap: float = 0.0,
    status: int = 200,
    done: bool = True,
):
    """A fake OpenAI-style streaming server with known timing, for testing clients.

    Every POST (any path) waits ``first_delay`` s, then sends ``events`` (dicts as JSON) as SSE,
    ``gap`` s apart, then ``data: [DONE]`` (if ``done``). With ``status`` != 200 it answers
    with that status and an OpenAI error body instead. ``app.state`` counts requests
    (``requests``) and the most that were in flight at once (``max_in_flight``).
    """
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    app.state.requests = 0
    app.state.in_flight = 0
    app.state.max_in_flight = 0
    app.state.bodies = []

    @app.post("/{path:path}")
    async def handle(path: str, request: Request):
        app.state.requests += 1
        try:
            app.state.bodies.append(json.loads(await request.body() or b"null"))
        except json.JSONDecodeError:
            app.state.bodies.append(None)
        if status != 200:
            body = {
                "error": {
                    "message": f"scripted failure {status}",
                    "type": "BadRequestError",
                    "param": None,
                    "code": status,
                }
            }
            return JSONResponse(body, status_code=status)
        app.state.in_flight += 1
        app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)

        async def stream():
            try:
                await asyncio.sleep(first_delay)
                for i, event in enumerate(events):
                    if i:
                        await asyncio.sleep(gap)
                    data = event if isinstance(event, str) else json.dumps(event)
                    yield f"data: {data}\n\n"
                if done:
                    yield "data: [DONE]\n\n"
            finally:
                app.state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def completion_chunks(texts: Sequence[str], finish_reason: str = "length", usage: bool = True, per_chunk=None):
    """Text-completion chunk dicts for :func:`scripted_app`: one per text, the last with ``finish_reason``.

    ``per_chunk`` gives the tokens of each chunk (default 1 each). With ``usage`` every chunk carries
    the usage so far (vLLM's ``continuous_usage_stats``) and a usage-only chunk comes last.
    """
    per_chunk = list(per_chunk) if per_chunk is not None else [1] * len(texts)
    chunks, total = [], 0
    for i, (text, n) in enumerate(zip(texts, per_chunk)):
        total += n
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason if i == len(texts) - 1 else None,
        }
        chunk = {"id": "cmpl-test", "object": "text_completion", "created": 0, "model": "fake", "choices": [choice]}
        if usage:
            chunk["usage"] = {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total}
        chunks.append(chunk)
    if usage:
        chunks.append(
            {
                "id": "cmpl-test",
                "object": "text_completion",
                "created": 0,
                "model": "fake",
                "choices": [],
                "usage": {"prompt_tokens": 7, "completion_tokens": total, "total_tokens": 7 + total},
            }
        )
    return chunks
