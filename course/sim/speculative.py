"""Speculative decoding in the course's cost model: what k draft tokens buy at acceptance rate a.

A cheap drafter proposes ``k`` tokens; the target model scores all of them, plus one position past
them, in one forward pass (the *verification step*); the longest prefix it agrees with is kept, and the
target's own token at the first disagreement (or past the last draft token when all were accepted) comes
for free: the **bonus token**. With each draft token accepted independently with probability ``a``, the
tokens one verification step yields are ``1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)``
(Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding", ICML 2023,
https://arxiv.org/abs/2211.17192, equation 1), ``k + 1`` when ``a = 1`` and 1 when ``a = 0``.

What the step costs comes from the course's cost model (:mod:`course.sim.cost`): verifying ``k + 1``
tokens per request after ``context`` cached ones is a chunk of ``k + 1`` tokens per request, the same
weights read once and ``k + 1`` times the FLOPs of a decode step. At a small batch the decode step is
bandwidth-bound (the weights dominate), so verification costs about one decode step and the speed-up
is nearly the tokens per step; as the batch grows the step turns compute-bound, verification costs up
to ``k + 1`` decode steps, and the speed-up falls below 1 (:func:`speedup_curve` shows where).

The drafter's own cost: ``None`` is a drafter with no model (vLLM's ``ngram`` prompt lookup, or an
EAGLE-style head whose cost is small next to the target's); or a cost model of a small draft model,
run ``k`` times at the same batch and context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one verification step yields with ``k`` draft tokens, each accepted with probability
    ``acceptance`` (independently), the bonus token included: (1 - a^(k+1)) / (1 - a)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k (draft tokens per step) must be an integer >= 0, got {k!r}")
    if not 0 <= acceptance <= 1:
        raise ValueError(f"acceptance is a probability in [0, 1], got {acceptance!r}")
    if acceptance == 1:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


def decode_seconds(cost: Any, batch: int, context: int) -> float:
    """One plain decode step: ``batch`` requests each compute one token after ``context`` cached ones."""
    _check(batch, context)
    return cost.step_seconds(0, batch, batch * context, batch * (context + 1))


def verify_seconds(cost: Any, batch: int, context: int, k: int) -> float:
    """One verification step: ``batch`` requests each score ``k + 1`` tokens after ``context`` cached
    ones (a chunk of ``k + 1``: ``(k+1)*context + (k+1)(k+2)/2`` attention pairs per request)."""
    _check(batch, context)
    n = k + 1
    return cost.step_seconds(batch * n, 0, batch * context, batch * (n * context + n * (n + 1) / 2))


def _check(batch: int, context: int) -> None:
    if batch < 1 or context < 0:
        raise ValueError(f"need batch >= 1 and context >= 0 tokens, got {batch} and {context}")


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding at one batch size (seconds; ``speedup`` over plain decoding, per request).

    Attributes:
        batch, context, k, acceptance: the setting.
        tokens_per_step: expected tokens per verification step (bonus included).
        decode: a plain decode step.
        verify: the target's verification step.
        draft: the drafter's ``k`` steps (0 for a drafter with no model).
        speedup: tokens per second with speculation over without:
            ``tokens_per_step x decode / (verify + draft)``.
    """

    batch: int
    context: int
    k: int
    acceptance: float
    tokens_per_step: float
    decode: float
    verify: float
    draft: float

    @property
    def speedup(self) -> float:
        return self.tokens_per_step * self.decode / (self.verify + self.draft)


def speculate(
    cost: Any, batch: int, context: int, k: int, acceptance: float, draft_cost: Any | None = None
) -> Speculation:
    """Speculative decoding's step costs and speed-up at one batch size (see the module docstring)."""
    tokens = expected_tokens(k, acceptance)
    draft = k * decode_seconds(draft_cost, batch, context) if draft_cost is not None else 0.0
    return Speculation(
        batch, context, k, acceptance, tokens, decode_seconds(cost, batch, context),
        verify_seconds(cost, batch, context, k), draft,
    )  # fmt: skip


def speedup_curve(
    cost: Any,
    batches: Sequence[int],
    context: int,
    k: int,
    acceptance: float,
    draft_cost: Any | None = None,
) -> list[Speculation]:
    """:func:`speculate` at every batch size: the speed-up shrinks as the step turns compute-bound."""
    return [speculate(cost, b, context, k, acceptance, draft_cost) for b in batches]


def break_even_batch(
    cost: Any, context: int, k: int, acceptance: float, draft_cost: Any | None = None, limit: int = 4096
) -> int | None:
    """The smallest batch (power of two up to ``limit``) at which speculation no longer speeds decoding
    up (speed-up <= 1), or None when it still does at ``limit``."""
    batch = 1
    while batch <= limit:
        if speculate(cost, batch, context, k, acceptance, draft_cost).speedup <= 1:
            return batch
        batch *= 2
    return None
