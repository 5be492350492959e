"""``course simulate``: run the scheduler simulator from flags or a config file.

Examples::

    course simulate --requests 2000 --rate 20 --prompt-tokens lognormal:512:0.8 --output-tokens 200 \\
        --gpu H100-SXM --model llama-3-8b --num-blocks 20000 --slo-ttft-ms 500 --slo-tpot-ms 50
    course simulate --trace run.json --cost linear --linear 0.004,2e-5,3e-4,1e-7 --json
    course simulate --config experiment.toml --scheduler static
    course simulate --model Llama-3.1-70B --gpu H100-SXM --tp 4 --max-model-len 8192 --replicas 4 \\
        --router least-outstanding --rate 20
    course simulate --model Llama-3.1-70B --max-model-len 8192 --slo-ttft-ms 1000 --slo-tpot-ms 50 \\
        --plan-rate 20 --plan-gpus H100-SXM=3.0,H200-SXM=3.8 --plan-tp 4,8

The vLLM release whose defaults, block size and KV budget apply is ``--vllm`` (0.34, the newest, by
default; 0.32, the runnable CPU build's, with ``--vllm 0.32``), named in every printout
(:mod:`course.vllm_release`).

A config file (TOML or JSON) holds the same settings as the flags, with underscores: scheduler
settings at the top level (``scheduler``, ``max_num_seqs``, ``num_blocks``, ``vllm``, ...) and the tables
``[workload]``, ``[cost]`` (with ``tp``, ``pp``, ``interconnect``), ``[slo]`` and ``[fleet]`` (``replicas``,
``router``); flags given on the command line win over the file. A model that does not fit on ``--tp``
GPUs is refused with the smallest tensor-parallel size that fits (:mod:`course.sim.parallel`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from course import geometry, hardware, workload
from course.kv import vllm
from course.kv.catalogue import catalogue, get_model
from course.sim import parallel
from course.sim.config import SCHEDULERS, SimConfig, kv_blocks, read_config_file
from course.vllm_release import NEWEST, RELEASES, RUNNABLE, get_release

MODELS = tuple(catalogue())  # the one model catalogue (course/data/kv_models.json), as course kv reads it
DEFAULTS = {
    "workload": {"requests": 1000, "rate": 10.0, "burstiness": 1.0, "prompt_tokens": "lognormal:512:0.8:8192",
                 "output_tokens": "uniform:100:300", "seed": 0, "trace": None, "system_prompt_tokens": 0,
                 "front_tokens": 0, "max_tokens": None},
    "cost": {"kind": "roofline", "gpu": "H100-SXM", "model": "llama-3-8b", "num_params": None,
             "flops_efficiency": None, "bandwidth_efficiency": None, "step_overhead_ms": 0.0, "linear": None,
             "tp": 1, "pp": 1, "interconnect": None},
    "slo": {"ttft_ms": None, "tpot_ms": None},
    "fleet": {"replicas": 1, "router": "round-robin"},
}  # fmt: skip
SCHEDULER_FLAGS = (
    "scheduler",
    "max_num_seqs",
    "max_num_batched_tokens",
    "chunked_prefill",
    "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive",
    "reserve_full_isl",
    "max_num_queued_reqs",
    "block_size",
    "num_blocks",
    "enable_prefix_caching",
    "watermark",
    "max_model_len",
    "decode_after_prefill",
    "async_scheduling",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``course simulate`` (every default None, so the config file can fill them), in their
    ``--help`` groups."""
    parser.add_argument("--config", help="TOML or JSON file with the settings (flags override it)")
    _add_workload_arguments(parser)
    _add_scheduler_arguments(parser)
    _add_cost_arguments(parser)
    _add_plan_arguments(parser)
    _add_fleet_arguments(parser)
    _add_output_arguments(parser)


