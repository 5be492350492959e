"""A load client for any OpenAI-compatible server: timestamps every streamed chunk into traces.

It works against the course's server, vLLM, SGLang or ``transformers serve``: it speaks plain
HTTP + SSE (aiohttp, as vLLM's benchmark client does), sends streaming ``/v1/completions`` (or
chat) requests, and records for each request a :class:`~course.trace.RequestTrace`: the send
time, the arrival time and token count of every chunk, the prompt and output token counts the
server reports, the finish reason, and the error if it failed. :func:`course.metrics.summarize`
turns the traces into TTFT / ITL / TPOT / E2E percentiles; :func:`course.trace.save_traces`
writes them for module 3's simulator (:func:`course.workload.from_traces` replays them).

Conventions (as vLLM's ``vllm bench serve``, see ``course.metrics``):

* times come from ``time.perf_counter()`` when the client's code sees the chunk;
* every chunk that carries a choice is a chunk, even with empty text, except a chat stream's
  role-only first chunk, which carries no token (``transformers serve`` even sends it before
  the prompt is processed, which would make its TTFT look too small);
* tokens per chunk come from per-chunk usage when the server sends it
  (``continuous_usage_stats``), else one per chunk with text; output tokens from the final
  usage chunk (``include_usage``) when there is one.
* Arrivals: fixed concurrency (closed loop: each of N workers sends its next request when its
  previous one is done) or timed arrivals from a :class:`~course.workload.Workload` (Poisson,
  bursty), optionally capped by a concurrency limit.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from course.metrics import BenchmarkSummary, summarize
from course.trace import RequestTrace, save_traces
from course.workload import RequestSpec, Workload


def api_base(url: str) -> str:
    """``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


class PromptBuilder:
    """Prompts of an exact token count under a given tokenizer (default: the course's).

    A prompt is a sequence of words that are each one token with their leading space, drawn
    at random (seeded), so it has exactly the number of tokens asked for. Against a server with
    a different tokenizer the count is approximate; the trace records the count the server
    reports.
    """

    def __init__(self, tokenizer=None) -> None:
        if tokenizer is None:
            from course.models import load_tokenizer

            tokenizer = load_tokenizer()
        elif isinstance(tokenizer, (str, Path)):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        self.tokenizer = tokenizer
        words = []
        for token in tokenizer.get_vocab():
            word = tokenizer.convert_tokens_to_string([token])
            if len(word) > 2 and word[0] == " " and word[1:].isascii() and word[1:].isalpha():
                words.append(word)
        # Keep words that really encode to one token on their own and after another word.
        self.words = sorted(w for w in words if len(self.count(w)) == 1 and len(self.count(w + w)) == 2)
        if len(self.words) < 20:
            raise ValueError("this tokenizer has too few single-token words to build prompts of exact length")

    def count(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, verbose=False).input_ids

    def make(self, n_tokens: int, seed: int = 0) -> str:
        """A prompt of exactly ``n_tokens`` tokens (without special tokens the server may add)."""
        if n_tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {n_tokens}")
        rng = random.Random(seed)
        text = "".join(rng.choice(self.words) for _ in range(n_tokens))
        ids = self.count(text)
        while len(ids) < n_tokens:  # two words merged into one token (rare): pad with more words
            text += rng.choice(self.words)
            ids = self.count(text)
        if len(ids) > n_tokens:  # then trim to the exact count
            text = self.tokenizer.decode(ids[:n_tokens])
        return text


@functools.cache
def default_prompt_builder() -> PromptBuilder:
    """The course tokenizer's prompt builder, built once per process."""
    return PromptBuilder()


def request_payload(
    model: str,
    prompt: str | list[int],
    max_tokens: int,
    endpoint: str = "completions",
    ignore_eos: bool = True,
    continuous_usage: bool = True,
    extra: dict | None = None,
) -> dict:
    """The JSON body of one streaming benchmark request, as vLLM's benchmark sends it (greedy)."""
    payload: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    options = {"include_usage": True}
    if continuous_usage:
        options["continuous_usage_stats"] = True
    payload["stream_options"] = options
    if ignore_eos:
        payload["ignore_eos"] = True
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    payload.update(extra or {})
    return payload


def _error_message(status: int, body: bytes) -> str:
    try:
        detail = json.loads(body)
        message = detail.get("error", {}).get("message") if isinstance(detail.get("error"), dict) else detail
    except (json.JSONDecodeError, AttributeError):
        message = body.decode(errors="replace")[:300]
    return f"HTTP {status}: {message}"


