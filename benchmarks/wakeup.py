"""What a pipe write costs the writer when the reader sleeps on another core, and when it does not.

The engine core writes each decode step's tokens to the API server's pipe (one message per step;
at one stream, one per token). The server's event loop waits for it in ``epoll_wait``, so the
write must wake it, and waking a thread that sleeps on another core sends an inter-processor
interrupt, which on a virtual machine traps to the hypervisor. This script times that write from
the writer's side, the way the engine core sees it:

* "reader asleep on the pipe": the reader, pinned to core 1, blocks in ``os.read`` (what the
  server's event loop does);
* "reader polling": the reader naps 100 µs between non-blocking checks, so a write finds nobody
  to wake (the alternative, which costs the reader CPU instead: see benchmarks/RESULTS.md, the streaming server).

The writer, pinned to core 0, writes 60 bytes (about one step's message at one stream) every
``--period-ms`` of busy work (a stand-in for the forward pass), ``--writes`` times; printed: the
median and p90 of the write's duration for each reader, in µs, after how the machine's idle cores
wait (``_processes.idle_policy``: a vCPU that halts at once makes every wake-up an interrupt that exits
to the host). Linux with 2+ cores.

    .venv/bin/python benchmarks/wakeup.py [--writes 600] [--period-ms 1.5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import select
import statistics
import sys
import time

from _processes import idle_policy

MESSAGE = b"x" * 60  # about one step's events at one stream, pickled


def timed_writes(reader_polls: bool, writes: int, period_s: float) -> list[float]:
    """Durations (s) of ``writes`` pipe writes from core 0, with a reader process on core 1."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the reader
        os.close(write_end)
        os.sched_setaffinity(0, {1})
        while True:
            if reader_polls:
                while not select.select([read_end], [], [], 0)[0]:
                    time.sleep(100e-6)
            if not os.read(read_end, 65536):
                os._exit(0)
    os.close(read_end)
    os.sched_setaffinity(0, {0})
    durations = []
    for _ in range(writes):
        busy_until = time.perf_counter() + period_s
        while time.perf_counter() < busy_until:  # the forward pass's stand-in: keep core 0 busy
            pass
        start = time.perf_counter()
        os.write(write_end, MESSAGE)
        durations.append(time.perf_counter() - start)
    os.close(write_end)
    os.waitpid(child, 0)
    return durations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--writes", type=int, default=600)
    parser.add_argument("--period-ms", type=float, default=1.5, help="busy work between two writes (default 1.5)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two readers (default 2)")
    args = parser.parse_args(argv)
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2 or not hasattr(os, "fork"):
        print("needs Linux with at least two usable cores", file=sys.stderr)
        return 2
    print(f"load average before the run: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores", flush=True)
    print(idle_policy(), flush=True)
    for round_ in range(args.rounds):
        for label, polls in (("reader asleep on the pipe", False), ("reader polling every 100 us", True)):
            durations = sorted(timed_writes(polls, args.writes, args.period_ms * 1e-3))
            p90 = durations[int(0.9 * len(durations))]
            print(
                f"round {round_ + 1}, {label:28s}: write median {statistics.median(durations) * 1e6:6.1f} us, "
                f"p90 {p90 * 1e6:6.1f} us",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
