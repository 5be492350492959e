"""Aborts reach every request, whether it is waiting, being admitted or running (the engine driven by hand)."""

from __future__ import annotations

import pytest
import torch

from course.serving.engine import Engine, SamplingParams
from course.serving.runner import observe_forward
from course.serving.testing import shared_chatty_model


@pytest.fixture(scope="module")
def lm():
    return shared_chatty_model(seed=11)


def _params(n: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_requests_aborted_before_admission_never_run(lm):
    """40 requests submitted and aborted at once on a busy engine: none is prefilled or decoded."""
    engine = Engine(lm, max_batch_size=8, max_prefill_tokens=64, background=False)
    busy = [engine.submit(list(range(10, 20)), _params()) for _ in range(4)]
    engine.step()  # the busy ones are running
    assert engine.num_running == 4
    doomed = [engine.submit(list(range(30, 40 + i % 5)), _params()) for i in range(40)]
    for request in doomed:
        engine.abort(request.request_id)
    engine.step()
    assert all(r.finish_reason == "abort" for r in doomed), [r for r in doomed if r.finish_reason != "abort"]
    assert all(r.output_ids == [] and r.steps_after_abort == 0 for r in doomed)
    assert engine.num_waiting == 0 and engine.num_running == 4 and engine.counters.prefills == 1
    for request in busy:
        engine.abort(request.request_id)
    engine.step()
    assert all(r.finish_reason == "abort" and r.steps_after_abort <= 1 for r in busy)
    assert engine.num_unfinished == 0 and engine.cache_tokens() == 0


@pytest.mark.parametrize("when", ["after submit", "after its prefill", "mid-decode"])
def test_at_most_one_step_after_an_abort(lm, when):
    engine = Engine(lm, max_batch_size=4, background=False)
    other = engine.submit([5, 6, 7], _params())
    request = engine.submit([8, 9, 10, 11], _params())
    steps = {"after submit": 0, "after its prefill": 1, "mid-decode": 6}[when]
    for _ in range(steps):
        engine.step()
    engine.abort(request.request_id)
    produced = len(request.output_ids)
    for _ in range(3):
        engine.step()
    assert request.finish_reason == "abort"
    assert request.steps_after_abort <= 1 and len(request.output_ids) - produced <= 1
    assert request.freed_step is not None and request.freed_step - request.abort_requested_step <= 1
    events = list(request)
    assert events[-1].finish_reason == "abort" and events[-1].token is None
    assert other.finish_reason is None and engine.num_running == 1


def test_stop_admits_nothing_and_fails_every_request(lm):
    engine = Engine(lm, max_batch_size=2, background=False)
    running = engine.submit([5, 6, 7], _params())
    engine.step()
    waiting = [engine.submit([8, 9, 10], _params()) for _ in range(5)]
    engine.stop()  # background=False: stop() only asks; the next steps carry it out
    prefills = engine.counters.prefills
    while not engine.step():
        pass
    assert engine.counters.prefills == prefills, "a request waiting at shutdown must not be prefilled"
    assert all(r.finish_reason == "error" and "shutting down" in r.error for r in [running, *waiting])
    assert all(r.output_ids == [] for r in waiting)


def test_steps_run_in_inference_mode(lm):
    """Issue 14 item 5: every step of the engine, background or by hand, runs without autograd."""
    grad_modes = []
    handle = observe_forward(lm.model, lambda _: grad_modes.append(torch.is_grad_enabled()))  # the lean runner's passes
    try:
        engine = Engine(lm, background=False)
        engine.submit([5, 6, 7], _params(4))
        for _ in range(5):
            engine.step()
        threaded = Engine(lm)
        threaded.generate([5, 6, 7], _params(4))
        threaded.stop()
    finally:
        handle()
    assert len(grad_modes) >= 8 and not any(grad_modes)
