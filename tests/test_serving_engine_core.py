"""A finished request's reason is an enum with its message beside it (never a string to parse), and the
engine core steps apart from the clients that drive it (vLLM V1's ``EngineCore`` and its clients)."""

from __future__ import annotations

import json
import pickle

import pytest

from course import vllm_release
from course.serving.messages import AbortRequest, StepOutputs
from course.serving.request import ABORTED, EngineRequest, FinishReason, TokenEvent, failed, unavailable
from course.serving.sampler import SamplingParams
from course.serving.testing import shared_chatty_model


@pytest.fixture(scope="module")
def lm():
    return shared_chatty_model()


def test_finish_reasons_are_vllms_wire_values():
    """Each reason is written into a response as vLLM's API spells it (JSON and SSE text alike)."""
    assert {reason.value for reason in FinishReason} <= set(vllm_release.FINISH_REASONS)
    assert json.dumps({"finish_reason": FinishReason.LENGTH}) == '{"finish_reason": "length"}'
    assert f'"{FinishReason.STOP}"' == '"stop"' and FinishReason.ABORT == "abort"


def test_an_error_carries_its_message_and_status_beside_the_reason():
    """500 for a failure, 503 for an engine shutting down; the message is not part of the reason."""
    assert failed("boom: it broke") == TokenEvent(None, FinishReason.ERROR, "boom: it broke", 500)
    assert unavailable("the engine is shut down").status == 503
    assert ABORTED.finish_reason is FinishReason.ABORT and ABORTED.error is None and ABORTED.status is None


def test_reasons_cross_the_process_boundary_as_the_enum():
    """The core's last events and abort commands keep their enum through pickling."""
    outputs = pickle.loads(pickle.dumps(StepOutputs([("r1", failed("x")), ("r2", TokenEvent(7, FinishReason.STOP))])))
    assert [event.finish_reason for _, event in outputs.events] == [FinishReason.ERROR, FinishReason.STOP]
    assert outputs.events[0][1].status == 500
    assert pickle.loads(pickle.dumps(AbortRequest("r1"))).reason is FinishReason.ABORT


def test_an_abort_reason_is_not_parsed(lm):
    """A reason that is not a FinishReason is refused, not read as "kind:message"."""
    from course.serving.engine import Engine

    engine = Engine(lm, background=False)
    request = engine.submit([1, 2, 3], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError):
        engine.abort(request.request_id, "error:boom")
    engine.abort(request.request_id)
    engine.step()
    assert request.finish_reason is FinishReason.ABORT and request.error is None
    engine.stop()


def test_the_core_steps_by_hand_with_no_thread_or_lock_of_its_own(lm):
    """EngineCore is stepped by its caller; it starts no thread and holds no lock (the scheduler's queue is
    where other threads hand it requests)."""
    import threading

    import torch

    from course.serving.config import EngineConfig
    from course.serving.engine import Engine
    from course.serving.engine_core import EngineCore

    events = []
    core = EngineCore(lm, EngineConfig(max_batch_size=2), on_events=events.extend)
    assert not any(isinstance(v, (threading.Thread, type(threading.Lock()))) for v in vars(core).values())
    threads = threading.active_count()
    requests = [core.add_request(EngineRequest(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=4))) for i in range(3)]
    with torch.inference_mode():
        for _ in range(20):
            core.step()
    assert threading.active_count() == threads and core.num_unfinished == 0
    assert [r.finish_reason for r in requests] == [FinishReason.LENGTH] * 3
    assert [event.finish_reason for _, event in events if event.finish_reason] == [FinishReason.LENGTH] * 3
    engine = Engine(lm, max_batch_size=2)
    try:
        assert [r.output_ids for r in requests] == [
            engine.generate([5 + i, 6, 7], SamplingParams(max_tokens=4)) for i in range(3)
        ]
    finally:
        engine.stop()
    core.stop()
    with torch.inference_mode():
        assert core.step() is True


def test_the_in_process_client_reads_and_writes_its_cores_parts(lm):
    """Engine's settings, parts and counters are its core's (a benchmark swaps the runner through it)."""
    from course.serving.engine import Engine

    engine = Engine(lm, max_batch_size=3, background=False)
    assert engine.max_batch_size == engine.core.max_batch_size == 3 and engine.scheduler is engine.core.scheduler
    runner = engine.runner
    engine.runner = "swapped"
    assert engine.core.runner == "swapped"
    engine.runner = runner
    engine.submit([1, 2], SamplingParams(max_tokens=2))
    while engine.num_unfinished:
        engine.step()
    assert engine.counters is engine.core.counters
    assert engine.counters.steps == 1 and engine.counters.tokens_generated == 2 and engine.stats()["steps"] == 1
    engine.stop()


def test_module_2s_guard_watches_the_core_too(lm):
    """forbid_reference(course.serving.engine) refuses an answer that builds and steps the core itself."""
    import course.serving.engine
    from course.grading import forbid_reference
    from course.serving.config import EngineConfig
    from course.serving.engine_core import EngineCore

    with pytest.raises(AssertionError, match="course.serving.engine_core"), forbid_reference(course.serving.engine):
        EngineCore(lm, EngineConfig(max_batch_size=1))
