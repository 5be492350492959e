"""One request of the readable simulation, and the step functions that move such requests.

The request record follows vLLM V1 (``vllm/v1/request.py``): a request has ``num_tokens`` =
prompt + generated tokens and ``computed`` tokens whose KV is in the cache. Each step the scheduler
gives it ``n`` new tokens to compute; when ``computed`` reaches ``num_tokens`` the step also
samples one new output token. A prefill is just a request with many uncomputed tokens; a request
preempted by recompute keeps its generated tokens, gets ``computed = 0`` and prefills them again.

Module 3's learners write step functions over these records (:data:`StepFunction`); the library's own are in
:mod:`course.sim.steps`, and the readable ledger (:class:`course.sim.harness.ReadableLedger`) keeps them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from course.workload import RequestSpec


@dataclass(eq=False)
class SimRequest:
    """One request inside the readable simulation (compared by identity, so ``victim is request`` works).

    Attributes:
        request_id, arrival_time (s), prompt_tokens, output_tokens: from the workload.
        computed: tokens whose KV is in the cache.
        generated: output tokens produced so far.
        preemptions: how often it was preempted.
        block_hashes: chained hashes of its full prompt blocks (prefix caching only).
        prefix_hit_tokens, queried_tokens: prompt tokens served from the prefix cache and tokens looked
            up in it, over all its admissions.
        error: why it was rejected on arrival (None: it ran).
        token_steps, scheduled_steps, preempted_steps: the steps (indices into the run's step log) that
            gave it an output token, admitted it to the batch and preempted it.
    """

    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    computed: int = 0
    generated: int = 0
    preemptions: int = 0
    block_hashes: list = field(default_factory=list)
    prefix_hit_tokens: int = 0
    queried_tokens: int = 0
    error: str | None = None
    token_steps: list[int] = field(default_factory=list)
    scheduled_steps: list[int] = field(default_factory=list)
    preempted_steps: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return self.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next output token."""
        return self.num_tokens - self.computed

    @property
    def finished(self) -> bool:
        return self.generated >= self.output_tokens

    @classmethod
    def from_spec(cls, spec: RequestSpec) -> SimRequest:
        return cls(spec.request_id, spec.arrival_time, spec.prompt_tokens, spec.output_tokens)


# The step functions that the harness drives: (running, waiting, blocks) -> [(request, tokens)].
StepFunction = Callable[[list, deque, object], list]
