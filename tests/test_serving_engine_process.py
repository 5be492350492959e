"""The engine core in its own process (EngineProcess): same tokens as the in-process engine, aborts,
stop and a dying core end every request with an error event, counters reach the server, and the
server runs on it."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course import vllm_release
from course.serving.api.background import BackgroundServer, run_sync
from course.serving.api.protocol import longest_token_chars, render_chat
from course.serving.api.server import create_app
from course.serving.config import EngineConfig
from course.serving.engine import Engine, EngineStopped, SamplingParams
from course.serving.engine_process import EngineProcess, EngineStartError
from course.serving.testing import chatty_tiny_model


@pytest.fixture(scope="module")
def lm():
    return chatty_tiny_model(seed=3)


@pytest.fixture(scope="module")
def core(lm):
    engine = EngineProcess(lm, max_batch_size=8)
    yield engine
    engine.stop()


def _prompts(lm, n: int) -> list[list[int]]:
    return [lm.random_ids(1, 5 + 3 * i, seed=i)[0].tolist() for i in range(n)]


def test_same_tokens_as_the_in_process_engine(lm, core):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    here = Engine(lm, max_batch_size=8)
    try:
        expected = [here.generate(prompt, params) for prompt in _prompts(lm, 3)]
    finally:
        here.stop()
    assert [core.generate(prompt, params) for prompt in _prompts(lm, 3)] == expected
    assert len({tuple(tokens) for tokens in expected}) > 1  # the prompts lead to different text

    async def together():  # continuous batching in the core, consumed with async for
        async def one(prompt):
            return [event.token async for event in core.submit(prompt, params)]

        return await asyncio.gather(*(one(prompt) for prompt in _prompts(lm, 3)))

    assert run_sync(together(), timeout=60) == expected


def test_seeded_sampling_crosses_the_process_boundary(lm, core):
    prompt = _prompts(lm, 1)[0]
    sampled = [core.generate(prompt, SamplingParams(max_tokens=16, temperature=1.5, seed=s)) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] != sampled[2]


def test_abort_ends_a_long_request_and_the_core_keeps_serving(lm, core):
    request = core.submit(_prompts(lm, 1)[0], SamplingParams(max_tokens=3000, ignore_eos=True))
    events = iter(request)
    for _ in range(3):
        assert next(events).token is not None
    core.abort(request.request_id)
    rest = list(events)
    assert rest[-1].finish_reason == "abort" and rest[-1].token is None
    assert len(rest) < 50, f"{len(rest)} more events after the abort"
    assert core.generate(_prompts(lm, 1)[0], SamplingParams(max_tokens=4, ignore_eos=True))


def test_counters_come_back_from_the_core(lm, core):
    before = core.stats()
    core.generate(_prompts(lm, 1)[0], SamplingParams(max_tokens=10, ignore_eos=True))
    after = core.stats()  # the core sends a snapshot as soon as it falls idle
    assert after["tokens_generated"] - before["tokens_generated"] == 10
    assert after["steps"] - before["steps"] == 9  # one token from the prefill, nine decode steps
    assert after["running"] == after["waiting"] == after["unfinished"] == 0
    assert after["engine_process"] == core.process.pid and after["runner"] == "llama"


def test_bad_prompts_are_refused_here_before_the_core_sees_them(lm, core):
    with pytest.raises(ValueError, match="exceeds the context"):
        core.submit([1, 2], SamplingParams(max_tokens=core.max_model_len))
    with pytest.raises(ValueError, match="token ids must be in"):
        core.submit([lm.vocab_size], SamplingParams(max_tokens=2))
    assert core.num_unfinished == 0


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
def test_a_prompt_longer_than_the_context_gets_the_engines_one_refusal_as_vllms_400(lm, engine_process):
    """The prompt meets the context once, in the engine's submit (engine_client.checked_prompt), on both
    engines: the refusal is vLLM's wording, the server sends it as the 400 of either endpoint with the
    field that holds the prompt, and nothing reaches the engine."""
    context = 64
    prompt = lm.random_ids(1, context + 5, seed=0)[0].tolist()
    words = " hello" * context  # a chat message that renders to more than the context
    assert len(words) <= 2 * longest_token_chars(lm.tokenizer) * context  # tokenized: not refused by its length
    chat_tokens = len(render_chat(lm.tokenizer, [("user", words)]))
    app = create_app(lm, model_name="m", engine_process=engine_process, max_model_len=context, max_batch_size=2)
    engine = app.state.engine
    with BackgroundServer(app) as server:
        with pytest.raises(ValueError) as refused:
            engine.submit(prompt, SamplingParams(max_tokens=1))
        assert str(refused.value) == vllm_release.prompt_too_long_error(len(prompt), context)
        for path, body, param, tokens in (
            ("completions", {"prompt": prompt, "max_tokens": 1}, "prompt", len(prompt)),
            ("chat/completions", {"messages": [{"role": "user", "content": words}]}, "messages", chat_tokens),
        ):
            response = httpx.post(f"{server.base_url}/{path}", json={"model": "m", **body}, timeout=30)
            assert response.status_code == 400, response.text
            message = vllm_release.prompt_too_long_error(tokens, context)
            expected = {"message": message, "type": "BadRequestError", "param": param, "code": 400}
            assert response.json()["error"] == expected
        assert engine.num_unfinished == 0


def test_stop_fails_open_requests_with_503_and_refuses_new_ones(lm):
    engine = EngineProcess(lm)
    request = engine.submit(_prompts(lm, 1)[0], SamplingParams(max_tokens=3000, ignore_eos=True))
    events = iter(request)
    next(events)
    engine.stop()
    last = list(events)[-1]
    assert last.finish_reason == "error" and last.status == 503, last
    assert engine.process.exitcode == 0
    with pytest.raises(EngineStopped):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2))


def test_a_core_that_dies_fails_open_requests_with_500(lm):
    engine = EngineProcess(lm)
    request = engine.submit(_prompts(lm, 1)[0], SamplingParams(max_tokens=3000, ignore_eos=True))
    events = iter(request)
    next(events)
    engine.process.kill()
    last = list(events)[-1]
    assert last.finish_reason == "error" and last.status == 500, last
    assert "exited" in last.error and "exit code -9" in last.error
    assert engine.last_error == last.error
    with pytest.raises(EngineStopped):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2))
    engine.stop()


def test_a_core_that_cannot_start_says_why(lm):
    started = time.monotonic()
    # the context length is checked against the model, which happens where the engine is built: in the child
    with pytest.raises(RuntimeError, match="did not start: ValueError: max_model_len 1000000 exceeds the model's"):
        EngineProcess(lm, max_model_len=1_000_000)
    assert time.monotonic() - started < 60


def test_a_bad_setting_is_refused_before_a_core_starts(lm):
    # EngineConfig checks what it can without the model, so no process is spawned for a setting that cannot work
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        EngineProcess(lm, max_batch_size=0)
    with pytest.raises(TypeError, match="as config or as keyword arguments, not both"):
        EngineProcess(lm, EngineConfig(), max_batch_size=2)


def test_no_room_to_share_the_weights_says_what_to_do(lm, monkeypatch):
    import multiprocessing.context

    def full(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", full)
    with pytest.raises(EngineStartError, match=r"No space left.*--shm-size.*--engine-core thread"):
        EngineProcess(lm)


def test_the_server_streams_from_the_core_process(lm):
    app = create_app(lm, model_name="m", engine_process=True, max_batch_size=4)
    assert isinstance(app.state.engine, EngineProcess)
    with BackgroundServer(app) as server:
        body = {"model": "m", "prompt": "hello", "max_tokens": 6, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]
        assert response.status_code == 200 and lines[-1] == "[DONE]"
        chunks = [json.loads(line) for line in lines[:-1]]
        assert len(chunks) == 6 and chunks[-1]["choices"][0]["finish_reason"] == "length"
        body = {"model": "m", "prompt": "hi", "max_tokens": 3, "logprobs": 2, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()  # logprobs cross over
        logprobs = reply["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == 3 and all(len(top) == 2 for top in logprobs["top_logprobs"])
        health = httpx.get(server.url + "/health", timeout=10).json()
        assert health["engine_process"] == app.state.engine.process.pid and health["tokens_generated"] == 9
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'vllm:generation_tokens_total{engine="0",model_name="m"} 9.0' in metrics
        # the server's event loop reads the core's pipe itself: no reader thread for this core
        reader = f"course-engine-output-{app.state.engine.process.pid}"
        assert reader not in {thread.name for thread in threading.enumerate()}
    assert not app.state.engine.process.is_alive()


def test_a_core_that_dies_under_the_server_ends_its_streams_with_an_error(lm):
    # The server's event loop reads the core's pipe: its end must still fail what is open.
    app = create_app(lm, model_name="m", engine_process=True)
    with BackgroundServer(app) as server:
        body = {"model": "m", "prompt": "hello", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is streaming
            app.state.engine.process.kill()
            rest = [line[5:].strip() for line in lines if line.startswith("data:")]
        assert rest[-1] == "[DONE]"
        error = json.loads(rest[-2])["error"]
        assert error["code"] == 500 and "exit code -9" in error["message"], error
        health = httpx.get(server.url + "/health", timeout=10)  # the server answers, and says the engine is dead
        assert health.status_code == 503 and "exit code -9" in health.json()["reason"], health.text


def test_every_field_of_an_event_crosses_the_process_boundary(lm, core):
    # The core sends events in a typed StepOutputs message; the server unpacks them. Logprobs, top alternatives,
    # finish reasons and errors must arrive as the in-process engine makes them.
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    prompt = _prompts(lm, 1)[0]
    here = Engine(lm, max_batch_size=8)
    try:
        expected = list(here.submit(prompt, params))
    finally:
        here.stop()
    got = list(core.submit(prompt, params))
    assert [tuple(event) for event in got] == [tuple(event) for event in expected]
    assert all(type(event).__name__ == "TokenEvent" for event in got)
    assert got[-1].finish_reason == "length" and all(len(event.top_logprobs) == 2 for event in got)
    too_long = SamplingParams(max_tokens=10_000)
    with pytest.raises(ValueError):  # refused on this side, before the core (see the test above)
        core.submit(prompt, too_long)


def test_the_core_s_messages_are_typed_and_framed_by_the_standard_pipe():
    import multiprocessing

    from course.serving.engine_process import _readable_now
    from course.serving.messages import CoreReady, StepOutputs
    from course.serving.request import TokenEvent

    reader, writer = multiprocessing.Pipe(duplex=False)
    readable = _readable_now(reader)
    assert not readable()
    small = StepOutputs([("req-1", TokenEvent(5))])
    events = [(f"req-{i}", TokenEvent(i, "length", "x" * 50, None, -0.5, ((1, -0.1),))) for i in range(4000)]
    large = StepOutputs(events, {"steps": 3})
    received = []
    thread = threading.Thread(target=lambda: received.extend(reader.recv() for _ in range(3)))
    writer.send(small)
    assert readable()
    thread.start()
    writer.send(large)  # larger than the pipe's buffer: written whole while the other side reads
    writer.send(CoreReady(4, 128, "lean", {"steps": 0}))
    thread.join(30)
    assert received == [small, large, CoreReady(4, 128, "lean", {"steps": 0})]
    assert all(type(event) is TokenEvent for _, event in received[1].events), "unpacked into TokenEvents"
    assert not readable()
    writer.close()  # the server is gone: the busy core must see it (then recv() raises EOFError and it stops)
    assert readable()
    with pytest.raises(EOFError):
        reader.recv()
    assert readable()  # the end of the pipe counts, so the core's loop notices a server that is gone


def test_both_engines_implement_the_engine_client_protocol(lm, core):
    """The server is typed against EngineClient; both engines answer it with the same signatures."""
    import inspect

    from course.serving.engine_client import EngineClient

    here = Engine(lm, max_batch_size=2)
    try:
        assert isinstance(here, EngineClient) and isinstance(core, EngineClient)
    finally:
        here.stop()
    for name in ("submit", "abort", "abort_all", "generate", "stop", "cache_tokens", "stats"):
        assert inspect.signature(getattr(Engine, name)) == inspect.signature(getattr(EngineProcess, name)), name
        assert inspect.signature(getattr(Engine, name)) == inspect.signature(getattr(EngineClient, name)), name
