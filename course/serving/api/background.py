"""Run an ASGI app (the reference server, or a learner's) in a background thread.

``uvicorn.run`` cannot be called inside Jupyter (the kernel already runs an event loop), so the
notebooks and tests run ``uvicorn.Server`` in a daemon thread on a pre-bound socket: port 0
means any free port, so two servers never collide. ``stop()`` first runs the app's
``app.state.on_server_stop`` callbacks (the reference server aborts its requests there, so
open streams end with an error event and ``[DONE]``), then asks uvicorn to exit and cancels
whatever is still running after ``graceful_timeout`` seconds: a stream that never ends cannot
keep the server alive. Every connection is bounded (:class:`ConnectionLimits`, enforced by
:func:`http_protocol`, the HTTP protocol of this class and of ``course serve``): request-header
size and count, and timeouts for a request that never finishes and for idle keep-alive connections.

:func:`run_sync` runs a coroutine to completion from any code, including a notebook cell whose
thread already has a running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class _QuietShutdown(logging.Filter):
    """Hide uvicorn's error line about cancelling streams at shutdown: that is the point of stopping."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "timeout graceful shutdown exceeded" not in record.getMessage()


def without_autograd():
    """``torch.no_grad()`` (a context manager), or a no-op where torch is not installed.

    Autograd's on/off switch is per thread and every new thread starts with it on: a model
    stepped on a helper thread would record a graph (memory and time) unless the thread turns it
    off itself. The threads this module starts do.
    """
    try:
        import torch
    except ImportError:  # the helpers also serve apps that never touch torch
        return contextlib.nullcontext()
    return torch.no_grad()


def run_stop_callbacks(app) -> None:
    """Run the app's ``app.state.on_server_stop`` callbacks (once per app; later calls do nothing)."""
    state = getattr(app, "state", None)
    if state is None or getattr(state, "stop_callbacks_ran", False):
        return
    state.stop_callbacks_ran = True
    for callback in getattr(state, "on_server_stop", []):
        callback()


def uvicorn_server(config):
    """A ``uvicorn.Server`` that runs the app's stop callbacks as soon as it is told to exit.

    uvicorn answers SIGTERM / SIGINT by closing the listening socket and waiting up to
    ``timeout_graceful_shutdown`` s for open connections, then cancels them (a traceback per
    request in the log, streams cut without ``[DONE]``). Running the callbacks first (the
    reference server stops its engine there) ends every open request properly at once. They run
    on a fresh thread: a signal handler may interrupt code that holds the engine's lock.
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            threading.Thread(target=run_stop_callbacks, args=(config.app,), name="course-stop", daemon=True).start()
            super().handle_exit(sig, frame)

    return Server(config)


class BackgroundServer:
    """An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread.

    >>> with BackgroundServer(app) as server:           # doctest: +SKIP
    ...     httpx.get(server.url + "/health")

    ``limits`` bounds what each client connection may cost (header size, timeouts; see
    :class:`ConnectionLimits`, whose defaults apply when it is None).

    Attributes:
        url: ``http://host:port``; ``base_url`` adds ``/v1`` (what the openai client wants).
    """

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        graceful_timeout: float = 1.0,
        log_level: str = "warning",
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn_config(
            app,
            limits,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=graceful_timeout,
            lifespan="on",
        )
        self.server = uvicorn_server(config)
        self.thread = threading.Thread(target=self._serve, name=f"uvicorn-{self.port}", daemon=True)
        self._error: BaseException | None = None
        logging.getLogger("uvicorn.error").addFilter(_QuietShutdown())

    def _serve(self) -> None:
        try:
            with without_autograd():  # a learner's app may step its model on this thread
                self.server.run(sockets=[self.sock])
        except BaseException as err:  # reported by start()
            self._error = err

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        """Start serving; returns once the server accepts connections."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server thread died while starting: {self._error!r}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server did not start within {timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving: abort the app's work, close connections, join the thread."""
        run_stop_callbacks(self.app)
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError(f"the server on port {self.port} did not stop within {timeout} s")

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.thread.is_alive() else "stopped"
        return f"BackgroundServer({self.url}, {state})"