class _StreamParser:
    """Turns a stream's SSE ``data:`` lines into a trace's chunk times and token counts."""

    def __init__(self, chat: bool, expected_prompt_tokens: int) -> None:
        self.chat = chat
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.prompt_tokens, self.output_tokens, self.counted = expected_prompt_tokens, None, 0
        self.finish_reason: str | None = None
        self.error: str | None = None

    def line(self, line: str, now: float) -> bool:
        """Take one line read at ``now`` (perf_counter s); False once the stream is over."""
        if not line.startswith("data:"):
            return True
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            self.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            return False
        usage = chunk.get("usage")
        if usage:
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.output_tokens = usage.get("completion_tokens", self.output_tokens)
        choices = chunk.get("choices") or []
        if not choices:
            return True  # the usage-only chunk is not a chunk
        choice = choices[0]
        if self.chat:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
            if "role" in delta and not text and choice.get("finish_reason") is None:
                return True  # the role announcement carries no token
        else:
            text = choice.get("text") or ""
        if usage and usage.get("completion_tokens") is not None:
            # tokens since the last chunk (a server may report usage on the last chunk only)
            count = usage["completion_tokens"] - self.counted
        else:
            count = 1 if text else 0
        self.times.append(now)
        self.tokens.append(max(count, 0))
        self.counted += self.tokens[-1]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return True

    def trace(self, request_id: str, send_time: float) -> RequestTrace:
        return RequestTrace(
            request_id=request_id,
            send_time=send_time,
            chunk_times=self.times,
            chunk_tokens=self.tokens,
            prompt_tokens=int(self.prompt_tokens or 0),
            output_tokens=int(sum(self.tokens) if self.output_tokens is None else self.output_tokens),
            finish_reason=self.finish_reason,
            error=self.error,
        )


async def stream_request(client, url: str, payload: dict, request_id: str = "0", expected_prompt_tokens: int = 0):
    """Send one streaming request and record its trace (never raises for server or network errors).

    Args:
        client: an ``aiohttp.ClientSession`` (what :func:`run_load` uses: it reads a busy stream with far
            less delay per chunk, ``benchmarks/client_timing.py``) or an ``httpx.AsyncClient``.
        url: the endpoint, e.g. ``http://127.0.0.1:8000/v1/completions``.
        payload: the JSON body (``stream: true``).
        request_id: the trace's id.
        expected_prompt_tokens: used as the prompt length when the server reports no usage.
    """
    import aiohttp
    import httpx

    parser = _StreamParser("messages" in payload, expected_prompt_tokens)
    send_time = time.perf_counter()
    try:
        if isinstance(client, aiohttp.ClientSession):
            await _read_aiohttp(client, url, payload, parser)
        else:
            await _read_httpx(client, url, payload, parser)
    except (TimeoutError, aiohttp.ClientError, httpx.HTTPError, OSError, json.JSONDecodeError, ValueError) as err:
        parser.error = f"{type(err).__name__}: {err}"
    return parser.trace(request_id, send_time)


async def _read_aiohttp(session, url: str, payload: dict, parser: _StreamParser) -> None:
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            parser.error = _error_message(response.status, await response.read())
            return
        pending = b""
        # every read the socket has ready at once, split into lines here: the chunks of one read share
        # its timestamp, as in vLLM's benchmark client (response.content.iter_any())
        async for data in response.content.iter_any():
            now = time.perf_counter()
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if not parser.line(line.decode().rstrip("\r"), now):
                    return


async def _read_httpx(client, url: str, payload: dict, parser: _StreamParser) -> None:
    async with client.stream("POST", url, json=payload) as response:
        if response.status_code != 200:
            parser.error = _error_message(response.status_code, await response.aread())
            return
        async for line in response.aiter_lines():
            if not parser.line(line, time.perf_counter()):
                return


@dataclass
class LoadResult:
    """The traces of one load run, its wall-clock duration (s) and what was run."""

    traces: list[RequestTrace]
    duration: float
    metadata: dict = field(default_factory=dict)

    @property
    def summary(self) -> BenchmarkSummary:
        return summarize(self.traces, duration=self.duration)

    def save(self, path: str | Path) -> Path:
        """Write the traces as JSON (``course.trace.load_traces`` and module 3's replay read it)."""
        return save_traces(path, self.traces, duration_s=self.duration, **self.metadata)


