"""The course's reference OpenAI-compatible server (FastAPI) over the continuous-batching engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models``, ``GET /health`` (with the engine's counters). Wire format, errors and
disconnect handling follow vLLM 0.11; see :mod:`course.serving.protocol`.

Disconnects: a streaming response watches the connection while it streams; a non-streaming
request races its generation against the connection (vLLM's ``with_cancellation``). Either way
a client that goes away aborts its engine request, which stops before the next decode step and
frees its rows of the KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from course.models import LanguageModel
from course.serving.detok import IncrementalDetokenizer
from course.serving.engine import Engine, EngineRequest, EngineStopped, SamplingParams
from course.serving.protocol import (
    DONE_EVENT,
    BadRequest,
    ChunkWriter,
    GenerationRequest,
    ServingContext,
    error_body,
    find_stop,
    parse_chat,
    parse_completion,
    parse_json_body,
    sse_event,
)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def wait_for_disconnect(receive) -> None:
    """Return when the ASGI server reports that the client went away (``http.disconnect``).

    After the request body has been read, uvicorn's ``receive()`` waits until the connection
    closes or the response completes, so this costs nothing while the request runs.
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _event_stream_response(events: AsyncIterator[str], on_disconnect):
    """A streaming ``text/event-stream`` response that aborts its work when the client leaves."""

    class EventStreamResponse(Response):
        media_type = "text/event-stream"

        def __init__(self) -> None:  # no content-length: the body is a stream
            self.status_code = 200
            self.background = None
            self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
                (key.lower().encode(), value.encode()) for key, value in SSE_HEADERS.items()
            ]

        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            watcher = asyncio.ensure_future(wait_for_disconnect(receive))
            # Abort as soon as the client goes, even while the stream waits for its next token.
            watcher.add_done_callback(lambda task: task.cancelled() or on_disconnect())
            try:
                async for event in events:
                    if watcher.done():
                        break
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                if not watcher.done():
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client vanished mid-write
                on_disconnect()
            finally:
                watcher.cancel()
                await events.aclose()

    return EventStreamResponse()


class _Generation:
    """One request's way through the engine: detokenization, stop strings, the chunks."""

    def __init__(self, engine: Engine, request: GenerationRequest, tokenizer) -> None:
        self.engine = engine
        self.request = request
        self.writer = ChunkWriter(request)
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_ids)
        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            ignore_eos=request.ignore_eos,
            stop_token_ids=tuple(request.stop_token_ids),
        )
        try:
            self.engine_request: EngineRequest = engine.submit(request.prompt_ids, params, request_id=self.writer.id)
        except EngineStopped:
            raise
        except ValueError as err:  # validated already; kept so a gap in validation is still a 400
            raise BadRequest(str(err)) from None
        self.stop_holdback = max((len(stop) for stop in request.stop), default=1) - 1
        self.completion_tokens = 0
        self.emitted = 0  # characters of detok.text sent so far
        self.finish_reason: str | None = None
        self.error: str | None = None

    def abort(self) -> None:
        if self.finish_reason is None or self.engine_request.finish_reason is None:
            self.engine.abort(self.engine_request.request_id)

    def _text_of(self, token: int, finished: bool) -> str:
        self.detok.push(token)
        if finished:
            self.detok.flush()
        text = self.detok.text
        if self.request.stop:
            index = find_stop(text, self.request.stop, self.emitted)
            if index is not None:
                text = text[:index]
                self.finish_reason = "stop"
                self.engine.abort(self.engine_request.request_id)
            elif not finished:  # hold back what could be the start of a stop string (as vLLM does)
                text = text[: max(self.emitted, len(text) - self.stop_holdback)]
        delta = text[self.emitted :]
        self.emitted = len(text)
        return delta

    async def events(self) -> AsyncIterator[str]:
        """SSE events: (role chunk), one chunk per token, (usage chunk), [DONE]."""
        try:
            async for event in self.engine_request:
                if event.token is None:
                    if event.error:
                        self.error = event.error
                        yield sse_event(error_body(event.error, "InternalServerError", code=500))
                        yield DONE_EVENT
                    return  # aborted: the client is gone
                self.completion_tokens += 1
                if self.request.kind == "chat" and self.completion_tokens == 1:
                    yield self.writer.role_chunk()
                delta = self._text_of(event.token, event.finish_reason is not None)
                self.finish_reason = self.finish_reason or event.finish_reason
                yield self.writer.token_chunk(delta, self.finish_reason, self.completion_tokens)
                if self.finish_reason is not None:
                    break
            if self.request.include_usage:
                yield self.writer.usage_chunk(self.completion_tokens)
            yield DONE_EVENT
        finally:
            if self.engine_request.finish_reason is None:
                self.engine.abort(self.engine_request.request_id)

    async def collect(self) -> dict:
        """The whole (non-streaming) response body."""
        text = []
        try:
            async for event in self.engine_request:
                if event.token is None:
                    if event.error:
                        raise RuntimeError(event.error)
                    break
                self.completion_tokens += 1
                text.append(self._text_of(event.token, event.finish_reason is not None))
                self.finish_reason = self.finish_reason or event.finish_reason
                if self.finish_reason is not None:
                    break
        finally:
            if self.engine_request.finish_reason is None:
                self.engine.abort(self.engine_request.request_id)
        return self.writer.full_response("".join(text), self.finish_reason, self.completion_tokens)


