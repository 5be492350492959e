"""The course's reference OpenAI-compatible server (FastAPI) over the continuous-batching engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming and not),
``GET /v1/models`` and ``GET /v1/models/{id}``, ``GET /health`` (with the engine's counters) and
``GET /metrics`` (Prometheus, vLLM's metric names: :mod:`course.serving.api.prometheus`). Wire format,
errors and disconnect handling follow vLLM 0.11; see :mod:`course.serving.api.protocol`.

What keeps one request from hurting the others:

* a generation route takes only ``Content-Type: application/json`` (415 otherwise, before the body is
  read), as vLLM's ``validate_json_request`` does (vLLM answers 400): a web page can send a cross-site
  "simple" request, without the browser asking the server first, only as ``text/plain``, a form or with
  no type, so no page a user visits can start a generation on a server on their machine or network;
* the body is read with a size limit (413 past ``max_request_bytes``: :mod:`course.serving.api.operator`);
* JSON parsing, validation, tokenization and chat templating run on one worker thread, not on
  the event loop, so a large prompt cannot stall the other streams or ``/health`` (the Rust
  tokenizer releases the GIL); a prompt with too many characters to fit is refused untokenized;
* a waiting queue longer than ``max_waiting_requests`` is answered with 503 and ``Retry-After``;
* a stream whose client reads more slowly than the engine generates keeps at most
  ``max_stream_backlog`` tokens waiting on this side of its connection (whose own buffers are capped:
  :mod:`course.serving.api.http_limits`); past that its generation is aborted, which frees its batch slot
  and KV cache at once, and it ends with an error event if the client ever reads on. A client that reads
  nothing for ``send_timeout`` s has its connection closed (``ConnectionLimits``).

Disconnects: a streaming response watches the connection while it streams; a non-streaming
request races its generation against the connection (vLLM's ``with_cancellation``). Either way
a client that goes away aborts its engine request, which stops before the next decode step and
frees its rows of the KV cache. Shutdown (SIGTERM, Ctrl-C, ``BackgroundServer.stop``) first
stops the engine: every open stream ends with an error event and ``[DONE]``, every waiting
non-streaming request gets a 503, and uvicorn then finds no connection left to cancel.

Operator features (:mod:`course.serving.api.operator`): ``api_key`` (``Authorization: Bearer``, as
vLLM's ``--api-key``, for the ``/v1`` routes; one key or one per tenant), ``X-Request-Id`` taken from the
request or made up, and echoed on the response, and one access-log line per request (``access_log=True``,
logger ``course.serving.access``).

Tenants and the prefix cache: a request's ``cache_salt`` (vLLM's field) salts its prompt's block hashes,
so only requests with the same salt share cached blocks. With ``cache_isolation="per-key"`` every request
is salted with its API key's identity too (:func:`~course.serving.api.operator.tenant_salt`): tenants never
share a block, so none can learn from a cache hit (its time to first token, or ``/metrics``' hit counter)
which prompts another sent. ``metrics_api_key`` puts ``/metrics`` behind a key of its own (vLLM leaves it
open: its prefix-cache counters are everyone's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from course.models import LanguageModel
from course.serving.api.operator import OperatorMiddleware, api_keys, overload_refusal, read_body, tenant_salt
from course.serving.api.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_STREAM_BACKLOG,
    DONE_EVENT,
    BadRequest,
    ChunkWriter,
    GenerationRequest,
    Logprobs,
    ServingContext,
    clip,
    error_body,
    find_stop,
    longest_token_chars,
    parse_chat,
    parse_completion,
    parse_json_body,
    sse_event,
)
from course.serving.config import EngineConfig
from course.serving.detok import IncrementalDetokenizer
from course.serving.engine import Engine, EngineRequest, EngineStopped
from course.serving.engine_client import EngineClient

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
JSON_MEDIA_TYPE = "application/json"

logger = logging.getLogger("course.serving.server")


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
            state = scope.setdefault("state", {})

            def client_left() -> None:
                state.setdefault("client_gone", "while its response streamed")
                on_disconnect()

            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            watcher = asyncio.ensure_future(wait_for_disconnect(receive))
            # Abort as soon as the client goes, even while the stream waits for its next token.
            watcher.add_done_callback(lambda task: task.cancelled() or client_left())
            try:
                async for event in events:
                    if watcher.done():
                        break
                    await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                if not watcher.done():
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the client vanished mid-write (ClientDisconnected, or the socket's own error)
                client_left()
            finally:
                watcher.cancel()
                await events.aclose()

    return EventStreamResponse()


class GenerationFailed(Exception):
    """The engine ended a request with an error (``status`` 500, or 503 while shutting down)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status


