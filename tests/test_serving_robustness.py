"""Robustness of the reference server: a barrage of malformed requests, then 32 concurrent streams
with random mid-stream disconnects. Afterwards the server still answers, no response was a 5xx,
and no request is left running in the engine (nor any row of the KV cache)."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.api.background import BackgroundServer, run_sync
from course.serving.api.server import create_app
from course.serving.engine import Engine
from course.serving.testing import chatty_tiny_model

MODEL = "robust"


def malformed_requests(rng: random.Random) -> list[tuple[str, dict]]:
    """At least 100 bad requests: (endpoint, httpx keyword arguments)."""
    cases: list[tuple[str, dict]] = []
    raw = [b"", b"{", b"}", b"null", b"42", b'"text"', b"[]", b'{"prompt": }', b"\xff\xfe\x00", b'{"prompt": "x"'] + [
        bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 40))) for _ in range(10)
    ]
    json_type = {"content-type": "application/json"}  # declared JSON: the parser must refuse them with a 400
    for body in raw:
        cases.append(("completions", {"content": body, "headers": json_type}))
        cases.append(("chat/completions", {"content": body, "headers": json_type}))
    wrong_values = [None, True, -1, 0, 1.5, "abc", [], {}, [1, "a"], {"x": 1}, 10**9]
    for field in ("prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "model"):
        for value in wrong_values:
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, field: value}
            cases.append(("completions", {"json": body}))
    messages_values = [
        None,
        "hi",
        [],
        [None],
        [{"role": "user"}],
        [{"content": "x"}],
        [{"role": 5, "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image"}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
    ]
    for messages in messages_values:
        cases.append(("chat/completions", {"json": {"model": MODEL, "messages": messages}}))
    cases.append(("completions", {"json": {"prompt": "a " * 400, "max_tokens": 1}}))  # prompt over the context
    cases.append(("completions", {"json": {"prompt": "x", "max_tokens": 256}}))  # prompt + max_tokens over it
    cases.append(("completions", {"json": {"prompt": [-1, 5]}}))
    cases.append(("completions", {"content": b'{"prompt": "x"}', "headers": {"content-type": "text/plain"}}))
    return cases


@pytest.fixture(scope="module")
def server():
    engine = Engine(chatty_tiny_model(seed=9), max_batch_size=16, max_model_len=256)
    with BackgroundServer(create_app(engine=engine, model_name=MODEL)) as running:
        running.engine = engine
        yield running


def test_malformed_requests_then_random_disconnects(server):
    rng = random.Random(1234)
    cases = malformed_requests(rng)
    assert len(cases) >= 100
    statuses = []
    with httpx.Client(timeout=30) as http:
        for endpoint, kwargs in cases:
            response = http.post(f"{server.base_url}/{endpoint}", **kwargs)
            statuses.append(response.status_code)
            if response.status_code != 200:  # a few "bad" values are legal (e.g. stream null)
                assert "error" in response.json(), response.text
    assert not [s for s in statuses if s >= 500], "a client's mistake must never be a 5xx"
    assert statuses.count(400) >= 100
    assert statuses[-1] == 415, "JSON sent as text/plain (a cross-site form's type) is refused"

    async def stream(i: int, http: httpx.AsyncClient) -> tuple[int, int]:
        body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 200, "stream": True, "ignore_eos": True}
        leave_after = rng.choice([0, 1, 3, 10, 40, None])  # None: read to the end
        async with http.stream("POST", server.base_url + "/completions", json=body) as response:
            events = 0
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    events += 1
                    if leave_after is not None and events > leave_after:
                        break  # leaving the block closes the connection mid-stream
            return response.status_code, events

    async def storm():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as http:
            return await asyncio.gather(*(stream(i, http) for i in range(32)))

    results = run_sync(storm(), timeout=120)
    assert all(status == 200 for status, _ in results)
    engine = server.engine
    deadline = time.monotonic() + 10
    while (engine.num_unfinished or engine.cache_tokens()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.num_unfinished == 0, "a request was left running after its client left"
    assert engine.cache_tokens() == 0, "the KV cache still holds rows of finished requests"
    assert engine.stats()["running"] == 0 and engine.last_error is None
    reply = httpx.post(
        server.base_url + "/completions", json={"model": MODEL, "prompt": "still there?", "max_tokens": 3}, timeout=30
    )
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
    assert json.loads(httpx.get(server.url + "/health", timeout=10).text)["status"] == "ok"
