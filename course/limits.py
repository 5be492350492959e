"""The rules that make a request too long, each with one message.

Two limits turn a request away before it runs:

* the model's context, ``max_model_len``: prompt plus output must fit in it. A simulated workload
  fixes every output length, so the simulator rejects a request that does not fit, in the words of
  vLLM 0.11's OpenAI server (``vllm/entrypoints/openai/``, input validation). vLLM 0.32's server, and
  the course's (``course serve``), clamp ``max_tokens`` to the room the prompt leaves instead, and
  refuse only a prompt or a ``max_tokens`` longer than the context (:mod:`course.vllm_release`);
* the KV cache: a request whose prompt plus output need more blocks than the whole cache has (or,
  under vLLM V0's free-block watermark, more than admission may use) could never run; the simulator
  rejects it on arrival instead of letting it block the queue forever.
"""

from __future__ import annotations

from course.units import cdiv


def context_length_error(
    prompt_tokens: int, max_tokens: int, max_model_len: int, max_tokens_name: str = "max_tokens"
) -> tuple[str, str] | None:
    """vLLM's context-length check: ``(field to fix, message)``, or None when the request fits.

    Args:
        prompt_tokens: tokens in the prompt.
        max_tokens: output tokens asked for (a value <= 0 is taken as "none left", see below).
        max_model_len: the context length in tokens (prompt + output).
        max_tokens_name: how the request named its output cap (``max_tokens`` or
            ``max_completion_tokens``), for the message and the returned field.

    The field is ``"prompt"`` when the prompt alone leaves no room for a single output token
    (``prompt_tokens >= max_model_len``), else ``max_tokens_name``.
    """
    if prompt_tokens >= max_model_len:
        return "prompt", (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_tokens} input tokens. Please reduce the length of the input messages."
        )
    if prompt_tokens + max_tokens > max_model_len:
        return max_tokens_name, (
            f"'{max_tokens_name}' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {prompt_tokens})."
        )
    return None


def kv_capacity_error(prompt_tokens: int, output_tokens: int, num_blocks: int, block_size: int) -> str | None:
    """Why a request can never fit in a KV cache of ``num_blocks`` x ``block_size`` tokens, or None."""
    total = prompt_tokens + output_tokens
    if cdiv(total, block_size) <= num_blocks:
        return None
    return (
        f"prompt + output ({total} tokens) need {cdiv(total, block_size)} KV blocks of {block_size} tokens, "
        f"more than the cache has ({num_blocks}); give the cache more blocks or cap the output"
    )


def watermark_error(
    prompt_tokens: int, output_tokens: int, num_blocks: int, block_size: int, reserved: int
) -> str | None:
    """Why a scheduler that keeps ``reserved`` blocks free when admitting can never admit a request, or None.

    vLLM V0 admits a prompt only if ``reserved`` (its watermark) blocks stay free afterwards, and
    ignores one that could not be admitted even into an empty cache (``AllocStatus.NEVER`` in
    ``vllm/core/interfaces.py``, 0.6.x). The longest prefill a request may need is a recompute after
    a preemption: prompt + output - 1 tokens, which is what is checked here.
    """
    longest = prompt_tokens + output_tokens - 1
    if reserved <= 0 or cdiv(longest, block_size) <= num_blocks - reserved:
        return None
    return (
        f"a (re)computed prompt of up to {longest} tokens needs {cdiv(longest, block_size)} KV blocks of "
        f"{block_size} tokens, more than admission may use ({num_blocks} - {reserved} kept free by the watermark)"
    )


def rejection(
    prompt_tokens: int,
    output_tokens: int,
    num_blocks: int | None,
    block_size: int,
    max_model_len: int | None = None,
    watermark_blocks: int = 0,
) -> str | None:
    """The simulator's reason to reject a request on arrival (``"rejected: ..."``), or None.

    A request that needs more KV blocks than the cache has (``num_blocks``; None = no limit), more
    context than ``max_model_len`` (None = no limit), or, under a scheduler that keeps
    ``watermark_blocks`` free when admitting, more blocks than admission may ever use, can never
    run; the readable harness, the static reference and the fast engine all reject it with this
    message.
    """
    reason = None
    if num_blocks is not None:
        reason = kv_capacity_error(prompt_tokens, output_tokens, num_blocks, block_size)
    if reason is None and max_model_len is not None:
        too_long = context_length_error(prompt_tokens, output_tokens, max_model_len)
        reason = too_long[1] if too_long else None
    if reason is None and num_blocks is not None:
        reason = watermark_error(prompt_tokens, output_tokens, num_blocks, block_size, watermark_blocks)
    return None if reason is None else f"rejected: {reason}"