def _failure_body(message: str, status: int) -> dict:
    kind = "ServiceUnavailableError" if status == 503 else "InternalServerError"
    return error_body(message, kind, code=status)


class _Generation:
    """One request's way through the engine: detokenization, stop strings, the chunks, its metrics."""

    def __init__(
        self,
        engine: EngineClient,
        request: GenerationRequest,
        tokenizer,
        metrics=None,
        state=None,
        cache_salt: str | None = None,
        max_backlog: int | None = None,
        streams: set | None = None,
    ) -> None:
        self.engine = engine
        self.streams = streams  # the server's open streams: this one is in it while it streams
        self.max_backlog = max_backlog  # a stream's tokens waiting for its client; more: aborted (None: no bound)
        self.too_slow = False  # aborted because its client fell max_backlog tokens behind
        self.request = request
        self.writer = ChunkWriter(request)
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_ids)
        salted = {} if cache_salt is None else {"cache_salt": cache_salt}  # an engine without salts is served too
        try:
            self.engine_request: EngineRequest = engine.submit(
                request.prompt_ids, request.sampling, request_id=self.writer.id, **salted
            )
        except ValueError as err:  # the engine's check of the prompt (checked_prompt): vLLM's 400
            raise BadRequest(str(err), "messages" if request.kind == "chat" else "prompt") from None
        self.stop_holdback = max((len(stop) for stop in request.stop), default=1) - 1
        self.completion_tokens = 0
        self.emitted = 0  # characters of detok.text sent so far
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.metrics = metrics
        self.state = state  # the ASGI scope's state: usage for the access log
        self.token_times: list[float] = []
        self.logprobs = None if request.logprobs is None else Logprobs(request.kind, tokenizer)

    def abort(self) -> None:
        if self.finish_reason is None or self.engine_request.finish_reason is None:
            self.engine.abort(self.engine_request.request_id)

    def _client_too_slow(self) -> None:
        """More than ``max_backlog`` tokens wait for this stream's client: stop generating (the batch slot
        and the KV cache are freed before the next step); what waits goes out if the client reads on."""
        self.too_slow = True
        self.engine.abort(self.engine_request.request_id)
        request_id = (self.state or {}).get("request_id", self.engine_request.request_id)
        logger.info(
            "request_id=%s: its client read too slowly (more than %d tokens waited to be sent): generation "
            "aborted, its batch slot freed",
            request_id,
            self.max_backlog,
        )

    def _logprobs_of(self, event) -> dict | None:
        """The logprobs part of this token's chunk (None unless the request asked for them)."""
        if self.logprobs is None or event.logprob is None:
            return None
        return self.logprobs.add(event.token, event.logprob, event.top_logprobs, len(self.detok.text))

    def _text_of(self, token: int, finished: bool) -> str:
        self.token_times.append(time.perf_counter())
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

    def _done(self) -> None:
        """Abort what is still running, record the metrics and the usage (once per request)."""
        if self.streams is not None:
            self.streams.discard(self)
        if self.engine_request.finish_reason is None:
            self.engine.abort(self.engine_request.request_id)
        if self.state is not None:
            self.state["usage"] = (len(self.request.prompt_ids), self.completion_tokens)
        if self.metrics is not None:
            reason = self.finish_reason or ("error" if self.error else "abort")
            self.metrics.request_finished(
                self.engine_request.arrival_time, self.token_times, len(self.request.prompt_ids), reason
            )
            self.metrics = None

    def _last_events(self, event) -> list[str]:
        """The SSE events that end a stream whose last engine event has no token: the error and [DONE], or
        nothing for an abort (the client is gone), unless it was this stream's too slow client that read on."""
        if event.error:
            self.error = event.error
            return [sse_event(_failure_body(event.error, event.status or 500)), DONE_EVENT]
        if self.too_slow:  # the client read on after all: say why the stream stopped
            message = (
                f"The stream was stopped: its client read too slowly (more than {self.max_backlog} "
                "tokens waited to be sent). Read a stream as it arrives."
            )
            return [sse_event(error_body(message, "SlowClientError", code=408)), DONE_EVENT]
        return []

    async def events(self) -> AsyncIterator[str]:
        """SSE events: (role chunk), one chunk per token, (usage chunk), [DONE]."""
        if self.max_backlog:
            self.engine_request.sink.bound(self.max_backlog, self._client_too_slow)
        if self.streams is not None:
            self.streams.add(self)
        try:
            async for event in self.engine_request:
                if event.token is None:
                    for last in self._last_events(event):
                        yield last
                    return
                self.completion_tokens += 1
                if self.request.kind == "chat" and self.completion_tokens == 1:
                    yield self.writer.role_chunk()
                logprobs = self._logprobs_of(event)
                delta = self._text_of(event.token, event.finish_reason is not None)
                if self.request.echo is not None and self.completion_tokens == 1:
                    delta = self.request.echo + delta  # vLLM sends the prompt with the first token
                self.finish_reason = self.finish_reason or event.finish_reason
                yield self.writer.token_chunk(delta, self.finish_reason, self.completion_tokens, logprobs)
                if self.finish_reason is not None:
                    break
            if self.request.include_usage:
                yield self.writer.usage_chunk(self.completion_tokens)
            yield DONE_EVENT
        finally:
            self._done()

    async def collect(self) -> dict:
        """The whole (non-streaming) response body; raises GenerationFailed."""
        text = []
        try:
            async for event in self.engine_request:
                if event.token is None:
                    if event.error:
                        self.error = event.error
                        raise GenerationFailed(event.error, event.status or 500)
                    break
                self.completion_tokens += 1
                self._logprobs_of(event)
                text.append(self._text_of(event.token, event.finish_reason is not None))
                self.finish_reason = self.finish_reason or event.finish_reason
                if self.finish_reason is not None:
                    break
        finally:
            self._done()
        logprobs = None if self.logprobs is None else self.logprobs.whole()
        whole = (self.request.echo or "") + "".join(text)
        return self.writer.full_response(whole, self.finish_reason, self.completion_tokens, logprobs)