def _switch(group: argparse._ArgumentGroup, flag: str, dest: str, value: bool, help: str | None = None) -> None:
    """A flag that sets ``dest`` to ``value``; None when not given, so that the config file can set it."""
    group.add_argument(flag, dest=dest, action="store_const", const=value, default=None, help=help)


def _add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workload (generated, or replayed from a course bench trace file)")
    w.add_argument("--trace", help="replay the arrivals and token counts of a trace JSON file from course bench")
    w.add_argument("--requests", type=int, help="number of generated requests (default 1000)")
    w.add_argument("--rate", type=float, help="arrivals per second; 0 = all at t=0 (default 10)")
    w.add_argument("--burstiness", type=float, help="gamma shape of the gaps: 1 Poisson, <1 burstier (default 1)")
    w.add_argument(
        "--prompt-tokens", help="N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA[:MAX] (default lognormal:512:0.8:8192)"
    )
    w.add_argument("--output-tokens", help="same forms as --prompt-tokens (default uniform:100:300)")
    w.add_argument("--system-prompt-tokens", type=int, help="the same system prompt of N tokens before every prompt")
    w.add_argument("--front-tokens", type=int, help="N unique tokens (a timestamp) before the system prompt")
    w.add_argument("--max-tokens", type=int, help="cap every output at N tokens")
    w.add_argument("--seed", type=int, help="seed of the generated workload (default 0)")


def _add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    s = parser.add_argument_group("scheduler (vLLM's names and defaults)")
    s.add_argument(
        "--vllm",
        choices=[r.short for r in RELEASES] + [r.version for r in RELEASES],
        help=f"the vLLM release whose defaults, block size and KV budget apply: {NEWEST.short} (default, the newest) "
        f"or {RUNNABLE.short} (the runnable CPU build's)",
    )
    s.add_argument("--scheduler", choices=SCHEDULERS, help="continuous (vLLM V1), prefill-first (V0) or static")
    s.add_argument(
        "--max-num-seqs", type=int, help="most running requests (static: batch size; default vLLM's for the --gpu)"
    )
    s.add_argument(
        "--max-num-batched-tokens", type=int, help="token budget per step (default vLLM's for the --gpu: 8192 or 2048)"
    )
    _switch(s, "--no-chunked-prefill", "chunked_prefill", False)
    s.add_argument(
        "--long-prefill-token-threshold", type=int, help="most tokens per request per step, unless alone (0 = off)"
    )
    _switch(
        s, "--long-prefill-token-threshold-adaptive", "long_prefill_token_threshold_adaptive", True,
        "never cap a request below budget // requests (vLLM's option)",
    )  # fmt: skip
    _switch(
        s, "--no-reserve-full-isl", "reserve_full_isl", False,
        "admit when the first chunk fits (vLLM 0.11); vLLM 0.32 waits until the whole prompt fits",
    )  # fmt: skip
    s.add_argument(
        "--max-num-queued-reqs",
        type=int,
        help="shed (HTTP 503) requests arriving while this many are unfinished (vLLM's load shedding; default off)",
    )
    s.add_argument(
        "--block-size",
        type=int,
        help=f"tokens per KV block (default the release's: {vllm.GPU_BLOCK_SIZE} in 0.34, {vllm.BLOCK_SIZE} in 0.32)",
    )
    s.add_argument(
        "--num-blocks",
        type=int,
        help="KV blocks in the cache (default: the release's budget for --model on --gpu: 0.34 measures it after "
        "warm-up at utilization 1.0, 0.32 estimates it at 0.92)",
    )
    s.add_argument("--kv-gib", type=float, help="size the cache from a KV budget in GiB instead of --num-blocks")
    _switch(s, "--prefix-caching", "enable_prefix_caching", True, "reuse cached prompt blocks (vLLM's default: on)")
    _switch(s, "--no-prefix-caching", "enable_prefix_caching", False)
    s.add_argument(
        "--watermark",
        type=float,
        help="fraction of blocks kept free when admitting while others run (V1: 0, off; V0's prefill-first: 0.01)",
    )
    _switch(
        s, "--no-async-scheduling", "async_scheduling", False,
        "schedule each step after the last one's output is processed (vLLM's GPU default is async: "
        "a finished request holds its blocks and slot one step longer)",
    )  # fmt: skip
    s.add_argument("--max-model-len", type=int, help="reject requests whose prompt + output exceed this")
    _switch(
        s, "--decode-after-prefill", "decode_after_prefill", True,
        "prefill-first: one decode step after every prefill step (module 2's server loop)",
    )  # fmt: skip


