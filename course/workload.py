"""Workloads: when requests arrive and how long their prompts and answers are.

One record feeds both the real server's load client (module 2's ``course bench``) and the
simulator (module 3), so a measured run and a simulated run can be given the same requests.
Arrival times are seconds from the start of the run. Generators are seeded and deterministic.

Arrival processes follow vLLM's benchmark (``vllm/benchmarks/serve.py``): Poisson arrivals
have exponential gaps of mean 1/rate; bursty arrivals draw gamma gaps with shape
``burstiness`` and the same mean (burstiness 1 is Poisson, below 1 burstier, above 1 more even).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from course.trace import RequestTrace

# A sampler draws n token counts with a numpy Generator; see fixed(), uniform(), lognormal().
LengthSampler = Callable[[np.random.Generator, int], np.ndarray]


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: when, and how many tokens in and out."""

    request_id: str
    arrival_time: float  # s from the start of the run
    prompt_tokens: int
    output_tokens: int  # tokens to generate (max_tokens, with ignore_eos on a real server)
    # What the prompt holds, as named spans (name, tokens) in order: spans with the same name hold the
    # same tokens (a shared system prompt), so prefix caching can reuse them. Empty: all unique.
    prompt_segments: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.arrival_time < 0:
            raise ValueError(f"request {self.request_id}: arrival_time must be >= 0, got {self.arrival_time}")
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"request {self.request_id}: prompt_tokens and output_tokens must be >= 1, "
                f"got {self.prompt_tokens} and {self.output_tokens}"
            )
        if self.prompt_segments and sum(length for _, length in self.prompt_segments) != self.prompt_tokens:
            raise ValueError(
                f"request {self.request_id}: prompt_segments add up to "
                f"{sum(length for _, length in self.prompt_segments)} tokens, but prompt_tokens is {self.prompt_tokens}"
            )


@dataclass
class Workload:
    """Requests in arrival order, with a name for plots and reports."""

    requests: list[RequestSpec]
    name: str = "workload"
    metadata: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.requests = sorted(self.requests, key=lambda r: r.arrival_time)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)

    @property
    def duration(self) -> float:
        """Time from the first to the last arrival (s)."""
        return self.requests[-1].arrival_time - self.requests[0].arrival_time if self.requests else 0.0

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)


# --- length distributions -------------------------------------------------------------------


def fixed(tokens: int) -> LengthSampler:
    """Every request gets exactly ``tokens``."""
    _check_positive("tokens", tokens)
    return lambda rng, n: np.full(n, tokens, dtype=int)


def uniform(low: int, high: int) -> LengthSampler:
    """Integers drawn uniformly from [low, high]."""
    _check_positive("low", low)
    if high < low:
        raise ValueError(f"uniform lengths need low <= high, got {low} > {high}")
    return lambda rng, n: rng.integers(low, high + 1, size=n)


def lognormal(median: float, sigma: float, low: int = 1, high: int | None = None) -> LengthSampler:
    """Log-normal lengths (long-tailed, like real prompts and answers), clipped to [low, high]."""
    _check_positive("median", median)
    if sigma < 0:
        raise ValueError(f"sigma must be >= 0, got {sigma}")

    def draw(rng: np.random.Generator, n: int) -> np.ndarray:
        values = np.rint(rng.lognormal(np.log(median), sigma, size=n)).astype(int)
        return np.clip(values, low, high if high is not None else np.iinfo(np.int64).max)

    return draw


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


# --- arrival processes ------------------------------------------------------------------------


def _build(
    name: str, arrivals: np.ndarray, prompt: LengthSampler, output: LengthSampler, rng: np.random.Generator, **meta
) -> Workload:
    n = len(arrivals)
    prompts, outputs = prompt(rng, n), output(rng, n)
    requests = [
        RequestSpec(str(i), float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs))
    ]
    return Workload(requests, name=name, metadata=meta)


def as_sampler(lengths: int | LengthSampler) -> LengthSampler:
    """An int means fixed lengths."""
    return fixed(lengths) if isinstance(lengths, (int, np.integer)) else lengths


def poisson(
    rate: float, n: int, prompt_tokens: int | LengthSampler, output_tokens: int | LengthSampler, seed: int = 0
) -> Workload:
    """``n`` requests arriving as a Poisson process of ``rate`` requests per second."""
    return bursty(rate, n, prompt_tokens, output_tokens, burstiness=1.0, seed=seed)


def bursty(
    rate: float,
    n: int,
    prompt_tokens: int | LengthSampler,
    output_tokens: int | LengthSampler,
    burstiness: float = 0.5,
    seed: int = 0,
) -> Workload:
    """Gamma-distributed gaps of mean 1/rate; ``burstiness`` < 1 clusters arrivals into bursts."""
    _check_positive("rate", rate)
    _check_positive("burstiness", burstiness)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    arrivals = np.cumsum(gaps) - (gaps[0] if n else 0.0)  # the first request arrives at t = 0
    kind = "poisson" if burstiness == 1.0 else f"bursty (burstiness {burstiness:g})"
    return _build(
        f"{kind}, {rate:g} req/s",
        arrivals,
        as_sampler(prompt_tokens),
        as_sampler(output_tokens),
        rng,
        rate=rate,
        burstiness=burstiness,
        seed=seed,
    )


def all_at_once(
    n: int, prompt_tokens: int | LengthSampler, output_tokens: int | LengthSampler, seed: int = 0
) -> Workload:
    """``n`` requests that all arrive at t = 0 (a burst, or a closed-loop run's request list)."""
    rng = np.random.default_rng(seed)
    return _build(
        f"{n} requests at once", np.zeros(n), as_sampler(prompt_tokens), as_sampler(output_tokens), rng, seed=seed
    )


def from_traces(traces: Sequence[RequestTrace], name: str = "replayed trace") -> Workload:
    """The workload a measured run carried: arrivals relative to the first send, and token counts.

    Failed requests are kept (they were offered load) with the tokens they asked for when known;
    a request that reported no output tokens is replayed with one.
    """
    if not traces:
        return Workload([], name=name)
    start = min(t.send_time for t in traces)
    requests = [
        RequestSpec(t.request_id, t.send_time - start, max(t.prompt_tokens, 1), max(t.output_tokens, 1)) for t in traces
    ]
    return Workload(requests, name=name)
