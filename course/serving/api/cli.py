"""``course serve`` and ``course bench``: the reference server and the load client on the command line.

course serve [--port 8000] [--model NAME] [--max-batch-size 64]
    the OpenAI-compatible reference server on 127.0.0.1 (the tiny model on a CPU; a real small
    model from the Hub on a GPU runtime with Hub access; or a local model folder).
course bench --base-url URL [--concurrency N | --request-rate R] [--prompt-tokens P] [--output-tokens O]
    a load test of any OpenAI-compatible server (ours, vLLM, SGLang, transformers serve): TTFT /
    ITL / TPOT / E2E mean, p50, p95, p99 and throughput; ``--output`` writes the raw traces.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from course.serving.api.background import ConnectionLimits  # light: no uvicorn
from course.serving.api.protocol import (  # light: no FastAPI
    DEFAULT_CHAT_MAX_TOKENS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_STREAM_BACKLOG,
)
from course.serving.prefix_cache import DEFAULT_CAPACITY_BYTES as DEFAULT_PREFIX_CACHE_BYTES  # light: no torch

_LIMITS = ConnectionLimits()  # the defaults of --max-header-bytes and the timeouts


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``course serve``'s options, in the order ``--help`` lists them."""
    _add_address_and_model_arguments(parser)
    _add_engine_arguments(parser)
    _add_deployment_arguments(parser)
    _add_limit_arguments(parser)
    parser.set_defaults(run=serve)


def _add_address_and_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the server listens, and the model it serves under which name."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    parser.add_argument(
        "--model",
        default=None,
        help="'tiny' (the offline random model), 'prose' (the offline model trained on the course's text, "
        "whose output reads as text), a Hub id or a local model folder (loaded whatever HF_HUB_OFFLINE says; "
        "a model that cannot be loaded is an error unless --allow-fallback) (default: tiny on CPU, a real "
        "small model on a GPU runtime with Hub access)",
    )
    parser.add_argument(
        "--allow-fallback",
        action="store_true",
        help="if --model cannot be loaded, serve the offline stand-in (under its own name) instead of failing",
    )
    parser.add_argument("--served-model-name", default=None, help="the id clients send as 'model'")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine: batch, context, token budget, prefix cache, runner, device and threads."""
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together (1 = one at a time)")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output tokens)")
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=512,
        help="tokens computed per engine iteration: one for each running request, the rest for prompt chunks "
        "(a longer prompt is prefilled over several iterations, as with vLLM's --max-num-batched-tokens); "
        "default 512",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="reuse the keys and values of a prompt's leading full blocks of 16 tokens when an earlier prompt "
        "began the same way (vLLM's flag; off by default here, on in vLLM: the course's measurements repeat "
        "prompt prefixes and time their prefill)",
    )
    parser.add_argument(
        "--prefix-cache-gib",
        type=float,
        default=DEFAULT_PREFIX_CACHE_BYTES / 2**30,
        help="with --enable-prefix-caching: memory for cached prefix blocks, GiB on the model's device (least "
        f"recently used evicted first; default {DEFAULT_PREFIX_CACHE_BYTES / 2**30:g})",
    )
    parser.add_argument(
        "--runner",
        choices=["auto", "transformers"],
        default="auto",
        help="model runner: auto = the lean Llama-family runner where it applies, else the transformers "
        "forward pass (default auto)",
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the GPU if there is one)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")


def _add_deployment_arguments(parser: argparse.ArgumentParser) -> None:
    """The operator's choices: logging, the API key, the waiting-queue limit, where the engine core runs."""
    parser.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    parser.add_argument(
        "--api-key",
        nargs="+",
        default=[os.environ["COURSE_API_KEY"]] if os.environ.get("COURSE_API_KEY") else None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes; several keys (one per tenant) accept any of "
        "them, as vLLM's --api-key (default: $COURSE_API_KEY; none = open)",
    )
    parser.add_argument(
        "--cache-isolation",
        choices=["shared", "per-key"],
        default="shared",
        help="with --enable-prefix-caching: shared (vLLM's behaviour: requests share cached prompt blocks unless "
        "their cache_salt differs) or per-key (each API key's requests are also salted with the key, so tenants "
        "never share a block and none can tell from a cache hit what another sent; needs --api-key) "
        "(default shared)",
    )
    parser.add_argument(
        "--metrics-api-key",
        default=os.environ.get("COURSE_METRICS_API_KEY"),
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on GET /metrics, a key for the operator's scraper (tenants' "
        "--api-key keys do not open it); default: $COURSE_METRICS_API_KEY; none = open, as in vLLM, where the "
        "prefix-cache counters show every client how many prompt tokens hit the cache",
    )
    parser.add_argument("--access-log", action="store_true", help="log one line per request (status, ms, tokens)")
    parser.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 while this many requests wait (default: no limit)",
    )
    parser.add_argument(
        "--engine-core",
        choices=["process", "thread"],
        default="process",
        help="process (default): the engine runs in its own process, apart from the API server, as in "
        "vLLM V1, so serving work overlaps the decode step on a second core; thread: on a thread "
        "of the server's process (one process; with one core nothing overlaps, so it gains nothing there)",
    )


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """What one request or connection may cost: body size, headers, timeouts, a chat's default output."""
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 (default 4 MiB)",
    )
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        default=_LIMITS.max_header_bytes,
        help="request line + headers larger than this get 431 and the connection is closed "
        f"(default {_LIMITS.max_header_bytes // 1024} KiB)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=_LIMITS.header_timeout,
        help="seconds for a request line and headers to arrive, else 408 and close "
        f"(default {_LIMITS.header_timeout:g})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=_LIMITS.body_timeout,
        help="seconds without a byte of an unfinished request body, else 408 and close "
        f"(default {_LIMITS.body_timeout:g})",
    )
    parser.add_argument(
        "--body-min-rate",
        type=float,
        default=_LIMITS.body_min_rate,
        help="bytes per second a request body must average: it must arrive within --body-timeout s plus 1 s per "
        f"this many bytes, else 408 and close (Apache's MinRate; default {_LIMITS.body_min_rate:g}; 0 = no deadline)",
    )
    parser.add_argument(
        "--send-timeout",
        type=float,
        default=_LIMITS.send_timeout,
        help="seconds a response may wait for a client that reads none of it before the connection is closed and "
        f"its request aborted (nginx's send_timeout; default {_LIMITS.send_timeout:g})",
    )
    parser.add_argument(
        "--max-stream-backlog",
        type=int,
        default=DEFAULT_MAX_STREAM_BACKLOG,
        help="tokens a stream may have waiting for a client that reads more slowly than they are generated; past "
        f"them its generation is aborted and its batch slot freed (default {DEFAULT_MAX_STREAM_BACKLOG}; 0 = no "
        "bound)",
    )
    parser.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=_LIMITS.keep_alive_timeout,
        help=f"close idle keep-alive connections after this many seconds (default {_LIMITS.keep_alive_timeout:g}, "
        "uvicorn's)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_CHAT_MAX_TOKENS,
        help=f"max_tokens of a chat request that sends none (default {DEFAULT_CHAT_MAX_TOKENS}; 0 = up to the context)",
    )


