"""The engine core's pipe survives any message size, and the server tells the core's death apart.

uvloop makes a pipe it watches non-blocking (libuv's ``uv_poll_init``), and there ``Connection.recv()``
fails half-way through any message that has not wholly arrived. A burst of 64 streams with 20 logprobs
each sends steps larger than the pipe's buffer, and each partial read was once taken for the core's
death: every open stream ended with an error, and from then on every request got 503 while ``/health``
said ok. These tests read the pipe the way the server does (``FrameReader`` on an event loop) with
messages of any size, run that burst against the real multiprocess engine, and check that a real death
(the core killed) and a wedged core (stopped) are reported as such, on ``/health`` too.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pickle
import signal
import struct
import threading
import time

import httpx
import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.api.background import BackgroundServer, run_sync
from course.serving.api.server import create_app
from course.serving.engine_process import CorruptOutput, EngineProcess, FrameReader
from course.serving.messages import StepOutputs
from course.serving.request import TokenEvent
from course.serving.testing import chatty_tiny_model

uvloop = pytest.importorskip("uvloop")


def _big_step(i: int, rows: int) -> StepOutputs:
    """A step of ``rows`` events with 20 alternatives each (about 0.3 KiB an event once pickled)."""
    events = []
    for r in range(rows):
        top = tuple((t, -1.0 - (r + t) / 1e4) for t in range(20))  # each its own floats: pickle cannot share them
        events.append((f"req-{i}-{r}", TokenEvent(r, None, None, None, -0.5, top)))
    return StepOutputs(events, {"i": i})


def test_the_frame_reader_reads_messages_of_any_size_from_a_pipe_uvloop_made_non_blocking():
    """Messages from 0.3 KiB to 8 MiB, written by another thread while uvloop's callback reads what has
    arrived: every one comes whole and in order, partial reads are never an error, and the end is seen."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    sizes = [1, 64, 300, 2, 5000, 27_000, 1, 64]  # events per message; 27,000 is about 8 MiB
    sent = [_big_step(i, rows) for i, rows in enumerate(sizes)]
    assert max(len(pickle.dumps(m)) for m in sent) > 7 * 2**20  # 100 times the pipe's buffer

    async def read_all() -> tuple[list, int, bool]:
        loop = asyncio.get_running_loop()
        frames, got, done = FrameReader(reader), [], loop.create_future()
        reads = [0]

        def readable() -> None:
            reads[0] += 1
            got.extend(frames.read())
            if frames.ended:
                loop.remove_reader(frames.fd)
                done.set_result(None)

        loop.add_reader(frames.fd, readable)
        blocking = os.get_blocking(frames.fd)
        writing = threading.Thread(target=lambda: ([writer.send(m) for m in sent], writer.close()))
        writing.start()
        await asyncio.wait_for(done, 60)
        writing.join()
        return got, reads[0], blocking

    got, reads, blocking = uvloop.run(read_all())
    assert not blocking, "uvloop no longer makes the pipe non-blocking: this test no longer covers that case"
    assert got == sent
    assert reads > len(sent), "every message came in one read: the test did not exercise partial messages"


def test_the_frame_reader_handles_the_8_byte_length_and_refuses_a_broken_pipe():
    reader, writer = multiprocessing.Pipe(duplex=False)
    frames = FrameReader(reader)
    payload = pickle.dumps({"large": True})
    # Connection.send's header for a message of 2 GiB or more: -1, then the length in 8 bytes
    os.write(writer.fileno(), struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload)
    assert frames.read() == [{"large": True}]
    os.write(writer.fileno(), struct.pack("!i", 1000) + b"x" * 10)  # a message cut short by the writer's end
    assert frames.read() == []
    writer.close()
    with pytest.raises(CorruptOutput, match="ended inside a message"):
        frames.read()


@pytest.fixture(scope="module")
def lm():
    return chatty_tiny_model(seed=5)


def _stream(url: str, body: dict) -> tuple[int, list[dict], bool]:
    """(status, the JSON events, whether it ended with [DONE]) of one streamed request."""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        lines = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
    done = bool(lines) and lines[-1] == "[DONE]"
    return response.status_code, [json.loads(line) for line in lines if line != "[DONE]"], done


