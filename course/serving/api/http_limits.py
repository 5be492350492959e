"""The HTTP/1.1 protocol of the course's servers: uvicorn's fast parser (httptools), held to
:class:`~course.serving.api.background.ConnectionLimits`.

uvicorn's ``HttpToolsProtocol`` has no limit on the request line and headers and no timeout for a
request that never finishes; :class:`LimitedHttpProtocol` adds the limits web servers have. Importing
this module imports uvicorn and httptools; :func:`~course.serving.api.background.http_protocol` does
it only when a server starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from http import HTTPStatus
from typing import TYPE_CHECKING

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

if TYPE_CHECKING:
    from course.serving.api.background import ConnectionLimits

log = logging.getLogger("course.serving.http")

# What a connection may hold on the server's side for a client that does not read: unsent bytes in its socket
# (TCP_NOTSENT_LOWAT, Linux and macOS; without it Linux lets a loopback socket's send buffer grow to 4 MB,
# measured on the course's 2-core machine) and bytes in the transport's buffer (its high-water mark; asyncio's
# and uvloop's default is 64 KiB). Past them the response waits (uvicorn's flow control), the send timeout
# runs, and the reference server's stream backlog starts to fill. A client that reads is not slowed: what it
# has taken is no longer unsent, and the transport's buffer is empty while the socket takes every write.
# (What the client's own kernel has taken and not yet read is bounded by its receive buffer, which Linux
# grows while data trickles in: that is the client's memory, and to the server such a client reads.)
NOTSENT_LOWAT = 16 * 1024
WRITE_HIGH_WATER = 16 * 1024
_TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", None)


def _raw_error(status: int, message: str, err_type: str, default_headers=()) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI-style error object, closing the connection."""
    body = json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}}).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    lines += [name + b": " + value for name, value in default_headers]
    lines += [b"content-type: application/json", b"content-length: %d" % len(body), b"connection: close", b"", body]
    return b"\r\n".join(lines)


class _TooManyHeaders(Exception):
    pass


def protocol_class(limits: ConnectionLimits) -> type[LimitedHttpProtocol]:
    """:class:`LimitedHttpProtocol` held to ``limits`` (uvicorn builds one instance per connection)."""
    return type("CourseHttpProtocol", (LimitedHttpProtocol,), {"limits": limits})


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol held to :attr:`limits` (set by a subclass: :func:`protocol_class`).

    On top of uvicorn's ``HttpToolsProtocol`` it

    * counts the bytes of every request line and header block as they arrive and answers 431 (with
      an OpenAI-style error object) past ``limits.max_header_bytes`` or ``max_header_count``, before
      buffering more: what a connection holds is bounded whatever the client sends (a body is
      bounded by uvicorn's flow control and the app's own limit);
    * times out a request line and headers that never finish, a body that stops arriving or trickles in
      (slower than ``limits.body_min_rate`` once ``body_timeout`` has passed), and a connection that
      sends nothing (408, or a plain close when nothing arrived); idle keep-alive connections keep
      uvicorn's ``timeout_keep_alive``;
    * closes a connection whose client has read none of its response for ``limits.send_timeout`` s while
      the response waits to be sent (the app sees a disconnect: the reference server aborts the request
      and frees its KV cache), with the socket's unsent bytes and the transport's buffer capped
      (:data:`NOTSENT_LOWAT`, :data:`WRITE_HIGH_WATER`), so that such a client is noticed after some
      32 KB on the server's side, not megabytes;
    * answers a request with an ``Upgrade`` header (``curl --http2``'s h2c, a websocket handshake)
      as plain HTTP/1.1 with its body, as RFC 9110 allows a server to: httptools would otherwise
      stop parsing at the end of the headers and the app would see an empty body;
    * answers a malformed request with a 400 error object and logs it at INFO, not WARNING (any
      client can send one).
    """

    limits: ConnectionLimits

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # waiting for (the rest of) a request line and headers
        self._head_bytes = 0
        self._head_count = 0
        self._closed_by_us = False
        self._replaying = False  # feeding a request head again, without its Upgrade header
        self._skip_complete = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind = ""
        self._body_start = 0.0  # when the current request's headers ended (loop time)
        self._body_bytes = 0  # bytes of its body received so far
        self._send_stall: asyncio.TimerHandle | None = None  # armed while the client reads nothing

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
                self._body_start = self.loop.time()
                self._body_bytes = 0
                self._arm("body", self.limits.body_timeout)
            elif self.loop.time() >= self._body_deadline() - 0.01:
                seconds = self.loop.time() - self._body_start
                self._refuse(
                    408,
                    f"The request body arrived too slowly: {self._body_bytes} bytes in {seconds:.0f} s; this server "
                    f"needs it within {self.limits.body_timeout:g} s plus 1 s per {self.limits.body_min_rate:g} "
                    "bytes. Send the body at once.",
                    "RequestTimeoutError",
                )
            else:
                self._refuse(408, "The request body stopped arriving before its end.", "RequestTimeoutError")

    def _body_deadline(self) -> float:
        """When the current body must have arrived (loop time): ``body_timeout`` after its headers, plus a
        second per ``body_min_rate`` bytes received (infinite without a minimum rate)."""
        if self.limits.body_min_rate <= 0:
            return float("inf")
        return self._body_start + self.limits.body_timeout + self._body_bytes / self.limits.body_min_rate

    def _arm_body(self) -> None:
        """The body's timer: the next silence limit or the whole body's deadline, whichever comes first."""
        self._arm("body", min(self.limits.body_timeout, self._body_deadline() - self.loop.time()))

    # the client's reading: a response that cannot be written
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_stall is None and self.limits.send_timeout > 0:
            self._send_stall = self.loop.call_later(self.limits.send_timeout, self._send_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._send_stall is not None:
            self._send_stall.cancel()
            self._send_stall = None

    def _send_stalled(self) -> None:
        """The client read nothing for ``send_timeout`` s while its response waited: close the connection
        (its buffered output is dropped; the app's receive() reports the disconnect and the reference
        server aborts the request, freeing its batch slot and KV cache)."""
        self._send_stall = None
        if self._closed_by_us or self.transport.is_closing():
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        log.info("%s: read none of its response for %g s: connection closed", client, self.limits.send_timeout)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            state = cycle.scope.setdefault("state", {})
            state.setdefault(
                "client_gone",
                f"while its response waited: it read none of it for {self.limits.send_timeout:g} s (the send "
                "timeout), so the connection was closed and its request aborted",
            )
        self._closed_by_us = True
        self.transport.abort()  # close() would wait to send what is buffered: for ever

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
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        sock = transport.get_extra_info("socket")
        if _TCP_NOTSENT_LOWAT is not None and sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):  # a kernel without it: the send timeout still applies, later
                sock.setsockopt(socket.IPPROTO_TCP, _TCP_NOTSENT_LOWAT, NOTSENT_LOWAT)
        self._arm("head", self.limits.header_timeout)

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self._send_stall is not None:
            self._send_stall.cancel()
            self._send_stall = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closed_by_us:
            return
        if not self._in_head:
            if self._timer_kind == "body" and self._timer is not None:
                self._body_bytes += len(data)
                self._arm_body()
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
        self._body_start, self._body_bytes = self.loop.time(), 0
        self._arm_body()
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
