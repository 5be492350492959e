"""Helpers shared by several test modules (imported as ``helpers``; pytest puts tests/ on the path).

Test modules import from here instead of from each other, so a test file can be renamed, split or
run alone without breaking another.
"""

from __future__ import annotations

import functools

from course.sim import BlockManager, SimConfig, harness, prompt_block_hashes, steps
from course.trace import RequestTrace
from course.workload import Workload

# --- the simulator's readable reference ----------------------------------------------------------


class CheckedBlocks:
    """A block manager that checks its invariants after every change (slow; for property tests)."""

    def __init__(self, blocks: BlockManager) -> None:
        self._blocks = blocks

    def __getattr__(self, name):
        attribute = getattr(self._blocks, name)
        if name in {"allocate", "append", "reserve", "free", "cache_full_blocks"}:

            def checked(*args, **kwargs):
                result = attribute(*args, **kwargs)
                self._blocks.check()
                return result

            return checked
        return attribute


def reference_step(config: SimConfig) -> harness.StepFunction:
    """The step function of ``config``'s iteration-level scheduler, with every setting it has."""
    if config.scheduler == "continuous":
        return functools.partial(
            steps.continuous_step,
            token_budget=config.token_budget,
            max_num_seqs=config.max_num_seqs,
            chunked_prefill=config.chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
        )
    if config.scheduler == "prefill-first" and config.decode_after_prefill:
        return steps.PrefillThenDecode(config.token_budget, config.max_num_seqs, config.watermark_blocks)
    if config.scheduler == "prefill-first":
        return functools.partial(
            steps.prefill_first_step,
            token_budget=config.token_budget,
            max_num_seqs=config.max_num_seqs,
            watermark_blocks=config.watermark_blocks,
        )
    raise ValueError(f"{config.scheduler!r} has no step function; static batching is steps.run_static")


def reference(
    work: Workload, config: SimConfig, cost, *, check_blocks: bool = False
) -> tuple[list[RequestTrace], harness.HarnessRun | None]:
    """``config``'s simulation through the readable reference: (traces, the harness run or None).

    Iteration-level schedulers run through :func:`course.sim.harness.run` and the step functions
    of :mod:`course.sim.steps`; static batching through :func:`course.sim.steps.run_static` (no
    harness run). Every setting of ``config`` is honoured, so the fast engine can be compared with
    this on any configuration.
    """
    if config.scheduler == "static":
        traces = steps.run_static(
            work,
            config.max_num_seqs,
            cost,
            num_blocks=config.num_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
        )
        return traces, None
    blocks = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)

    def hashes(spec):
        return prompt_block_hashes(spec.request_id, spec.prompt_tokens, config.block_size, spec.prompt_segments)

    run = harness.run(
        work,
        reference_step(config),
        CheckedBlocks(blocks) if check_blocks else blocks,
        cost,
        block_hashes=hashes if config.enable_prefix_caching else None,
        max_model_len=config.max_model_len,
        watermark_blocks=config.watermark_blocks if config.scheduler == "prefill-first" else 0,
    )
    return run.traces, run
