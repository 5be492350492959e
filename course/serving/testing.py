"""Helpers for the tests of servers and generators (the course's and the learners').

* :func:`chatty_tiny_model`: the tiny model with wider random weights. The shipped tiny model's
  greedy output repeats one token forever, which cannot tell a correct decoder from one that
  mixes up positions or sequences; this one's output changes at every step.
* :class:`ForwardLog`: records the input length of every forward pass of a model, so a test
  can check "prefill once, then one token per step" and count decode steps server-side.
* :func:`greedy_reference`: greedy tokens computed the straightforward way, for comparison.
* :func:`sse_data`: the ``data:`` payloads of a raw SSE body, checking the framing on the way.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

from course.models import LanguageModel, build_tiny_model, forward, new_cache


def chatty_tiny_model(seed: int = 0, dtype=None, std: float = 0.15) -> LanguageModel:
    """The tiny model with every weight matrix redrawn from N(0, std) (seeded): varied greedy output."""
    import torch

    lm = build_tiny_model(seed, dtype=dtype)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in lm.model.parameters():
            if parameter.dim() == 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * std)
    lm.source += f", weights redrawn with std {std}"
    return lm


class ForwardLog:
    """Record ``(batch, new_tokens)`` of every forward pass of ``lm.model`` while active.

    >>> with ForwardLog(lm) as log:               # doctest: +SKIP
    ...     list(generate(...))
    >>> log.shapes                                 # [(1, 12), (1, 1), (1, 1), ...]
    """

    def __init__(self, lm: LanguageModel) -> None:
        self.model = lm.model
        self.shapes: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._handle = None

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        with self._lock:
            self.shapes.append((int(ids.shape[0]), int(ids.shape[1])))

    @property
    def calls(self) -> int:
        return len(self.shapes)

    @property
    def decode_steps(self) -> int:
        """Forward passes that fed one new token per sequence."""
        return sum(1 for _, n in self.shapes if n == 1)

    def __enter__(self) -> ForwardLog:
        self._handle = self.model.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def greedy_reference(lm: LanguageModel, prompt_ids: Sequence[int], max_tokens: int, stop_ids=()) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (prefill, then cached decode steps), batch 1."""
    import torch

    tokens: list[int] = []
    with torch.inference_mode():
        logits, cache = forward(lm.model, torch.tensor([list(prompt_ids)], device=lm.device), new_cache(lm.model))
        for _ in range(max_tokens):
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if token in stop_ids:
                break
            logits, cache = forward(lm.model, torch.tensor([[token]], device=lm.device), cache)
    return tokens


def sse_data(body: str) -> list[str]:
    """The payloads of ``data:`` events in an SSE body; raises AssertionError on bad framing.

    Events must be ``data: <payload>`` followed by a blank line (``\\n\\n``; ``\\r\\n`` tolerated).
    """
    text = body.replace("\r\n", "\n")
    assert text.endswith("\n\n"), f"an SSE body must end with a blank line; it ends with {text[-20:]!r}"
    payloads = []
    for event in text[:-2].split("\n\n"):
        lines = [line for line in event.split("\n") if line and not line.startswith(":")]
        assert len(lines) == 1 and lines[0].startswith("data:"), f"not a single data: line: {event[:80]!r}"
        payloads.append(lines[0][5:].strip())
    return payloads


def sse_json(body: str) -> tuple[list[dict], bool]:
    """(JSON payloads before [DONE], whether [DONE] came last)."""
    payloads = sse_data(body)
    done = bool(payloads) and payloads[-1] == "[DONE]"
    return [json.loads(p) for p in (payloads[:-1] if done else payloads)], done
