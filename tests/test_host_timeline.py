"""benchmarks/host_timeline.py: which of vLLM's processes a thread's CPU time goes to, and the fit that says when
around a request's events that time is spent."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import host_timeline as timeline  # noqa: E402  (benchmarks/ is not a package)

from tests.test_benchmark_processes import fake_proc  # noqa: E402


def test_each_thread_counts_for_its_process_group(tmp_path):
    # vllm serve (two threads) -> the engine core -> the worker, and a helper process the server started
    proc = fake_proc(tmp_path, {
        100: ("python", [200, 400], {100: 3_000_000, 101: 1_000_000}),
        200: ("VLLM::EngineCore", [300], {200: 2_500_000}),
        300: ("VLLM::Worker", [], {300: 90_000_000, 301: 5_000_000}),
        400: ("python", [], {400: 7_000_000}),
    })  # fmt: skip
    threads = timeline.open_threads(100, proc)
    assert timeline.read_sums(threads) == [4_000_000, 2_500_000, 95_000_000, 7_000_000]  # api, core, worker, other


def test_the_server_is_found_by_either_command_line(tmp_path):
    for pid, args in {10: [b"python", b"app.py"], 11: [b"/venv/bin/vllm", b"serve", b"tiny"]}.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"\0".join(args) + b"\0")
    assert timeline.find_server(tmp_path) == 11
    (tmp_path / "11" / "cmdline").write_bytes(b"python\0-m\0vllm.entrypoints.cli.main\0serve\0tiny\0")
    assert timeline.find_server(tmp_path) == 11
    (tmp_path / "11" / "cmdline").write_bytes(b"python\0-m\0vllm.entrypoints.cli.main\0bench\0")
    assert timeline.find_server(tmp_path) is None


def synthetic_run(seed: int = 0, period: float = 0.005, seconds: float = 60.0):
    """A timeline whose API server spends 1.5 ms in the bin after each arrival, 0.2 ms in the bin of each finish
    and 0.5 ms in every bin; the other groups nothing. Returns (times, cumulative ms per group, traces)."""
    rng = np.random.default_rng(seed)
    times = np.arange(0.0, seconds, period) + 1000.0
    arrivals = np.sort(rng.uniform(times[10], times[-400], 600))
    traces = [{"send_time": float(a), "chunk_times": list(a + 0.02 + 0.006 * np.arange(1, 9))} for a in arrivals]
    per_bin = np.full(len(times) - 1, 0.5)
    for trace in traces:
        per_bin[np.searchsorted(times, trace["send_time"], side="right") - 1 + 1] += 1.5
        per_bin[np.searchsorted(times, trace["chunk_times"][-1], side="right") - 1] += 0.2
    api = np.concatenate([[0.0], np.cumsum(per_bin)])
    zero = np.zeros_like(times)
    return times, {"api": api, "core": zero, "worker": zero, "other": zero}, traces


def test_the_fit_finds_how_much_cpu_each_event_brings_and_when():
    times, cumulative, traces = synthetic_run()
    fitted = timeline.fit_events(times, cumulative, [traces[:300], traces[300:]])["api"]
    names = [(name, lag) for name, lags in timeline.LAGS.items() for lag in lags]
    arrival = {lag: fitted[names.index(("arrival", lag))] for lag in timeline.LAGS["arrival"]}
    assert arrival[1] == pytest.approx(1.5, abs=0.05) and abs(arrival[0]) < 0.05 and abs(arrival[2]) < 0.05
    assert fitted[names.index(("finish", 0))] == pytest.approx(0.2, abs=0.05)
    assert fitted[-1] == pytest.approx(0.5, abs=0.02)


def test_shares_are_the_cpu_over_the_span_of_the_traces():
    times, cumulative, traces = synthetic_run(seconds=20.0)
    spent = timeline.shares(times, cumulative, traces)
    assert spent["core"] == 0.0
    assert spent["api"] == pytest.approx(spent["wall"] / 5.0 * 0.5 + 1.7 * len(traces), rel=0.02)
    assert timeline.shares(times, cumulative, [{"send_time": 0.0, "chunk_times": [0.001]}]) is None
