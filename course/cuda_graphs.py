"""Decode steps with the launch overhead removed: a static KV cache, one step captured as a CUDA graph.

A decode step of a small model on a GPU does little work per kernel: each of its few hundred
kernels (norms, projections, rotary embeddings, attention, the MLP) reads a sliver of the
weights in microseconds, and eager PyTorch spends about as long on the CPU launching it. The
step is then bound by launches, not by memory bandwidth, and the course's claim (decode reads
the weights once per step) is hidden behind Python. Serving engines remove that overhead by
capturing the step once as a CUDA graph and replaying it (vLLM captures one graph for each
batch size in ``CompilationConfig.cudagraph_capture_sizes``, ``vllm/config/compilation.py``).
This module does the same for the course's transformers models:

* the KV cache is a transformers ``StaticCache``: preallocated tensors of ``capacity`` tokens
  per sequence that every step writes into in place, so every replay touches the same
  addresses (a ``DynamicCache`` concatenates, allocating new tensors every step);
* :class:`StaticDecodeStep` holds the static input ids, runs one step (forward, greedy next
  token written back into the input in place), and on CUDA captures that step as a
  ``torch.cuda.CUDAGraph`` after warming it up on a side stream, as PyTorch's CUDA-graph
  documentation prescribes; each replay then decodes one more token with a single launch;
* :func:`decode_step_seconds` and :func:`decode_sweep` time those steps exactly as
  :func:`course.measure.decode_step_seconds` times eager ones (synchronise, one step,
  synchronise), so the two figures can be set side by side.

The positions come from the cache itself: transformers' ``StaticLayer`` keeps its length in a
device tensor that each step increments in place (transformers 5.17 and 5.24 alike), so a
replayed graph advances the positions and the attention mask with no host-side state.

On a CPU there are no CUDA graphs: the same step runs eagerly (``graph=False``), which is how
the tests check on the tiny model that a static-cache step computes the logits of a
dynamic-cache step, and asking for the graph says why it cannot run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from course.measure import Timing, filled_cache, synchronize
from course.models import LanguageModel, forward
from course.progressbar import progress as _progress

WARMUP_STEPS = 3  # eager steps on a side stream before capture (PyTorch's CUDA-graph recipe)
WHAT_WAS_DONE = (
    "decode steps on a transformers StaticCache, captured once per batch size as a CUDA graph "
    "(torch.cuda.CUDAGraph) and replayed: one launch per step instead of one per kernel"
)


def graph_unavailable(lm: LanguageModel) -> str | None:
    """None when ``lm``'s decode step can be captured as a CUDA graph here, else why not."""
    import torch

    if lm.device.type != "cuda":
        return f"CUDA graphs need a CUDA device; this model runs on {lm.device.type}, so decode was timed eagerly only"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def static_cache(lm: LanguageModel, capacity: int) -> Any:
    """An empty transformers ``StaticCache`` of ``capacity`` tokens per sequence for ``lm``.

    Its tensors are allocated by the first write (shape (batch, kv_heads, capacity, head_dim)
    per layer, in the dtype and on the device of the keys written).
    """
    from transformers import StaticCache

    return StaticCache(config=lm.model.config, max_cache_len=capacity)


class StaticDecodeStep:
    """Greedy decode steps of a fixed batch on a static KV cache, replayable as one CUDA graph.

    ``ids`` (batch, 1) is the step's static input: each step reads it, runs the model, and
    writes the greedy next token of every sequence back into it, so repeated steps generate
    text. ``logits`` (batch, 1, vocab) holds the last step's output. Build one with
    :meth:`filled` (random cached keys and values, for timing) or :meth:`from_prompt` (a real
    prefill, for checking against the dynamic cache).
    """

    def __init__(self, lm: LanguageModel, cache: Any, ids: Any, length: int, capacity: int):
        self.lm, self.cache, self.ids = lm, cache, ids
        self.length = length  # tokens now cached per sequence (host-side copy, for the capacity check)
        self.capacity = capacity
        self.logits: Any = None
        self.graph: Any = None
        self.warmup_inputs: list[Any] = []  # the ids each warm-up step of capture() read

    @classmethod
    def filled(cls, lm: LanguageModel, batch: int, context: int, capacity: int, seed: int = 0) -> StaticDecodeStep:
        """``batch`` sequences that each hold ``context`` random cached tokens, room for ``capacity``."""
        if capacity <= context:
            raise ValueError(f"capacity {capacity} leaves no room to decode after {context} cached tokens")
        cache = filled_cache(lm, batch, context, seed=seed, cache=static_cache(lm, capacity))
        return cls(lm, cache, lm.random_ids(batch, 1, seed=seed), context, capacity)

    @classmethod
    def from_prompt(cls, lm: LanguageModel, prompt_ids: Any, capacity: int) -> StaticDecodeStep:
        """Prefill ``prompt_ids`` (batch, tokens) into a static cache; the first step decodes its greedy token."""
        import torch

        tokens = int(prompt_ids.shape[1])
        if capacity <= tokens:
            raise ValueError(f"capacity {capacity} leaves no room to decode after a {tokens}-token prompt")
        with torch.inference_mode():
            logits, cache = forward(lm.model, prompt_ids, static_cache(lm, capacity))
            step = cls(lm, cache, logits[:, -1:].argmax(-1), tokens, capacity)
        step.logits = logits[:, -1:]
        return step

    def _check_room(self) -> None:
        if self.length >= self.capacity:
            raise ValueError(
                f"the static cache is full ({self.capacity} tokens per sequence): build the step with a larger capacity"
            )

    def _eager_step(self) -> Any:
        logits, _ = forward(self.lm.model, self.ids, self.cache)
        self.ids.copy_(logits[:, -1:].argmax(-1))  # in place: the next step (or replay) reads the same tensor
        return logits

    def capture(self, warmup: int = WARMUP_STEPS) -> None:
        """Capture one step as a CUDA graph, after ``warmup`` eager steps on a side stream.

        The warm-up steps decode real tokens (they advance the cache by ``warmup`` tokens);
        the capture itself runs nothing. Raises ValueError off CUDA, saying why.
        """
        import torch

        if reason := graph_unavailable(self.lm):
            raise ValueError(f"cannot capture a CUDA graph: {reason}")
        if self.length + warmup + 1 > self.capacity:
            raise ValueError(f"capacity {self.capacity} is too small for {warmup} warm-up steps after {self.length}")
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the default stream: lazy inits happen before capture
                for _ in range(warmup):
                    self.warmup_inputs.append(self.ids.clone())
                    self._eager_step()
            torch.cuda.current_stream().wait_stream(side)
            self.length += warmup
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._eager_step()  # recorded, not run: its output lives in the graph's pool
        self.graph = graph

    def __call__(self) -> Any:
        """One decode step (a graph replay once captured, else eager); returns logits (batch, 1, vocab)."""
        import torch

        self._check_room()
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.inference_mode():
                self.logits = self._eager_step()
        self.length += 1
        return self.logits