def create_app(
    lm: LanguageModel | None = None,
    *,
    engine: EngineClient | None = None,
    model_name: str | None = None,
    aliases: tuple[str, ...] = (),
    max_batch_size: int = EngineConfig.max_batch_size,
    max_model_len: int | None = EngineConfig.max_model_len,
    max_prefill_tokens: int = EngineConfig.max_prefill_tokens,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    max_waiting_requests: int | None = None,
    max_stream_backlog: int | None = DEFAULT_MAX_STREAM_BACKLOG,
    default_max_tokens: int | None = DEFAULT_CHAT_MAX_TOKENS,
    api_key: str | Sequence[str] | None = None,
    access_log: bool = False,
    runner: str = EngineConfig.runner,
    engine_process: bool = False,
    prefix_cache_bytes: int = EngineConfig.prefix_cache_bytes,
    cache_isolation: str = "shared",
    metrics_api_key: str | None = None,
):
    """The reference server as a FastAPI app (run it with uvicorn or :class:`BackgroundServer`).

    Args:
        lm: the model (default: ``course.load_model()``'s choice for this runtime); ignored
            when ``engine`` is given.
        engine: an engine to serve (tests pass their own to look inside it): any
            :class:`~course.serving.engine_client.EngineClient` (an :class:`Engine`, an
            :class:`~course.serving.engine_process.EngineProcess`).
        model_name: the id clients send as ``model`` (default: the model's name).
        aliases: more ids accepted as ``model`` (e.g. a local path, as ``transformers serve``).
        max_batch_size, max_model_len, max_prefill_tokens, runner, prefix_cache_bytes: the engine's
            settings (:class:`~course.serving.config.EngineConfig`, which says what each means).
        max_request_bytes: larger request bodies get 413.
        max_waiting_requests: with this many requests already waiting for the engine, new ones
            get 503 with ``Retry-After`` (None: no limit).
        max_stream_backlog: a stream whose client falls more than this many tokens behind (they wait
            on this side of its connection) is aborted, freeing its batch slot (None: no bound).
        default_max_tokens: a chat request without ``max_tokens`` generates at most this many
            (None: up to the context length, vLLM's default). Completions default to 16 (OpenAI).
        api_key: require ``Authorization: Bearer <api_key>`` on the ``/v1`` routes; a list of keys
            accepts any of them (one per tenant).
        access_log: log one line per request to the ``course.serving.access`` logger.
        engine_process: run the engine in a child process
            (:class:`~course.serving.engine_process.EngineProcess`, as vLLM V1 does) instead of
            on a thread of this one.
        cache_isolation: "shared" (vLLM's behaviour: requests share cached prompt blocks unless their
            ``cache_salt`` differs) or "per-key" (each API key's requests are salted with the key's
            identity as well: tenants never share a block; needs ``api_key``).
        metrics_api_key: ``GET /metrics`` needs ``Authorization: Bearer <metrics_api_key>`` (None: open,
            as in vLLM).

    ``app.state.engine`` is the engine; ``app.state.on_server_stop`` holds callbacks that
    :class:`~course.serving.api.background.BackgroundServer` and ``course serve`` run when the
    server is told to stop, before uvicorn closes connections.
    """
    if cache_isolation not in ("shared", "per-key"):
        raise ValueError(f"cache_isolation must be 'shared' or 'per-key', got {cache_isolation!r}")
    if cache_isolation == "per-key" and not api_keys(api_key):
        raise ValueError(
            "cache_isolation='per-key' salts each API key's requests with the key: give the tenants' keys "
            "(api_key, course serve --api-key KEY [KEY ...])"
        )
    if engine is None:
        config = EngineConfig(max_batch_size, max_model_len, max_prefill_tokens, runner, prefix_cache_bytes)
        engine = build_engine(lm, config, engine_process=engine_process)
    routes = OpenAIRoutes(
        engine,
        model_name or engine.lm.name,
        aliases,
        max_request_bytes=max_request_bytes,
        max_waiting_requests=max_waiting_requests,
        max_stream_backlog=max_stream_backlog,
        default_max_tokens=default_max_tokens,
        per_key_cache=cache_isolation == "per-key",
    )
    app = FastAPI(title="course reference server", lifespan=routes.lifespan)
    app.state.engine = engine
    app.state.model_name = routes.name
    app.state.metrics = routes.metrics
    # Stopping: refuse new requests and end the running ones with an error event (503).
    app.state.on_server_stop = [lambda: engine.stop(timeout=0)]
    app.add_middleware(OperatorMiddleware, api_key=api_key, access_log=access_log, metrics_api_key=metrics_api_key)
    install_error_handlers(app)
    routes.install(app)
    return app