def _add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("cost model")
    c.add_argument("--cost", dest="kind", choices=("roofline", "linear"), help="step-time model (default roofline)")
    c.add_argument("--gpu", help=f"roofline GPU: {', '.join(hardware.GPUS)} (default H100-SXM)")
    c.add_argument(
        "--model", help="roofline model: a catalogue name (course kv --list) or a config.json path (with --num-params)"
    )
    c.add_argument("--num-params", type=float, help="parameter count of a --model config.json")
    c.add_argument("--flops-efficiency", type=float, help="share of peak FLOP/s reached (default 0.75)")
    c.add_argument("--bandwidth-efficiency", type=float, help="share of peak bandwidth reached (default 0.77)")
    c.add_argument("--step-overhead-ms", type=float, help="fixed ms per step added to the roofline")
    c.add_argument(
        "--linear",
        help="linear model A,B,C,D[,F[,G]] in seconds: A + B*prefill + C*decode + D*KV tokens read + F*prefill "
        "attention pairs (a prompt of n tokens: n(n+1)/2) + G on a step of two or more token rows",
    )
    c.add_argument("--tp", type=int, help="tensor-parallel GPUs per replica (vLLM's --tensor-parallel-size; default 1)")
    c.add_argument(
        "--pp", type=int, help="pipeline-parallel stages per replica (vLLM's --pipeline-parallel-size; default 1)"
    )
    c.add_argument(
        "--interconnect",
        choices=("nvlink", "pcie", "network"),
        help="link the TP group all-reduces over (default: the fastest that joins --tp GPUs of the --gpu)",
    )


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    p = parser.add_argument_group(
        "capacity search: the cheapest GPU, TP, PP and replicas that hold the SLOs (needs --slo-ttft-ms, --slo-tpot-ms)"
    )
    p.add_argument("--plan-rate", type=float, help="target arrival rate (req/s) of the workload; turns the search on")
    p.add_argument(
        "--plan-gpus", help="GPUs and their $ per GPU-hour, e.g. H100-SXM=3.0,H200-SXM=3.8 (default H100-SXM=3.0)"
    )
    p.add_argument("--plan-tp", help="TP sizes to try, e.g. 2,4,8 (default: every size vLLM accepts up to 8)")
    p.add_argument("--plan-pp", help="PP sizes to try, e.g. 1,2 (default 1)")
    p.add_argument("--plan-headroom", type=float, help="share of each replica's capacity kept free (default 0)")


