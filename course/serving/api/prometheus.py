"""``GET /metrics``: the reference server's Prometheus metrics, under vLLM's names.

Names, kinds and labels follow vLLM's ``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``):
histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds`` and
``vllm:e2e_request_latency_seconds``; gauges ``vllm:num_requests_running``,
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (a fraction: 1 = full); counters
``vllm:num_preemptions_total``, ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:request_success_total{finished_reason}``, and ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` (prompt tokens looked up in the prefix cache and found there, counted
once per request at admission, as ``PrefixCacheStats`` counts them in ``vllm/v1/metrics/stats.py``;
both stay 0 with prefix caching off), each labelled ``model_name`` and ``engine``. So a Grafana
dashboard or an alert written for vLLM reads this server unchanged.

Two differences, both honest zeros or definitions rather than missing series: this engine never
preempts (its cache grows with the batch), so ``num_preemptions_total`` stays 0; and its
"KV-cache usage" is the token slots the batch cache holds over the most it can hold
(``max_batch_size x max_model_len``), as it has no fixed pool of blocks.

Each app has its own registry (tests run several servers in one process).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from course import vllm_release

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets and finish reasons, in seconds (course.vllm_release: vllm/v1/metrics/buckets.py)
TTFT_BUCKETS = vllm_release.TTFT_BUCKETS
ITL_BUCKETS = vllm_release.ITL_BUCKETS
E2E_BUCKETS = vllm_release.REQUEST_LATENCY_BUCKETS
LABELS = ("model_name", "engine")


# Counters the engine keeps itself (it may run in another process), read at scrape time: vLLM's names
# and help texts (vllm/v1/metrics/loggers.py, PrometheusStatLogger), the engine's stats() keys.
ENGINE_COUNTERS = {
    "vllm:prefix_cache_queries": (
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_cache_queries",
    ),
    "vllm:prefix_cache_hits": ("Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
}


class _EngineGauges:
    """Gauges and the engine's own counters, read from the engine at scrape time (so they are never stale)."""

    def __init__(self, engine, labels: tuple[str, str]) -> None:
        self.engine, self.labels = engine, list(labels)

    def collect(self):
        engine = self.engine
        capacity = engine.max_batch_size * engine.max_model_len
        values = {
            "vllm:num_requests_running": ("Number of requests in model execution batches.", engine.num_running),
            "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", engine.num_waiting),
            "vllm:kv_cache_usage_perc": (
                "KV-cache usage. 1 means 100 percent usage.",
                engine.cache_tokens() / capacity,
            ),
        }
        for name, (doc, value) in values.items():
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, value)
            yield family
        stats = engine.stats()
        for name, (doc, key) in ENGINE_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=LABELS)  # exported as <name>_total
            family.add_metric(self.labels, stats.get(key, 0))
            yield family


class ServerMetrics:
    """The metrics of one server; :meth:`request_finished` is called once per request that ran."""

    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = (model_name, "0")
        self.registry.register(_EngineGauges(engine, labels))

        def histogram(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets).labels(*labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, LABELS, registry=self.registry).labels(*labels)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=self.registry,
        )
        for reason in vllm_release.FINISH_REASONS:  # vLLM creates every finish reason's series at start
            self._success.labels(*labels, reason)
        self._labels = labels

    def request_finished(
        self, arrival: float, token_times: list[float], prompt_tokens: int, finish_reason: str | None
    ) -> None:
        """Record a request: ``arrival`` and ``token_times`` in ``time.perf_counter()`` seconds."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(token_times))
        if token_times:
            self.ttft.observe(token_times[0] - arrival)
            for before, after in zip(token_times, token_times[1:]):
                self.itl.observe(after - before)
            self.e2e.observe(token_times[-1] - arrival)
        if finish_reason in ("stop", "length", "abort"):
            self._success.labels(*self._labels, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
