"""Clients that read slowly, send slowly, or are not meant to send at all.

* A stream whose client stops reading: its connection's buffers on the server's side are capped (the
  socket's unsent bytes, ``http_limits.NOTSENT_LOWAT``, and the transport's, ``WRITE_HIGH_WATER``), then
  at most ``max_stream_backlog`` tokens wait before its generation is aborted (its batch slot and KV cache
  freed at once), and after ``send_timeout`` s of reading nothing its connection is closed. 64 such
  streams in a full batch delay an innocent request's first token by at most what these bounds let them
  generate: what the client's kernel takes (its receive buffer), the two buffers, and the backlog.
* A body that trickles in (one byte every 12 s, scaled down here) is cut off with a 408 once it falls
  behind ``body_timeout`` s plus a second per ``body_min_rate`` bytes (Apache's ``MinRate``).
* A generation route takes only ``Content-Type: application/json`` (415 otherwise): a web page's
  cross-site request without a CORS preflight can send only ``text/plain``, the form types or no type.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.api.background import BackgroundServer, ConnectionLimits
from course.serving.api.http_limits import NOTSENT_LOWAT, WRITE_HIGH_WATER
from course.serving.api.protocol import DEFAULT_MAX_STREAM_BACKLOG
from course.serving.api.server import create_app
from course.serving.engine import Engine
from course.serving.request import EventSink, TokenEvent
from course.serving.testing import chatty_tiny_model

MODEL = "slow"
# The hogs' receive buffer: set, so their kernel keeps it (Linux doubles the value for its bookkeeping) and does
# not grow it, as it does for a socket that takes small segments slowly and reads nothing (measured on the
# course's machine: 131 KB to 589 KB in 60 s at 450 bytes every 50 ms). A client whose kernel takes everything
# is, to the server, a client that reads: it holds its slot as long as one would (up to its max_tokens).
HOG_RCVBUF = 16 * 1024
# What a hog's connection takes before the server's transport pauses: its receive buffer, the socket's unsent
# bytes and the transport's buffer, with 16 KiB for the kernel's rounding and the segments' overheads.
ABSORBED_BYTES = 2 * HOG_RCVBUF + NOTSENT_LOWAT + WRITE_HIGH_WATER + 16 * 1024


@pytest.fixture(scope="module")
def lm():
    return chatty_tiny_model(seed=11)


def _stream_request(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"Content-Length: %d\r\n\r\n" % len(data)
        + data
    )


def _sse_events(response: bytes) -> list[bytes]:
    """The ``data:`` events of a raw HTTP/1.1 response with a chunked body."""
    body, events = response.split(b"\r\n\r\n", 1)[1], b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        events, body = events + rest[: int(size, 16)], rest[int(size, 16) + 2 :]
    return [event for event in events.split(b"\n\n") if event.startswith(b"data:")]


def _health(server: BackgroundServer) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


# --- the bound on a stream's backlog ------------------------------------------------------------------------


def test_a_sinks_bound_calls_back_once_when_its_consumer_falls_behind():
    sink, calls = EventSink(), []

    async def fill() -> int:
        sink.bound(3, lambda: calls.append(sink.backlog))
        events = sink.events()
        first = asyncio.ensure_future(events.__anext__())  # attaches the loop, then waits for an event
        await asyncio.sleep(0)
        for token in range(8):
            sink.put(TokenEvent(token))
        await first
        return sink.backlog

    left = asyncio.run(fill())
    assert calls == [4], "called once, as the fourth waiting event arrived"
    assert left == 7


def test_64_streams_that_stop_reading_free_their_slots_and_an_innocent_request_gets_its_first_token(lm):
    """A full batch (64) of streams whose clients send their request and read nothing, then one innocent
    streamed request. Each non-reader can run ahead of its client by what its connection absorbs
    (``ABSORBED_BYTES`` / its chunk size) plus the backlog bound, then it is aborted and its slot freed: the
    innocent's first token comes before the engine has generated more than 64 times that for them (without
    the bound they would each run to their 2,000 tokens first; in time, the bound is that many decode steps
    of a batch of 64). What waits on the server's side stays within 64 x the bound throughout, and every
    connection is closed after the send timeout."""
    engine = Engine(lm, max_batch_size=64, max_model_len=4096)
    app = create_app(engine=engine, model_name=MODEL)
    limits = ConnectionLimits(send_timeout=4.0)
    hogs: list[socket.socket] = []
    backlog_seen: list[int] = []
    sampling = threading.Event()
    with BackgroundServer(app, limits=limits) as server:

        def sample_backlog() -> None:
            while not sampling.is_set():
                backlog_seen.append(_health(server)["stream_backlog"])
                time.sleep(0.1)

        sampler = threading.Thread(target=sample_backlog, daemon=True)
        sampler.start()
        try:
            body = {"model": MODEL, "max_tokens": 2000, "ignore_eos": True, "stream": True}
            for i in range(64):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, HOG_RCVBUF)
                sock.connect((server.host, server.port))
                sock.sendall(_stream_request({**body, "prompt": f"hog {i}"}))
                hogs.append(sock)
            deadline = time.monotonic() + 60
            while engine.num_running < 64 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.num_running == 64, "the hogs never filled the batch: the test would prove nothing"
            started, at_start = time.monotonic(), engine.counters.tokens_generated
            innocent = {"model": MODEL, "prompt": "innocent", "max_tokens": 8, "stream": True}
            with httpx.stream("POST", server.base_url + "/completions", json=innocent, timeout=300) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                hog_tokens, seconds = engine.counters.tokens_generated - at_start, time.monotonic() - started
                rest = [line for line in lines if line.startswith("data:")]
            chunk_bytes = len(first) + 2  # an SSE event of one token, as the hogs' chunks
            # + 4: the abort's own event and the steps in flight while the abort reaches the engine
            per_hog = ABSORBED_BYTES // chunk_bytes + 1 + DEFAULT_MAX_STREAM_BACKLOG + 4
            print(f"innocent TTFT {seconds:.1f} s after {hog_tokens} hog tokens (bound {64 * per_hog}, chunk "
                  f"{chunk_bytes} B); server backlog peak {max(backlog_seen)} events")  # fmt: skip
            assert hog_tokens <= 64 * per_hog < 64 * 2000, (hog_tokens, per_hog)
            assert rest[-1] == "data: [DONE]" and len(rest) == 8 and "error" not in first
            deadline = time.monotonic() + 60
            while (engine.num_unfinished or engine.cache_tokens()) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.num_unfinished == 0 and engine.cache_tokens() == 0, "an aborted hog kept its slot"
            deadline = time.monotonic() + 30  # the send timeout (4 s) closes the hogs' connections
            while _health(server)["streams"] and time.monotonic() < deadline:
                time.sleep(0.2)
            health = _health(server)
            assert health["streams"] == 0 and health["stream_backlog"] == 0, health
        finally:
            sampling.set()
            sampler.join(10)
            for sock in hogs:
                sock.close()
    assert max(backlog_seen) <= 64 * (DEFAULT_MAX_STREAM_BACKLOG + 4), max(backlog_seen)


def test_a_stream_that_waits_too_long_is_closed_and_aborted_and_says_so_in_the_log(lm, caplog):
    """With no backlog bound, the send timeout alone: a client that reads nothing for ``send_timeout`` s has
    its connection closed and its generation aborted (logged as one line)."""
    engine = Engine(lm, max_batch_size=4, max_model_len=4096)
    app = create_app(engine=engine, model_name=MODEL, max_stream_backlog=None)
    limits = ConnectionLimits(send_timeout=1.0)
    with caplog.at_level(logging.INFO, logger="course.serving"), BackgroundServer(app, limits=limits) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        body["logprobs"] = 5
        with socket.create_connection((server.host, server.port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(_stream_request(body))
            deadline = time.monotonic() + 60
            while (engine.num_unfinished or not engine.counters.tokens_generated) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.num_unfinished == 0, "a client that read nothing kept its generation running"
            assert engine.counters.tokens_generated < 4000
            received, closed = b"", False
            sock.settimeout(5)
            while not closed:
                try:
                    chunk = sock.recv(1 << 16)
                except (ConnectionResetError, TimeoutError):
                    break
                closed = not chunk
                received += chunk
        assert received.startswith(b"HTTP/1.1 200")
    lines = [r.getMessage() for r in caplog.records]
    assert any("read none of its response for 1 s" in line for line in lines), lines
    assert any("the client went away while its response waited" in line for line in lines), lines


def test_a_client_that_pauses_and_reads_on_gets_its_whole_stream(lm):
    engine = Engine(lm, max_batch_size=4, max_model_len=4096)
    with BackgroundServer(create_app(engine=engine, model_name=MODEL)) as server:
        body = {"model": MODEL, "prompt": "pause", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            head = [next(lines) for _ in range(4)]
            time.sleep(1.0)  # it stops reading a while; its connection holds what comes meanwhile
            rest = list(lines)
        events = [line for line in head + rest if line.startswith("data:")]
        assert events[-1] == "data: [DONE]" and len(events) == 201 and not any('"error"' in e for e in events)


def test_a_backlogged_stream_that_reads_on_ends_with_an_error_event(lm):
    """A tiny bound, a client that reads a little, stops, then reads on: its stream has the tokens that
    waited, then an error event saying why it stopped, then [DONE]."""
    engine = Engine(lm, max_batch_size=4, max_model_len=4096)
    app = create_app(engine=engine, model_name=MODEL, max_stream_backlog=8)
    with BackgroundServer(app) as server:
        body = {"model": MODEL, "prompt": "lag", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        body["logprobs"] = 20
        with socket.create_connection((server.host, server.port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(_stream_request(body))
            deadline = time.monotonic() + 60
            while (engine.counters.tokens_generated < 10 or engine.num_unfinished) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.num_unfinished == 0 and engine.counters.tokens_generated < 4000
            received = b""
            sock.settimeout(10)
            while not received.endswith(b"\r\n0\r\n\r\n"):  # the chunked body's end
                chunk = sock.recv(1 << 16)
                assert chunk, received[-300:]
                received += chunk
    events = _sse_events(received)
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2][5:])["error"]
    assert error["type"] == "SlowClientError" and "read too slowly" in error["message"], error
    assert all(b'"text"' in e for e in events[:-2]) and len(events) > 10


# --- bodies that trickle in ---------------------------------------------------------------------------------


def test_the_default_body_deadline_cuts_one_byte_every_12_s_after_about_20_s():
    limits = ConnectionLimits()
    assert (limits.body_timeout, limits.body_min_rate) == (20.0, 500.0)  # Apache's body=20,MinRate=500
    # one byte every 12 s never trips the 20 s silence limit; the deadline is 20 s + 2 ms per byte received
    assert 12 < limits.body_timeout < limits.body_timeout + 2 / limits.body_min_rate < 24
    assert limits.body_timeout + 4 * 2**20 / limits.body_min_rate > 8000  # a 4 MiB body may take over 2 hours


@pytest.fixture(scope="module")
def quick_limits_server(lm):
    engine = Engine(lm, max_batch_size=4, max_model_len=256)
    limits = ConnectionLimits(body_timeout=1.0, body_min_rate=500.0, header_timeout=5.0)
    with BackgroundServer(create_app(engine=engine, model_name=MODEL), limits=limits) as server:
        yield server


def _send_slowly(server, body: bytes, piece: int, gap: float, timeout: float) -> tuple[bytes, float]:
    """Send the headers, then ``body`` in pieces of ``piece`` bytes every ``gap`` s; (the answer, seconds)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
    started = time.monotonic()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body))
        sock.settimeout(timeout)
        for start in range(0, len(body), piece):
            try:
                sock.sendall(body[start : start + piece])
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(gap)
        answer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            answer += chunk
    return answer, time.monotonic() - started