def test_64_streams_with_20_logprobs_each_then_the_server_keeps_serving(lm):
    """The burst of the issue against the real multiprocess engine (uvloop, the default batch of 64):
    no stream ends with an error, every one gets all its tokens with their alternatives, and then a
    plain request is answered and /health says ok."""
    app = create_app(lm, model_name="m", engine_process=True)
    engine = app.state.engine
    tokens = 12
    with BackgroundServer(app) as server:

        async def one(http: httpx.AsyncClient, i: int) -> tuple[int, int, int]:
            body = {"model": "m", "prompt": f"burst {i}", "max_tokens": tokens, "stream": True, "logprobs": 20}
            body["ignore_eos"] = True
            chunks = errors = alternatives = 0
            async with http.stream("POST", server.base_url + "/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line.endswith("[DONE]"):
                        continue
                    event = json.loads(line[5:])
                    if "error" in event:
                        errors += 1
                    else:
                        chunks += 1
                        alternatives = min(alternatives or 99, len(event["choices"][0]["logprobs"]["top_logprobs"][0]))
            return chunks, errors, alternatives

        async def burst():
            async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) as http:
                return await asyncio.gather(*(one(http, i) for i in range(64)))

        results = run_sync(burst(), timeout=600)
        assert [errors for _, errors, _ in results] == [0] * 64, "streams ended with an error event"
        assert {chunks for chunks, _, _ in results} == {tokens}
        # the completions' top_logprobs dict is keyed by text: alternatives that decode alike merge (as in vLLM)
        assert min(alternatives for _, _, alternatives in results) >= 15
        assert engine.stats()["mean_batch_size"] > 8, "the burst never ran as one batch: it tested nothing"
        status, events, done = _stream(server.url, {"model": "m", "prompt": "after", "max_tokens": 4, "stream": True})
        assert status == 200 and done and len(events) == 4
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert engine.process.is_alive() and engine.last_error is None


def test_a_killed_core_is_reported_as_killed_on_streams_new_requests_and_health(lm):
    app = create_app(lm, model_name="m", engine_process=True, max_batch_size=4)
    engine = app.state.engine
    with BackgroundServer(app) as server:
        body = {"model": "m", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is streaming
            os.kill(engine.process.pid, signal.SIGKILL)
            rest = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == 500 and "killed by SIGKILL" in error["message"], error
        refused = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "x"}, timeout=30)
        assert refused.status_code == 503 and "killed by SIGKILL" in refused.json()["error"]["message"]
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503, health.text
        assert health.json()["status"] == "error" and "killed by SIGKILL" in health.json()["reason"]


def test_a_wedged_core_makes_health_fail_with_a_reason_until_it_moves_again(lm):
    """A core that is alive but stopped (SIGSTOP) while a request is open: /health answers 503 saying it
    is wedged once ``wedged_after`` has passed, and ok again once the core goes on."""
    engine = EngineProcess(lm, max_batch_size=2, wedged_after=1.0)
    app = create_app(engine=engine, model_name="m")
    with BackgroundServer(app) as server:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        os.kill(engine.process.pid, signal.SIGSTOP)
        try:
            body = {"model": "m", "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
            answer = {}
            waiting = threading.Thread(
                target=lambda: answer.update(r=httpx.post(server.url + "/v1/completions", json=body, timeout=60))
            )
            waiting.start()
            deadline = time.monotonic() + 30
            while engine.num_unfinished == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(1.5)
            health = httpx.get(server.url + "/health", timeout=10)
            assert health.status_code == 503 and "wedged" in health.json()["reason"], health.text
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)
        waiting.join(60)
        assert answer["r"].status_code == 200 and answer["r"].json()["usage"]["completion_tokens"] == 5
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_the_thread_engine_reports_a_stuck_step_and_a_shutdown_on_health(lm):
    """The in-process engine says the same things: a forward pass that does not return while a request is
    open makes /health answer 503 (wedged) until it returns; after stop(), 503 saying it is shut down."""
    from course.grading import DecodeProbe
    from course.serving.engine import Engine

    engine = Engine(lm, max_batch_size=2, wedged_after=0.5)
    app = create_app(engine=engine, model_name="m")
    with BackgroundServer(app) as server, DecodeProbe(lm, hold_pass=1, hold_limit=30) as probe:
        body = {"model": "m", "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        answer = {}
        waiting = threading.Thread(
            target=lambda: answer.update(r=httpx.post(server.url + "/v1/completions", json=body, timeout=60))
        )
        waiting.start()
        assert probe.held.wait(30)
        time.sleep(1.0)
        stuck = httpx.get(server.url + "/health", timeout=10)
        probe.release()
        waiting.join(60)
        assert stuck.status_code == 503 and "wedged" in stuck.json()["reason"], stuck.text
        assert answer["r"].status_code == 200
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        engine.stop()
        stopped = httpx.get(server.url + "/health", timeout=10)
        assert stopped.status_code == 503 and stopped.json()["reason"] == "the engine is shut down"
