"""Live oracle tests: a real ``vllm serve`` (the CPU build) on the course's tiny model, built offline.

One vLLM server for the module (about a minute to start on a 2-core machine, most of it torch.compile),
and the course's own server beside it for the comparisons. Every request goes to 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from course import kv, vllm_lab
from course import vllm_release as release
from course.hardware import GiB
from course.metrics import summarize
from course.models import save_tiny_model

MAX_MODEL_LEN = 512
KV_SPACE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE
START_TIMEOUT_S = 600  # torch.compile on a busy 2-core machine
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def vllm_server(model_dir, tmp_path_factory):
    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN)]
    log = tmp_path_factory.mktemp("logs") / "vllm.log"
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB)}
    server = vllm_lab.VLLMServer(model_dir, log, args, env=env, start_timeout=START_TIMEOUT_S)
    with server:
        yield server


@pytest.fixture(scope="module")
def course_server(tmp_path_factory):
    command = [
        str(BIN / "course"), "serve", "--port", str(vllm_lab.free_port()), "--served-model-name", "tiny",
        "--max-model-len", str(MAX_MODEL_LEN),
    ]  # fmt: skip
    with vllm_lab.ServerProcess(command, tmp_path_factory.mktemp("logs") / "course.log", start_timeout=300) as server:
        yield server


def _budget(model_dir: Path) -> kv.KVBudget:
    return kv.budget(
        str(model_dir / "config.json"), "CPU", max_model_len=MAX_MODEL_LEN, dtype="float32",
        kv_cache_memory_bytes=KV_SPACE_GIB * GiB,
    )  # fmt: skip


def _metric_families(text: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names seen on its samples), from a Prometheus text page."""
    families: dict[str, tuple[str, set[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            families[name] = (kind, set())
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        match = re.match(r"([a-zA-Z_:][\w:]*)(\{(.*)\})?\s", line)
        name, labels = match.group(1), match.group(3) or ""
        base = re.sub(r"_(bucket|sum|count|total|created)$", "", name)
        for family in (name, base, base + "_total"):
            if family in families:
                families[family][1].update(re.findall(r'(\w+)="', labels))
                break
    return families


def _buckets(text: str, name: str) -> list[float]:
    return sorted({float(value) for value in re.findall(rf'^{re.escape(name)}_bucket\{{.*le="([^"+]+)"', text, re.M)})


def test_the_logged_kv_capacity_is_what_course_kv_predicts(vllm_server, model_dir):
    """course kv --gpu CPU with VLLM_CPU_KVCACHE_SPACE and --dtype float32 predicts the startup log line."""
    logged = re.search(r"CPU KV cache size: .*x", vllm_server.log.read_text())
    assert logged, f"no KV-capacity line in the log:\n{vllm_server.tail()}"
    assert logged.group(0) == _budget(model_dir).log_line


def test_cache_config_info_matches_the_budget(vllm_server, model_dir):
    text = httpx.get(vllm_server.url + "/metrics").text
    labels = dict(re.findall(r'(\w+)="([^"]*)"', re.search(r"^vllm:cache_config_info\{(.*)\}", text, re.M).group(1)))
    b = _budget(model_dir)
    assert int(labels["block_size"]) == b.block_size == kv.vllm.CPU_BLOCK_SIZE
    assert int(labels["num_gpu_blocks"]) == b.num_blocks
    assert int(labels["kv_cache_size_tokens"]) == b.num_tokens
    assert float(labels["kv_cache_max_concurrency"]) == pytest.approx(b.max_concurrency)
    assert float(labels["gpu_memory_utilization"]) == kv.vllm.GPU_MEMORY_UTILIZATION
    assert labels["enable_prefix_caching"] == str(kv.vllm.ENABLE_PREFIX_CACHING)


def test_the_course_servers_metrics_are_a_subset_of_vllms(vllm_server, course_server):
    """Names, types and labels of every vllm: series the course's server exports exist in vLLM's, with
    vLLM's buckets and its pre-created finish reasons."""
    for server in (vllm_server, course_server):  # one finished request each, so every series has samples
        httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3})
    theirs_text = httpx.get(vllm_server.url + "/metrics").text
    ours_text = httpx.get(course_server.url + "/metrics").text
    theirs, ours = _metric_families(theirs_text), _metric_families(ours_text)
    exported = {name: spec for name, spec in ours.items() if name.startswith("vllm:")}
    assert exported, "the course's server exports no vllm: metric"
    for name, (kind, labels) in exported.items():
        assert name in theirs, f"{name}: not a vLLM {release.VLLM_VERSION} metric"
        assert kind == theirs[name][0], f"{name}: {kind} here, {theirs[name][0]} in vLLM"
        assert labels <= theirs[name][1], f"{name}: labels {labels - theirs[name][1]} are not vLLM's"
        if kind == "histogram":
            assert _buckets(ours_text, name) == _buckets(theirs_text, name), f"{name}: buckets"
    for text in (ours_text, theirs_text):
        reasons = set(re.findall(r'^vllm:request_success_total\{[^}]*finished_reason="(\w+)"', text, re.M))
        assert reasons == set(release.FINISH_REASONS), "pre-created finish reasons"


# Requests both servers must refuse alike: (description, body, expected status).
BAD_REQUESTS = [
    ("unknown model", {"model": "nope", "prompt": "hi", "max_tokens": 2}, 404),
    ("max_tokens < 1", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400),
    ("max_tokens over the whole context", {"model": "tiny", "prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}, 400),
    ("prompt longer than the context", {"model": "tiny", "prompt": "hello " * 2000, "max_tokens": 1}, 400),
    ("prompt filling the context", {"model": "tiny", "prompt": " a" * MAX_MODEL_LEN, "max_tokens": 1}, 400),
    ("temperature < 0", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": -1}, 400),
    ("top_p > 1", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "top_p": 1.5}, 400),
    ("no prompt", {"model": "tiny", "max_tokens": 2}, 400),
    ("prompt of the wrong type", {"model": "tiny", "prompt": {"a": 1}, "max_tokens": 2}, 400),
    ("stream_options without stream", {"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}},
     400),
]  # fmt: skip


@pytest.mark.parametrize(("case", "body", "status"), BAD_REQUESTS, ids=[case for case, _, _ in BAD_REQUESTS])
def test_bad_requests_get_the_same_status_and_error_shape(vllm_server, course_server, case, body, status):
    for server in (vllm_server, course_server):
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert response.status_code == status, f"{server.url}: {case}: {response.status_code} {response.text[:300]}"
        error = response.json()["error"]
        assert {"message", "type", "param", "code"} <= set(error), f"{server.url}: {case}: {error}"
        assert error["code"] == status


def test_max_tokens_is_clamped_alike(vllm_server, course_server):
    """A prompt + max_tokens over the context runs on both, cut at the context (get_max_tokens)."""
    body = {"model": "tiny", "prompt": " a" * 400, "max_tokens": 200, "ignore_eos": True}
    for server in (vllm_server, course_server):
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, f"{server.url}: {response.text[:300]}"
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN, (server.url, usage)
        assert response.json()["choices"][0]["finish_reason"] == "length"


def test_invalid_json_is_a_400_on_both(vllm_server, course_server):
    for server in (vllm_server, course_server):
        response = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30,
                              headers={"content-type": "application/json"})  # fmt: skip
        assert response.status_code == 400, f"{server.url}: {response.status_code}"


def test_vllm_bench_serve_and_course_metrics_agree_on_the_same_chunk_times(vllm_server, model_dir, tmp_path):
    """vLLM's own benchmark drives the server; its recorded per-request chunk times, fed to the course's
    metric functions, give the percentiles vLLM's benchmark printed."""
    result = tmp_path / "bench.json"
    subprocess.run(
        [str(BIN / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", vllm_server.url,
         "--model", "tiny", "--tokenizer", str(model_dir), "--dataset-name", "random", "--random-input-len", "32",
         "--random-output-len", "16", "--num-prompts", "12", "--max-concurrency", "4", "--ignore-eos",
         "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
         "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", result.name],
        check=True, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    data = json.loads(result.read_text())
    ours = summarize(vllm_lab.bench_traces(data), percentiles=(50, 90, 99))
    for metric in ("ttft", "tpot", "itl"):
        stats = getattr(ours, metric)
        assert stats.mean * 1e3 == pytest.approx(data[f"mean_{metric}_ms"], abs=1e-6), metric
        for q in (50, 90, 99):
            assert stats.percentiles[q] * 1e3 == pytest.approx(data[f"p{q}_{metric}_ms"], abs=1e-6), (metric, q)