def test_a_body_that_trickles_in_is_cut_off_with_a_408(quick_limits_server):
    """The issue's body, one byte every 12 s, scaled by 1/30 (limits 1 s + 1 s per 500 bytes): each gap
    (0.4 s) is under the silence limit, so only the deadline stops it."""
    body = json.dumps({"model": MODEL, "prompt": "x" * 100, "max_tokens": 2}).encode()
    answer, seconds = _send_slowly(quick_limits_server, body, piece=1, gap=0.4, timeout=30)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["type"] == "RequestTimeoutError" and "arrived too slowly" in error["message"], error
    assert seconds < 10, f"cut off after {seconds:.1f} s; the deadline is about 1 s"


def test_a_body_that_keeps_the_minimum_rate_is_served(quick_limits_server):
    """About 1,000 bytes/s for 3 s (over the 1 s grace, at twice the minimum rate): answered."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "u" * 2900}).encode()
    assert len(body) > 2900
    answer, _ = _send_slowly(quick_limits_server, body, piece=100, gap=0.1, timeout=30)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


# --- the content type of a generation request ------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data"],
)
def test_a_body_that_is_not_declared_json_is_refused_with_415_before_anything_runs(lm, content_type):
    engine = Engine(lm, max_batch_size=2, max_model_len=256)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    headers = {} if content_type is None else {"Content-Type": content_type}
    with BackgroundServer(create_app(engine=engine, model_name=MODEL)) as server:
        for path in ("/completions", "/chat/completions"):
            refused = httpx.post(server.base_url + path, content=body, headers=headers, timeout=30)
            assert refused.status_code == 415, refused.text
            error = refused.json()["error"]
            assert error["type"] == "UnsupportedMediaTypeError" and error["code"] == 415
            assert "application/json" in error["message"]
            assert ("no Content-Type" if content_type is None else repr(content_type)) in error["message"]
    assert engine.counters.tokens_generated == 0 and engine.counters.prefills == 0


def test_json_with_any_parameters_and_the_openai_client_are_served(lm):
    import openai

    engine = Engine(lm, max_batch_size=2, max_model_len=256)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with BackgroundServer(create_app(engine=engine, model_name=MODEL)) as server:
        for content_type in ("application/json", "application/json; charset=utf-8", "Application/JSON ; x=1"):
            served = httpx.post(server.base_url + "/completions", content=body, headers={"Content-Type": content_type})
            assert served.status_code == 200, (content_type, served.text)
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.usage.completion_tokens == 2
