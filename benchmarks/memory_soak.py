"""Memory of the course's server over many varied requests: does it stay bounded?

Starts `course serve` as an operator would on a campus network (the engine core in its own process, prefix
caching on with a small cache so that its bound is reached within the run, two API keys with per-key cache
isolation), then sends ``--requests`` varied requests (10,000 by default) from this process, ``--concurrency``
at a time:

* completions and chat; prompts of 1 to 600 tokens (token ids, or text), a fifth of them after one of 8
  shared "system prompts" (prefix-cache hits), the rest new;
* streamed or not; max_tokens 1-48; logprobs none, 0, 5 or 20; a stop string now and then; seeded sampling;
* one of 40 cache salts or none, under either key;
* a tenth aborted mid-stream (the connection closed after a few chunks), a twentieth refused (a bad field).

Every ``--every`` requests it prints the resident memory (RSS) of the API server process and of the engine
core process, the engine's prefix-cache bytes and blocks (``/health``), and the requests that failed
unexpectedly. At the end: the growth per 1,000 requests over the run's first half and its second half,
for each process. A bounded process stops growing once its caches are full: its second-half growth is near
zero; a leak grows the same in both halves.

The figures are memory, not time: other work on the machine slows the run (its requests/s) but moves RSS only
through what the allocator keeps, about ±2-5 MiB from sample to sample here. A second-half growth under that
noise (a few MiB per 1,000 requests) cannot be told from flat; one run shows a trend, not a rate to 10 %.

    .venv/bin/python benchmarks/memory_soak.py [--requests 10000] [--concurrency 16] [--every 500]
        [--prefix-cache-gib 0.0625]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from _processes import WHOLE_MACHINE, free_port, idle_policy, start_server, stop

KEYS = ("soak-key-a", "soak-key-b")
SALTS = [f"salt-{i}" for i in range(40)]
WORDS = ["the", "a", "prefill", "decode", "cache", "token", "batch", "stream", "engine", "latency", "memory", "block"]


def server_command(port: int, args: argparse.Namespace) -> list[str]:
    return [
        str(Path(sys.executable).parent / "course"), "serve", "--port", str(port),
        "--enable-prefix-caching", "--prefix-cache-gib", str(args.prefix_cache_gib),
        "--api-key", *KEYS, "--cache-isolation", "per-key",
        "--max-model-len", "2048",
    ]  # fmt: skip


def make_request(rng: random.Random, systems: list[list[int]]) -> tuple[str, dict, str]:
    """(path, body, kind) of one varied request; kind: "ok", "abort" (close mid-stream) or "bad" (a 400)."""
    kind = "bad" if rng.random() < 0.05 else "abort" if rng.random() < 0.1 else "ok"
    length = int(rng.choice([rng.randint(1, 40), rng.randint(40, 200), rng.randint(200, 600)]))
    ids = [rng.randrange(4, 2000) for _ in range(length)]
    if rng.random() < 0.2:
        ids = rng.choice(systems) + ids[:200]
    body: dict = {"model": "course-tiny-llama", "max_tokens": rng.randint(1, 48), "ignore_eos": True}
    body["stream"] = kind == "abort" or rng.random() < 0.5
    if rng.random() < 0.4:
        body["logprobs"] = rng.choice([0, 5, 20])
    if rng.random() < 0.5:
        body["cache_salt"] = rng.choice(SALTS)
    if rng.random() < 0.1:
        body["stop"] = [rng.choice(WORDS)]
    if rng.random() < 0.3:
        body |= {"temperature": 0.8, "seed": rng.randrange(1000)}
    if kind == "bad":
        body["max_tokens"] = rng.choice([0, -3, "many"])
    if rng.random() < 0.3:  # chat: text messages
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, length // 2)))
        if "logprobs" in body:
            body["top_logprobs"], body["logprobs"] = body.pop("logprobs"), True
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}, kind
    return "/v1/completions", {**body, "prompt": ids}, kind


async def send_one(http: httpx.AsyncClient, url: str, request: tuple[str, dict, str], key: str) -> bool:
    """Send one request; True if it went as meant (200, an abort, or the 400 a bad one should get)."""
    path, body, kind = request
    headers = {"Authorization": f"Bearer {key}"}
    try:
        if not body.get("stream"):
            response = await http.post(url + path, json=body, headers=headers)
            return response.status_code == (400 if kind == "bad" else 200)
        async with http.stream("POST", url + path, json=body, headers=headers) as response:
            if response.status_code != 200:
                await response.aread()
                return kind == "bad" and response.status_code == 400
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    chunks += 1
                    if '"error"' in line[:20]:
                        return False
                    if kind == "abort" and chunks >= 2:
                        return True  # leaving the block closes the connection mid-stream
            return kind != "bad"
    except httpx.HTTPError:
        return False


def sample(server: psutil.Process, url: str) -> dict:
    health = httpx.get(url + "/health", timeout=30).json()
    engine = psutil.Process(health["engine_process"])
    return {
        "api_mib": server.memory_info().rss / 2**20,
        "engine_mib": engine.memory_info().rss / 2**20,
        "api_cpu_s": sum(server.cpu_times()[:2]),
        "engine_cpu_s": sum(engine.cpu_times()[:2]),
        "cache_mib": health.get("prefix_cache_bytes", 0) / 2**20,
        "blocks": health.get("prefix_cache_blocks", 0),
        "trims": health.get("heap_trims", 0),
        "trim_seconds": health.get("heap_trim_seconds", 0.0),
    }


async def soak(url: str, server: psutil.Process, args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(4, 2000) for _ in range(rng.randint(64, 512))] for _ in range(8)]
    requests = [make_request(rng, systems) for _ in range(args.requests)]
    rows, failures, done, started = [], 0, 0, time.monotonic()
    queue: asyncio.Queue = asyncio.Queue()
    for i, request in enumerate(requests):
        queue.put_nowait((i, request))
    lock = asyncio.Lock()

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal failures, done
        while not queue.empty():
            i, request = queue.get_nowait()
            ok = await send_one(http, url, request, KEYS[i % 2])
            async with lock:
                failures += not ok
                done += 1
                if done % args.every == 0 or done == args.requests:
                    row = {"requests": done, "seconds": time.monotonic() - started, "failed": failures}
                    row["idle"] = done == args.requests  # the last request is done: the load is over
                    row |= await asyncio.to_thread(sample, server, url)
                    rows.append(row)
                    print(
                        f"{done:>6} requests {row['seconds']:6.0f} s  API server {row['api_mib']:7.1f} MiB  "
                        f"engine core {row['engine_mib']:7.1f} MiB  prefix cache {row['cache_mib']:6.1f} MiB "
                        f"({row['blocks']} blocks)  heap trims {row['trims']} ({row['trim_seconds']:.1f} s)  "
                        f"failed {failures}",
                        flush=True,
                    )

    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    await asyncio.sleep(3)  # idle: an engine that trims its heap gives back what the load left behind
    idle = {"requests": done, "seconds": time.monotonic() - started, "failed": failures, "idle": True}
    idle |= await asyncio.to_thread(sample, server, url)
    print(
        f"idle 3 s after the last request: API server {idle['api_mib']:.1f} MiB, engine core {idle['engine_mib']:.1f} "
        f"MiB, heap trims {idle['trims']}",
        flush=True,
    )
    return rows + [idle]


def growth(rows: list[dict], key: str) -> tuple[float, float]:
    """MiB per 1,000 requests over the first half of the run and over the second half (under load)."""
    rows = [row for row in rows if not row.get("idle")]
    first, middle, last = rows[0], rows[len(rows) // 2], rows[-1]

    def rate(a: dict, b: dict) -> float:
        return 1000 * (b[key] - a[key]) / max(1, b["requests"] - a["requests"])

    return rate(first, middle), rate(middle, last)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--every", type=int, default=500, help="print a row every this many requests")
    parser.add_argument("--prefix-cache-gib", type=float, default=0.0625, help="the server's prefix cache (64 MiB)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the rows to this file")
    parser.add_argument(
        "--no-trim", action="store_true", help="serve with COURSE_HEAP_TRIM=0: the engine never trims its heap"
    )
    args = parser.parse_args(argv)
    print(f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {idle_policy()}")
    print(
        f"n = {args.requests} requests, {args.concurrency} at a time, a row every {args.every}; prefix cache "
        f"{args.prefix_cache_gib * 1024:g} MiB"
    )
    port = free_port()
    if args.no_trim:
        os.environ["COURSE_HEAP_TRIM"] = "0"  # the server inherits this environment
    with tempfile.TemporaryFile("w+") as log:
        process = start_server(server_command(port, args), f"http://127.0.0.1:{port}/health", log, cores=WHOLE_MACHINE)
        try:
            rows = asyncio.run(soak(f"http://127.0.0.1:{port}", psutil.Process(process.pid), args))
        finally:
            stop(process)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    for key, name in (("api_mib", "API server"), ("engine_mib", "engine core"), ("cache_mib", "prefix cache")):
        early, late = growth(rows, key)
        print(f"{name}: {early:+.1f} MiB per 1,000 requests in the first half, {late:+.1f} in the second")
    loaded = [row for row in rows if not row.get("idle")]
    last = loaded[-1]
    peak = max(row["engine_mib"] for row in loaded[len(loaded) // 2 :])
    print(f"engine core: highest sample in the second half {peak:.1f} MiB")
    engine_ms, api_ms = (1e3 * last[key] / last["requests"] for key in ("engine_cpu_s", "api_cpu_s"))
    print(
        f"{last['requests'] / last['seconds']:.0f} requests/s; CPU per request (user + system, from the start): "
        f"engine core {engine_ms:.1f} ms, API server {api_ms:.1f} ms; {last['failed']} went wrong"
    )
    print(f"load average after the run: {os.getloadavg()[0]:.2f}")
    return 0 if last["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
