"""The reference server over loopback: the official openai client (sync and async), raw httpx, the load client."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.metrics import summarize
from course.serving.api.background import BackgroundServer, run_sync
from course.serving.api.server import create_app
from course.serving.client import PromptBuilder, run_load, stream_request
from course.serving.engine import Engine
from course.serving.testing import chatty_tiny_model, failing_decode, greedy_reference, sse_json
from course.trace import load_traces
from course.workload import all_at_once, from_traces, poisson

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def server():
    lm = chatty_tiny_model(seed=2)
    engine = Engine(lm, max_batch_size=16, max_model_len=512)
    with BackgroundServer(create_app(engine=engine, model_name=MODEL, aliases=("alias",))) as running:
        running.engine = engine
        running.lm = lm
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=30, max_retries=0)


def wait_idle(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while (engine.num_unfinished or engine.cache_tokens()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.num_unfinished == 0 and engine.cache_tokens() == 0


def test_openai_client_completion_streaming_and_not(server, client):
    prompt_ids = server.lm.tokenizer("def serve(request):").input_ids
    expected_text = server.lm.tokenizer.decode(greedy_reference(server.lm, prompt_ids, 12))
    full = client.completions.create(
        model=MODEL, prompt="def serve(request):", max_tokens=12, extra_body={"ignore_eos": True}
    )
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(prompt_ids) and full.usage.completion_tokens == 12
    assert full.choices[0].text == expected_text
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="def serve(request):", max_tokens=12, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert len(chunks) == 12 and len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == expected_text
    assert [c.choices[0].finish_reason for c in chunks] == [None] * 11 + ["length"]


def test_openai_client_chat_streaming_with_usage(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_completion_tokens=5, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 5
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    full = client.chat.completions.create(model="alias", messages=messages, max_tokens=3)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"


def test_async_openai_client_streams_concurrently(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", timeout=30, max_retries=0)

        async def one(i):
            stream = await client.completions.create(
                model=MODEL, prompt=f"request {i}", max_tokens=8, stream=True, extra_body={"ignore_eos": True}
            )
            return [chunk async for chunk in stream]

        return await asyncio.gather(*(one(i) for i in range(6)))

    results = run_sync(main(), timeout=60)
    assert [len(chunks) for chunks in results] == [8] * 6


def test_raw_sse_framing_done_and_usage(server):
    body = {
        "model": MODEL,
        "prompt": "x = 1",
        "max_tokens": 6,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    response = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events, done = sse_json(response.text)
    assert done, "the stream must end with data: [DONE]"
    token_chunks, usage_chunk = events[:-1], events[-1]
    assert len(token_chunks) == 6 and usage_chunk["choices"] == []
    assert [c["usage"]["completion_tokens"] for c in token_chunks] == [1, 2, 3, 4, 5, 6]
    n_prompt = len(server.lm.tokenizer("x = 1").input_ids)
    assert usage_chunk["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 6, "total_tokens": n_prompt + 6}
    assert {c["id"] for c in events} == {events[0]["id"]} and {c["created"] for c in events} == {events[0]["created"]}
    first = token_chunks[0]["choices"][0]
    assert set(first) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
    # include_usage alone: null usage on every chunk but the last
    body["stream_options"] = {"include_usage": True}
    events, done = sse_json(httpx.post(server.base_url + "/completions", json=body, timeout=30).text)
    assert done and all(c["usage"] is None for c in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 6
    # no stream_options: no usage key at all, and [DONE] still last
    body.pop("stream_options")
    events, done = sse_json(httpx.post(server.base_url + "/completions", json=body, timeout=30).text)
    assert done and len(events) == 6 and all("usage" not in c for c in events)


def test_trace_of_a_stream_has_ttft_below_e2e_and_exact_token_counts(server):
    async def main():
        async with httpx.AsyncClient(timeout=30) as http:
            payload = {"model": MODEL, "prompt": "a b c", "max_tokens": 16, "stream": True, "ignore_eos": True}
            payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
            return await stream_request(http, server.base_url + "/completions", payload, "t")

    trace = run_sync(main(), timeout=60)
    assert trace.error is None and trace.finish_reason == "length"
    assert trace.output_tokens == 16 and trace.chunk_tokens == [1] * 16 and trace.prompt_tokens == 3
    assert trace.send_time < trace.chunk_times[0] < trace.chunk_times[-1]


BAD_REQUESTS = {
    "invalid JSON": (b'{"prompt": "x", ', "completions"),
    "empty body": (b"", "completions"),
    "JSON array": (b"[1, 2]", "completions"),
    "missing prompt": ({"model": MODEL, "max_tokens": 4}, "completions"),
    "prompt of wrong type": ({"prompt": 42}, "completions"),
    "max_tokens a string": ({"prompt": "x", "max_tokens": "abc"}, "completions"),
    "max_tokens a bool": ({"prompt": "x", "max_tokens": True}, "completions"),
    "max_tokens zero": ({"prompt": "x", "max_tokens": 0}, "completions"),
    "max_tokens negative": ({"prompt": "x", "max_tokens": -5}, "completions"),
    "prompt longer than context": ({"prompt": " a" * 600, "max_tokens": 1}, "completions"),
    "max_tokens over the whole context": ({"prompt": "x", "max_tokens": 513}, "completions"),
    "a prompt that fills the context": ({"prompt": " a" * 512, "max_tokens": 1}, "completions"),
    "token id out of range": ({"prompt": [1, 999999]}, "completions"),
    "empty prompt": ({"prompt": ""}, "completions"),
    "n = 2": ({"prompt": "x", "n": 2}, "completions"),
    "stream not a bool": ({"prompt": "x", "stream": "yes"}, "completions"),
    "temperature out of range": ({"prompt": "x", "temperature": 9}, "completions"),
    "messages missing": ({"model": MODEL}, "chat"),
    "messages not a list": ({"messages": "hello"}, "chat"),
    "messages empty": ({"messages": []}, "chat"),
    "message not an object": ({"messages": ["hello"]}, "chat"),
    "message without content": ({"messages": [{"role": "user"}]}, "chat"),
    "unknown role": ({"messages": [{"role": "robot", "content": "hi"}]}, "chat"),
    "image content part": ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "chat"),
    # Malformed in ways that used to reach the server as 500 text/plain (issue 13, defect 4):
    "JSON nested 1,000 deep in an unknown field": (
        b'{"prompt": "x", "extra": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        "completions",
    ),
    "JSON nested 100,000 deep": (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "completions"),
    "integer of 5,000 digits": (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "completions"),
    "integer of 5,000 digits in an unknown field": (b'{"prompt": "x", "extra": ' + b"1" * 5000 + b"}", "completions"),
    "NaN temperature": (b'{"prompt": "x", "temperature": NaN}', "completions"),
    "lone surrogate in a prompt": (b'{"prompt": "abc \\ud800 def"}', "completions"),
    "lone surrogate in a message": (b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "chat"),
    "lone surrogate in a stop string": (b'{"prompt": "x", "stop": ["\\ud83d"]}', "completions"),
    "logprobs of the wrong type": ({"prompt": "x", "logprobs": "yes"}, "completions"),
    "top_logprobs negative": ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}, "chat"),
    "65 stop strings": ({"prompt": "x", "stop": [f"s{i}" for i in range(65)]}, "completions"),
    "a stop string of 1,025 characters": ({"prompt": "x", "stop": "z" * 1025}, "completions"),
    "max_completion_tokens zero": (
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        "chat",
    ),
    # vLLM 0.32 refuses these (the live oracle test, tests/oracle/test_live.py, compares both servers):
    "stream_options without stream": ({"prompt": "x", "stream_options": {"include_usage": True}}, "completions"),
    "stream_options with stream false": (
        {"messages": [{"role": "user", "content": "x"}], "stream": False, "stream_options": {"include_usage": True}},
        "chat",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_400_with_an_openai_error_body(server, case):
    body, endpoint = BAD_REQUESTS[case]
    url = server.base_url + ("/chat/completions" if endpoint == "chat" else "/completions")
    json_type = {"content-type": "application/json"}  # raw bytes declared as JSON: the parser's refusals
    kwargs = {"content": body, "headers": json_type} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(url, timeout=30, **kwargs)
    assert response.status_code == 400, (case, response.status_code, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"] == "BadRequestError"
    assert error["code"] == 400 and "param" in error


def test_max_tokens_is_clamped_to_the_room_the_prompt_leaves(server):
    """vLLM 0.32's rule (get_max_tokens): prompt + max_tokens over the context runs, cut at the context."""
    body = {"model": MODEL, "prompt": " a" * 500, "max_tokens": 200, "ignore_eos": True}
    response = httpx.post(server.base_url + "/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    usage, choice = response.json()["usage"], response.json()["choices"][0]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512 and choice["finish_reason"] == "length"


def test_an_explicit_null_max_tokens_fills_the_context_and_a_missing_one_is_16(server):
    """vLLM's completions: max_tokens left out is 16 (CompletionRequest's default); null is None, the room the
    prompt leaves (get_max_tokens), as OpenAI's API accepts it."""
    url = server.base_url + "/completions"
    filled = httpx.post(
        url, json={"model": MODEL, "prompt": " a" * 100, "max_tokens": None, "ignore_eos": True}, timeout=60
    )
    assert filled.status_code == 200, filled.text
    usage = filled.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 512, usage
    default = httpx.post(url, json={"model": MODEL, "prompt": "hello", "ignore_eos": True}, timeout=60)
    assert default.json()["usage"]["completion_tokens"] == 16, default.text


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=" a" * 600, max_tokens=1)