def _add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    f = parser.add_argument_group("replicas behind a router")
    f.add_argument("--replicas", type=int, help="data-parallel replicas, each --tp x --pp GPUs (default 1)")
    f.add_argument(
        "--router",
        choices=("round-robin", "least-outstanding", "prefix-aware"),
        help="how requests are spread over the replicas (default round-robin)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    o = parser.add_argument_group("SLOs and output")
    o.add_argument("--slo-ttft-ms", dest="ttft_ms", type=float, help="TTFT SLO for goodput (ms)")
    o.add_argument("--slo-tpot-ms", dest="tpot_ms", type=float, help="TPOT SLO for goodput (ms)")
    o.add_argument("--json", action="store_true", help="print JSON instead of the table")
    o.add_argument("--save-traces", help="write the simulated requests as a trace file (for course summarize)")


def _lengths(text: str | int, what: str) -> workload.LengthSampler:
    """Parse ``N``, ``uniform:LOW:HIGH`` or ``lognormal:MEDIAN:SIGMA[:MAX]``."""
    if isinstance(text, int):
        return workload.fixed(text)
    parts = str(text).split(":")
    try:
        if len(parts) == 1:
            return workload.fixed(int(parts[0]))
        if parts[0] == "uniform" and len(parts) == 3:
            return workload.uniform(int(parts[1]), int(parts[2]))
        if parts[0] == "lognormal" and len(parts) in (3, 4):
            high = int(parts[3]) if len(parts) == 4 else None
            return workload.lognormal(float(parts[1]), float(parts[2]), high=high)
    except ValueError as err:
        raise ValueError(f"{what} {text!r}: {err}") from None
    raise ValueError(f"{what} {text!r}: use N, uniform:LOW:HIGH or lognormal:MEDIAN:SIGMA[:MAX]")


def settings_from(args: argparse.Namespace) -> dict:
    """Defaults, then the config file, then the flags given on the command line."""
    settings = {key: dict(value) for key, value in DEFAULTS.items()}
    settings["scheduler"] = {}
    if args.config:
        _merge_config_file(settings, args.config)
    flags = vars(args)
    for section in ("workload", "cost", "slo", "fleet"):
        for key in DEFAULTS[section]:
            if flags.get(key) is not None:
                settings[section][key] = flags[key]
    for key in (*SCHEDULER_FLAGS, "kv_gib", "vllm"):
        if flags.get(key) is not None:
            settings["scheduler"][key] = flags[key]
    return settings


def _merge_config_file(settings: dict, path: str) -> None:
    """A config file's tables over ``settings``: its [workload], [cost], [slo] and [fleet] tables (known keys
    only), and every top-level key a scheduler setting."""
    data = read_config_file(path)
    for section in ("workload", "cost", "slo", "fleet"):
        given = data.pop(section, {})
        unknown = set(given) - set(DEFAULTS[section])
        if unknown:
            raise ValueError(f"{path}: unknown [{section}] settings {sorted(unknown)}")
        settings[section].update(given)
    for key in ("kv_gib", "vllm"):
        if key in data:
            settings["scheduler"][key] = data.pop(key)
    settings["scheduler"].update(data)


def workload_from(w: dict) -> workload.Workload:
    """The requests of a ``[workload]`` settings table (generated, or replayed from a trace file)."""
    from course.sim.workload_variants import cap_output, with_system_prompt

    if w["trace"]:
        from course.trace import load_traces

        requests = workload.from_traces(load_traces(w["trace"]), name=f"replay of {Path(w['trace']).name}")
    elif w["rate"] and w["rate"] > 0:
        requests = workload.bursty(
            w["rate"],
            w["requests"],
            _lengths(w["prompt_tokens"], "prompt tokens"),
            _lengths(w["output_tokens"], "output tokens"),
            burstiness=w["burstiness"],
            seed=w["seed"],
        )
    else:
        requests = workload.all_at_once(
            w["requests"],
            _lengths(w["prompt_tokens"], "prompt tokens"),
            _lengths(w["output_tokens"], "output tokens"),
            seed=w["seed"],
        )
    if w["system_prompt_tokens"] or w["front_tokens"]:
        requests = with_system_prompt(requests, w["system_prompt_tokens"], front_tokens=w["front_tokens"])
    if w["max_tokens"]:
        requests = cap_output(requests, w["max_tokens"])
    return requests


def build(settings: dict):
    """(workload, SimConfig, cost model, SLOs in seconds) from merged settings."""
    requests = workload_from(settings["workload"])
    c = settings["cost"]
    model = None if c["kind"] == "linear" else _model(c["model"], c["num_params"])
    cost = _linear_cost(c) if model is None else _roofline_cost(c, model)
    config = _sim_config(settings["scheduler"], c, model)
    slo = settings["slo"]
    slos = {
        "ttft_slo": slo["ttft_ms"] / 1e3 if slo["ttft_ms"] else None,
        "tpot_slo": slo["tpot_ms"] / 1e3 if slo["tpot_ms"] else None,
    }
    return requests, config, cost, slos


def _linear_cost(c: dict):
    """The ``[cost]`` table's ``--cost linear`` model (:class:`course.sim.cost.LinearCost`)."""
    from course.sim.cost import LinearCost

    if not c["linear"]:
        raise ValueError(
            "--cost linear needs --linear A,B,C,D[,F[,G]] (seconds per step, prefill token, decode token, KV token, "
            "prefill attention pair, and step of two or more token rows)"
        )
    values = c["linear"] if isinstance(c["linear"], list) else str(c["linear"]).split(",")
    if len(values) not in (4, 5, 6):
        raise ValueError(f"--linear needs four to six numbers A,B,C,D[,F[,G]]; got {c['linear']!r}")
    try:
        numbers = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"--linear takes numbers in seconds, A,B,C,D[,F[,G]]; got {c['linear']!r}") from None
    cost = LinearCost(*numbers[:4], **dict(zip(("f", "g"), numbers[4:])))
    if c["tp"] * c["pp"] > 1:
        raise ValueError(
            "--tp/--pp with --cost linear: a linear cost is fitted on one deployment and already holds its "
            "parallelism; fit it on the TP/PP server, or use --cost roofline"
        )
    return cost


