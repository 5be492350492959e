"""Start, pin and stop server and client processes for the benchmarks (shared by serving.py and
sim_fidelity.py).

On 2 cores the load client competes with the server for the CPU, so the client runs on core 1 with
one thread (peers.md, "Benchmarking fairly on 2 cores"). A server runs on core 0 alone
(``SERVER_CORE``), or on both cores (``WHOLE_MACHINE``: as an operator runs it, the machine is
the server's, less what the client takes of core 1), with one math thread either way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO

SERVER_CORE, CLIENT_CORE = 0, 1
WHOLE_MACHINE = "0,1"


def pinned(cores: int | str, command: list[str]) -> list[str]:
    """``command`` under ``taskset -c cores`` (a core, or a list such as "0,1") when taskset exists
    and the machine has those cores."""
    highest = max(int(core) for core in str(cores).split(","))
    if shutil.which("taskset") and (os.cpu_count() or 1) > highest:
        return ["taskset", "-c", str(cores), *command]
    return list(command)


def single_thread_env() -> dict[str, str]:
    """This environment with one math thread and no model hub."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def idle_policy(sysfs: Path = Path("/sys")) -> str:
    """How this machine's idle cores wait, in words: the cpuidle driver and governor, and on a VM
    with the haltpoll driver its ``guest_halt_poll_ns``.

    Benchmarks print it beside the load average because it sets what waking a process on an idle
    core costs the waker: a core that halts at once (``guest_halt_poll_ns`` 0) must be sent an
    inter-processor interrupt, which on a virtual machine traps to the hypervisor; a core that
    polls a while first notices the wake-up without one.
    """

    def read(relative: str) -> str | None:
        try:
            return (sysfs / relative).read_text().strip()
        except OSError:
            return None

    cpuidle = "devices/system/cpu/cpuidle"
    driver = read(f"{cpuidle}/current_driver")
    if driver is None:
        return "idle cores: unknown (no cpuidle in /sys)"
    governor = read(f"{cpuidle}/current_governor") or read(f"{cpuidle}/current_governor_ro") or "unknown"
    words = f"idle cores: cpuidle driver {driver}, governor {governor}"
    poll_ns = read("module/haltpoll/parameters/guest_halt_poll_ns")
    if driver == "haltpoll" and poll_ns is not None:
        if poll_ns == "0":
            words += ", guest_halt_poll_ns 0 (an idle vCPU halts at once: waking a process there traps to the host)"
        else:
            words += f", guest_halt_poll_ns {poll_ns} (an idle vCPU polls that long before it halts)"
    return words


# The client half of send_workload, run on the client core in its own process (the load generator must not share
# the server's core or the benchmark's interpreter): a workload of [id, arrival s, prompt, output] rows.
_CLIENT = """
import json, sys
from course.serving.client import run_load
from course.workload import RequestSpec

url, workload, out, concurrency = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
specs = [RequestSpec(*row) for row in json.loads(open(workload).read())]
run_load(url, specs, concurrency=concurrency or None, progress=False, seed=101).save(out)
"""


def send_workload(port: int, rows: list[tuple[str, float, int, int]], out: Path, concurrency: int = 0) -> list:
    """Send ``rows`` (request id, arrival s from the start, prompt tokens, output tokens) to the server on
    ``port`` from the client core, each at its arrival time (at most ``concurrency`` in flight; 0: no cap),
    write their traces to ``out`` and return them. RuntimeError naming the client's error, or the first
    failed request's, when the client or a request failed."""
    from course.trace import load_traces

    out = Path(out)
    workload = out.with_suffix(".workload.json")
    workload.write_text(json.dumps([list(row) for row in rows]))
    command = [sys.executable, "-c", _CLIENT, f"http://127.0.0.1:{port}", str(workload), str(out), str(concurrency)]
    result = subprocess.run(pinned(CLIENT_CORE, command), env=single_thread_env(), capture_output=True, text=True)
    workload.unlink()
    if result.returncode != 0:
        raise RuntimeError(f"the load client failed: {result.stderr.strip()[-1500:]}")
    traces = load_traces(out)
    failed = [t for t in traces if not t.succeeded or not t.chunk_times]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(traces)} requests failed: {failed[0].error}")
    return traces


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    command: list[str], ready_url: str, log: IO, timeout: float = 120, cores: int | str = SERVER_CORE
) -> subprocess.Popen:
    """Start a server pinned to ``cores`` and wait until ``ready_url`` answers 200.

    Raises RuntimeError (with the tail of the log) if it exits or does not answer in time.
    """
    process = subprocess.Popen(pinned(cores, command), env=single_thread_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}: {_tail(log)}")
        try:
            with urllib.request.urlopen(ready_url, timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"{ready_url} did not answer within {timeout:.0f} s: {_tail(log)}")