def test_fields_real_clients_send_are_accepted(server):
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 3,
        "stream": True,  # benchmark clients send stream_options with a stream (vLLM refuses it without one)
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
        "stop": None,
        "n": 1,
        "user": "bench",
        "seed": 1,
        "top_p": 1.0,
        "logprobs": None,
        "best_of": 1,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "echo": False,
        "some_future_field": {"nested": True},
    }
    response = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    events, done = sse_json(response.text)
    assert done and events[-1]["usage"]["completion_tokens"] == 3


def test_stop_strings_end_the_text_and_the_generation(server, client):
    full = client.completions.create(model=MODEL, prompt="s", max_tokens=20, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model=MODEL, prompt="s", max_tokens=20, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    assert wait_idle(server.engine)


def test_streaming_disconnect_stops_generation_server_side(server):
    engine = server.engine
    steps_before = engine.counters.steps
    body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.base_url + "/completions", json=body) as response:
        lines = response.iter_lines()
        received = sum(1 for _, line in zip(range(6), lines) if line.startswith("data:"))
    assert received == 3
    assert wait_idle(engine), "the aborted request must leave the engine and free its cache"
    assert engine.counters.steps - steps_before < 100, "generation went on after the client left"


def test_non_streaming_disconnect_stops_generation_server_side(server):
    engine = server.engine
    generated_before = engine.counters.tokens_generated
    body = {"model": MODEL, "prompt": "long", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=httpx.Timeout(0.3, connect=5))
    assert wait_idle(engine), "the abandoned request must be aborted and its cache freed"
    assert engine.counters.tokens_generated - generated_before < 500