def decode_step_seconds(
    lm: LanguageModel, batch: int, context: int, steps: int = 8, *, graph: bool = True, seed: int = 0
) -> Timing:
    """Time single decode steps of ``batch`` sequences holding ``context`` tokens, on a static cache.

    graph: capture the step as a CUDA graph and time its replays (CUDA only; ValueError with
    the reason elsewhere); False times the same static-cache step eagerly. The cache is
    filled with random keys and values as in :func:`course.measure.decode_step_seconds`, one
    untimed step warms up, and each timed step is bracketed by synchronisations. The cache has
    room for the steps and warm-ups only, so the attention over it (which reads its whole
    capacity, masked) reads at most ``WARMUP_STEPS + steps + 2`` tokens more than ``context``.
    """
    import time

    if graph and (reason := graph_unavailable(lm)):
        raise ValueError(reason)
    capacity = context + WARMUP_STEPS + steps + 2
    step = StaticDecodeStep.filled(lm, batch, context, capacity, seed=seed)
    if graph:
        step.capture()
    step()  # warm-up: the first replay (or eager step) at this batch size
    times = []
    for _ in range(steps):
        synchronize(lm)
        start = time.perf_counter()
        step()
        synchronize(lm)
        times.append(time.perf_counter() - start)
    del step  # frees the graph's memory pool and the cache before the next batch size
    return Timing.of(batch, times)


def decode_sweep(
    lm: LanguageModel, batch_sizes: Sequence[int], context: int, steps: int = 8, *, graph: bool = True
) -> list[Timing]:
    """Static-cache decode step latency at each batch size (CUDA graph replays, or eager with graph=False)."""
    label = "decode sweep, CUDA graph" if graph else "decode sweep, static cache"
    return [decode_step_seconds(lm, b, context, steps, graph=graph) for b in _progress(batch_sizes, label)]


def max_logit_difference(
    lm: LanguageModel, prompt_tokens: int = 12, steps: int = 6, *, graph: bool | None = None
) -> float:
    """Largest |logit| difference between static-cache steps and dynamic-cache steps from one prompt.

    Both prefill the same random prompt, then decode ``steps`` tokens, each side fed the token
    the static side chose (so a near-tie in the argmax cannot send them down different texts).
    The static side replays a CUDA graph where one can run (graph None: wherever
    :func:`graph_unavailable` allows it). A correct static step differs only by float rounding.
    """
    import torch

    from course.models import new_cache

    use_graph = graph_unavailable(lm) is None if graph is None else graph
    prompt = lm.random_ids(1, prompt_tokens, seed=1)
    static = StaticDecodeStep.from_prompt(lm, prompt, capacity=prompt_tokens + steps + WARMUP_STEPS + 2)
    with torch.inference_mode():
        logits, cache = forward(lm.model, prompt, new_cache(lm.model))
        worst = (logits[:, -1:] - static.logits).abs().max().item()
        if use_graph:
            static.capture()
            for ids in static.warmup_inputs:  # the tokens the capture's warm-up steps decoded
                logits, cache = forward(lm.model, ids, cache)
        for _ in range(steps):
            logits, cache = forward(lm.model, static.ids.clone(), cache)
            worst = max(worst, (logits - static()).abs().max().item())
    return worst