def create_app(
    lm: LanguageModel | None = None,
    *,
    engine: Engine | None = None,
    model_name: str | None = None,
    aliases: tuple[str, ...] = (),
    max_batch_size: int = 64,
    max_model_len: int | None = None,
    max_prefill_tokens: int = 512,
):
    """The reference server as a FastAPI app (run it with uvicorn or :class:`BackgroundServer`).

    Args:
        lm: the model (default: ``course.load_model()``'s choice for this runtime); ignored
            when ``engine`` is given.
        engine: an engine to serve (tests pass their own to look inside it).
        model_name: the id clients send as ``model`` (default: the model's name).
        aliases: more ids accepted as ``model`` (e.g. a local path, as ``transformers serve``).
        max_batch_size: requests decoded together (1 = one request at a time).
        max_model_len: context length in tokens (prompt + output).
        max_prefill_tokens: prompt tokens prefilled per engine iteration (see :class:`Engine`).

    ``app.state.engine`` is the engine; ``app.state.on_server_stop`` holds callbacks that
    :class:`~course.serving.background.BackgroundServer` runs before it stops the server.
    """
    if engine is None:
        if lm is None:
            from course.models import load_model

            lm = load_model(verbose=False)
        engine = Engine(
            lm, max_batch_size=max_batch_size, max_model_len=max_model_len, max_prefill_tokens=max_prefill_tokens
        )
    lm = engine.lm
    name = model_name or lm.name
    context = ServingContext(lm.tokenizer, (name, *aliases), engine.max_model_len, lm.vocab_size)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.stop()

    app = FastAPI(title="course reference server", lifespan=lifespan)
    app.state.engine = engine
    app.state.model_name = name
    app.state.on_server_stop = [engine.abort_all]

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, err: BadRequest):
        return JSONResponse(error_body(err.message, "BadRequestError", err.param, err.code), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError):
        return JSONResponse(error_body(f"Invalid request: {err.errors()}", "BadRequestError"), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        kind = "NotFoundError" if err.status_code == 404 else "HTTPError"
        return JSONResponse(error_body(str(err.detail), kind, code=err.status_code), status_code=err.status_code)

    @app.exception_handler(EngineStopped)
    async def stopped(request: Request, err: EngineStopped):
        return JSONResponse(error_body(str(err), "ServiceUnavailableError", code=503), status_code=503)

    async def handle(request: Request, parse) -> Any:
        generation_request = parse(parse_json_body(await request.body()), context)
        generation = _Generation(engine, generation_request, lm.tokenizer)
        if generation_request.stream:
            return _event_stream_response(generation.events(), generation.abort)
        collecting = asyncio.ensure_future(generation.collect())
        watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
        done, _ = await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collecting not in done:  # the client went away: stop generating, free the cache
            generation.abort()
            collecting.cancel()
            return Response(status_code=499)
        watcher.cancel()
        try:
            return JSONResponse(collecting.result())
        except RuntimeError as err:
            return JSONResponse(error_body(str(err), "InternalServerError", code=500), status_code=500)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, parse_chat)

    @app.get("/v1/models")
    async def models():
        data = [
            {
                "id": model_id,
                "object": "model",
                "created": 0,
                "owned_by": "course",
                "max_model_len": engine.max_model_len,
            }
            for model_id in context.model_names
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, **engine.stats()}

    return app
