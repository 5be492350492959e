"""How faithfully a load client timestamps streamed tokens: the course's client against vLLM's.

A client's ITL is only as good as the moment its code sees each chunk. When the client falls behind
(many streams in one Python process, a busy CPU), chunks wait in the socket buffer and are read
together: they get (nearly) the same timestamp, the ITL distribution gains a spike near 0 ms, and its
median drops although the server sent tokens at a steady pace. This benchmark measures that without
a model: an emitter process sends ``--tokens`` SSE completion chunks per stream at a fixed interval
to ``--streams`` concurrent requests and records when it wrote each one (``time.perf_counter()``,
CLOCK_MONOTONIC, the same clock in every process on Linux), and each client records when it read
each one. Printed per client and stream count: the ITL it reports (p50, p95) against the interval
the emitter kept, the share of ITLs under 0.2 ms (bunched reads), and the read lag (read time minus
write time) p50 and p99.

Clients: the course's (``course.serving.client.stream_request`` over the aiohttp session ``run_load``
uses; ``--with-httpx`` adds it over httpx, the transport it used before, which reads a busy stream
several times later) always; vLLM's
``vllm bench serve`` request function (``vllm/benchmarks/lib/endpoint_request_func.py``,
``async_request_openai_completions``, aiohttp) when vLLM is importable: run it with the oracle
environment's Python to compare both in one run (``bin/vllm-env`` builds it):

    .vllm-venv/bin/python benchmarks/client_timing.py --streams 1 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable

BUNCHED_S = 0.0002  # two reads closer than this came from one socket read


def _emitter(port_queue, interval: float, tokens: int, log_path: str) -> None:
    """A stand-in for a batched engine: every ``interval`` seconds one step writes the next SSE chunk to
    every open stream (``tokens`` chunks each), as a server's decode step gives every running request a
    token at once."""

    async def main() -> None:
        streams: list[dict] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length")), 0)  # fmt: skip
            request_id = json.loads(await reader.readexactly(length)).get("request_id", "?")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            done = asyncio.get_running_loop().create_future()
            streams.append({"id": request_id, "writer": writer, "sent": [], "done": done})
            await done

        async def step_loop() -> None:
            start, step = time.perf_counter(), 0
            while True:
                step += 1
                # absolute deadlines: a late step does not push the later ones back
                await asyncio.sleep(max(0.0, start + step * interval - time.perf_counter()))
                for stream in list(streams):
                    i = len(stream["sent"])
                    last = i == tokens - 1
                    chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if last else None}]}
                    stream["writer"].write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    stream["sent"].append(time.perf_counter())
                    if last:
                        usage = {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": tokens + 8}
                        tail = json.dumps({"choices": [], "usage": usage}).encode()
                        stream["writer"].write(b"data: " + tail + b"\n\ndata: [DONE]\n\n")
                        stream["writer"].close()
                        streams.remove(stream)
                        with open(log_path, "a") as log:
                            log.write(json.dumps({"id": stream["id"], "sent": stream["sent"]}) + "\n")
                        stream["done"].set_result(None)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_queue.put(server.sockets[0].getsockname()[1])
        asyncio.create_task(step_loop())
        async with server:
            await server.serve_forever()

    asyncio.run(main())


async def _course_client(url: str, streams: int, tokens: int, transport: str = "aiohttp") -> dict[str, list[float]]:
    """The course's ``stream_request`` over the session ``run_load`` uses (aiohttp), or over httpx."""
    import aiohttp
    import httpx

    from course.serving.client import stream_request

    def body(i: int) -> dict:
        return {"prompt": "x", "max_tokens": tokens, "stream": True, "request_id": f"c{i}"}

    if transport == "httpx":
        session = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=streams + 4))
    else:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams + 4))
    async with session as client:
        traces = await asyncio.gather(*[stream_request(client, url, body(i), f"c{i}") for i in range(streams)])
    return {trace.request_id: list(trace.chunk_times) for trace in traces}


async def _course_client_httpx(url: str, streams: int, tokens: int) -> dict[str, list[float]]:
    return await _course_client(url, streams, tokens, "httpx")