def build_engine(lm: LanguageModel | None, config: EngineConfig, *, engine_process: bool = False) -> EngineClient:
    """The engine ``create_app`` serves when it is given none: an :class:`Engine` on a thread of this
    process, or with ``engine_process`` an :class:`~course.serving.engine_process.EngineProcess`, both with
    ``config``; ``lm`` defaults to ``course.load_model()``'s choice for this runtime."""
    if lm is None:
        from course.models import load_model

        lm = load_model(verbose=False)
    if engine_process:
        from course.serving.engine_process import EngineProcess

        return EngineProcess(lm, config)
    return Engine(lm, config)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error the way vLLM's OpenAI server does: ``{"error": {...}}`` with its status."""

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, err: BadRequest):
        body = error_body(err.message, err.err_type, err.param, err.code)
        return JSONResponse(body, status_code=err.status)

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


class OpenAIRoutes:
    """The server's routes over one engine: ``/v1/completions``, ``/v1/chat/completions``,
    ``/v1/models``, ``/health`` and ``/metrics``.

    A request's body is read on the event loop, parsed and tokenized on one tokenizer thread
    (Hugging Face tokenizers are not safe to call from several threads at once), then streamed
    or collected from the engine.
    """

    def __init__(
        self,
        engine: EngineClient,
        name: str,
        aliases: tuple[str, ...] = (),
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_waiting_requests: int | None = None,
        max_stream_backlog: int | None = DEFAULT_MAX_STREAM_BACKLOG,
        default_max_tokens: int | None = DEFAULT_CHAT_MAX_TOKENS,
        per_key_cache: bool = False,
    ) -> None:
        from course.serving.api.prometheus import ServerMetrics

        self.engine = engine
        self.per_key_cache = per_key_cache  # salt every request's blocks with its API key's tenant
        self.name = name
        self.max_request_bytes = max_request_bytes
        self.max_waiting_requests = max_waiting_requests
        if max_stream_backlog is not None and max_stream_backlog < 1:
            raise ValueError(f"max_stream_backlog must be >= 1 (None: no bound), got {max_stream_backlog}")
        self.max_stream_backlog = max_stream_backlog
        self.streams: set[_Generation] = set()  # the streams being sent now (for /health's backlog)
        tokenizer = engine.lm.tokenizer
        self.context = ServingContext(
            tokenizer,
            (name, *aliases),
            engine.max_model_len,
            engine.lm.vocab_size,
            max_token_chars=longest_token_chars(tokenizer),
            default_chat_max_tokens=default_max_tokens,
        )
        self.tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="course-tokenizer")
        self.metrics = ServerMetrics(engine, name)

    def install(self, app: FastAPI) -> None:
        """Register the routes on ``app``."""
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/models/{model_id:path}", self.model, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.prometheus_metrics, methods=["GET"])

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        read_outputs_on = getattr(self.engine, "read_outputs_on", None)
        if read_outputs_on is not None:  # an EngineProcess: its events are read on this loop
            read_outputs_on(asyncio.get_running_loop())
        yield
        self.engine.stop()
        self.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def completions(self, request: Request):
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: Request):
        return await self._generate(request, parse_chat)

    async def models(self):
        return {"object": "list", "data": [self._model_card(model_id) for model_id in self.context.model_names]}

    async def model(self, model_id: str):
        if model_id not in self.context.model_names:
            raise BadRequest(
                f"The model `{clip(model_id)}` does not exist.", "model", status=404, err_type="NotFoundError"
            )
        return self._model_card(model_id)

    async def health(self):
        """200 and the engine's counters while it runs; 503 with ``"status": "error"`` and the engine's own
        words (``reason``) when it is dead, shutting down or wedged (vLLM answers 503 when its engine is dead)."""
        reason = self.engine.health()
        body = {"status": "ok" if reason is None else "error", "model": self.name, **self.engine.stats()}
        # what waits for slow clients on this side of their connections: bounded by max_stream_backlog each
        body["streams"] = len(self.streams)
        body["stream_backlog"] = self.stream_backlog()
        if reason is None:
            return body
        return JSONResponse({**body, "reason": reason}, status_code=503)

    async def prometheus_metrics(self):
        from course.serving.api.prometheus import CONTENT_TYPE

        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    def stream_backlog(self) -> int:
        """Tokens (events) generated for the open streams and not yet handed to their connections."""
        return sum(stream.engine_request.sink.backlog for stream in list(self.streams))

    def _model_card(self, model_id: str) -> dict:
        return {
            "id": model_id,
            "object": "model",
            "created": 0,
            "owned_by": "course",
            "max_model_len": self.engine.max_model_len,
        }

    def _parse(self, raw: bytes, parse) -> GenerationRequest:
        return parse(parse_json_body(raw), self.context)

    async def _generate(self, request: Request, parse) -> Any:
        _require_json(request)
        raw = await read_body(request, self.max_request_bytes)
        loop = asyncio.get_running_loop()
        generation_request = await loop.run_in_executor(self.tokenizer_thread, self._parse, raw, parse)
        if (refusal := overload_refusal(self.engine.num_waiting, self.max_waiting_requests)) is not None:
            return refusal
        state = request.scope.get("state") or {}
        salt = generation_request.cache_salt
        if self.per_key_cache:  # the middleware let the request in with a key: its tenant is known
            salt = tenant_salt(state["tenant"], salt)
        generation = _Generation(
            self.engine,
            generation_request,
            self.engine.lm.tokenizer,
            self.metrics,
            request.scope.get("state"),
            salt,
            self.max_stream_backlog,
            self.streams,
        )
        if generation_request.stream:
            return _event_stream_response(generation.events(), generation.abort)
        return await self._collect(request, generation)

    async def _collect(self, request: Request, generation: _Generation) -> Response:
        """A non-streaming answer, or 499 if the client leaves first (generation stopped, cache freed)."""
        collecting = asyncio.ensure_future(generation.collect())
        watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
        done, _ = await asyncio.wait({collecting, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if collecting not in done:
            generation.abort()
            collecting.cancel()
            request.scope.setdefault("state", {}).setdefault("client_gone", "before its response was ready")
            return Response(status_code=499)
        watcher.cancel()
        try:
            return JSONResponse(collecting.result())
        except GenerationFailed as err:
            return JSONResponse(_failure_body(err.message, err.status), status_code=err.status)


def _require_json(request: Request) -> None:
    """BadRequest 415 unless the request says its body is JSON (``Content-Type: application/json``, any
    parameters such as a charset allowed), as vLLM's ``validate_json_request`` requires (vLLM 0.32,
    ``vllm/entrypoints/serve/utils/api_utils.py``; it answers 400). The OpenAI client, ``httpx``'s and
    ``requests``' ``json=`` and ``curl --json`` send it; a browser's cross-site request without a CORS
    preflight cannot (it may send only ``text/plain``, the two form types, or no type)."""
    given = request.headers.get("content-type")
    media_type = (given or "").split(";", 1)[0].strip().lower()
    if media_type == JSON_MEDIA_TYPE:
        return
    got = f"its Content-Type is {clip(given)!r}" if given is not None else "it has no Content-Type"
    raise BadRequest(
        f"Unsupported Media Type: Only 'application/json' is allowed ({got}). Send the body as JSON with "
        "'Content-Type: application/json' (curl: --json, or -H 'Content-Type: application/json').",
        status=415,
        err_type="UnsupportedMediaTypeError",
    )