def run_sync(coroutine: Awaitable[T], timeout: float | None = None) -> T:
    """Run ``coroutine`` to completion in a fresh event loop on a helper thread; return its result.

    Works everywhere, including notebook cells (whose thread already runs an event loop, so
    ``asyncio.run`` would refuse). ``timeout`` (s) cancels the coroutine and raises TimeoutError.
    """
    result: dict[str, Any] = {}

    async def main():
        return await (asyncio.wait_for(coroutine, timeout) if timeout else coroutine)

    def target() -> None:
        try:
            with without_autograd():
                result["value"] = asyncio.run(main())
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err

    thread = threading.Thread(target=target, name="course-run-sync", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        error = result["error"]
        if isinstance(error, asyncio.TimeoutError):
            raise TimeoutError(f"gave up after {timeout} s") from None
        raise error
    return result["value"]


# --- the HTTP layer: what one connection may cost ----------------------------------------------------


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may cost the server, enforced before the app sees a request.

    uvicorn's fast parser (httptools) has no limit on the request line and headers and no timeout
    for a request that never finishes: a client that sends megabytes of headers without their end,
    or nothing at all, holds that memory and the connection for as long as it likes. The course's
    protocol (:func:`http_protocol`) adds the limits web servers have (nginx's
    ``large_client_header_buffers``, ``client_header_timeout``, ``client_body_timeout``).

    Attributes:
        max_header_bytes: request line plus headers; more gets 431 and the connection is closed.
        max_header_count: header fields per request (vLLM's ``--h11-max-header-count`` default); more: 431.
        header_timeout: seconds for a whole request line and headers to arrive, counted from the
            connection's start or the end of the previous response (408, or a silent close when
            nothing arrived).
        body_timeout: seconds without a byte while a request body is unfinished (408).
        keep_alive_timeout: an idle keep-alive connection is closed after this many seconds (uvicorn's).
    """

    max_header_bytes: int = 64 * 1024
    max_header_count: int = 256
    header_timeout: float = 20.0
    body_timeout: float = 20.0
    keep_alive_timeout: float = 5.0


def _raw_error(status: int, message: str, err_type: str, default_headers=()) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-style error object, closing the connection."""
    import json
    from http import HTTPStatus

    body = json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}}).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close", b"", body]
    return b"\r\n".join(lines)


class _TooManyHeaders(Exception):
    pass


