"""Where the lab's ``vllm serve`` (vLLM's CPU build) spends its CPU time: idle, and under the lab's client load.

Run it with the oracle environment's interpreter and a py-spy binary (``pip install py-spy``; any folder)::

    .vllm-venv/bin/python benchmarks/vllm_cpu_profile.py --py-spy /path/to/py-spy [--idle 20] [--out DIR]

It serves the course's tiny model with the lab's arguments (:func:`course.vllm_lab.lab_serve_args`), warms it
up, then measures two windows:

* **idle**: nothing sent for ``--idle`` seconds. The CPU seconds of every thread of every process of the server
  (psutil, from ``/proc``), and a ``py-spy dump`` of each process: where each Python thread waits.
* **load**: the lab's ``client`` phase (:class:`course.vllm_lab.LabPlan`: Poisson arrivals, 4 requests/s,
  64-token prompts, 32 output tokens) sent with the course's load client, while ``py-spy record`` samples every
  process's Python threads (100 samples/s, active threads only: where CPU time goes). The CPU seconds of every
  thread again, per output token.

A thread py-spy does not list is a native thread (OpenMP workers, the allocator, ...); its CPU time is in the
per-thread table but no Python stack explains it. The report prints to stdout; ``--out`` also keeps py-spy's raw
samples and a JSON summary.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course import vllm_lab, workload  # noqa: E402
from course.models import save_tiny_model  # noqa: E402

MAX_MODEL_LEN, KV_BLOCKS, MAX_QUEUED = 512, 16, 16  # the recorded lab run's (benchmarks/record_vllm_lab.py)


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return "?"


def thread_cpu(root_pid: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (the thread's OS name, user + system CPU seconds so far), every thread of ``root_pid``
    and its descendants."""
    import psutil

    out = {}
    root = psutil.Process(root_pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            for t in process.threads():
                out[(process.pid, t.id)] = (_comm(process.pid, t.id), t.user_time + t.system_time)
        except psutil.NoSuchProcess:
            pass
    return out


def processes(root_pid: int) -> dict[int, str]:
    """pid -> a short description (its OS name and the start of its command line)."""
    import psutil

    root = psutil.Process(root_pid)
    out = {}
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            out[process.pid] = f"{process.name()} ({' '.join(process.cmdline())[:60]})"
    return out


def py_spy_threads(py_spy: str, pid: int) -> dict[int, dict]:
    """os thread id -> {"name", "active", "top": the innermost frames} of a process's Python threads (py-spy dump)."""
    done = subprocess.run([py_spy, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return {}
    threads = {}
    for t in json.loads(done.stdout):
        frames = [f"{f['name']} ({Path(f['filename']).name}:{f['line']})" for f in t.get("frames", [])[:4]]
        threads[t.get("os_thread_id") or t["thread_id"]] = {
            "name": t.get("thread_name") or "?", "active": t.get("active"), "top": frames,
        }  # fmt: skip
    return threads


def deltas(before: dict, after: dict) -> dict[tuple[int, int], tuple[str, float]]:
    return {key: (after[key][0], after[key][1] - before.get(key, ("", 0.0))[1]) for key in after}


def thread_table(window: dict, names: dict[int, dict[int, dict]], seconds: float, per: float | None = None) -> list:
    """Rows (pid, tid, OS name, Python thread name or "native", CPU s, share of one core, ms per output token)."""
    rows = []
    for (pid, tid), (comm, cpu) in sorted(window.items(), key=lambda kv: -kv[1][1]):
        python = names.get(pid, {}).get(tid, {}).get("name", "native (no Python frames)")
        rows.append((pid, tid, comm, python, cpu, cpu / seconds, cpu / per * 1e3 if per else None))
    return rows


SPIN_FRAMES = ("SpinCondition.wait", "sched_yield")  # vllm/distributed/device_communicators/shm_broadcast.py


def thread_samples(path: Path) -> dict[int, dict]:
    """py-spy's raw samples (recorded with ``--threads``) by OS thread id: {"name", "samples", "spinning": the
    samples with a shared-memory queue's spin-wait on the stack, "self": Counter of innermost frames}."""
    threads: dict[int, dict] = {}
    if not path.exists():
        return threads
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack.startswith("thread ("):
            continue
        head, _, rest = stack.partition(";")
        tid = int(head[len("thread (") : head.index(")")])
        name = head.partition("): ")[2]
        t = threads.setdefault(tid, {"name": name, "samples": 0, "spinning": 0, "self": collections.Counter()})
        n = int(count)
        frames = rest.split(";") if rest else []
        t["samples"] += n
        if any(frame.startswith(SPIN_FRAMES) for frame in frames):
            t["spinning"] += n
        if frames:
            t["self"][frames[-1]] += n
    return threads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--py-spy", default=shutil.which("py-spy"), help="the py-spy binary")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of the idle window")
    parser.add_argument("--out", type=Path, help="keep py-spy's samples and a JSON summary here")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for vllm serve (repeat)")
    args = parser.parse_args(argv)
    if not args.py_spy:
        print("py-spy not found: pip install py-spy, or give --py-spy PATH", file=sys.stderr)
        return 2
    if missing := vllm_lab.vllm_missing():
        print(missing, file=sys.stderr)
        return 2
    from course.serving.client import run_load

    work = Path(tempfile.mkdtemp(prefix="vllm-profile-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    model_dir = save_tiny_model(work / "tiny")
    serve_args = vllm_lab.lab_serve_args(model_dir, MAX_MODEL_LEN, KV_BLOCKS, MAX_QUEUED)
    env = dict(item.split("=", 1) for item in args.env)
    report: dict = {"command": " ".join(sys.argv), "env": env, "load_average_at_start": os.getloadavg()}
    with vllm_lab.VLLMServer(model_dir, work / "vllm.log", serve_args, env=env, start_timeout=900) as server:
        run_load(server.url, workload.all_at_once(2, 16, 8), progress=False)  # warm-up, as the lab does
        time.sleep(2)
        procs = processes(server.process.pid)
        print("processes:", json.dumps(procs, indent=1))

        # --- idle ---
        names = {pid: py_spy_threads(args.py_spy, pid) for pid in procs}
        before, t0 = thread_cpu(server.process.pid), time.perf_counter()
        time.sleep(args.idle)
        idle, idle_s = deltas(before, thread_cpu(server.process.pid)), time.perf_counter() - t0
        print(f"\nIDLE, {idle_s:.1f} s: {sum(c for _, c in idle.values()):.3f} CPU s in all")
        for pid, tid, comm, python, cpu, share, _ in thread_table(idle, names, idle_s)[:12]:
            print(f"  pid {pid} tid {tid} {comm:16s} {python:28s} {cpu:7.3f} s ({share:6.2%} of a core)")
        print("  where each Python thread of each process is while idle (py-spy dump, innermost frame first):")
        for pid, threads in names.items():
            for t in threads.values():
                print(f"    pid {pid} {t['name']:26s} active={t['active']}: {' <- '.join(t['top'][:3])}")
        report["idle"] = {"seconds": idle_s, "threads": thread_table(idle, names, idle_s), "py_spy_dump": names}

        # --- load ---
        plan = vllm_lab.LabPlan().client
        spies = {
            pid: subprocess.Popen(
                [
                    args.py_spy,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    "100",
                    "--threads",
                    "--format",
                    "raw",
                    "--output",
                    str(out / f"py_spy_{pid}.txt"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for pid in procs
        }
        time.sleep(2)  # py-spy attaches
        before, t0 = thread_cpu(server.process.pid), time.perf_counter()
        traces = run_load(server.url, workload.poisson(**plan), progress=False).traces
        load, load_s = deltas(before, thread_cpu(server.process.pid)), time.perf_counter() - t0
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)
        for spy in spies.values():
            spy.wait(timeout=60)
        tokens = sum(t.output_tokens for t in traces if t.succeeded)
        total = sum(c for _, c in load.values())
        print(f"\nLOAD ({len(traces)} requests, {tokens} output tokens, {load_s:.1f} s): {total:.3f} CPU s in all, "
              f"{total / tokens * 1e3:.2f} ms per output token")  # fmt: skip
        by_process = collections.Counter()
        for (pid, _), (_, cpu) in load.items():
            by_process[pid] += cpu
        for pid, cpu in by_process.most_common():
            print(f"  pid {pid} {procs.get(pid, '?')[:50]:50s} {cpu:7.3f} s = {cpu / tokens * 1e3:6.2f} ms/token")
        rows = thread_table(load, names, load_s, tokens)
        for pid, tid, comm, python, cpu, share, per in rows[:14]:
            print(f"  pid {pid} tid {tid} {comm:16s} {python:28s} {cpu:7.3f} s {per:6.2f} ms/token ({share:6.1%})")
        report["load"] = {"seconds": load_s, "output_tokens": tokens, "cpu_seconds": total, "threads": rows,
                          "by_process": dict(by_process), "py_spy": {}}  # fmt: skip
        # The threads that used the CPU, with py-spy's samples of each: what their time went to.
        print("\n  the busiest threads' py-spy samples (a sample is a thread py-spy found running or runnable):")
        spinning_cpu = 0.0
        for pid, tid, comm, python, cpu, _share, _per in rows:
            if cpu < 0.05 * total:
                break
            sampled = thread_samples(out / f"py_spy_{pid}.txt").get(tid)
            if not sampled or not sampled["samples"]:
                print(f"    pid {pid} tid {tid} {comm}: {cpu:.3f} CPU s, no Python samples (a native thread)")
                continue
            spin = sampled["spinning"] / sampled["samples"]
            spinning_cpu += spin * cpu
            print(
                f"    pid {pid} tid {tid} {comm} {python}: {cpu:.3f} CPU s; {sampled['samples']} samples, "
                f"{spin:.1%} of them in the shared-memory queue's spin-wait (~{spin * cpu:.2f} CPU s)"
            )
            for frame, n in sampled["self"].most_common(8):
                print(f"      {n / sampled['samples']:6.1%}  {frame[:110]}")
            report["load"]["py_spy"][f"{pid}/{tid}"] = {
                "samples": sampled["samples"], "spinning": sampled["spinning"],
                "self": sampled["self"].most_common(15),
            }  # fmt: skip
        report["load"]["spinning_cpu_seconds_estimate"] = spinning_cpu
        print(
            f"\n  spinning, estimated: {spinning_cpu:.2f} of {total:.2f} CPU s ({spinning_cpu / total:.0%}), "
            f"{spinning_cpu / tokens * 1e3:.2f} ms per output token"
        )
    report["load_average_at_end"] = os.getloadavg()
    (out / "vllm_cpu_profile.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nload average {report['load_average_at_start']} -> {report['load_average_at_end']}; kept in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