def serve(args: argparse.Namespace) -> int:
    """Run the reference server until SIGTERM or Ctrl-C; 1 if the model or the engine cannot start."""
    import torch

    from course.env import QUIET_ENV
    from course.models import ModelUnavailable
    from course.serving.api.background import uvicorn_server
    from course.serving.engine_process import EngineStartError

    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefix_cache_gib < 0:
        print(f"course serve: error: --prefix-cache-gib must be >= 0, got {args.prefix_cache_gib:g}", file=sys.stderr)
        return 2
    if args.cache_isolation == "per-key" and not args.api_key:
        print("course serve: error: --cache-isolation per-key needs the tenants' keys (--api-key KEY [KEY ...])",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        app = _build_app(args, _load_model(args))
    except (ModelUnavailable, EngineStartError) as err:
        print(f"course serve: error: {err}", file=sys.stderr)
        return 1
    if args.access_log:
        _print_access_log()
    server = uvicorn_server(_uvicorn_config(args, app))  # stops the engine first on SIGTERM / Ctrl-C
    _announce(args, app)
    server.run()
    return 0


def _load_model(args: argparse.Namespace):
    """The model ``--model`` names (``tiny`` and ``prose``: the offline ones); ModelUnavailable otherwise."""
    from course.models import PROSE_NAME, TINY_NAME, load_model

    name = {"tiny": TINY_NAME, "prose": PROSE_NAME}.get(args.model, args.model)
    return load_model(
        name,
        device=args.device,
        seed=args.seed,
        allow_hub=None if name is None else True,
        fallback=True if args.allow_fallback else None,
    )


def _build_app(args: argparse.Namespace, lm):
    """The reference server's app over ``lm`` with the engine and the operator features the options ask for."""
    from course.serving.api.server import create_app

    return create_app(
        lm,
        model_name=args.served_model_name or lm.name,
        aliases=(),  # a stand-in is served under its own name only: never as the model that was asked for
        max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len,
        max_prefill_tokens=args.max_prefill_tokens,
        max_request_bytes=args.max_request_bytes,
        max_waiting_requests=args.max_waiting_requests,
        max_stream_backlog=args.max_stream_backlog or None,
        default_max_tokens=args.default_max_tokens or None,
        api_key=args.api_key,
        cache_isolation=args.cache_isolation,
        metrics_api_key=args.metrics_api_key,
        access_log=args.access_log,
        runner=args.runner,
        engine_process=args.engine_core == "process",
        prefix_cache_bytes=int(args.prefix_cache_gib * 2**30) if args.enable_prefix_caching else 0,
    )


def _print_access_log() -> None:
    """Send the access log's lines (logger ``course.serving.access``) to stderr, with their time."""
    import logging

    from course.serving.api.operator import access_logger

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access_logger.addHandler(handler)
    access_logger.setLevel(logging.INFO)


def _uvicorn_config(args: argparse.Namespace, app):
    """uvicorn's configuration: the address, the log level, and each connection's limits."""
    from course.serving.api.background import uvicorn_config

    limits = ConnectionLimits(
        max_header_bytes=args.max_header_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        body_min_rate=args.body_min_rate,
        send_timeout=args.send_timeout,
        keep_alive_timeout=args.timeout_keep_alive,
    )
    return uvicorn_config(
        app,
        limits,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


def _announce(args: argparse.Namespace, app) -> None:
    """The line that says what is served where, and how."""
    import torch

    engine = app.state.engine
    print(
        f"serving {app.state.model_name} on http://{args.host}:{args.port}/v1 (max batch {engine.max_batch_size}, "
        f"context {engine.max_model_len} tokens, {engine.runner.name} runner, engine core in a {args.engine_core}, "
        f"prefix caching {engine.stats().get('prefix_caching', 'off')}"
        f"{' isolated per API key' if args.cache_isolation == 'per-key' else ''}, "
        f"/metrics {'behind --metrics-api-key' if args.metrics_api_key else 'open'}, "
        f"{torch.get_num_threads()} CPU threads); "
        "Ctrl-C stops",
        flush=True,
    )


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    parser.add_argument("--model", default=None, help="model id to send (default: the first listed by /v1/models)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-requests", type=int, default=32, help="requests to send (default 32)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: this many requests in flight")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals, requests per second")
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="cap on requests in flight with --request-rate"
    )
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--output-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer folder for exact prompt lengths (default: the course's)"
    )
    parser.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (outputs may be shorter)")
    parser.add_argument(
        "--no-continuous-usage", action="store_true", help="do not ask for per-chunk usage (for servers that reject it)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up requests first (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--percentiles", type=float, nargs="+", default=[50, 95, 99], metavar="Q")
    parser.add_argument("--output", default=None, help="write the raw request traces to this JSON file")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(run=bench)


def bench(args: argparse.Namespace) -> int:
    from course.metrics import summarize
    from course.serving.client import PromptBuilder, run_load
    from course.workload import all_at_once, bursty

    if args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if args.request_rate is not None:
        workload = bursty(
            args.request_rate, args.num_requests, args.prompt_tokens, args.output_tokens, args.burstiness, args.seed
        )
        concurrency = args.max_concurrency
    else:
        workload = all_at_once(args.num_requests, args.prompt_tokens, args.output_tokens, seed=args.seed)
        concurrency = args.concurrency or 1
    prompts = PromptBuilder(args.tokenizer)
    options = dict(
        model=args.model,
        endpoint=args.endpoint,
        prompts=prompts,
        ignore_eos=not args.no_ignore_eos,
        continuous_usage=not args.no_continuous_usage,
        timeout=args.timeout,
    )
    if args.warmup:
        warm = run_load(
            args.base_url,
            all_at_once(args.warmup, args.prompt_tokens, 4, seed=args.seed + 10_000),
            concurrency=1,
            progress=False,
            **options,
        )
        if warm.summary.completed == 0:
            error = warm.traces[0].error if warm.traces else "no response"
            raise ValueError(f"the warm-up request to {args.base_url} failed: {error}")
    result = run_load(
        args.base_url, workload, concurrency=concurrency, progress=not args.no_progress, seed=args.seed, **options
    )
    summary = summarize(result.traces, percentiles=args.percentiles, duration=result.duration)
    if args.output:
        result.save(args.output)
    if args.json:
        print(json.dumps({"workload": result.metadata, **summary.to_dict()}, indent=1))
    else:
        load = f"{concurrency} concurrent" if args.request_rate is None else f"{args.request_rate:g} req/s"
        print(
            f"{args.base_url} model {result.metadata['model']}: {args.num_requests} requests, {load}, "
            f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens"
        )
        print(summary.table())
        failures = [t.error for t in result.traces if t.error]
        if failures:
            print(f"{len(failures)} failed; first error: {failures[0]}", file=sys.stderr)
        if args.output:
            print(f"traces written to {args.output}")
    return 0 if summary.completed else 1