@functools.cache
def http_protocol(limits: ConnectionLimits = ConnectionLimits()) -> type | None:
    """uvicorn's httptools protocol with per-connection limits; None where httptools is missing.

    On top of uvicorn's ``HttpToolsProtocol`` it

    * counts the bytes of every request line and header block as they arrive and answers 431 (with
      an OpenAI-style error object) past ``limits.max_header_bytes`` or ``max_header_count``, before
      buffering more: what a connection holds is bounded whatever the client sends (a body is
      bounded by uvicorn's flow control and the app's own limit);
    * times out a request line and headers that never finish, a body that stops arriving, and a
      connection that sends nothing (408, or a plain close when nothing arrived); idle keep-alive
      connections keep uvicorn's ``timeout_keep_alive``;
    * answers a request with an ``Upgrade`` header (``curl --http2``'s h2c, a websocket handshake)
      as plain HTTP/1.1 with its body, as RFC 9110 allows a server to: httptools would otherwise
      stop parsing at the end of the headers and the app would see an empty body;
    * answers a malformed request with a 400 error object and logs it at INFO, not WARNING (any
      client can send one).
    """
    try:
        import httptools
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools is a dependency of the course; uvicorn's h11 is the fallback
        return None

    log = logging.getLogger("course.serving.http")

    class CourseHttpProtocol(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.limits = limits
            self._in_head = True  # waiting for (the rest of) a request line and headers
            self._head_bytes = 0
            self._head_count = 0
            self._closed_by_us = False
            self._replaying = False  # feeding a request head again, without its Upgrade header
            self._skip_complete = False
            self._timer: asyncio.TimerHandle | None = None
            self._timer_kind = ""

        # timers
        def _arm(self, kind: str, seconds: float) -> None:
            self._disarm()
            self._timer_kind = kind
            self._timer = self.loop.call_later(seconds, self._timed_out)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _timed_out(self) -> None:
            self._timer = None
            if self._closed_by_us or self.transport.is_closing():
                return
            cycle = self.cycle
            if self._timer_kind == "head":
                if cycle is not None and not cycle.response_complete:  # a response is still being sent
                    self._arm("head", self.limits.header_timeout)
                elif self._head_bytes:
                    self._refuse(408, "The request line and headers did not arrive in time.", "RequestTimeoutError")
                else:
                    self._closed_by_us = True
                    self.transport.close()
            elif self._timer_kind == "body":
                if cycle is not None and cycle.response_complete:  # answered already (a 413, say): just close
                    self._closed_by_us = True
                    self.transport.close()
                elif self.flow.read_paused:  # the server is not reading (flow control): not the client's fault
                    self._arm("body", self.limits.body_timeout)
                else:
                    self._refuse(408, "The request body stopped arriving before its end.", "RequestTimeoutError")

        def _refuse(self, status: int, message: str, err_type: str) -> None:
            """Answer ``status`` with an error object (unless a response has started) and close."""
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
            log.info("%s: %s %s", client, status, message)
            self._closed_by_us = True
            self._disarm()
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                started = cycle.response_started
                cycle.disconnected = True  # the app's receive() sees a disconnect; its send() writes nothing
                cycle.message_event.set()
                if started:
                    self.transport.close()
                    return
            self.transport.write(_raw_error(status, message, err_type, self.server_state.default_headers))
            self.transport.close()

        # connection events
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm("head", self.limits.header_timeout)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._closed_by_us:
                return
            if not self._in_head:
                if self._timer_kind == "body" and self._timer is not None:
                    self._arm("body", self.limits.body_timeout)
                self._feed(data)
                return
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) <= room:
                self._head_bytes += len(data)
                self._feed(data)
                return
            self._head_bytes += room
            self._feed(data[:room])  # what fits: the head may end inside it
            if self._closed_by_us or self.transport.is_closing():
                return
            if self._in_head:
                self._refuse(
                    431,
                    f"The request line and headers are longer than this server's limit of "
                    f"{self.limits.max_header_bytes} bytes.",
                    "RequestHeaderFieldsTooLargeError",
                )
                return
            self.data_received(data[room:])

        def _feed(self, data: bytes) -> None:
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade as upgrade:
                self._ignore_upgrade(data[upgrade.args[0] :])
            except httptools.HttpParserError as err:  # a callback's error (too many headers) is one too
                if self._head_count > self.limits.max_header_count:
                    self._too_many_headers()
                else:
                    self._refuse(400, f"Invalid HTTP request received: {err}"[:200], "BadRequestError")

        def _too_many_headers(self) -> None:
            self._refuse(
                431,
                f"The request has more than this server's limit of {self.limits.max_header_count} header fields.",
                "RequestHeaderFieldsTooLargeError",
            )

        def _ignore_upgrade(self, rest: bytes) -> None:
            """Go on parsing an ``Upgrade`` request as plain HTTP/1.1: its body follows its headers."""
            if self.scope.get("method") == "CONNECT" or self._replaying or self.cycle is None:
                self._refuse(400, "This server does not switch protocols or tunnel (CONNECT).", "BadRequestError")
                return
            head = [self.scope["method"].encode(), b" ", self.url, b" HTTP/1.1\r\n"]
            for name, value in self.headers:
                if name == b"upgrade":
                    continue
                if name == b"connection":
                    kept = [t.strip() for t in value.split(b",") if t.strip().lower() != b"upgrade"]
                    if not kept:
                        continue
                    value = b", ".join(kept)
                head += [name, b": ", value, b"\r\n"]
            head.append(b"\r\n")
            self.parser = httptools.HttpRequestParser(self)
            self._replaying = True  # its head is known: only its body (and what follows) is new
            self._feed(b"".join(head) + rest)

        def _should_upgrade(self) -> bool:
            return False  # never: no websocket routes, no HTTP/2 (ws="none" in the config, too)

        # parser callbacks
        def on_message_begin(self) -> None:
            if self._replaying:
                return
            self._in_head = True
            self._head_count = 0
            if self._timer is None or self._timer_kind != "head":
                self._arm("head", self.limits.header_timeout)
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            if not self._replaying:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._replaying:
                return
            self._head_count += 1
            if self._head_count > self.limits.max_header_count:
                raise _TooManyHeaders
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._replaying:
                self._replaying = False
                return
            self._in_head = False
            self._head_bytes = 0
            self._arm("body", self.limits.body_timeout)
            # An Upgrade request: httptools ends the message here and stops; its body is fed again.
            self._skip_complete = bool(self.parser.should_upgrade())
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            if self._skip_complete:
                self._skip_complete = False
                return
            if self._timer_kind == "body":
                self._disarm()
            self._in_head, self._head_bytes = True, 0  # what follows is the next request's head
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._in_head and self._timer is None:
                self._arm("head", self.limits.header_timeout)

        def timeout_keep_alive_handler(self) -> None:
            self._disarm()
            super().timeout_keep_alive_handler()

    return CourseHttpProtocol


def uvicorn_config(app, limits: ConnectionLimits | None = None, **options):
    """A ``uvicorn.Config`` for ``app`` with the course's HTTP protocol and ``limits`` (defaults)."""
    import uvicorn

    limits = limits or ConnectionLimits()
    protocol = http_protocol(limits)
    if protocol is None:
        options.setdefault("http", "h11")
        options.setdefault("h11_max_incomplete_event_size", limits.max_header_bytes)
    else:
        options.setdefault("http", protocol)
    return uvicorn.Config(app, ws="none", timeout_keep_alive=limits.keep_alive_timeout, **options)
