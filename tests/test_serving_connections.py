"""What one client connection may cost the reference server (the HTTP layer, under the app).

A hostile client, without an API key, must not be able to grow the server's memory or hold its
connections: request headers are bounded in size and count (431 with an OpenAI-style error
object), a request that never finishes times out (408), idle connections are closed, and the
server's resident memory stays flat while many connections send never-ending headers. Requests
with an ``Upgrade`` header (curl --http2's h2c, a websocket handshake) are answered as plain
HTTP/1.1 with their body. Raw sockets on 127.0.0.1 throughout, every loop bounded.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers import one_torch_thread, wait_until_healthy  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.api.background import BackgroundServer, ConnectionLimits
from course.serving.api.server import create_app
from course.serving.engine import Engine
from course.serving.testing import shared_chatty_model

MODEL = "conn"
BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}).encode()


def _read_all(sock: socket.socket, timeout: float) -> tuple[bytes, bool]:
    """What the server sends until it closes (True) or ``timeout`` s pass (False)."""
    sock.settimeout(timeout)
    data, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _post(path: bytes, extra_headers: bytes = b"", body: bytes = BODY) -> bytes:
    return (
        b"POST "
        + path
        + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + extra_headers
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


@pytest.fixture(scope="module")
def server():
    engine = Engine(shared_chatty_model(seed=3), max_batch_size=4, max_model_len=256)
    limits = ConnectionLimits(  # the timeouts scaled down from 20 s and 5 s, and the body's minimum rate with them
        max_header_bytes=8192, max_header_count=50, header_timeout=0.6, body_timeout=0.6, keep_alive_timeout=0.6,
        body_min_rate=50.0,
    )  # fmt: skip
    with BackgroundServer(create_app(engine=engine, model_name=MODEL), limits=limits) as running:
        yield running


def test_oversized_or_too_many_headers_get_431_with_an_error_object(server):
    cases = {
        "bytes": _post(b"/v1/completions", b"X-Fill: " + b"a" * 20_000 + b"\r\n"),
        "request line": b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        "count": _post(b"/v1/completions", b"".join(b"X-H%d: 1\r\n" % i for i in range(60))),
    }
    for name, request in cases.items():
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(request)
            raw, closed = _read_all(sock, 10)
        status, body = _status_and_json(raw)
        assert status == 431 and closed, (name, raw[:300])
        assert body["error"]["type"] == "RequestHeaderFieldsTooLargeError" and body["error"]["code"] == 431, body
    with socket.create_connection((server.host, server.port)) as sock:  # under the limits: served
        sock.sendall(
            _post(b"/v1/completions", b"".join(b"X-H%d: 1\r\n" % i for i in range(40)) + b"Connection: close\r\n")
        )
        raw, _ = _read_all(sock, 30)
    assert _status_and_json(raw)[0] == 200, raw[:300]


def test_unfinished_requests_and_idle_connections_are_closed(server):
    partial = {
        "request line": b"POST /v1/compl",
        "headers": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n",
        "body": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 400\r\n\r\n{"prompt": ',
    }
    for name, request in partial.items():
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(request)
            start = time.monotonic()
            raw, closed = _read_all(sock, 10)
        assert closed and time.monotonic() - start < 5, f"{name}: the connection was left open"
        status, body = _status_and_json(raw)
        assert status == 408 and body["error"]["type"] == "RequestTimeoutError", (name, raw[:300])
    with socket.create_connection((server.host, server.port)) as sock:  # says nothing at all
        raw, closed = _read_all(sock, 10)
    assert closed and raw == b""
    with socket.create_connection((server.host, server.port)) as sock:  # keep-alive, then idle
        sock.sendall(_post(b"/v1/completions"))
        raw, closed = _read_all(sock, 10)
    assert closed and raw.startswith(b"HTTP/1.1 200"), raw[:200]


def test_slow_but_steady_body_and_pipelined_requests_are_served(server):
    with socket.create_connection((server.host, server.port)) as sock:
        request = _post(b"/v1/completions", b"Connection: close\r\n")
        head, body = request[: -len(BODY)], request[-len(BODY) :]
        sock.sendall(head)
        for i in range(0, len(body), 20):  # pauses shorter than the body timeout: not a stalled body
            time.sleep(0.2)
            sock.sendall(body[i : i + 20])
        raw, _ = _read_all(sock, 30)
    assert _status_and_json(raw)[0] == 200, raw[:300]
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(_post(b"/v1/completions") + _post(b"/v1/completions", b"Connection: close\r\n"))
        raw, _ = _read_all(sock, 30)
    assert raw.count(b"HTTP/1.1 200 OK") == 2, raw[:500]


@pytest.mark.parametrize(
    "upgrade",
    [
        b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
        b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: x3JJHMbDL1EzLkh9GBhXDw==\r\n",
    ],
    ids=["h2c", "websocket"],
)
def test_upgrade_requests_are_plain_http_with_their_body(server, upgrade):
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(_post(b"/v1/completions", upgrade) + _post(b"/v1/completions", b"Connection: close\r\n"))
        raw, _ = _read_all(sock, 30)
    assert raw.startswith(b"HTTP/1.1 200 OK") and raw.count(b"HTTP/1.1 200 OK") == 2, raw[:400]
    first = raw.split(b"HTTP/1.1 200 OK")[1]
    assert json.loads(first.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 3
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + upgrade
        + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n%x\r\n" % len(BODY)
        + BODY
        + b"\r\n0\r\n\r\n"
    )
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(chunked)
        raw, _ = _read_all(sock, 30)
    assert raw.startswith(b"HTTP/1.1 200 OK"), raw[:400]


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_course_serve_memory_stays_flat_under_never_ending_headers(tmp_path):
    """8 connections each send up to 16 MiB of headers that never end (the attack of issue 24 sent 32 MiB
    each and added about 250 MiB to the server); a 1 MB header block is refused, not served."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "course.cli", "serve", "--model", "tiny", "--port", str(port), "--threads", "1"]
    command += ["--engine-core", "thread", "--log-level", "info"]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    sockets: list[socket.socket] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(process, base, log_path)
        assert (
            httpx.post(base + "/v1/completions", json={"prompt": "warm", "max_tokens": 2}, timeout=30).status_code
            == 200
        )
        before = _rss_kib(process.pid)
        block = b"a" * 65536
        sent_total = 0
        for _ in range(8):
            sock = socket.create_connection(("127.0.0.1", port))
            sockets.append(sock)
            sock.settimeout(10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Fill: ")
            for _ in range(256):  # 16 MiB, unless the server closes first
                try:
                    sock.sendall(block)
                except OSError:  # refused and closed: the point
                    break
                sent_total += len(block)
        time.sleep(0.5)
        grown_mib = (_rss_kib(process.pid) - before) / 1024
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"b" * 1_000_000 + b"\r\n\r\n")
            raw, _ = _read_all(sock, 10)
        with httpx.Client() as http:  # a header of a million bytes, as a client library sends it
            big = http.get(base + "/health", headers={"X-Big": "c" * 1_000_000}, timeout=30)
        assert httpx.get(base + "/health", timeout=10).status_code == 200  # still serving
    finally:
        for sock in sockets:
            sock.close()
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    print(f"RSS grew by {grown_mib:.1f} MiB while 8 connections sent {sent_total / 2**20:.0f} MiB of headers")
    assert grown_mib < 32, f"the server's memory grew by {grown_mib:.0f} MiB under never-ending headers"
    assert raw.startswith(b"HTTP/1.1 431") or raw.startswith(b"HTTP/1.1 400"), raw[:200]
    assert "error" in _status_and_json(raw)[1]
    assert big.status_code in (400, 431) and "error" in big.json(), big.text[:300]
    assert "Traceback" not in log_path.read_text()
