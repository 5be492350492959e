"""The prefix cache's timing side channel between tenants, with and without per-key isolation.

A prompt prefix that is cached is prefilled in a fraction of the time: a tenant who sends a prompt another
tenant sent before gets its answer sooner, and so learns that the other sent it. This benchmark starts two
`course serve` processes with prefix caching on and two API keys, one sharing the cache between the keys
(vLLM's behaviour without a ``cache_salt``) and one with ``--cache-isolation per-key``, both up at once and
driven in alternation, round after round. Each round, on each server, with a fresh ``--prompt-tokens`` prompt P:

1. tenant A sends P (a miss: the whole prompt is prefilled);
2. tenant B sends P: the probe. Shared, it hits A's blocks; isolated, it cannot;
3. tenant B sends a fresh prompt of the same length: a miss, the probe's baseline;
4. tenant A sends P again: a hit on its own blocks under both settings (the cache works).

Each request is non-streaming with ``max_tokens`` 1, so its time is the prefill plus one HTTP round trip.
Printed: each round's four times, then their medians and the probe's time over its baseline. Shared, the
probe is several times faster than its baseline (the signal); isolated, the ratio is 1 within the noise
(no signal), while A's repeat stays fast. Other work on the machine moves every time by ±20-30 %; the
medians over ``--rounds`` (default 8) and the interleaving keep the comparison within a round.

    .venv/bin/python benchmarks/prefix_isolation.py [--rounds 8] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from _processes import WHOLE_MACHINE, free_port, idle_policy, start_server, stop

KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}
STEPS = ("A sends P", "B sends P (probe)", "B sends a fresh prompt", "A sends P again")


def server_command(port: int, isolation: str) -> list[str]:
    return [
        str(Path(sys.executable).parent / "course"), "serve", "--port", str(port), "--enable-prefix-caching",
        "--api-key", *KEYS.values(), "--cache-isolation", isolation,
    ]  # fmt: skip


def timed(url: str, tenant: str, prompt: list[int]) -> float:
    """Seconds for one request of ``tenant`` with ``prompt`` (token ids) and one output token."""
    body = {"prompt": prompt, "max_tokens": 1}
    started = time.perf_counter()
    response = httpx.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=300
    )
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    print(f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; {idle_policy()}")
    print(f"n = {args.rounds} rounds per server, prompts of {args.prompt_tokens} tokens, max_tokens 1")
    servers, times = {}, {"shared": [], "per-key": []}
    with contextlib.ExitStack() as cleanup:
        for isolation in times:
            port = free_port()
            log = cleanup.enter_context(tempfile.TemporaryFile("w+"))
            url = f"http://127.0.0.1:{port}"
            process = start_server(server_command(port, isolation), url + "/health", log, cores=WHOLE_MACHINE)
            cleanup.callback(stop, process)
            servers[isolation] = url
            timed(url, "A", [rng.randrange(4, 2000) for _ in range(64)])  # warm-up
        for round_ in range(args.rounds):
            for isolation, url in servers.items():
                prompt = [rng.randrange(4, 2000) for _ in range(args.prompt_tokens)]
                fresh = [rng.randrange(4, 2000) for _ in range(args.prompt_tokens)]
                row = [timed(url, "A", prompt), timed(url, "B", prompt)]
                row += [timed(url, "B", fresh), timed(url, "A", prompt)]
                times[isolation].append(row)
                print(f"round {round_ + 1} {isolation:>7}: " + "  ".join(f"{s:6.3f} s" for s in row), flush=True)
    print()
    print("| cache | " + " | ".join(STEPS) + " | probe / its baseline |")
    print("|---|" + "---|" * (len(STEPS) + 1))
    for isolation, rows in times.items():
        medians = [statistics.median(row[i] for row in rows) for i in range(len(STEPS))]
        ratios = [row[1] / row[2] for row in rows]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        cells = " | ".join(f"{m:.3f} s" for m in medians)
        print(f"| {isolation} | {cells} | {statistics.median(ratios):.2f} (rounds {spread}) |")
    print(f"load average after the run: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
