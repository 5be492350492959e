"""What a hostile client must not be able to do to the reference server's log and errors.

Access-log lines escape every control character (a percent-encoded CR LF or ESC in the path cannot
forge lines or terminal escapes); a client that disconnects while its body is read, or whose
transport is closed when the stream writes (uvloop raises RuntimeError there), is logged as one INFO
line, never as an "Exception in ASGI application" traceback; repeated Authorization headers are
refused with 400; error messages do not echo a megabyte model id back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.api.background import BackgroundServer, run_sync
from course.serving.api.server import create_app
from course.serving.engine import Engine
from course.serving.testing import shared_chatty_model

MODEL = "hostile"


class Records(logging.Handler):
    """Every record of the named loggers while active (uvicorn's loggers do not propagate to pytest's)."""

    def __init__(self, *names: str) -> None:
        super().__init__(logging.DEBUG)
        self.names, self.records = names, []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, name: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.name == name]

    def __enter__(self) -> Records:
        for name in self.names:
            logger = logging.getLogger(name)
            self._levels = getattr(self, "_levels", {}) | {name: logger.level}
            logger.addHandler(self)
            logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.names:
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            logger.setLevel(self._levels[name])


LOGGERS = ("course.serving.access", "course.serving.server", "uvicorn.error")


@pytest.fixture(scope="module")
def engine():
    return Engine(shared_chatty_model(seed=5), max_batch_size=8, max_model_len=512)


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(create_app(engine=engine, model_name=MODEL, access_log=True, api_key="k3y")) as running:
        yield running


def _raw(server, request: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(request)
        sock.settimeout(timeout)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def _controls(text: str) -> list[str]:
    return [c for c in text if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029\u202e"]


def test_access_log_escapes_control_characters(server):
    paths = [
        b"/v1/models/%0d%0a127.0.0.1%20%22GET%20/admin%22%20200",  # CR LF: a forged second line
        b"/health%1b[31mred%1b]0;title%07",  # ESC / CSI / OSC / BEL: terminal escapes
        b"/x%c2%85y%e2%80%aez%e2%80%a8",  # C1 NEL, RIGHT-TO-LEFT OVERRIDE, LINE SEPARATOR
    ]
    with Records(*LOGGERS) as log:
        for path in paths:
            reply = _raw(server, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 "), reply[:100]
        time.sleep(0.2)
    lines = log.lines("course.serving.access")
    assert len(lines) == len(paths), lines
    for line in lines:
        assert not _controls(line), repr(line)
    assert "\\x0D\\x0A127.0.0.1 \\x22GET /admin\\x22 200" in lines[0], lines[0]
    assert "\\x1B[31mred\\x1B]0;title\\x07" in lines[1] and "\\u0085" in lines[2] and "\\u202E" in lines[2]


def test_disconnect_while_the_body_is_read_is_one_info_line(server):
    with Records(*LOGGERS) as log:
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\n"
                b"Content-Type: application/json\r\n"
                b'Content-Length: 1000\r\n\r\n{"prompt": "x'
            )
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while not log.lines("course.serving.server") and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    assert not [r for r in log.records if r.levelno >= logging.WARNING], [r.getMessage() for r in log.records]
    assert not [r for r in log.records if r.exc_info], "a disconnect must not log a traceback"
    gone = log.lines("course.serving.server")
    assert len(gone) == 1 and "went away while sending its request body" in gone[0], gone


def test_a_stream_whose_transport_closed_is_one_info_line(engine):
    """uvloop raises RuntimeError("... the handler is closed") from a write to a transport that closed
    before uvicorn saw the disconnect; the stream must end (and abort) without a traceback."""
    app = create_app(engine=engine, model_name=MODEL)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 200, "stream": True, "ignore_eos": True})
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
        "client": ("127.0.0.1", 5555),
        "server": ("127.0.0.1", 80),
    }
    sent = []

    async def main():
        never = asyncio.Event()
        messages = [{"type": "http.request", "body": body.encode(), "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await never.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if len(sent) == 4:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>; the handler is closed")

        await app(scope, receive, send)

    with Records(*LOGGERS) as log:
        run_sync(main(), timeout=60)
    deadline = time.monotonic() + 10
    while engine.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_unfinished == 0, "the stream's engine request was not aborted"
    assert len(sent) == 4  # nothing written after the failed write
    gone = log.lines("course.serving.server")
    assert len(gone) == 1 and "went away while its response streamed" in gone[0], gone
    assert not [r for r in log.records if r.exc_info or r.levelno >= logging.WARNING], log.records


def test_repeated_authorization_headers_are_refused(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for headers in (
        [("Authorization", "Bearer wrong"), ("Authorization", "Bearer k3y")],
        [("Authorization", "Bearer k3y"), ("Authorization", "Bearer k3y")],
    ):
        reply = httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=30)
        assert reply.status_code == 400, reply.text
        assert "Authorization" in reply.json()["error"]["message"]
    assert httpx.post(server.base_url + "/completions", json=body, headers={"Authorization": "Bearer k3y"}).is_success


def test_errors_do_not_echo_a_huge_model_id(server):
    auth = {"Authorization": "Bearer k3y"}
    huge = "m" * 1_000_000
    reply = httpx.post(server.base_url + "/completions", json={"model": huge, "prompt": "x"}, headers=auth, timeout=30)
    assert reply.status_code == 404 and len(reply.content) < 3000, len(reply.content)
    assert "more characters" in reply.json()["error"]["message"]
    reply = httpx.get(server.base_url + "/models/" + "n" * 30_000, headers=auth, timeout=30)
    assert reply.status_code == 404 and len(reply.content) < 3000, len(reply.content)
