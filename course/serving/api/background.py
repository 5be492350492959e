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
    ``large_client_header_buffers``, ``client_header_timeout``, ``client_body_timeout`` and
    ``send_timeout``; Apache's ``RequestReadTimeout body=20,MinRate=500``, mod_reqtimeout's default).

    Attributes:
        max_header_bytes: request line plus headers; more gets 431 and the connection is closed.
        max_header_count: header fields per request (vLLM's ``--h11-max-header-count`` default); more: 431.
        header_timeout: seconds for a whole request line and headers to arrive, counted from the
            connection's start or the end of the previous response (408, or a silent close when
            nothing arrived).
        body_timeout: seconds without a byte while a request body is unfinished (408).
        body_min_rate: bytes per second a body must average once ``body_timeout`` has passed: the
            whole body must arrive within ``body_timeout`` s plus one second per ``body_min_rate``
            bytes received (408 otherwise; 0: no such deadline). A body sent one byte every 12 s is
            cut off after about 20 s; a 4 MiB body may take 20 s + 8,389 s.
        send_timeout: seconds a response may wait for its client to read (the connection's buffers
            full: the client stopped reading) before the connection is closed and its request aborted.
        keep_alive_timeout: an idle keep-alive connection is closed after this many seconds (uvicorn's).
    """

    max_header_bytes: int = 64 * 1024
    max_header_count: int = 256
    header_timeout: float = 20.0
    body_timeout: float = 20.0
    body_min_rate: float = 500.0
    send_timeout: float = 60.0
    keep_alive_timeout: float = 5.0


@functools.cache
def http_protocol(limits: ConnectionLimits = ConnectionLimits()) -> type | None:
    """uvicorn's httptools protocol held to ``limits``
    (:class:`~course.serving.api.http_limits.LimitedHttpProtocol` says how); None where httptools is missing."""
    try:
        from course.serving.api.http_limits import protocol_class
    except ImportError:  # httptools is a dependency of the course; uvicorn's h11 is the fallback
        return None
    return protocol_class(limits)


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
