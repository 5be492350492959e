"""How this machine's speed drifts: lone prefills of three prompt sizes, interleaved, against the course's server.

Starts ``course serve`` pinned to core 0 as ``sim_fidelity.py`` does, and from core 1 sends requests one at a
time (a closed loop of one, 2 output tokens each) whose prompts cycle through ``--sizes``, so that every
prompt size samples the same moments. Prints each prompt size's median TTFT, then, for every block of
``--block`` cycles, each size's median over its median for the whole run: a drift of the machine moves every
size together and lasts many blocks; a disturbance of one request moves one cell.

Why it matters: a calibration microbenchmark lasts a second or less, so it measures one stretch of the
machine. On this VM the speed moved by up to 40 %, every size together, for seconds at a time
(benchmarks/RESULTS.md, 2026-12-04; other stretches of the evening were quieter), which is why
``sim_fidelity.py`` calibrates the course's server in ``COURSE_ROUNDS`` rounds spread through the run.

    .venv/bin/python benchmarks/speed_drift.py [--requests 600] [--sizes 16 128 512] [--block 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _processes import SERVER_CORE, send_workload, start_server, stop  # noqa: E402
from sim_fidelity import course_server_command, load_average  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=600, help="requests in all (default 600: about 25 s)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 512], help="prompt sizes, in tokens")
    parser.add_argument("--block", type=int, default=8, help="cycles through the sizes per printed row")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args(argv)
    if not args.sizes or any(size < 1 for size in args.sizes):
        parser.error(f"--sizes must be prompt sizes >= 1 token, got {args.sizes}")
    if args.block < 1 or args.requests < 2 * args.block * len(args.sizes):
        parser.error(f"--requests must fill two blocks of --block cycles through {len(args.sizes)} sizes at least")
    return args


def drift_table(rows: list[tuple[float, int, float]], sizes: list[int], block: int) -> list[tuple[float, list[float]]]:
    """``(seconds from the start, [median TTFT over the run's median, per size])`` for each block of ``block``
    cycles; ``rows``: ``(send time s, prompt size, TTFT s)`` in the order sent."""
    by_size = {size: [(sent, ttft) for sent, s, ttft in rows if s == size] for size in sizes}
    medians = {size: statistics.median(ttft for _, ttft in pairs) for size, pairs in by_size.items()}
    cycles = min(len(pairs) for pairs in by_size.values())
    start = rows[0][0]
    table = []
    for first in range(0, cycles - block + 1, block):
        window = slice(first, first + block)
        ratios = [statistics.median(t for _, t in by_size[size][window]) / medians[size] for size in sizes]
        table.append((by_size[sizes[0]][first][0] - start, ratios))
    return table


def measure(args: argparse.Namespace, work: Path) -> list[tuple[float, int, float]]:
    """Serve, send the requests from core 1 one at a time, stop: ``(send time s, prompt size, TTFT s)`` in the
    order sent. RuntimeError when the client or a request failed."""
    command = course_server_command(args.port, 16, max(512, max(args.sizes)))
    sizes = {str(i): args.sizes[i % len(args.sizes)] for i in range(args.requests)}
    with open(work / "server.log", "w+") as log:
        server = start_server(command, f"http://127.0.0.1:{args.port}/health", log, cores=SERVER_CORE)
        try:
            rows = [(rid, 0.0, size, 2) for rid, size in sizes.items()]
            traces = send_workload(args.port, rows, work / "traces.json", concurrency=1)
        finally:
            stop(server)
    return sorted((t.send_time, sizes[t.request_id], t.chunk_times[0] - t.send_time) for t in traces)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"lone prefills of {', '.join(map(str, args.sizes))} tokens, interleaved, {args.requests} requests; "
          f"{load_average()}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="speed-drift-") as work:
        try:
            rows = measure(args, Path(work))
        except RuntimeError as err:
            print(err, file=sys.stderr)
            return 1
    for size in args.sizes:
        ttfts = [ttft for _, s, ttft in rows if s == size]
        print(f"prompt {size:5d} tokens: median TTFT {statistics.median(ttfts) * 1e3:7.2f} ms "
              f"over {len(ttfts)} requests")  # fmt: skip
    print(f"each block of {args.block} cycles: its median TTFT over the run's, per prompt size")
    print("{:>8s} ".format("from s") + " ".join(f"{size:>7d}" for size in args.sizes))
    table = drift_table(rows, args.sizes, args.block)
    for seconds, ratios in table:
        print(f"{seconds:8.1f} " + " ".join(f"{ratio:7.2f}" for ratio in ratios))
    levels = [statistics.median(ratios) for _, ratios in table]
    print(f"blocks' level (median over the sizes): {min(levels):.2f} to {max(levels):.2f} of the run's median; "
          f"{load_average()} at the end")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
