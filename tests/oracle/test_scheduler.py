"""The simulator's V1 step against vLLM's own scheduler, driven with the same requests on the CPU.

vLLM's ``Scheduler`` (``vllm/v1/core/sched/scheduler.py``) runs without a model: it only needs a config
and a KV-cache layout. Each test feeds it and the course's readable step (:func:`course.sim.steps.
continuous_step`, which the fast engine is property-tested against) the same arrivals, then compares
every step: which requests got how many tokens, and which were preempted. vLLM keeps one block back
(the null block), so its pool has one block more than the course's.

With async scheduling (vLLM 0.32's default on GPUs) the test drives ``AsyncScheduler``
(``vllm/v1/core/sched/async_scheduler.py``) the way ``EngineCore.step_with_batch_queue``
(``vllm/v1/engine/core.py``) does with its batch queue of 2: step k+1 is scheduled, then step k's output
is processed. The course's side holds the requests that finished in step k until step k+1 is
scheduled (:func:`course.sim.harness.retire`), as :func:`course.sim.harness.run` does.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from course.models import save_tiny_model
from course.sim import BlockManager, steps
from course.sim.harness import SimRequest, retire

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


def _vllm_scheduler(model_dir, *, num_blocks, budget, max_num_seqs, threshold=0, adaptive=False, full=True,
                    watermark=0.0, async_scheduling=False):  # fmt: skip
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True, is_encoder_decoder=False, long_prefill_token_threshold=threshold,
        long_prefill_token_threshold_adaptive=adaptive, scheduler_reserve_full_isl=full, watermark=watermark,
        async_scheduling=async_scheduling,
    )  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, dtype="float32"),
        scheduler_config=scheduler_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False),
    )
    vllm_blocks = num_blocks + 1  # the null block
    config.cache_config.num_gpu_blocks = vllm_blocks
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    layout = KVCacheConfig(
        num_blocks=vllm_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)]
    )
    kind = AsyncScheduler if async_scheduling else Scheduler
    return kind(config, layout, StructuredOutputManager(config), block_size=BLOCK_SIZE)


def _run_both(model_dir, arrivals, *, num_blocks, budget, max_num_seqs, threshold=0, adaptive=False, full=True,
              watermark=0.0, async_scheduling=False, course_async=None, max_steps=3000):  # fmt: skip
    """Step both schedulers; ``arrivals`` is [(step, prompt tokens, output tokens)]. Returns the two logs.

    A "step" is one call of ``schedule()`` on each side; under async scheduling a call may schedule
    nobody (every running request's last token is in flight). ``course_async`` (default: as vLLM)
    lets a test run the course's side the other way, to show the comparison catches it.
    """
    course_async = async_scheduling if course_async is None else course_async
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    theirs = _vllm_scheduler(
        model_dir, num_blocks=num_blocks, budget=budget, max_num_seqs=max_num_seqs, threshold=threshold,
        adaptive=adaptive, full=full, watermark=watermark, async_scheduling=async_scheduling,
    )  # fmt: skip
    blocks = BlockManager(num_blocks, BLOCK_SIZE)
    finishing: list[SimRequest] = []  # course, async: finished in the last step, freed after this schedule
    in_flight = None  # vLLM, async: (the last step's output, its model output), processed after the next schedule
    running: list[SimRequest] = []
    waiting: deque[SimRequest] = deque()
    pending = sorted(enumerate(arrivals), key=lambda item: item[1][0])
    ours_log, theirs_log = [], []
    for step in range(max_steps):
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, output) = pending.pop(0)
            rid = f"r{i}"
            waiting.append(SimRequest(rid, float(step), prompt, output))
            theirs.add_request(
                Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=output, ignore_eos=True), None,
                        arrival_time=float(step))
            )  # fmt: skip
        if not running and not waiting and not pending:
            if in_flight is not None:
                theirs.update_from_output(*in_flight)
            assert not theirs.has_unfinished_requests()
            return ours_log, theirs_log
        # the course's step
        before = {r.request_id: r.preemptions for r in running}
        batch = steps.continuous_step(
            running, waiting, blocks, budget, max_num_seqs, long_prefill_token_threshold=threshold,
            long_prefill_token_threshold_adaptive=adaptive, reserve_full_isl=full,
            watermark_blocks=int(watermark * num_blocks),
        )  # fmt: skip
        preempted = {rid for rid, count in before.items() if any(
            r.request_id == rid and r.preemptions > count for r in waiting)}  # fmt: skip
        ours_log.append(({r.request_id: n for r, n in batch}, preempted))
        retire(finishing, running, waiting, blocks)  # async: the last step's finished requests leave now
        finished = []
        for request, n in batch:
            request.computed += n
            if request.computed == request.num_tokens:
                request.generated += 1
                if request.finished:
                    finished.append(request)
        if course_async:
            finishing = finished
        else:
            retire(finished, running, waiting, blocks)
        # vLLM's step: a token is sampled for a request whose chunk completed its prompt or that decodes
        out = theirs.schedule()
        ids = list(out.num_scheduled_tokens)
        if async_scheduling:  # after schedule() the placeholders count the in-flight tokens
            sampled = [[] if theirs.requests[rid].is_prefill_chunk else [7] for rid in ids]
        else:
            sampled = [[7] if theirs.requests[rid].num_computed_tokens >= theirs.requests[rid].num_tokens else []
                       for rid in ids]  # fmt: skip
        theirs_log.append((dict(out.num_scheduled_tokens), set(out.preempted_req_ids or ())))
        model_output = ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled
        )
        if async_scheduling:  # the engine core's batch queue: schedule k+1, then process k
            if in_flight is not None:
                theirs.update_from_output(*in_flight)
            in_flight = (out, model_output)
        else:
            theirs.update_from_output(out, model_output)
        assert ours_log[-1] == theirs_log[-1], f"step {step}: course {ours_log[-1]} vs vLLM {theirs_log[-1]}"
    pytest.fail("did not finish")


def _workload(seed: int, n: int = 24, spread: int = 40):
    rng = random.Random(seed)
    return [(rng.randint(0, spread), rng.randint(1, 300), rng.randint(1, 60)) for _ in range(n)]


@pytest.mark.parametrize("seed", range(4))
def test_steps_match_vllm_with_room_to_spare(model_dir, seed):
    ours, _ = _run_both(model_dir, _workload(seed), num_blocks=4096, budget=256, max_num_seqs=8)
    assert len(ours) > 10


@pytest.mark.parametrize("seed", range(4))
def test_steps_match_vllm_under_kv_pressure_with_preemption(model_dir, seed):
    ours, _ = _run_both(model_dir, _workload(seed), num_blocks=40, budget=128, max_num_seqs=16)
    assert any(preempted for _, preempted in ours) or seed, "the tight cache preempts (in at least seed 0)"


@pytest.mark.parametrize("full", [True, False])
def test_whole_sequence_reservation_matches_vllm_both_ways(model_dir, full):
    """scheduler_reserve_full_isl on (vLLM 0.32's default) and off (0.11's rule)."""
    _run_both(model_dir, _workload(7), num_blocks=30, budget=64, max_num_seqs=16, full=full)


@pytest.mark.parametrize("adaptive", [False, True])
def test_long_prefill_threshold_matches_vllm(model_dir, adaptive):
    work = [(0, 700, 5)] + _workload(3, n=10, spread=20)
    _run_both(model_dir, work, num_blocks=2048, budget=256, max_num_seqs=8, threshold=48, adaptive=adaptive)


def test_the_watermark_matches_vllm(model_dir):
    _run_both(model_dir, _workload(5), num_blocks=60, budget=128, max_num_seqs=16, watermark=0.2)


# --- async scheduling (vLLM 0.32's default on GPUs) -------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_async_steps_match_vllm_with_room_to_spare(model_dir, seed):
    ours, _ = _run_both(model_dir, _workload(seed), num_blocks=4096, budget=256, max_num_seqs=8, async_scheduling=True)
    assert len(ours) > 10


@pytest.mark.parametrize("seed", range(4))
def test_async_steps_match_vllm_under_kv_pressure_with_preemption(model_dir, seed):
    ours, _ = _run_both(model_dir, _workload(seed), num_blocks=30, budget=128, max_num_seqs=16, async_scheduling=True)
    assert any(preempted for _, preempted in ours), "the tight cache preempts"


def test_async_a_finished_request_holds_its_slot_for_one_more_schedule(model_dir):
    """max_num_seqs 2: C waits for A's slot; A's last token is in flight when the next step is scheduled."""
    work = [(0, 20, 2), (0, 20, 6), (0, 20, 3)]
    ours, _ = _run_both(model_dir, work, num_blocks=4096, budget=256, max_num_seqs=2, async_scheduling=True)
    # A finishes in step 1 (prefill, then 1 decode); synchronous scheduling would admit C in step 2
    assert [sorted(batch) for batch, _ in ours[:4]] == [["r0", "r1"], ["r0", "r1"], ["r1"], ["r1", "r2"]]


def test_async_preempting_a_request_whose_last_token_is_in_flight_matches_vllm(model_dir):
    """The finishing request is the newest in the batch, so it is the victim; it still finishes."""
    # r0 fills 3 blocks and decodes on; r1 (1 block) finishes after 1 token; r0's next block needs r1's
    work = [(0, 47, 10), (1, 15, 1)]
    ours, theirs = _run_both(model_dir, work, num_blocks=4, budget=64, max_num_seqs=4, async_scheduling=True)
    assert any("r1" in preempted for _, preempted in ours)


@pytest.mark.parametrize("seed", range(2))
def test_freeing_finished_requests_at_once_disagrees_with_async_vllm(model_dir, seed):
    """The comparison can fail: the course's side freeing at the end of the step (synchronous) is caught."""
    with pytest.raises(AssertionError, match="course"):
        _run_both(model_dir, _workload(seed), num_blocks=30, budget=128, max_num_seqs=16, async_scheduling=True,
                  course_async=False)  # fmt: skip