def _roofline_args(c: dict) -> dict:
    """The ``[cost]`` table's settings of :class:`course.sim.cost.RooflineCost`: step overhead (s) and the
    efficiencies given."""
    efficiency = {key: c[key] for key in ("flops_efficiency", "bandwidth_efficiency") if c[key] is not None}
    return {"step_overhead": (c["step_overhead_ms"] or 0.0) / 1e3, **efficiency}


def _roofline_cost(c: dict, model: geometry.ModelGeometry):
    """The roofline of ``model`` on one ``--gpu``, or spread over ``--tp`` x ``--pp`` of them
    (:func:`course.sim.parallel.parallel_cost`)."""
    from course.sim.cost import RooflineCost

    if c["tp"] * c["pp"] > 1:
        return parallel.parallel_cost(
            model, c["gpu"], c["tp"], c["pp"], interconnect=c["interconnect"], **_roofline_args(c)
        )
    return RooflineCost(model, hardware.gpu(c["gpu"]), **_roofline_args(c))


def _sim_config(scheduler: dict, c: dict, model: geometry.ModelGeometry | None) -> SimConfig:
    """``vllm serve``'s settings on the ``--gpu`` (:meth:`SimConfig.vllm_defaults`; the batch defaults are the
    same in both releases for every catalogue GPU) overridden by the scheduler settings given, with the
    release's block size and the KV blocks of ``--num-blocks``, of ``--kv-gib`` per GPU, or else of the
    release's budget; ``--pp`` batches per round (:func:`course.sim.parallel.pipeline_config`)."""
    scheduler = dict(scheduler)
    kv_gib = scheduler.pop("kv_gib", None)
    release = get_release(scheduler.pop("vllm", None))
    gpu = hardware.gpu(c["gpu"])
    if "block_size" not in scheduler:
        is_mla = model.is_mla if model is not None else False
        scheduler["block_size"] = vllm.default_block_size(gpu, is_mla, release=release)
    if kv_gib is not None:
        model = model or _model(c["model"], c["num_params"])
        # --kv-gib is per GPU: what one GPU of the heaviest stage caches per token
        per_gpu = parallel.shard_geometry(parallel.heaviest_stage(model, c["pp"]), c["tp"])
        scheduler["num_blocks"] = kv_blocks(kv_gib * 2**30, per_gpu, scheduler["block_size"])
    elif "num_blocks" not in scheduler:
        model = model or _model(c["model"], c["num_params"])
        scheduler["num_blocks"] = _budget_blocks(model, gpu, scheduler, c["tp"], c["pp"], release.version)
    return parallel.pipeline_config(SimConfig.vllm_defaults(gpu, **scheduler), c["pp"])


