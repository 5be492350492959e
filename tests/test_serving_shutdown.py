"""SIGTERM under load (`course serve` in its own process, its engine core in a child process or
on a thread): every stream ends with an error event and [DONE], every non-streaming request gets
a 503 with an OpenAI error body, the log has no traceback, and the process exits within a
bounded time."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from helpers import wait_until_healthy

from course.serving.api.background import run_sync


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("engine_core", ["process", "thread"])
def test_sigterm_under_load_ends_every_request_cleanly(tmp_path, engine_core):
    port = _free_port()
    log_path = tmp_path / "serve.log"
    command = [sys.executable, "-m", "course.cli", "serve", "--model", "tiny", "--port", str(port)]
    command += ["--threads", "1", "--max-batch-size", "32", "--log-level", "info", "--engine-core", engine_core]
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(process, base, log_path)

        async def main():
            body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True}
            seen = [0] * 16

            async def stream(i, http):
                lines = []
                async with http.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data:"):
                            lines.append(line[5:].strip())
                            seen[i] += 1
                return response.status_code, lines

            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=40)) as http:
                streams = [asyncio.ensure_future(stream(i, http)) for i in range(16)]
                whole = [asyncio.ensure_future(http.post(base + "/v1/completions", json=body)) for _ in range(8)]
                while min(seen) < 3:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.2)  # the non-streaming ones are decoding too
                sent = time.monotonic()
                process.send_signal(signal.SIGTERM)
                streamed = await asyncio.gather(*streams)
                replies = await asyncio.gather(*whole, return_exceptions=True)
                return sent, streamed, replies

        sent, streamed, replies = run_sync(main(), timeout=120)
        process.wait(timeout=30)
        exited = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = log_path.read_text()
    for status, lines in streamed:
        assert status == 200 and lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error
    for reply in replies:
        assert isinstance(reply, httpx.Response), reply
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "ServiceUnavailableError", reply.text
    assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    assert exited < 10, f"the server took {exited:.1f} s to exit after SIGTERM"