def test_error_after_streaming_began_is_an_event_then_done(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 50, "stream": True, "ignore_eos": True}
    with failing_decode(server.engine, on_call=3, message="device lost"):
        events, done = sse_json(httpx.post(server.base_url + "/completions", json=body, timeout=30).text)
    assert done and "error" in events[-1] and "device lost" in events[-1]["error"]["message"]
    assert all("choices" in e for e in events[:-1]) and len(events) > 1
    assert wait_idle(server.engine)


def test_models_and_health(server):
    models = httpx.get(server.base_url + "/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"] and models["object"] == "list"
    health = httpx.get(server.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(server.url + "/nowhere", timeout=10).status_code == 404


def test_health_counts_the_steps_by_batch_size_and_prompt_tokens(server):
    # What benchmarks/sim_fidelity.py reads around each part of its run. One request alone, 6 tokens:
    # its first token comes from the prefill, the other 5 from 5 decode steps of batch 1.
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    import sim_fidelity

    port = int(server.url.rsplit(":", 1)[1])
    assert wait_idle(server.engine)
    before = sim_fidelity.server_step_counters(port)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 6, "ignore_eos": True}
    response = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    assert response.status_code == 200
    prompt = f"prefill {response.json()['usage']['prompt_tokens']}"
    # The engine adds a step to its counters just after the step's tokens went out, so the reply can come
    # back a moment before the last step is counted: wait for the count to settle.
    deadline = time.monotonic() + 5
    while True:
        after = sim_fidelity.server_step_counters(port)
        counted = after.get("decode 1", (0,))[0] - before.get("decode 1", (0,))[0]
        if counted >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    changed = {key for key in after if after[key] != before.get(key)}
    assert changed == {"decode 1", prompt}, changed
    steps, seconds, slots = (a - b for a, b in zip(after["decode 1"], before.get("decode 1", (0, 0.0, 0))))
    assert steps == 5 and seconds > 0 and slots > 0
    assert after[prompt][0] - before.get(prompt, (0, 0.0, 0))[0] == 1