def stop(process: subprocess.Popen) -> None:
    """Stop a server by its PID: TERM, then KILL (uvicorn can wait forever on a running generation)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        if process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


def process_tree(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """``pid`` and every process below it (its children's children too), from ``/proc``; [] when it is gone."""
    tree, stack = [], [pid]
    while stack:
        current = stack.pop()
        tasks = proc / str(current) / "task"
        if not tasks.is_dir():
            continue
        tree.append(current)
        for task in tasks.iterdir():
            try:
                stack += [int(child) for child in (task / "children").read_text().split()]
            except OSError:  # the thread ended meanwhile
                continue
    return tree


def process_title(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The first argument of ``pid``'s command line: what a process that retitles itself sets (vLLM's
    ``VLLM::Worker``); None when it is gone."""
    try:
        return (proc / str(pid) / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return None


def _schedstats(pid: int, proc: Path) -> list[tuple[int, int, int]] | None:
    """Each thread of ``pid``: its ``schedstat`` (nanoseconds on a CPU, nanoseconds runnable but waiting for one,
    times put on a CPU); None when the process is gone."""
    try:
        return [tuple(int(field) for field in (task / "schedstat").read_text().split()[:3])
                for task in (proc / str(pid) / "task").iterdir()]  # fmt: skip
    except (OSError, ValueError):  # it ended meanwhile
        return None


def cpu_seconds_outside(pid: int, model_processes: str, proc: Path = Path("/proc")) -> float | None:
    """The CPU time (s) that the threads of ``pid``'s process tree have run so far, less the processes whose
    command line starts with ``model_processes`` (vLLM's model runners retitle themselves ``VLLM::Worker``,
    vllm/v1/executor/multiproc_executor.py, 0.32.0): what the server's front end and scheduler have used.

    Read from each thread's ``schedstat`` (nanoseconds on the CPU; ``stat``'s ticks are 10 ms, too coarse
    for a few milliseconds per request); a thread that has ended no longer counts. None where ``/proc`` does
    not say."""
    nanoseconds, counted = 0, False
    for member in process_tree(pid, proc):
        title = process_title(member, proc)
        threads = None if title is None or title.startswith(model_processes) else _schedstats(member, proc)
        if threads:
            nanoseconds += sum(thread[0] for thread in threads)
            counted = True
    return nanoseconds / 1e9 if counted else None


@dataclass(frozen=True)
class CoreTime:
    """What a process's threads have had of the CPUs so far.

    Attributes:
        ran: seconds on a CPU.
        waited: seconds runnable but waiting for a CPU (another process had it): on a server pinned to one core,
            how much its processes take the core from one another.
        slices: times put on a CPU (each wake-up is at least one).
    """

    ran: float
    waited: float
    slices: int

    def since(self, earlier: CoreTime) -> CoreTime:
        """What was added after ``earlier`` (the same process read before)."""
        return CoreTime(self.ran - earlier.ran, self.waited - earlier.waited, self.slices - earlier.slices)


def core_time_by_process(pid: int, proc: Path = Path("/proc")) -> dict[str, CoreTime]:
    """:class:`CoreTime` of every process in ``pid``'s tree, by title (the last part of its first argument:
    ``python`` for vLLM's API server, ``VLLM::EngineCore``, ``VLLM::Worker``); processes of one title are summed.
    Read from each thread's ``schedstat``; empty when the server is gone."""
    times: dict[str, CoreTime] = {}
    for member in process_tree(pid, proc):
        title = process_title(member, proc)
        threads = None if title is None else _schedstats(member, proc)
        if threads is None:
            continue
        name = title.rsplit("/", 1)[-1]
        ran, waited, slices = (sum(column) for column in zip(*threads)) if threads else (0, 0, 0)
        earlier = times.get(name, CoreTime(0.0, 0.0, 0))
        times[name] = CoreTime(earlier.ran + ran / 1e9, earlier.waited + waited / 1e9, earlier.slices + slices)
    return times


def _tail(log: IO, chars: int = 1500) -> str:
    try:
        log.flush()
        log.seek(0)
        return log.read()[-chars:]
    except (OSError, ValueError):
        return "(no log)"


def values_at(runs: list[dict], *path: str) -> list:
    """``run[path[0]][path[1]]...`` of every run (``course bench --json`` summaries), in order."""
    values = []
    for run in runs:
        value = run
        for key in path:
            value = value[key]
        values.append(value)
    return values
