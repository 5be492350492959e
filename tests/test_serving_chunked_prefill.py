"""Chunked prefill: a long prompt is prefilled a budget's worth per iteration while running streams decode.

Issue 24 item 7: before, the engine admitted the first waiting prompt whole whatever its length, so
a 4,000-token prompt froze every running stream for its whole prefill. Now each iteration's token
budget (``max_prefill_tokens``) is shared as vLLM V1 shares it: one token per running request, the
rest for prompt chunks; a partly prefilled prompt keeps its KV cache between iterations.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import generate_staggered, one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.engine import Engine, SamplingParams
from course.serving.testing import ForwardLog, chatty_tiny_model, greedy_reference, shared_chatty_model


@pytest.fixture(scope="module")
def lm64():
    # float64, so that every chunking computes the same greedy decision as one whole pass
    return chatty_tiny_model(seed=3, dtype=torch.float64)


def _run(engine: Engine, prompt: list[int], params: SamplingParams):
    request = engine.submit(prompt, params)
    while engine.num_unfinished:
        engine.step()
    return request


@pytest.mark.parametrize("runner", ["auto", "transformers"])
def test_chunked_prefill_gives_the_tokens_and_logprobs_of_a_whole_prefill(lm64, runner):
    prompt = torch.randint(4, 2048, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
    expected = greedy_reference(lm64, prompt, 12)
    results = {}
    for chunk in (1, 7, 64, 10**6):
        engine = Engine(lm64, background=False, max_prefill_tokens=chunk, runner=runner)
        with ForwardLog(lm64) as log:
            results[chunk] = _run(engine, prompt, params)
        prefill_passes = [n for _, n in log.shapes[: math.ceil(len(prompt) / chunk)]]
        assert prefill_passes == [min(chunk, len(prompt) - i) for i in range(0, len(prompt), chunk)], chunk
        assert engine.cache_tokens() == 0 and not engine.prefilling
    for chunk, request in results.items():
        assert request.output_ids == expected, f"chunks of {chunk} tokens changed the output"
    events = {chunk: list(request) for chunk, request in results.items()}
    for chunk, got in events.items():
        for a, b in zip(got, events[10**6]):
            assert a.token == b.token and a.finish_reason == b.finish_reason
            assert a.logprob == pytest.approx(b.logprob, abs=1e-9), chunk
            assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]


def test_a_running_stream_gets_a_token_in_every_iteration_of_a_long_prefill(lm64):
    """Counted in engine iterations, not wall time: the long prompt is split, the stream never waits."""
    budget, prompt_len = 64, 1000
    engine = Engine(lm64, background=False, max_batch_size=4, max_prefill_tokens=budget)
    stream = engine.submit(list(range(10, 20)), SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(3):
        engine.step()
    prompt = torch.randint(4, 2048, (prompt_len,), generator=torch.Generator().manual_seed(2)).tolist()
    long = engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    iterations = 0
    with ForwardLog(lm64) as log:
        while not long.output_ids:
            before = len(stream.output_ids)
            engine.step()
            iterations += 1
            assert len(stream.output_ids) == before + 1, f"the running stream got no token in iteration {iterations}"
    biggest = max(n for _, n in log.shapes)
    assert biggest <= budget - 1, f"one forward pass computed {biggest} prompt tokens, over the budget {budget}"
    assert iterations == math.ceil(prompt_len / (budget - 1))
    recent = list(engine.counters.budget_used)[-iterations:]  # (decodes, prompt tokens) per iteration
    assert all(decodes == 1 and decodes + prefilled <= budget for decodes, prefilled in recent), recent
    assert sum(prefilled for _, prefilled in recent) == prompt_len
    engine.abort(stream.request_id)
    while engine.num_unfinished:
        engine.step()
    assert long.output_ids == greedy_reference(lm64, prompt, 3)
    assert engine.cache_tokens() == 0


def test_the_background_engine_decodes_a_running_stream_in_every_iteration_of_a_4000_token_prefill():
    """The engine on its own thread, as the server runs it: counted in iterations, not wall time.

    The old engine prefilled the 4,000-token prompt in one iteration, so the running stream waited a
    whole prefill; with a 512-token budget every iteration gives the stream its token and the prompt a
    chunk. How long the stream's largest gap is in milliseconds is a benchmark's figure
    (``benchmarks/long_prompt_stall.py``), not a test's: wall time on a shared machine cannot fail alone.
    """
    budget, prompt_len = 512, 4000
    lm = shared_chatty_model(seed=6)
    engine = Engine(lm, max_batch_size=8, max_prefill_tokens=budget)
    prompt = torch.randint(4, 2048, (prompt_len,), generator=torch.Generator().manual_seed(3)).tolist()
    stream = engine.submit(list(range(10, 20)), SamplingParams(max_tokens=4000, ignore_eos=True))
    tokens = iter(stream)
    for _ in range(3):  # the stream is running before the long prompt arrives
        next(tokens)
    long = engine.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    assert [e.finish_reason for e in long] == ["length"]
    engine.abort(stream.request_id)
    for _ in tokens:  # drain until the abort's event
        pass
    engine.stop()
    chunks = [(decodes, prefilled) for decodes, prefilled in engine.counters.budget_used if prefilled]
    chunks = chunks[-math.ceil(prompt_len / (budget - 1)) :]  # the long prompt's iterations
    assert sum(prefilled for _, prefilled in chunks) == prompt_len, f"the prompt in chunks: {chunks}"
    assert all(decodes == 1 and decodes + prefilled <= budget for decodes, prefilled in chunks), (
        f"each chunk of the prompt shares its iteration with the running stream's token: {chunks}"
    )


def test_a_partly_prefilled_prompt_can_be_aborted_and_frees_its_cache(lm64):
    engine = Engine(lm64, background=False, max_batch_size=4, max_prefill_tokens=32)
    other = engine.submit(list(range(40, 50)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    long = engine.submit(list(range(100, 300)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    assert long.num_computed_tokens == 62 and engine.cache_tokens() > 62
    assert engine.num_waiting == 1 and engine.num_running == 1
    engine.abort(long.request_id)
    engine.step()
    assert long.finish_reason == "abort" and long.output_ids == [] and long.prefill_cache is None
    assert [e.token for e in long] == [None]
    assert not engine.prefilling and engine.num_waiting == 0
    engine.abort(other.request_id)
    engine.step()
    assert engine.cache_tokens() == 0 and engine.num_unfinished == 0
    assert other.output_ids == greedy_reference(lm64, list(range(40, 50)), len(other.output_ids))


def test_stop_fails_a_partly_prefilled_prompt(lm64):
    engine = Engine(lm64, background=False, max_prefill_tokens=16)
    long = engine.submit(list(range(100, 200)), SamplingParams(max_tokens=5))
    engine.step()
    assert engine.prefilling == [long]
    engine.stop()
    while not engine.step():
        pass
    events = list(long)
    assert events[-1].finish_reason == "error" and events[-1].status == 503
    assert engine.cache_tokens() == 0 and not engine.prefilling


def test_a_failing_chunk_fails_its_request_alone(lm64):
    engine = Engine(lm64, background=False, max_batch_size=4, max_prefill_tokens=16)
    other = engine.submit(list(range(40, 50)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    long = engine.submit(list(range(100, 200)), SamplingParams(max_tokens=5))
    engine.step()
    original, calls = engine.runner, []

    def failing(ids, cache, **kwargs):
        if ids.shape[1] > 1:  # a prompt chunk, not the decode step
            calls.append(ids.shape)
            raise RuntimeError("simulated out of memory")
        return original(ids, cache, **kwargs)

    engine.runner = failing
    engine.step()
    engine.runner = original
    assert calls and long.finish_reason == "error" and "simulated out of memory" in long.error
    assert not engine.prefilling and long.prefill_cache is None
    while engine.num_unfinished:
        engine.step()
    assert other.output_ids == greedy_reference(lm64, list(range(40, 50)), 30)


@pytest.mark.parametrize("budget", [5, 16])
def test_many_requests_with_small_budgets_keep_their_greedy_output(lm64, budget):
    """Requests join and leave while prompts are split across iterations (the background loop)."""
    generator = torch.Generator().manual_seed(budget)
    lengths = torch.randint(1, 48, (12,), generator=generator).tolist()
    outputs = torch.randint(1, 16, (12,), generator=generator).tolist()
    prompts = [torch.randint(4, 2048, (p,), generator=generator).tolist() for p in lengths]
    engine = Engine(lm64, max_batch_size=4, max_prefill_tokens=budget)
    results = generate_staggered(engine, prompts, outputs, gap=0.003)
    engine.stop()
    assert results == [greedy_reference(lm64, p, n) for p, n in zip(prompts, outputs)]
    assert max(decodes + prefilled for decodes, prefilled in engine.counters.budget_used) <= budget
    assert engine.cache_tokens() == 0