async def _vllm_client(url: str, streams: int, tokens: int) -> dict[str, list[float]]:
    """vLLM's request function; its chunk times rebuilt from its TTFT and ITLs (it keeps no others)."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    async def one(session, i: int) -> tuple[str, list[float]]:
        rid = f"v{i}"
        request = RequestFuncInput(prompt="x", api_url=url, prompt_len=1, output_len=tokens, model="m",
                                   extra_body={"request_id": rid})  # fmt: skip
        out = await async_request_openai_completions(request, session)
        if not out.success:
            raise RuntimeError(f"vLLM's client failed: {out.error[-300:]}")
        times = [out.start_time + out.ttft]
        for gap in out.itl:
            times.append(times[-1] + gap)
        return rid, times

    connector = aiohttp.TCPConnector(limit=streams + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        return dict(await asyncio.gather(*[one(session, i) for i in range(streams)]))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _measure(name: str, client: Callable, url: str, log_path: str, streams: int, tokens: int) -> dict:
    open(log_path, "w").close()
    received = asyncio.run(client(url, streams, tokens))
    sent = {}
    for _ in range(200):  # the emitter logs a stream after its last write
        with open(log_path) as log:
            sent = {row["id"]: row["sent"] for row in map(json.loads, log.read().splitlines())}
        if len(sent) >= streams:
            break
        time.sleep(0.01)
    itl, lag, interval = [], [], []
    for rid, times in received.items():
        itl += [b - a for a, b in zip(times, times[1:])]
        lag += [r - s for r, s in zip(times, sent[rid])]
        interval += [b - a for a, b in zip(sent[rid], sent[rid][1:])]
    ms = 1000
    return {
        "client": name, "streams": streams,
        "emitted_itl_p50_ms": statistics.median(interval) * ms,
        "itl_p50_ms": statistics.median(itl) * ms, "itl_p95_ms": _percentile(itl, 95) * ms,
        "bunched_share": sum(gap < BUNCHED_S for gap in itl) / len(itl),
        "read_lag_p50_ms": statistics.median(lag) * ms, "read_lag_p99_ms": _percentile(lag, 99) * ms,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=64, help="chunks per stream")
    parser.add_argument("--interval-ms", type=float, default=2.0, help="the emitter's inter-token interval")
    parser.add_argument("--repeats", type=int, default=3, help="runs per client and stream count, alternated")
    parser.add_argument("--json", action="store_true", help="print one JSON object per run instead of a table")
    parser.add_argument("--with-httpx", action="store_true",
                        help="also the course's client over httpx, which run_load used before 2026-12-02")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        import vllm.benchmarks.lib.endpoint_request_func  # noqa: F401

        clients = {"course": _course_client, "vllm bench serve": _vllm_client}
    except ImportError:
        clients = {"course": _course_client}
        print("vLLM is not importable here: the course's client only (run with .vllm-venv/bin/python for both)")
    if args.with_httpx:
        clients["course over httpx"] = _course_client_httpx
    log_path = f"/tmp/client_timing_{os.getpid()}.jsonl"
    ports: multiprocessing.Queue = multiprocessing.Queue()
    emitter = multiprocessing.Process(target=_emitter, args=(ports, args.interval_ms / 1000, args.tokens, log_path),
                                      daemon=True)  # fmt: skip
    emitter.start()
    url = f"http://127.0.0.1:{ports.get(timeout=30)}/v1/completions"
    rows = []
    try:
        for streams in args.streams:
            for _ in range(args.repeats):
                for name, client in clients.items():
                    rows.append(_measure(name, client, url, log_path, streams, args.tokens))
    finally:
        emitter.terminate()
        os.path.exists(log_path) and os.remove(log_path)
    load = os.getloadavg()[0]
    if args.json:
        for row in rows:
            print(json.dumps({**row, "load_1min": load}))
        return rows
    print(f"emitter interval {args.interval_ms} ms, {args.tokens} chunks per stream, load average {load:.2f} "
          f"on {os.cpu_count()} CPUs (a busy machine makes every client bunch more)")  # fmt: skip
    header = ("client", "streams", "emitted p50", "ITL p50", "ITL p95", "bunched", "lag p50", "lag p99")
    print("{:<22}{:>8}{:>12}{:>10}{:>10}{:>9}{:>10}{:>10}".format(*header))
    for r in rows:
        print(f"{r['client']:<22}{r['streams']:>8}{r['emitted_itl_p50_ms']:>10.2f}ms{r['itl_p50_ms']:>8.2f}ms"
              f"{r['itl_p95_ms']:>8.2f}ms{r['bunched_share']:>9.0%}{r['read_lag_p50_ms']:>8.2f}ms"
              f"{r['read_lag_p99_ms']:>8.2f}ms")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
