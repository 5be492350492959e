"""What the engine core counts while it steps: passes, steps, tokens and the seconds they took.

The core writes these from the thread that steps it; ``/health``, the tests and the calibration of the
simulator read them from any thread. They live apart from the core, as vLLM keeps its per-step counts in
records of their own beside its engine core (``SchedulerStats`` and ``IterationStats`` in
``vllm/v1/metrics/stats.py``, vLLM 0.32). Every compound value is replaced in one store (a tuple in a dict
slot, one ``append``), so a reader on another thread sees either the old or the new value, never half of one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

RECENT_ITERATIONS = 4096  # iterations whose start, length and token budget are kept (the oldest drop out)


def _recent() -> deque:
    return deque(maxlen=RECENT_ITERATIONS)


@dataclass
class StepCounters:
    """The engine core's counters since it started.

    Attributes:
        steps: decode steps run.
        prefills: prefill forward passes run (one per chunk of a chunked prompt; prompts prefilled together
            in one pass count once).
        tokens_generated: tokens handed to requests (first tokens included).
        batch_size_sum: the decode steps' batch sizes summed (mean batch = ``batch_size_sum / steps``).
        decode_seconds: seconds in decode steps (forward, sampling and hand-off).
        prefill_seconds: seconds in the iterations' prefill work.
        decode_by_batch: batch size -> (decode steps, their seconds, cache token slots they attended over),
            so a simulator's fit can be checked against the steps a run itself took, batch by batch.
        prefill_by_tokens: prompt tokens an iteration prefilled -> (iterations, their prefill seconds).
        iterations: (start on ``time.perf_counter``, seconds) of the recent iterations.
        budget_used: (decodes, prompt tokens) each recent iteration's token budget was split into.
    """

    steps: int = 0
    prefills: int = 0
    tokens_generated: int = 0
    batch_size_sum: int = 0
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_by_batch: dict[int, tuple[int, float, int]] = field(default_factory=dict)
    prefill_by_tokens: dict[int, tuple[int, float]] = field(default_factory=dict)
    iterations: deque[tuple[float, float]] = field(default_factory=_recent)
    budget_used: deque[tuple[int, int]] = field(default_factory=_recent)

    def count_prefill(self, prompt_tokens: int, seconds: float) -> None:
        """One iteration prefilled ``prompt_tokens`` prompt tokens (in one pass or several) in ``seconds``."""
        self.prefill_seconds += seconds
        passes, total = self.prefill_by_tokens.get(prompt_tokens, (0, 0.0))
        self.prefill_by_tokens[prompt_tokens] = (passes + 1, total + seconds)

    def count_decode(self, batch: int, seconds: float, slots_read: int) -> None:
        """One decode step of ``batch`` rows took ``seconds`` and attended over ``slots_read`` cache token slots
        (rows x padded length)."""
        self.decode_seconds += seconds
        steps, total, read = self.decode_by_batch.get(batch, (0, 0.0, 0))
        self.decode_by_batch[batch] = (steps + 1, total + seconds, read + slots_read)

    def count_iteration(self, started: float, seconds: float, decodes: int, prompt_tokens: int) -> None:
        """One iteration began at ``started`` (``time.perf_counter``), took ``seconds`` and split its token budget
        into ``decodes`` decodes and ``prompt_tokens`` prompt tokens."""
        self.iterations.append((started, seconds))
        self.budget_used.append((decodes, prompt_tokens))

    def as_stats(self) -> dict[str, Any]:
        """The counters as ``/health`` shows them (JSON: dict keys as text, tuples as lists)."""
        return {
            "steps": self.steps,
            "prefills": self.prefills,
            "tokens_generated": self.tokens_generated,
            "mean_batch_size": self.batch_size_sum / self.steps if self.steps else 0.0,
            "mean_decode_step_ms": 1e3 * self.decode_seconds / self.steps if self.steps else 0.0,
            "prefill_seconds": self.prefill_seconds,
            # {batch: [steps, seconds, cache token slots read]}; a step is counted just after its tokens went
            # out, so a reader that just got its last token may see it a moment later
            "decode_steps_by_batch": {str(b): list(t) for b, t in sorted(list(self.decode_by_batch.items()))},
            # {prompt tokens: [iterations, seconds]} of the iterations that prefilled
            "prefill_steps_by_tokens": {str(n): list(t) for n, t in sorted(list(self.prefill_by_tokens.items()))},
        }
