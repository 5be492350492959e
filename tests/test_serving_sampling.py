"""Sampling: what a greedy-only sampler would get wrong, hostile values next to innocent requests, and
the logit-changing parameters (bias, penalties) tested for their effect."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.models import build_tiny_model
from course.serving.api.background import BackgroundServer, run_sync
from course.serving.api.server import create_app
from course.serving.engine import Engine
from course.serving.sampler import MIN_TEMPERATURE, SamplingParams
from course.serving.testing import greedy_reference, shared_chatty_model

PROMPT = [9, 10, 11, 12]


@pytest.fixture(scope="module")
def lm():
    return shared_chatty_model(seed=2)


@pytest.fixture(scope="module")
def engine(lm):
    running = Engine(lm, max_batch_size=16, max_model_len=512)
    yield running
    running.stop()


def _run(engine, n=12, **kw):
    return engine.generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True, **kw))


def test_sampling_is_not_greedy_and_seeds_matter(engine, lm):
    greedy = greedy_reference(lm, PROMPT, 12)
    assert _run(engine) == greedy
    by_seed = {seed: _run(engine, temperature=1.0, seed=seed) for seed in range(4)}
    assert len({tuple(v) for v in by_seed.values()}) >= 3, "different seeds must give different samples"
    assert all(v != greedy for v in by_seed.values()), "temperature 1 must not be greedy"
    assert _run(engine, temperature=1.0, seed=2) == by_seed[2], "the same seed must give the same sample"
    # Truncation has its effect: top_p so small (or top_k = 1) that only the most likely token is left.
    assert _run(engine, temperature=2.0, top_p=1e-9, seed=5) == greedy
    assert _run(engine, temperature=2.0, top_k=1, seed=5) == greedy
    wide = [_run(engine, n=4, temperature=2.0, top_k=50, seed=s) for s in range(8)]
    assert len({tuple(w) for w in wide}) > 1


def test_top_p_keeps_only_the_nucleus(lm):
    """With top_p = 0.5 every sampled token lies in the smallest set of tokens holding half the mass."""
    from course.serving.sampler import Sampler

    logits = torch.randn(lm.vocab_size, generator=torch.Generator().manual_seed(0)) * 3
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_probs.cumsum(0) < 0.5).sum()) + 1].tolist())

    class Row:
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5, seed=1)
        prompt_ids, output_ids, generator = [1], [], None

    row = Row()
    drawn = Counter(Sampler().sample_row(logits, row) for _ in range(300))
    assert set(drawn) <= nucleus and len(drawn) > 1


def test_hostile_sampling_values_are_clamped_or_refused():
    assert SamplingParams(max_tokens=1, temperature=5e-324).temperature == MIN_TEMPERATURE
    assert SamplingParams(max_tokens=1, temperature=1e-300).temperature == MIN_TEMPERATURE
    for bad in (2**64, -(2**63) - 1):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(max_tokens=1, seed=bad)
    assert SamplingParams(max_tokens=1, seed=-(2**63)).seed == -(2**63)


def test_a_failing_row_fails_alone(engine, monkeypatch):
    """A request whose sampling raises fails by itself; the rows prefilled and decoded with it go on."""
    original = engine.sampler.sample_row

    def sample_row(logits, request):
        if request.params.seed == 666:
            raise RuntimeError("hostile row")
        return original(logits, request)

    monkeypatch.setattr(engine.sampler, "sample_row", sample_row)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    innocent = [engine.submit(PROMPT, params) for _ in range(5)]
    hostile = engine.submit(PROMPT, SamplingParams(max_tokens=8, temperature=1.0, seed=666, ignore_eos=True))
    assert [e.finish_reason for e in hostile][-1] == "error" and "hostile row" in hostile.error
    assert all([e.finish_reason for e in r][-1] == "length" and len(r.output_ids) == 8 for r in innocent)


def test_hostile_requests_next_to_innocent_ones_over_http(lm):
    """Temperatures that are 0 in float32 and seeds outside int64, sent together with innocent requests."""
    hostile = [
        {"temperature": 1e-300, "seed": 3},
        {"temperature": 5e-324},
        {"temperature": 1e-300, "top_p": 1e-300},
        {"seed": 2**64, "temperature": 1.0},
        {"seed": -(2**63) - 1, "temperature": 1.0},
    ]
    engine = Engine(lm, max_batch_size=32, max_model_len=512)  # all 17 requests in one prefill group
    with BackgroundServer(create_app(engine=engine, model_name="m")) as server:

        async def main():
            async with httpx.AsyncClient(timeout=60) as http:

                async def post(extra):
                    body = {"model": "m", "prompt": "abc", "max_tokens": 16, "ignore_eos": True, **extra}
                    return await http.post(server.base_url + "/completions", json=body)

                return await asyncio.gather(*(post(extra) for extra in [{}] * 6 + hostile + [{}] * 6))

        replies = run_sync(main(), timeout=120)
    innocent = replies[:6] + replies[-6:]
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16 for r in innocent)
    clamped, out_of_range = replies[6:9], replies[9:11]
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16 for r in clamped)
    for reply in out_of_range:
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "seed", reply.text


def test_logit_bias_and_penalties_have_their_effect(engine, lm):
    greedy = greedy_reference(lm, PROMPT, 24)
    forced = 1234
    assert _run(engine, n=6, logit_bias=((forced, 100.0),)) == [forced] * 6
    banned = greedy[0]
    assert banned not in _run(engine, n=24, logit_bias=((banned, -100.0),))
    # The shipped tiny model repeats itself under greedy decoding: what the penalties are for.
    repetitive = build_tiny_model(0)
    engine = Engine(repetitive, max_model_len=512)
    greedy = greedy_reference(repetitive, PROMPT, 24)
    repeats = Counter(greedy).most_common(1)[0][1]
    assert repeats > 4, "the test needs a greedy output that repeats a token"
    penalised = _run(engine, n=24, frequency_penalty=2.0)
    assert penalised != greedy and Counter(penalised).most_common(1)[0][1] < repeats
    present = _run(engine, n=24, presence_penalty=2.0)
    assert present != greedy
    assert _run(engine, n=24, repetition_penalty=1.5) != greedy
    assert _run(engine, n=24) == greedy
    engine.stop()


def test_a_huge_logit_bias_costs_one_vectorised_add(lm):
    """100,000 biases applied one by one take about half a second per step, for every row of the batch."""
    import time

    from course.serving.sampler import Sampler

    bias = tuple((t, 1.0) for t in range(min(100_000, lm.vocab_size)))
    params = SamplingParams(max_tokens=1, logit_bias=bias)
    logits = torch.zeros(lm.vocab_size)
    Sampler.adjust(logits.clone(), params, [1], [])  # builds the tensors once
    start = time.perf_counter()
    for _ in range(10):
        out = Sampler.adjust(logits.clone(), params, [1], [])
    assert (time.perf_counter() - start) / 10 < 0.05
    assert float(out[: len(bias)].min()) == 1.0
