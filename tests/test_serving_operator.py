"""What an operator expects of the reference server: Prometheus metrics under vLLM's names, request ids,
an access log, an API key, a waiting-queue limit, model lookups and 404s, a bounded chat default; and
every OpenAI parameter either honoured or refused with a 400 that names it (logprobs tested for their values)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import httpx
import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)
from prometheus_client.parser import text_string_to_metric_families

from course.serving.api.background import BackgroundServer
from course.serving.api.server import create_app
from course.serving.client import run_load
from course.serving.engine import Engine
from course.serving.testing import greedy_reference, shared_chatty_model, sse_json
from course.workload import all_at_once

MODEL = "op"


@pytest.fixture(scope="module")
def lm():
    return shared_chatty_model(seed=12)


def _server(lm, **options) -> BackgroundServer:
    engine = Engine(
        lm, max_batch_size=options.pop("max_batch_size", 16), max_model_len=options.pop("max_model_len", 512)
    )
    server = BackgroundServer(create_app(engine=engine, model_name=MODEL, **options)).start()
    server.engine = engine
    return server


def _scrape(url: str) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: {name{labels}: value}."""
    text = httpx.get(url + "/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k not in ("model_name", "engine"))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
            assert sample.labels.get("model_name") == MODEL and sample.labels.get("engine") == "0", sample
    return samples


def test_metrics_during_a_load_test_match_the_requests_sent(lm):
    # Outputs long enough that a quiet machine is still decoding when a scrape lands (12 requests of
    # 9 tokens finished between two scrapes 50 ms apart on a quiet 2-core machine).
    out_tokens = 120
    server = _server(lm)
    scrapes, stop = [], threading.Event()

    def scraper():
        while not stop.is_set():
            scrapes.append(_scrape(server.url))
            time.sleep(0.02)

    thread = threading.Thread(target=scraper)
    try:
        thread.start()
        result = run_load(server.url, all_at_once(12, 20, out_tokens, seed=3), concurrency=6, progress=False)
        stop.set()
        thread.join()
        final = _scrape(server.url)
    finally:
        stop.set()
        server.stop()
    assert all(t.error is None for t in result.traces)
    n, prompt, output = 12, sum(t.prompt_tokens for t in result.traces), sum(t.output_tokens for t in result.traces)
    assert (n, prompt, output) == (12, 12 * 20, 12 * out_tokens)
    assert final["vllm:prompt_tokens_total{}"] == prompt
    assert final["vllm:generation_tokens_total{}"] == output
    assert final["vllm:request_success_total{finished_reason=length}"] == n
    assert final["vllm:time_to_first_token_seconds_count{}"] == n
    assert final["vllm:e2e_request_latency_seconds_count{}"] == n
    assert final["vllm:inter_token_latency_seconds_count{}"] == n * (out_tokens - 1)
    ttft_sum = final["vllm:time_to_first_token_seconds_sum{}"]
    assert 0 < ttft_sum < final["vllm:e2e_request_latency_seconds_sum{}"]
    assert final["vllm:num_preemptions_total{}"] == 0  # this engine never preempts
    assert final["vllm:num_requests_running{}"] == 0 and final["vllm:kv_cache_usage_perc{}"] == 0
    assert any(s["vllm:num_requests_running{}"] > 0 for s in scrapes), "no scrape saw a running request"
    assert all(0 <= s["vllm:kv_cache_usage_perc{}"] <= 1 for s in scrapes)
    assert max(s["vllm:kv_cache_usage_perc{}"] for s in scrapes) > 0


def test_request_ids_api_key_and_access_log(lm, caplog):
    server = _server(lm, api_key="s3cret", access_log=True)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
    auth = {"Authorization": "Bearer s3cret"}
    try:
        with caplog.at_level(logging.INFO, logger="course.serving.access"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                refused = httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=30)
                assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # probes need no key
            assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
            mine = httpx.post(
                server.base_url + "/completions", json=body, headers={**auth, "X-Request-Id": "abc-123"}, timeout=30
            )
            streamed = httpx.post(server.base_url + "/completions", json={**body, "stream": True}, headers=auth)
            bad = httpx.post(server.base_url + "/completions", json={"prompt": ""}, headers=auth, timeout=30)
    finally:
        server.stop()
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "abc-123"
    assert streamed.status_code == 200 and len(streamed.headers["x-request-id"]) == 32  # made up: uuid4 hex
    assert bad.status_code == 400 and bad.headers["x-request-id"] != streamed.headers["x-request-id"]
    lines = [r.getMessage() for r in caplog.records if r.name == "course.serving.access"]
    ours = [line for line in lines if "request_id=abc-123" in line]
    assert len(ours) == 1 and '"POST /v1/completions" 200' in ours[0]
    prompt_tokens = mine.json()["usage"]["prompt_tokens"]
    assert f"prompt_tokens={prompt_tokens} completion_tokens=3" in ours[0] and " ms " in ours[0]
    assert any('" 401 ' in line for line in lines) and any('" 400 ' in line for line in lines)


def test_waiting_queue_limit_is_503_with_retry_after(lm):
    server = _server(lm, max_batch_size=1, max_waiting_requests=2, max_model_len=4096)
    engine = server.engine
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4000, "ignore_eos": True}

    def send() -> None:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(server.base_url + "/completions", json=body, timeout=120)

    senders = [threading.Thread(target=send) for _ in range(3)]
    try:
        for sender in senders:
            sender.start()
        deadline = time.monotonic() + 30
        while not (engine.num_waiting == 2 and engine.num_running == 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_waiting == 2 and engine.num_running == 1
        refused = httpx.post(server.base_url + "/completions", json=body, timeout=30)
    finally:
        server.stop()  # ends the three with 503s
        for sender in senders:
            sender.join(30)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "overloaded" in refused.json()["error"]["message"]


def test_models_lookup_unknown_model_404_and_chat_default(lm):
    server = _server(lm, default_max_tokens=7)
    try:
        card = httpx.get(server.base_url + "/models/" + MODEL, timeout=10)
        missing = httpx.get(server.base_url + "/models/gpt-17", timeout=10)
        unknown = httpx.post(server.base_url + "/completions", json={"model": "gpt-17", "prompt": "x"}, timeout=10)
        chat = httpx.post(
            server.base_url + "/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
            timeout=30,
        )
    finally:
        server.stop()
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["object"] == "model"
    for reply in (missing, unknown):
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["type"] == "NotFoundError" and reply.json()["error"]["code"] == 404
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 7


REFUSED = {
    "logprobs": ("completions", {"logprobs": 21}),
    "echo": ("completions", {"echo": True, "logprobs": 1}),  # echo alone is honoured
    "suffix": ("completions", {"suffix": " end"}),
    "best_of": ("completions", {"best_of": 2}),
    "response_format": ("chat", {"response_format": {"type": "json_object"}}),
    "tools": ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    "tool_choice": ("chat", {"tool_choice": "required"}),
    "top_logprobs": ("chat", {"top_logprobs": 2}),  # without logprobs: true
    "presence_penalty": ("completions", {"presence_penalty": 3}),
    "frequency_penalty": ("completions", {"frequency_penalty": -2.5}),
    "repetition_penalty": ("completions", {"repetition_penalty": 0}),
    "top_k": ("completions", {"top_k": -5}),
    "logit_bias": ("completions", {"logit_bias": {"not-a-token": 1}}),
    "seed": ("completions", {"seed": 2**64}),
    "min_p": ("completions", {"min_p": 0.1}),
    "min_tokens": ("chat", {"min_tokens": 4}),
    "guided_json": ("chat", {"guided_json": {"type": "object"}}),
}
ACCEPTED_OFF = {
    "logprobs": None,
    "echo": False,
    "best_of": 1,
    "suffix": None,
    "response_format": {"type": "text"},
    "min_p": 0,
    "min_tokens": 0,
    "skip_special_tokens": True,
    "user": "someone",
}


@pytest.fixture(scope="module")
def shared(lm):
    server = _server(lm)
    yield server
    server.stop()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unsupported_or_invalid_parameters_are_400_naming_them(shared, name):
    endpoint, extra = REFUSED[name]
    if endpoint == "chat":
        body, path = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra}, "/chat/completions"
    else:
        body, path = {"model": MODEL, "prompt": "x", **extra}, "/completions"
    reply = httpx.post(shared.base_url + path, json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == name and name in error["message"], error


def test_parameters_are_honoured(shared, lm):
    def text_ids(**extra):
        body = {"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 10, "ignore_eos": True, **extra}
        reply = httpx.post(shared.base_url + "/completions", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["text"]

    greedy = lm.tokenizer.decode(greedy_reference(lm, [9, 10, 11], 10))
    assert text_ids() == greedy
    assert text_ids(**ACCEPTED_OFF, tool_choice="none") == greedy  # "off" values change nothing
    assert text_ids(temperature=2.0, top_k=1, seed=1) == greedy
    assert text_ids(temperature=1.0, seed=1) != greedy
    forced = lm.tokenizer.decode([1234] * 10)
    assert text_ids(logit_bias={"1234": 100}) == forced
    # The penalties' effect is tested on a model that repeats itself (test_serving_sampling.py); here,
    # that the server hands them to the engine.
    seen, submit = [], shared.engine.submit

    def recording_submit(prompt_ids, params, request_id=None):
        seen.append(params)
        return submit(prompt_ids, params, request_id)

    shared.engine.submit = recording_submit
    try:
        text_ids(frequency_penalty=1.5, presence_penalty=-0.5, repetition_penalty=1.3)
    finally:
        shared.engine.submit = submit
    assert (seen[0].frequency_penalty, seen[0].presence_penalty, seen[0].repetition_penalty) == (1.5, -0.5, 1.3)


def test_logprobs_are_the_models_own(shared, lm):
    """Completions ``logprobs: N`` and chat ``logprobs`` + ``top_logprobs``: values of the raw distribution."""
    import openai

    from course.models import forward, new_cache

    client = openai.OpenAI(base_url=shared.base_url, api_key="unused", timeout=30, max_retries=0)
    prompt = [9, 10, 11]
    full = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}
    )
    logprobs = full.choices[0].logprobs
    generated = greedy_reference(lm, prompt, 6)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == full.choices[0].text and logprobs.text_offset[0] == 0
    with torch.inference_mode():  # the exact values, from the model itself
        ids = torch.tensor([prompt + generated])
        logits, _ = forward(lm.model, ids, new_cache(lm.model))
        expected = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
    for i, token in enumerate(generated):
        assert logprobs.token_logprobs[i] == pytest.approx(float(expected[i, token]), abs=1e-4)
        top = logprobs.top_logprobs[i]
        assert len(top) == 3 and max(top.values()) == pytest.approx(logprobs.token_logprobs[i])  # greedy: the top one
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, logprobs=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert [c.choices[0].logprobs.token_logprobs[0] for c in chunks] == pytest.approx(logprobs.token_logprobs, abs=1e-6)
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2, temperature=1.0, seed=4
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= c.top_logprobs[0].logprob + 1e-6 and c.bytes == list(c.token.encode()) for c in content)
    streamed = list(
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, logprobs=True, stream=True)
    )
    assert sum(len(c.choices[0].logprobs.content) for c in streamed[1:] if c.choices) == 5
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_echo_sends_the_prompt_before_the_completion(shared):
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 5, "ignore_eos": True}
    url = shared.base_url + "/completions"
    plain = httpx.post(url, json=body, timeout=30).json()["choices"][0]["text"]
    echoed = httpx.post(url, json={**body, "echo": True}, timeout=30).json()
    assert echoed["choices"][0]["text"] == "def f(x):" + plain and echoed["usage"]["completion_tokens"] == 5
    events, done = sse_json(httpx.post(url, json={**body, "echo": True, "stream": True}, timeout=30).text)
    assert done and "".join(e["choices"][0]["text"] for e in events) == "def f(x):" + plain
    by_ids = httpx.post(url, json={**body, "prompt": [9, 10, 11], "echo": True}, timeout=30).json()
    assert by_ids["choices"][0]["text"].startswith(shared.engine.lm.tokenizer.decode([9, 10, 11]))