def _model(name: str, num_params: float | None) -> geometry.ModelGeometry:
    """A catalogue model or a config.json (a config needs --num-params unless its count can be derived)."""
    try:
        model = get_model(name, num_params=int(num_params) if num_params else None)
    except ValueError as err:
        if Path(name).exists():
            raise
        raise ValueError(
            f"unknown model {name!r}: use a catalogue name ({', '.join(MODELS)}) or the path of a config.json"
        ) from err
    if model.num_params is None:
        raise ValueError(f"--model {name}: the config's parameter count cannot be derived; give --num-params")
    return model


def _budget_blocks(
    model: geometry.ModelGeometry,
    gpu: hardware.HardwareSpec,
    scheduler: dict,
    tp: int = 1,
    pp: int = 1,
    release: str = RUNNABLE.version,
) -> int:
    """vLLM ``release``'s block count per GPU for ``model`` on ``tp x pp`` of ``gpu`` at its default
    utilization (0.34: measured after warm-up at 1.0; 0.32: the estimate at 0.92), with the reference log's
    activation peak and non-torch memory (:data:`course.kv.vllm.REFERENCE_LOG`). A model vLLM would not
    start (one ``max_model_len`` request does not fit) is refused with the smallest tensor-parallel size
    that fits."""
    budget_args = {
        "max_model_len": scheduler.get("max_model_len") or model.max_position_embeddings or 8192,
        "block_size": scheduler.get("block_size", vllm.default_block_size(gpu, model.is_mla, release=release)),
        "activation_bytes": vllm.REFERENCE_LOG.activation_bytes,
        "non_torch_bytes": vllm.REFERENCE_LOG.non_torch_bytes,
        "release": release,
    }
    b = parallel.parallel_budget(model, gpu, tp, pp, **budget_args)
    if not b.fits_one_request:
        message = parallel.does_not_fit_message(model, gpu, tp, pp, **budget_args)
        raise ValueError(f"{message} (or give --num-blocks / --kv-gib per GPU)")
    return b.num_blocks


def run(args: argparse.Namespace) -> int:
    """Entry point of ``course simulate``."""
    from course.sim.simulator import simulate

    settings = settings_from(args)
    if getattr(args, "plan_rate", None) is not None:
        return _run_plan(args, settings)
    requests, config, cost, slos = build(settings)
    if not len(requests):
        raise ValueError("the workload has no requests")
    fleet = settings["fleet"]
    if fleet["replicas"] != 1 or fleet["router"] != "round-robin":
        return _run_fleet(args, requests, config, cost, slos, fleet["replicas"], fleet["router"], settings)
    result = simulate(requests, config, cost, name=f"{config.scheduler}: {requests.name}")
    release = _release_named(settings)
    _report(args, result, requests, config, slos, f"{release}: {config.describe()}; {result.config['cost']}", release)
    if not args.json:
        if result.failed:
            reason = next(r.error for r in result.requests if r.error)
            print(f"{result.failed} requests could not run, e.g. {reason}")
        print(f"simulated {result.busy_seconds:.2f} s of engine time in {result.wall_seconds:.2f} s")
    return 0


def _release_named(settings: dict) -> str:
    """The release whose defaults, block size and KV budget the run follows, as printouts name it:
    "vLLM 0.34.0 rules"."""
    return f"{get_release(settings['scheduler'].get('vllm')).name} rules"


