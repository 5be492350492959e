"""Where `vllm serve`'s processes spend the server core's time during a run: a timeline, and what it says.

vLLM's CPU build runs three processes on the core it is pinned to: the API server (``vllm serve`` itself: HTTP,
tokenizing, detokenizing, the SSE stream), the engine core (retitled ``VLLM::EngineCore``: scheduling, vLLM 0.32
``vllm/v1/engine/core.py``, ``run_engine_core``) and the model's worker (``VLLM::Worker``,
``vllm/v1/executor/multiproc_executor.py``). ``benchmarks/sim_fidelity.py --engine vllm`` measures their CPU time
per lone request; this tool records *when* it is spent, so the simulator's front end can be put where the work is.

Two steps, side by side with a kept fidelity run (the recorder pinned to the client's core, away from the server)::

    taskset -c 1 .venv/bin/python benchmarks/host_timeline.py record /tmp/tl/r1.csv &
    .venv/bin/python benchmarks/sim_fidelity.py --engine vllm --front-end queue --where-the-run-lives \\
        --rounds 4 --requests 450 --keep /tmp/tl/r1
    .venv/bin/python benchmarks/host_timeline.py analyse /tmp/tl/r1.csv /tmp/tl/r1

``record`` waits for a ``vllm serve`` process, then every ``--period`` seconds (5 ms) writes one CSV row: the time
(``time.monotonic``, the clock the load client stamps its traces with) and each process group's cumulative CPU
time in ns, summed over its threads' ``schedstat`` (``stat``'s 10 ms ticks are too coarse). It stops when the server
is gone. ``analyse`` prints, for every microbenchmark and run part of the kept folder, each group's share of the wall
time and its CPU per token and per request; then, over the run parts, each group's CPU per 5 ms bin fitted by least
squares to the requests' events in that bin and the bins around it (arrivals, first tokens, later tokens,
finishes): how many ms of CPU each event brings, and how long after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _processes import process_title, process_tree  # noqa: E402

GROUPS = ("api", "core", "worker", "other")
# vLLM's process titles (vllm/v1/engine/core.py and vllm/v1/executor/multiproc_executor.py, 0.32.0)
TITLES = {"VLLM::EngineCore": "core", "VLLM::Worker": "worker"}
REFRESH_S = 0.5  # how often the recorder looks for new threads (vLLM starts some after the first request)
# Event -> the bins around it whose CPU it may explain (0: the bin the event falls in; 2: two bins after it).
LAGS = {"arrival": range(-1, 6), "first token": range(-2, 2), "token": range(-1, 1), "finish": range(-1, 4)}


# --- record ------------------------------------------------------------------------------------------


def find_server(proc: Path = Path("/proc")) -> int | None:
    """The pid of a running ``vllm serve`` (``vllm serve ...`` or ``python -m vllm.entrypoints.cli.main serve``)."""
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and (any(a.endswith(b"vllm") for a in args[:2]) or b"vllm.entrypoints.cli.main" in args):
            return int(entry.name)
    return None


def group_of(pid: int, server: int, proc: Path = Path("/proc")) -> str | None:
    """Which of :data:`GROUPS` the process ``pid`` below ``server`` belongs to; None when it is gone."""
    title = process_title(pid, proc)
    if title is None:
        return None
    for prefix, group in TITLES.items():
        if title.startswith(prefix):
            return group
    return "api" if pid == server else "other"


def open_threads(server: int, proc: Path = Path("/proc")) -> list[tuple[int, int]]:
    """(group index, an open descriptor of the thread's ``schedstat``) for every thread of the server's tree."""
    opened = []
    for pid in process_tree(server, proc):
        group = group_of(pid, server, proc)
        if group is None:
            continue
        try:
            for task in (proc / str(pid) / "task").iterdir():
                opened.append((GROUPS.index(group), os.open(task / "schedstat", os.O_RDONLY)))
        except OSError:  # it ended meanwhile
            continue
    return opened


def read_sums(threads: list[tuple[int, int]]) -> list[int]:
    """Each group's CPU time so far (ns), summed over ``threads`` (a thread that ended adds nothing)."""
    sums = [0] * len(GROUPS)
    for group, fd in threads:
        try:
            sums[group] += int(os.pread(fd, 64, 0).split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return sums


def record(out: Path, period: float) -> None:
    """Write the timeline of the next ``vllm serve`` to ``out`` until it is gone (see the module's docstring)."""
    server = None
    while server is None:
        server = find_server()
        time.sleep(0.05)
    print(f"recording vllm serve (pid {server}) every {period * 1e3:g} ms into {out}", flush=True)
    with out.open("w") as sink:
        sink.write("t," + ",".join(GROUPS) + "\n")
        threads, refreshed, due = open_threads(server), time.monotonic(), time.monotonic()
        while Path(f"/proc/{server}").exists():
            now = time.monotonic()
            if now - refreshed > REFRESH_S:
                for _, fd in threads:
                    os.close(fd)
                threads, refreshed = open_threads(server), now
            sink.write(f"{now:.6f}," + ",".join(map(str, read_sums(threads))) + "\n")
            due += period
            time.sleep(max(0.0, due - time.monotonic()))
        for _, fd in threads:
            os.close(fd)
    print("vllm serve is gone", flush=True)


# --- analyse -----------------------------------------------------------------------------------------


def load_timeline(path: Path) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(sample times in s, group -> cumulative CPU in ms at each sample)."""
    data = np.genfromtxt(path, delimiter=",", names=True)
    return data["t"], {group: data[group] / 1e6 for group in GROUPS}


def load_traces(path: Path) -> list[dict]:
    """The traces of a kept microbenchmark or run part (``course bench``'s JSON), with at least one token each."""
    return [trace for trace in json.loads(path.read_text())["traces"] if trace["chunk_times"]]


def span_of(traces: list[dict]) -> tuple[float, float]:
    """(the first send, the last token) of ``traces``, in s."""
    return min(trace["send_time"] for trace in traces), max(trace["chunk_times"][-1] for trace in traces)


def shares(times: np.ndarray, cumulative: dict[str, np.ndarray], traces: list[dict]) -> dict[str, float] | None:
    """Over the span of ``traces`` (first send to last token): the wall time (ms) and each group's CPU (ms); None
    when the timeline holds fewer than three samples of it."""
    start, end = span_of(traces)
    first, last = np.searchsorted(times, start), np.searchsorted(times, end) - 1
    if last - first < 2:
        return None
    spent = {group: float(cumulative[group][last] - cumulative[group][first]) for group in GROUPS}
    return {"wall": float(times[last] - times[first]) * 1e3, **spent}


def event_times(traces: list[dict]) -> dict[str, np.ndarray]:
    """The requests' events (s): arrivals (sent), first tokens, later tokens, finishes (last token)."""
    return {
        "arrival": np.array([trace["send_time"] for trace in traces]),
        "first token": np.array([trace["chunk_times"][0] for trace in traces]),
        "token": np.array([t for trace in traces for t in trace["chunk_times"][1:]]),
        "finish": np.array([trace["chunk_times"][-1] for trace in traces]),
    }


def event_design(times: np.ndarray, traces: list[dict]) -> tuple[np.ndarray, slice]:
    """The columns of the fit for the bins between consecutive samples over the span of ``traces``: for each event
    and lag of :data:`LAGS`, how many such events fell ``lag`` bins before each bin; then a constant. Returns (the
    matrix, the bins it covers)."""
    bins = len(times) - 1
    columns = []
    for name, when in event_times(traces).items():
        counts = np.bincount(np.clip(np.searchsorted(times, when, side="right") - 1, 0, bins - 1), minlength=bins)
        columns += [np.roll(counts, lag) for lag in LAGS[name]]
    start, end = span_of(traces)
    span = slice(int(np.searchsorted(times, start)), int(np.searchsorted(times, end)) - 1)
    return np.column_stack(columns + [np.ones(bins)])[span], span


def fit_events(times: np.ndarray, cumulative: dict[str, np.ndarray], parts: list[list[dict]]) -> dict[str, np.ndarray]:
    """Per group that spent any CPU, the least-squares CPU (ms) each event brings to each bin around it, over the run
    ``parts`` (one list of traces each); the last value is the CPU per bin that no event explains."""
    per_bin = {group: np.clip(np.diff(cumulative[group]), 0.0, None) for group in GROUPS}  # a thread that ended: 0
    rows, targets = [], {group: [] for group in GROUPS}
    for traces in parts:
        design, span = event_design(times, traces)
        rows.append(design)
        for group in GROUPS:
            targets[group].append(per_bin[group][span])
    matrix = np.vstack(rows)
    return {
        group: np.linalg.lstsq(matrix, np.concatenate(targets[group]), rcond=None)[0]
        for group in GROUPS
        if sum(float(t.sum()) for t in targets[group]) > 0  # a group that spent nothing (no helper process)
    }


def print_shares(times: np.ndarray, cumulative: dict[str, np.ndarray], kept: Path) -> None:
    """Each microbenchmark's and run part's share of the core per group, and CPU per token and per request."""
    print(f"{'what':24s} {'wall s':>7s} " + " ".join(f"{g + ' %':>8s}" for g in GROUPS[:3])
          + "  api ms/token  core ms/token  api ms/request")  # fmt: skip
    for path in sorted(kept.glob("*/*.json")) + sorted(kept.glob("*part*.json")):
        try:
            traces = load_traces(path)
        except (OSError, ValueError, KeyError):
            continue
        spent = shares(times, cumulative, traces) if traces else None
        if spent is None:
            continue
        tokens = sum(len(trace["chunk_times"]) for trace in traces)
        print(
            f"{path.relative_to(kept).as_posix():24s} {spent['wall'] / 1e3:7.2f} "
            + " ".join(f"{spent[g] / spent['wall']:8.1%}" for g in GROUPS[:3])
            + f"  {spent['api'] / tokens:12.3f}  {spent['core'] / tokens:13.3f}  {spent['api'] / len(traces):14.2f}"
        )


def print_events(fitted: dict[str, np.ndarray], period: float) -> None:
    """The fitted CPU per event, in total and bin by bin around it."""
    for group, coefficients in fitted.items():
        print(f"\n{group}: CPU (ms) each event brings, in total and per {period * 1e3:.0f} ms bin from its lag")
        position = 0
        for name, lags in LAGS.items():
            values = coefficients[position : position + len(lags)]
            position += len(lags)
            print(f"  {name:12s} {values.sum():+7.3f}   lags {lags.start}..{lags.stop - 1}: "
                  + " ".join(f"{v:+.3f}" for v in values))  # fmt: skip
        rest = coefficients[-1]
        print(f"  {'no event':12s} {rest:+7.3f} per bin ({rest / (period * 1e3):.1%} of a core)")


def analyse(timeline: Path, kept: Path) -> None:
    """Print the shares and the fitted events of a kept fidelity run against its timeline."""
    times, cumulative = load_timeline(timeline)
    period = float(np.median(np.diff(times)))
    print(f"{len(times)} samples every {period * 1e3:.2f} ms (median) in {timeline}\n")
    print_shares(times, cumulative, kept)
    parts = [load_traces(path) for path in sorted(kept.glob("*part*.json"))]
    if parts:
        print_events(fit_events(times, cumulative, parts), period)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="write the next vllm serve's timeline to a CSV file")
    rec.add_argument("out", type=Path)
    rec.add_argument("--period", type=float, default=0.005, help="seconds between samples")
    ana = commands.add_parser("analyse", help="read a timeline against a kept sim_fidelity run")
    ana.add_argument("timeline", type=Path)
    ana.add_argument("kept", type=Path, help="the folder sim_fidelity.py --keep wrote")
    args = parser.parse_args()
    if args.command == "record":
        if not args.period > 0:
            parser.error(f"--period must be > 0 seconds, got {args.period}")
        record(args.out, args.period)
    else:
        for path in (args.timeline, args.kept):
            if not path.exists():
                parser.error(f"{path} does not exist")
        analyse(args.timeline, args.kept)


if __name__ == "__main__":
    main()
