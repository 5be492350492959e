"""Live measurements of prefill and decode on the learner's runtime.

Every function times real forward passes of a :class:`~course.models.LanguageModel` with
``time.perf_counter`` (synchronising the GPU first where there is one) and returns plain
numbers in seconds. Repeated timings report the median, which shrugs off the odd slow run
on a shared machine, with their count and extremes, so :func:`course.noise.check` can say
whether the runtime was quiet enough for the conclusion drawn from them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from course.models import LanguageModel, forward, new_cache
from course.progressbar import progress as _progress
from course.trace import RequestTrace


def synchronize(lm: LanguageModel) -> None:
    """Wait for queued GPU work, so the clock measures work done rather than work queued."""
    if lm.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def time_repeated(fn: Callable[[], object], lm: LanguageModel, repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``fn()`` over ``repeats`` runs, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    synchronize(lm)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(lm)
        times.append(time.perf_counter() - start)
    return times


@dataclass(frozen=True)
class Timing:
    """Median and spread of repeated timings of one configuration (seconds)."""

    size: int  # the swept quantity: prompt tokens, batch size, ...
    median: float
    low: float
    high: float
    n: int = 1  # how many timed repeats

    @classmethod
    def of(cls, size: int, times: Sequence[float]) -> Timing:
        if not times:
            raise ValueError("a timing needs at least one measured time")
        return cls(size, statistics.median(times), min(times), max(times), len(times))


def prefill_seconds(lm: LanguageModel, prompt_tokens: int, batch: int = 1, repeats: int = 3, warmup: int = 1) -> Timing:
    """Time one prefill: a forward pass over the whole prompt into an empty cache."""
    import torch

    ids = lm.random_ids(batch, prompt_tokens)
    with torch.inference_mode():
        times = time_repeated(lambda: forward(lm.model, ids, new_cache(lm.model)), lm, repeats, warmup)
    return Timing.of(prompt_tokens, times)


def prefill_sweep(lm: LanguageModel, lengths: Sequence[int], repeats: int = 3) -> list[Timing]:
    """Prefill latency at each prompt length (batch 1).

    Only the first length gets an untimed warm-up run: one is enough to select the kernels,
    and on a realistic model a warm-up of every long prompt would double the sweep's time.
    """
    return [
        prefill_seconds(lm, n, repeats=repeats, warmup=1 if i == 0 else 0)
        for i, n in enumerate(_progress(lengths, "prefill sweep"))
    ]


def filled_cache(lm: LanguageModel, batch: int, context: int, seed: int = 0, cache=None):
    """A KV cache holding ``context`` random tokens for each of ``batch`` sequences.

    A decode step reads the cache the same way whatever its values, so filling it with random
    keys and values times the same as a real prefill, in milliseconds instead of a prefill of
    batch x context tokens (minutes for a realistic model on a CPU). cache: the empty cache to
    fill (default a new dynamic one; :mod:`course.cuda_graphs` passes a static one).
    """
    import torch

    cache = new_cache(lm.model) if cache is None else cache
    g = lm.geometry
    generator = torch.Generator(device=lm.device).manual_seed(seed)
    shape = (batch, g.num_kv_heads, context, g.head_dim)
    with torch.inference_mode():
        for layer in range(g.num_layers):
            keys = torch.randn(shape, generator=generator, device=lm.device, dtype=lm.dtype)
            cache.update(keys, torch.randn(shape, generator=generator, device=lm.device, dtype=lm.dtype), layer)
    return cache


def decode_step_seconds(lm: LanguageModel, batch: int, context: int, steps: int = 8, *, prefill: bool = True) -> Timing:
    """Time single decode steps of ``batch`` sequences that each hold ``context`` tokens.

    The cache is filled by one prefill (not timed), or with random keys and values when
    ``prefill`` is False (same step time, far quicker to set up); then every step feeds one
    new token per sequence, exactly what a serving engine does for its running requests.
    """
    import torch

    with torch.inference_mode():
        if prefill:
            logits, cache = forward(lm.model, lm.random_ids(batch, context), new_cache(lm.model))
            next_ids = logits[:, -1:].argmax(-1)  # (batch, 1)
        else:
            cache, next_ids = filled_cache(lm, batch, context), lm.random_ids(batch, 1)
        forward(lm.model, next_ids, cache)  # warm-up step at this batch size
        times = []
        for _ in range(steps):
            synchronize(lm)
            start = time.perf_counter()
            logits, cache = forward(lm.model, next_ids, cache)
            next_ids = logits[:, -1:].argmax(-1)
            synchronize(lm)
            times.append(time.perf_counter() - start)
    return Timing.of(batch, times)


def runner_decode_steps(
    lm: LanguageModel, runner, batch: int, prompt_tokens: int, steps: int, seed: int = 0
) -> list[float]:
    """Seconds of each of ``steps`` decode steps of a serving runner (:mod:`course.serving.runner`).

    One prefill of ``batch`` random prompts of ``prompt_tokens`` tokens (not timed), then every
    step feeds back each row's argmax: the raw step, forward pass and argmax only, that the
    serving benchmarks hold the engine's step and the server's inter-token latency against.
    """
    import torch

    times = []
    with torch.inference_mode():
        logits, cache = runner(lm.random_ids(batch, prompt_tokens, seed=seed), runner.new_cache())
        token = logits[:, -1:].argmax(-1)  # (batch, 1)
        for _ in range(steps):
            synchronize(lm)
            start = time.perf_counter()
            logits, cache = runner(token, cache)
            token = logits[:, -1:].argmax(-1)
            synchronize(lm)
            times.append(time.perf_counter() - start)
    return times


def decode_sweep(
    lm: LanguageModel, batch_sizes: Sequence[int], context: int, steps: int = 8, *, prefill: bool = True
) -> list[Timing]:
    """Decode step latency at each batch size, all sequences at ``context`` tokens."""
    return [decode_step_seconds(lm, b, context, steps, prefill=prefill) for b in _progress(batch_sizes, "decode sweep")]


def greedy_step_times(
    lm: LanguageModel, prompt_tokens: int, new_tokens: int, use_cache: bool, progress: str | None = None
) -> list[float]:
    """Seconds per generated token, generating greedily with or without the KV cache.

    Without the cache every step runs the model over the whole sequence so far (prompt plus
    everything generated), which is what generation cost before KV caching. ``progress``: a
    description for a progress bar over the steps (None: no bar).
    """
    import torch

    ids = lm.random_ids(1, prompt_tokens)
    times = []
    steps = _progress(range(new_tokens), progress) if progress else range(new_tokens)
    with torch.inference_mode():
        if use_cache:
            logits, cache = forward(lm.model, ids, new_cache(lm.model))
            next_ids = logits[:, -1:].argmax(-1)
        for _ in steps:
            synchronize(lm)
            start = time.perf_counter()
            if use_cache:
                logits, cache = forward(lm.model, next_ids, cache)
                next_ids = logits[:, -1:].argmax(-1)
            else:
                logits = lm.model(input_ids=ids, use_cache=False).logits
                ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
            synchronize(lm)
            times.append(time.perf_counter() - start)
    return times


def greedy_runs(
    lm: LanguageModel, prompt_tokens: int, new_tokens: int, use_cache: bool, repeats: int = 3
) -> list[list[float]]:
    """:func:`greedy_step_times` repeated ``repeats`` times: one list of per-step seconds per run."""
    label = "with the KV cache" if use_cache else "without the cache"
    return [
        greedy_step_times(lm, prompt_tokens, new_tokens, use_cache, progress=f"{label}, run {r + 1}/{repeats}")
        for r in range(repeats)
    ]


def per_step_timings(runs: Sequence[Sequence[float]]) -> list[Timing]:
    """One Timing per generated token across runs (size = the token's position, 1-based)."""
    return [Timing.of(step + 1, [run[step] for run in runs]) for step in range(min(len(run) for run in runs))]


def generate_in_process(
    lm: LanguageModel,
    prompt_ids,
    max_new_tokens: int,
    request_id: str = "0",
    send_time: float | None = None,
) -> RequestTrace:
    """Generate greedily in this process (no server, no HTTP) and record each token's time as a trace.

    Synchronous: it returns when the last token is generated. (Module 2's HTTP client,
    ``course.serving.client.stream_request``, records the same trace from a real server.)
    prompt_ids: (1, prompt_tokens). Each token is one chunk. ``send_time`` is when the request
    "arrived" (default: now); a request that waited in a queue passes its arrival time, and
    the wait becomes part of its TTFT, as it would on a server.
    """
    import torch

    send = time.perf_counter() if send_time is None else send_time
    chunk_times = []
    with torch.inference_mode():
        logits, cache = forward(lm.model, prompt_ids, new_cache(lm.model))  # prefill
        next_ids = logits[:, -1:].argmax(-1)
        synchronize(lm)
        chunk_times.append(time.perf_counter())
        for _ in range(max_new_tokens - 1):  # decode, one token per step
            logits, cache = forward(lm.model, next_ids, cache)
            next_ids = logits[:, -1:].argmax(-1)
            synchronize(lm)
            chunk_times.append(time.perf_counter())
    return RequestTrace.from_token_times(request_id, send, chunk_times, int(prompt_ids.shape[1]))


def serve_one_at_a_time(
    lm: LanguageModel, prompt_lengths: Sequence[int], output_lengths: Sequence[int], seed: int = 0
) -> list[RequestTrace]:
    """A burst of requests that all arrive at once and are served one after another.

    The simplest possible server: no batching, first come first served. Request k waits for
    requests 0..k-1 to finish, and that queueing shows up in its TTFT.
    """
    if len(prompt_lengths) != len(output_lengths):
        raise ValueError("give one output length per prompt length")
    prompts = [lm.random_ids(1, n, seed=seed + i) for i, n in enumerate(prompt_lengths)]
    arrival = time.perf_counter()
    requests = _progress(list(enumerate(zip(prompts, output_lengths))), "serving one at a time")
    return [
        generate_in_process(lm, prompt, n_out, request_id=str(i), send_time=arrival) for i, (prompt, n_out) in requests
    ]