def _report(
    args: argparse.Namespace, result, requests, config: SimConfig, slos: dict, setup: str, release: str = ""
) -> None:
    """Save the traces if asked, then print the result as JSON or as a table under ``setup``."""
    if args.save_traces:
        from course.trace import save_traces

        save_traces(args.save_traces, result.traces, simulator=config.to_dict(), workload=requests.name)
    if args.json:
        print(json.dumps({**result.to_dict(**slos), "vllm": release.removesuffix(" rules")}, indent=1))
    else:
        print(f"{requests.name}: {len(requests)} requests")
        print(setup)
        print(result.table(**slos))


def _run_fleet(
    args: argparse.Namespace, requests, config: SimConfig, cost, slos: dict, replicas: int, router: str, settings: dict
) -> int:
    """``course simulate --replicas N [--router ...]``: the replicas behind the router (course.sim.fleet)."""
    from course.sim.fleet import simulate_fleet

    result = simulate_fleet(requests, replicas, config, cost, router)
    described = cost.describe() if hasattr(cost, "describe") else cost
    release = _release_named(settings)
    _report(args, result, requests, config, slos, f"{release}; each replica: {config.describe()}; {described}", release)
    return 0


def _int_list(text: str | None, what: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in str(text).split(","))
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{what} takes positive integers, got {text!r}")
    return values


def _run_plan(args: argparse.Namespace, settings: dict) -> int:
    """``course simulate --plan-rate R``: the capacity search of course.sim.fleet.plan_capacity."""
    from course.sim.fleet import plan_capacity
    from course.slo import SLO

    slo = settings["slo"]
    if not slo["ttft_ms"] or not slo["tpot_ms"]:
        raise ValueError("--plan-rate needs the SLOs to hold: give --slo-ttft-ms and --slo-tpot-ms")
    if args.plan_rate <= 0:
        raise ValueError(f"--plan-rate must be a positive rate (req/s), got {args.plan_rate}")
    c = settings["cost"]
    if c["kind"] != "roofline":
        raise ValueError("--plan-rate sizes GPUs from their datasheets: use --cost roofline")
    prices = {}
    for item in (args.plan_gpus or "H100-SXM=3.0").split(","):
        name, _, price = item.partition("=")
        try:
            prices[hardware.gpu(name.strip()).name] = float(price)
        except ValueError:
            raise ValueError(f"--plan-gpus takes NAME=DOLLARS_PER_HOUR pairs, got {item!r}") from None
    model = _model(c["model"], c["num_params"])
    base = settings["workload"]
    if base["trace"]:
        raise ValueError("--plan-rate generates the workload at each rate it tries; it cannot replay a --trace")
    target = SLO("--slo", ttft=slo["ttft_ms"] / 1e3, tpot=slo["tpot_ms"] / 1e3, source="course simulate flags")
    plans = plan_capacity(
        model,
        lambda rate: workload_from({**base, "rate": rate}),
        args.plan_rate,
        target,
        prices,
        tp_sizes=_int_list(args.plan_tp, "--plan-tp"),
        pp_sizes=_int_list(args.plan_pp, "--plan-pp") or (1,),
        router=settings["fleet"]["router"],
        headroom=args.plan_headroom or 0.0,
        max_model_len=settings["scheduler"].get("max_model_len"),
        interconnect=c["interconnect"],
        roofline=_roofline_args(c),
        release=get_release(settings["scheduler"].get("vllm")).version,
    )
    if args.json:
        finite = lambda v: None if isinstance(v, float) and v in (float("inf"), float("-inf")) or v != v else v  # noqa: E731
        print(json.dumps([{**{k: finite(v) for k, v in vars(p).items()}, "gpus": p.gpus} for p in plans], indent=1))
        return 0
    print(f"{_release_named(settings)}: {model.name}, {args.plan_rate:g} req/s of "
          f"{workload_from({**base, 'rate': args.plan_rate}).name}; "
          f"{target.describe()}; router {settings['fleet']['router']}")  # fmt: skip
    if not plans:
        print("no shape fits: add GPUs (--plan-tp), a larger GPU (--plan-gpus) or shorten --max-model-len")
    for plan in plans:
        print(plan.describe())
    return 0
