"""``course bench`` and ``vllm bench serve``, each driving its own load on the same vLLM server, agree?

The oracle tests show that the course's metric code gives vLLM's benchmark figures exactly when fed
the same chunk times. This benchmark checks the other half: the two *clients*, each sending its own
requests (same lengths, same closed-loop concurrency, ``ignore_eos``), alternated ``--repeats`` times
against one ``vllm serve`` on the course's tiny model. For TTFT, TPOT and ITL (p50 and p90) it prints
each tool's figures over the repeats and whether the two ranges overlap: on a noisy machine two runs of
the *same* tool differ, so agreement means "within the spread of repeated runs", not equality.

Run it in the oracle environment (``bin/vllm-env`` builds it), where both tools are installed:

    .vllm-venv/bin/python benchmarks/bench_agreement.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

METRICS = ("ttft", "tpot", "itl")
PERCENTILES = (50, 90)


def _vllm_bench(url: str, model_dir: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    from course.metrics import summarize
    from course.vllm_lab import bench_traces

    result = out / f"vllm-bench-{len(list(out.glob('vllm-bench-*')))}.json"
    subprocess.run(
        [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
         "--model", "tiny", "--tokenizer", str(model_dir), "--dataset-name", "random",
         "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
         "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency), "--ignore-eos",
         "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", result.name],
        check=True, capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    return _figures(summarize(bench_traces(json.loads(result.read_text())), percentiles=PERCENTILES))


def _course_bench(url: str, args: argparse.Namespace) -> dict[str, float]:
    from course.metrics import summarize
    from course.serving.client import run_load
    from course.workload import all_at_once

    work = all_at_once(args.num_prompts, args.input_len, args.output_len)
    run = run_load(url, work, model="tiny", concurrency=args.concurrency, progress=False)
    failed = [t.error for t in run.traces if t.error]
    if failed:
        raise RuntimeError(f"course bench: {len(failed)} requests failed, first: {failed[0]}")
    return _figures(summarize(run.traces, percentiles=PERCENTILES))


def _figures(summary) -> dict[str, float]:
    return {f"{m} p{q}": getattr(summary, m).percentiles[q] * 1e3 for m in METRICS for q in PERCENTILES}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)

    from course.models import save_tiny_model
    from course.vllm_lab import VLLMServer, vllm_missing

    missing = vllm_missing()
    if missing:
        sys.exit(f"{missing}\nRun this benchmark with the oracle environment's Python (bin/vllm-env builds it).")
    runs: dict[str, list[dict[str, float]]] = {"course bench": [], "vllm bench serve": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = save_tiny_model(tmp / "tiny")
        server_args = ["--dtype", "float32", "--max-model-len", "2048"]
        with VLLMServer(model_dir, tmp / "vllm.log", server_args, env={"VLLM_CPU_KVCACHE_SPACE": "1"}) as server:
            _course_bench(server.url, argparse.Namespace(**{**vars(args), "num_prompts": 4}))  # warm-up
            for _ in range(args.repeats):  # alternated, so that a slow spell hits both tools
                runs["vllm bench serve"].append(_vllm_bench(server.url, model_dir, args, tmp))
                runs["course bench"].append(_course_bench(server.url, args))
    load = os.getloadavg()[0]
    verdicts = {}
    for key in runs["course bench"][0]:
        ours = [r[key] for r in runs["course bench"]]
        theirs = [r[key] for r in runs["vllm bench serve"]]
        verdicts[key] = max(min(ours), min(theirs)) <= min(max(ours), max(theirs))
    if args.json:
        print(json.dumps({"runs": runs, "overlap": verdicts, "load_1min": load, "args": vars(args)}))
        return verdicts
    print(f"vllm serve (CPU build) on the tiny model, {args.num_prompts} requests x {args.repeats} repeats per tool, "
          f"concurrency {args.concurrency}, {args.input_len} -> {args.output_len} tokens; load average {load:.2f} "
          f"on {os.cpu_count()} CPUs")  # fmt: skip
    width = 8 * args.repeats + 2  # "1234.56, " per repeat
    print(f"{'metric (ms)':<12}{'course bench':>{width}}{'vllm bench serve':>{width}}  ranges overlap")
    for key, agree in verdicts.items():
        ours = ", ".join(f"{r[key]:.2f}" for r in runs["course bench"])
        theirs = ", ".join(f"{r[key]:.2f}" for r in runs["vllm bench serve"])
        print(f"{key:<12}{ours:>{width}}{theirs:>{width}}  {'yes' if agree else 'NO'}")
    if not all(verdicts.values()):
        print("Ranges that do not overlap: the two clients measured differently beyond this run's spread (or the "
              "machine's noise moved between runs; rerun on a quieter machine before concluding).")  # fmt: skip
    return verdicts


if __name__ == "__main__":
    main()
