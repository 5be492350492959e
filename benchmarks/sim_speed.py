"""How fast is the scheduler simulator? (issue 4: 10,000 requests, mean 200 output tokens, continuous
batching, in <= 5 s on a 2-core CPU.)

Simulates Llama-3-8B on an H100 (roofline cost, vLLM V1 continuous batching with the H100-class API
server defaults of 8192 tokens and 1024 sequences per step) for 10,000 requests with log-normal
prompts (median 512 tokens) and uniform 100..300 output tokens (mean 200), under three loads:
Poisson at 30 and 60 requests/s, and all 10,000 at once. Reports the wall-clock time of the
simulation itself, simulated steps per second, and separately the time to summarise the result with
vLLM's metrics (``result.summary()``, what ``result.table()`` costs), and the peak resident memory of
the process (``ru_maxrss``, which includes the workload itself).

Issue 4 asked for 10,000 requests in <= 5 s; the next target is a day of a busy service, 1,000,000
requests (200 M output tokens) with its metrics in <= 60 s and <= 4 GiB:

    .venv/bin/python benchmarks/sim_speed.py [--repeats 3]
    .venv/bin/python benchmarks/sim_speed.py --requests 1000000 --repeats 1 --loads 30
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from course import hardware, kv, workload
from course.sim import RooflineCost, SimConfig, kv_blocks, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3, help="runs per load; the median is reported")
    parser.add_argument(
        "--loads", nargs="+", choices=("30", "60", "all"), default=["30", "60", "all"],
        help="which loads to run: Poisson 30 and 60 requests/s, all at once (default: all three)",
    )  # fmt: skip
    args = parser.parse_args()

    model, gpu = kv.get_model("Llama-3-8B"), hardware.gpu("H100-SXM")
    cost = RooflineCost(model, gpu)
    # KV budget: 90 % of the H100's 80 GB minus the 16 GB of weights, minus 4 GB for activations
    blocks = kv_blocks(0.9 * gpu.memory_bytes - model.num_params * 2 - 4e9, model)
    config = SimConfig(max_num_batched_tokens=8192, max_num_seqs=1024, num_blocks=blocks)
    prompts = workload.lognormal(512, 0.8, high=4096)
    outputs = workload.uniform(100, 300)
    loads = {
        "30": ("Poisson 30 req/s", lambda: workload.poisson(30, args.requests, prompts, outputs, seed=0)),
        "60": ("Poisson 60 req/s", lambda: workload.poisson(60, args.requests, prompts, outputs, seed=0)),
        "all": ("all at once", lambda: workload.all_at_once(args.requests, prompts, outputs, seed=0)),
    }
    print(f"{args.requests} requests, {config.describe()}; {cost.describe()}")
    print(f"{'load':18s} {'out tok':>10s} {'steps':>8s} {'sim s':>7s} {'cpu s':>7s} {'steps/s':>9s} {'tokens/s':>10s} "
          f"{'summary s':>10s} {'preempt':>8s} {'batch':>6s} {'peak RSS GiB':>13s}")  # fmt: skip
    for key in args.loads:
        name, make = loads[key]
        requests = make()  # one workload at a time: a million requests' specs are a few hundred MB
        sim_times, cpu_times, report_times = [], [], []
        for _ in range(args.repeats):
            cpu = time.process_time()
            result = simulate(requests, config, cost)
            sim_times.append(result.wall_seconds)
            cpu_times.append(time.process_time() - cpu)
            started = time.perf_counter()
            result.summary()
            report_times.append(time.perf_counter() - started)
        wall = statistics.median(sim_times)
        steps = len(result.steps)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # Linux: KiB
        print(
            f"{name:18s} {requests.total_output_tokens:10d} {steps:8d} {wall:7.2f} {statistics.median(cpu_times):7.2f} "
            f"{steps / wall:9.0f} "
            f"{requests.total_output_tokens / wall:10.0f} {statistics.median(report_times):10.2f} "
            f"{result.preemptions:8d} {result.mean_batch_size:6.0f} {peak:13.2f}",
            flush=True,
        )
        del result, requests
    print(
        "sim s: median wall-clock seconds of simulate(); cpu s: its CPU seconds (less sensitive to a busy "
        "machine); summary s: result.summary(); peak RSS: the process's "
        "ru_maxrss so far. Targets: 10,000 requests <= 5 s; 1,000,000 requests <= 60 s (sim + summary) and "
        "<= 4 GiB. Timings on a shared machine vary: quote them with the load average (uptime)."
    )


if __name__ == "__main__":
    main()