def test_load_client_traces_and_replay(server, tmp_path):
    result = run_load(server.url, all_at_once(8, 24, 10), concurrency=4, progress=False)
    assert len(result.traces) == 8 and all(t.error is None for t in result.traces)
    assert all(t.prompt_tokens == 24 and t.output_tokens == 10 and len(t.chunk_times) == 10 for t in result.traces)
    summary = result.summary
    assert summary.completed == 8 and summary.ttft.n == 8 and summary.itl.n == 72 and summary.output_throughput > 0
    assert all(summary.ttft[q] < summary.e2e[q] for q in ("p50", "p95", "p99"))
    path = result.save(tmp_path / "run.json")
    replayed = from_traces(load_traces(path))
    assert len(replayed) == 8 and replayed.total_output_tokens == 80
    chat = run_load(server.url, poisson(50.0, 4, 8, 5, seed=1), endpoint="chat", progress=False)
    assert all(t.error is None and len(t.chunk_times) == 5 and t.output_tokens == 5 for t in chat.traces)
    failing = run_load(server.url, all_at_once(2, 600, 4), progress=False)  # prompts over the context
    assert all(t.error and t.error.startswith("HTTP 400") for t in failing.traces)
    assert summarize(failing.traces).failed == 2


def test_prompt_builder_makes_exact_lengths():
    builder = PromptBuilder()
    for n in (1, 7, 64, 300):
        assert len(builder.count(builder.make(n, seed=n))) == n


def test_course_bench_command(server, tmp_path, capsys):
    from course.cli import main

    out = tmp_path / "bench.json"
    code = main(
        [
            "bench",
            "--base-url",
            server.url,
            "--num-requests",
            "4",
            "--concurrency",
            "2",
            "--prompt-tokens",
            "16",
            "--output-tokens",
            "6",
            "--no-progress",
            "--output",
            str(out),
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["completed"] == 4 and report["ttft"]["n"] == 4 and report["itl"]["n"] == 20
    assert len(load_traces(out)) == 4


def test_background_server_stops_promptly_with_an_open_stream():
    lm = chatty_tiny_model(seed=4)
    server = BackgroundServer(create_app(lm, max_batch_size=4)).start()
    body = {"prompt": "x", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", server.base_url + "/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)
        started = time.monotonic()
        server.stop()
        elapsed = time.monotonic() - started
        rest = "\n".join(lines)
    assert elapsed < 5
    assert "error" in rest and rest.rstrip().endswith("data: [DONE]"), rest[-200:]
