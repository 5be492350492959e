"""The engine's settings, in one place (vLLM's ``VllmConfig``, in small).

:class:`EngineConfig` names each setting once, with its default, its check and its meaning. The
in-process engine (:class:`~course.serving.engine.Engine`), the engine core process
(:class:`~course.serving.engine_process.EngineProcess`, which sends the record to its child) and the server
(:func:`~course.serving.api.server.create_app`, ``course serve``) all take it, so a setting added here
reaches every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from course.models import LanguageModel

# A core with requests open that finishes no step for this long is reported as wedged (/health: 503). A busy
# core steps every few milliseconds on the tiny model, and at most a few seconds for a chunk of
# max_prefill_tokens on a large model on a CPU.
WEDGED_AFTER_S = 60.0


@dataclass(frozen=True)
class EngineConfig:
    """How the continuous-batching engine runs.

    Attributes:
        max_batch_size: most requests decoded together; 1 = one request at a time (vLLM's ``max_num_seqs``).
        max_model_len: most tokens (prompt + output) per request; None: the model's ``max_position_embeddings``.
        max_prefill_tokens: the token budget of one iteration, shared by the running requests (one token
            each) and the prompt chunks (vLLM's ``max_num_batched_tokens``): a prompt longer than what is
            left is prefilled over several iterations, so running requests stall for one chunk at most,
            never for a whole long prompt. It also caps how many requests decode together.
        runner: "auto" (the lean Llama-family runner where it applies, :mod:`course.serving.runner`) or
            "transformers" (the model's own forward pass).
        prefix_cache_bytes: the prefix cache's budget (:mod:`course.serving.prefix_cache`), bytes of cached
            keys and values on the model's device; 0 (the default) turns prefix caching off.
        wedged_after: seconds without a finished step, while requests are open, after which the engine's
            ``health()`` reports it wedged.
    """

    max_batch_size: int = 64
    max_model_len: int | None = None
    max_prefill_tokens: int = 512
    runner: str = "auto"
    prefix_cache_bytes: int = 0
    wedged_after: float = WEDGED_AFTER_S

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"prefix_cache_bytes must be >= 0 (0 = off), got {self.prefix_cache_bytes}")
        if not self.wedged_after > 0:
            raise ValueError(f"wedged_after must be positive seconds, got {self.wedged_after!r}")

    def model_len(self, lm: LanguageModel) -> int:
        """The context length the engine serves ``lm`` with: ``max_model_len``, at most the model's positions
        (4096 where its config names none); ValueError when it asks for more."""
        positions = getattr(lm.model.config, "max_position_embeddings", None) or 4096
        length = int(self.max_model_len or positions)
        if length > positions:
            raise ValueError(f"max_model_len {length} exceeds the model's {positions} positions")
        return length
