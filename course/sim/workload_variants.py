"""Workload transformations the module-3 experiments need, on top of :mod:`course.workload`."""

from __future__ import annotations

from dataclasses import replace

from course.workload import Workload


def with_system_prompt(
    workload: Workload, system_tokens: int, *, front_tokens: int = 0, name: str = "system prompt"
) -> Workload:
    """Put the same ``system_tokens``-token system prompt before every request's own prompt.

    With ``front_tokens > 0`` each request first gets that many tokens of its own (a timestamp or a
    request id placed at the very front), then the identical system prompt, then its question: the
    same text, but no two prompts share a first block any more, so the chained block hashes of
    prefix caching never match. The request's own prompt length is kept and the prefix added to it.
    """
    if system_tokens < 0 or front_tokens < 0:
        raise ValueError("system_tokens and front_tokens must be >= 0")
    requests = []
    for spec in workload:
        segments = []
        if front_tokens:
            segments.append((f"front of request {spec.request_id}", front_tokens))
        if system_tokens:
            segments.append((name, system_tokens))
        segments.append((f"question of request {spec.request_id}", spec.prompt_tokens))
        requests.append(
            replace(
                spec,
                prompt_tokens=spec.prompt_tokens + system_tokens + front_tokens,
                prompt_segments=tuple(segments),
            )
        )
    where = f", {front_tokens} unique tokens in front" if front_tokens else ""
    return Workload(requests, name=f"{workload.name} + {system_tokens}-token {name}{where}", metadata=workload.metadata)


def cap_output(workload: Workload, max_tokens: int) -> Workload:
    """Every request generates at most ``max_tokens`` tokens (the server's ``max_tokens`` cap)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    requests = [replace(spec, output_tokens=min(spec.output_tokens, max_tokens)) for spec in workload]
    return Workload(requests, name=f"{workload.name}, output cap {max_tokens}", metadata=workload.metadata)


def scale_prompts(workload: Workload, factor: float) -> Workload:
    """Every prompt ``factor`` times as long (at least one token)."""
    if factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    requests = [
        replace(spec, prompt_tokens=max(1, round(spec.prompt_tokens * factor)), prompt_segments=()) for spec in workload
    ]
    return Workload(requests, name=f"{workload.name}, prompts x{factor:g}", metadata=workload.metadata)