async def fetch_model_id(client, base_url: str) -> str:
    """The first model the server lists at ``GET /v1/models``."""
    url = api_base(base_url) + "/models"
    async with client.get(url) as response:
        if response.status != 200:
            # an OSError, as a refused connection is: callers report both as "cannot reach the server"
            raise ConnectionError(f"GET {url} answered HTTP {response.status}")
        models = (await response.json()).get("data") or []
    if not models:
        raise ValueError(f"{base_url} lists no models; pass the model name explicitly")
    return models[0]["id"]


async def run_load_async(
    base_url: str,
    workload: Workload | Sequence[RequestSpec],
    *,
    model: str | None = None,
    endpoint: str = "completions",
    concurrency: int | None = None,
    use_arrival_times: bool = True,
    prompts: PromptBuilder | None = None,
    ignore_eos: bool = True,
    continuous_usage: bool = True,
    extra_body: dict | None = None,
    progress: bool = True,
    timeout: float = 600.0,
    seed: int = 0,
) -> LoadResult:
    """Send a workload to a server and trace every request (see :func:`run_load`)."""
    import aiohttp

    if endpoint not in ("completions", "chat"):
        raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    specs = list(workload)
    prompts = prompts or default_prompt_builder()
    url = api_base(base_url) + ("/chat/completions" if endpoint == "chat" else "/completions")
    traces: list[RequestTrace | None] = [None] * len(specs)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(specs), desc=f"requests ({concurrency or 'open'} concurrent)", leave=False)
    connector = aiohttp.TCPConnector(limit=max(concurrency or len(specs), 1) + 4)
    timeouts = aiohttp.ClientTimeout(total=timeout, connect=10.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeouts) as client:
        model = model or await fetch_model_id(client, base_url)
        bodies = [
            request_payload(
                model,
                prompts.make(spec.prompt_tokens, seed=seed + i),
                spec.output_tokens,
                endpoint,
                ignore_eos,
                continuous_usage,
                extra_body,
            )
            for i, spec in enumerate(specs)
        ]
        gate = asyncio.Semaphore(concurrency) if concurrency else None
        start = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> None:
            if use_arrival_times:
                await asyncio.sleep(max(0.0, start + spec.arrival_time - time.perf_counter()))
            if gate is not None:
                async with gate:
                    trace = await stream_request(client, url, bodies[i], spec.request_id, spec.prompt_tokens)
            else:
                trace = await stream_request(client, url, bodies[i], spec.request_id, spec.prompt_tokens)
            traces[i] = trace
            if bar is not None:
                bar.update(1)

        await asyncio.gather(*(one(i, spec) for i, spec in enumerate(specs)))
        duration = time.perf_counter() - start
    if bar is not None:
        bar.close()
    metadata = {
        "server": base_url,
        "model": model,
        "endpoint": endpoint,
        "concurrency": concurrency,
        "workload": getattr(workload, "name", "requests"),
        "requests": len(specs),
    }
    return LoadResult([t for t in traces if t is not None], duration, metadata)


def run_load(base_url: str, workload: Workload | Sequence[RequestSpec], **options: Any) -> LoadResult:
    """Send a workload to an OpenAI-compatible server and trace every request.

    Args:
        base_url: ``http://host:port`` (``/v1`` optional).
        workload: requests with arrival times (s from the start) and prompt/output token counts,
            e.g. ``course.workload.poisson(...)`` or ``all_at_once(...)``.
        model: the model id to send (default: the first one the server lists).
        endpoint: "completions" (default, as vLLM's benchmark) or "chat".
        concurrency: at most this many requests in flight; with ``all_at_once`` arrivals this is
            a closed loop of ``concurrency`` workers.
        use_arrival_times: wait for each request's arrival time before sending it.
        prompts: a :class:`PromptBuilder` (default: the course tokenizer's).
        ignore_eos: ask the server to generate exactly ``output_tokens`` (vLLM's benchmark does).
        continuous_usage: ask for per-chunk token counts (``stream_options.continuous_usage_stats``).
        extra_body: more JSON fields for every request.
        progress: show a progress bar.
        timeout: seconds per request.

    Works in scripts and notebook cells alike (it runs its own event loop on a helper thread).
    """
    from course.serving.api.background import run_sync

    return run_sync(run_load_async(base_url, workload, **options))
