"""The continuous-batching engine and the incremental detokenizer, without HTTP."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import generate_staggered, one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.models import load_tokenizer
from course.serving.detok import IncrementalDetokenizer
from course.serving.engine import Engine, SamplingParams
from course.serving.testing import ForwardLog, chatty_tiny_model, failing_decode, greedy_reference


@pytest.fixture(scope="module")
def lm64():
    # float64 so that batched and one-at-a-time arithmetic agree to the last greedy decision
    return chatty_tiny_model(seed=3, dtype=torch.float64)


def _workload(n: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, 48, (n,), generator=generator).tolist()
    output_lengths = torch.randint(1, 24, (n,), generator=generator).tolist()
    prompts = [torch.randint(4, 2048, (p,), generator=generator).tolist() for p in prompt_lengths]
    return prompts, output_lengths


@pytest.mark.parametrize("max_batch_size", [4, 64])
def test_batched_greedy_output_equals_one_at_a_time(lm64, max_batch_size):
    prompts, outputs = _workload(14, seed=max_batch_size)
    expected = [greedy_reference(lm64, p, n) for p, n in zip(prompts, outputs)]
    assert len({tuple(e[:3]) for e in expected}) > 5, "the test model should not repeat itself"
    engine = Engine(lm64, max_batch_size=max_batch_size)
    results = generate_staggered(engine, prompts, outputs, gap=0.004)
    stats = engine.stats()
    engine.stop()
    assert results == expected
    assert stats["mean_batch_size"] > 1.5, f"requests should have been decoded together: {stats}"
    assert stats["cache_tokens"] == 0 and stats["unfinished"] == 0


@pytest.mark.parametrize("with_a_sampled_row", [False, True])
def test_rows_joining_a_batch_that_decoded_alone_by_hand(lm64, with_a_sampled_row):
    # A decodes alone first (no padding: the engine skips its length bookkeeping then, and feeds
    # the argmax tensor straight back); B (shorter) and C (longer than the cache) join it later.
    # A sampled row makes the engine build the next inputs from a list instead.
    engine = Engine(lm64, background=False)
    prompts = {"a": list(range(10, 17)), "b": list(range(40, 44)), "c": list(range(100, 130))}
    lengths = {"a": 20, "b": 6, "c": 9}
    params = {name: SamplingParams(max_tokens=n, ignore_eos=True) for name, n in lengths.items()}
    requests = {"a": engine.submit(prompts["a"], params["a"])}
    for _ in range(6):
        engine.step()
    requests["b"] = engine.submit(prompts["b"], params["b"])
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=5)
    if with_a_sampled_row:
        requests["sampled"] = engine.submit(list(range(60, 66)), sampled)
    for _ in range(3):
        engine.step()
    requests["c"] = engine.submit(prompts["c"], params["c"])
    while engine.num_unfinished:
        engine.step()
    sampled_row = requests.pop("sampled", None)
    for name, request in requests.items():
        assert request.output_ids == greedy_reference(lm64, prompts[name], lengths[name]), name
    assert engine.cache_tokens() == 0
    if sampled_row is not None:  # it continued from its own draws, not the batch's argmax
        alone = Engine(lm64, background=False)
        request = alone.submit(list(range(60, 66)), sampled)
        while alone.num_unfinished:
            alone.step()
        assert sampled_row.output_ids == request.output_ids


def test_a_row_leaving_an_unpadded_batch_by_hand(lm64):
    # Same prompt lengths: no padding, so lengths are not kept up to date step by step; the row
    # that leaves first must not take real cache columns of the other with it.
    engine = Engine(lm64, background=False)
    prompts, lengths = [list(range(10, 22)), list(range(50, 62))], [4, 12]
    requests = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    while engine.num_unfinished:
        engine.step()
    assert [r.output_ids for r in requests] == [greedy_reference(lm64, p, n) for p, n in zip(prompts, lengths)]


def test_steps_are_counted_by_batch_and_by_prompt_tokens(lm64):
    # A (12 prompt tokens, 4 output) and B (5, 7) are prefilled together: each gets its first token,
    # then they decode 3 steps side by side (B padded to A's length) and B 3 more steps alone.
    engine = Engine(lm64, background=False)
    a = engine.submit(list(range(10, 22)), SamplingParams(max_tokens=4, ignore_eos=True))
    b = engine.submit(list(range(40, 45)), SamplingParams(max_tokens=7, ignore_eos=True))
    while engine.num_unfinished:
        engine.step()
    assert len(a.output_ids) == 4 and len(b.output_ids) == 7
    by_batch = engine.stats()["decode_steps_by_batch"]
    assert set(by_batch) == {"1", "2"}
    assert by_batch["2"][0] == 3 and by_batch["1"][0] == 3
    # cache slots the steps read: 2 rows x 12, 13, 14 columns, then B alone (trimmed) at 8, 9, 10
    assert by_batch["2"][2] == 2 * (12 + 13 + 14) and by_batch["1"][2] == 8 + 9 + 10
    assert by_batch["1"][1] > 0 and by_batch["2"][1] > 0
    assert sum(steps for steps, _, _ in by_batch.values()) == engine.stats()["steps"]
    assert sum(seconds for _, seconds, _ in by_batch.values()) == pytest.approx(engine.counters.decode_seconds)
    prefills = engine.stats()["prefill_steps_by_tokens"]
    assert list(prefills) == ["17"] and prefills["17"][0] == 1  # both prompts in one iteration: 12 + 5 tokens
    assert prefills["17"][1] == pytest.approx(engine.counters.prefill_seconds)


def test_one_at_a_time_mode_never_batches(lm64):
    prompts, outputs = _workload(4, seed=1)
    engine = Engine(lm64, max_batch_size=1)
    requests = [engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, outputs)]
    results = [[e.token for e in r] for r in requests]
    assert engine.stats()["mean_batch_size"] == 1.0
    engine.stop()
    assert results == [greedy_reference(lm64, p, n) for p, n in zip(prompts, outputs)]


def test_prefill_once_then_one_token_per_decode_step(lm64):
    engine = Engine(lm64)
    with ForwardLog(lm64) as log:
        engine.generate(list(range(10, 30)), SamplingParams(max_tokens=6, ignore_eos=True))
    engine.stop()
    assert log.shapes == [(1, 20)] + [(1, 1)] * 5


def test_abort_stops_within_one_step_and_frees_the_cache(lm64):
    engine = Engine(lm64)
    long = engine.submit(list(range(10, 20)), SamplingParams(max_tokens=3000, ignore_eos=True))
    other = engine.submit(list(range(40, 50)), SamplingParams(max_tokens=3000, ignore_eos=True))
    for seen, _ in enumerate(long, start=1):
        if seen == 5:
            engine.abort(long.request_id)
    assert long.finish_reason == "abort" and long.steps_after_abort <= 1
    assert long.freed_step is not None and long.freed_step - long.abort_requested_step <= 1
    assert len(long.output_ids) < 10
    engine.abort(other.request_id)
    list(other)
    deadline = time.monotonic() + 5
    while engine.cache_tokens() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.cache_tokens() == 0 and engine.num_unfinished == 0
    engine.stop()


def test_eos_stops_unless_ignored():
    lm = chatty_tiny_model(seed=5)
    engine = Engine(lm)
    prompt = list(range(100, 110))
    free_run = greedy_reference(lm, prompt, 8)
    stop_at = free_run[3]  # pretend the 4th token is a stop token
    stopped = engine.submit(prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop_at,)))
    events = list(stopped)
    assert events[-1].finish_reason == "stop" and len(stopped.output_ids) == free_run.index(stop_at) + 1
    full = engine.submit(prompt, SamplingParams(max_tokens=8))
    assert [e.finish_reason for e in full][-1] == "length"
    engine.stop()


def test_a_failing_forward_pass_fails_its_requests_not_the_engine(lm64):
    engine = Engine(lm64)
    with failing_decode(engine, on_call=2, message="simulated out of memory"):
        events = list(engine.submit([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True)))
    assert events[-1].finish_reason == "error" and "simulated out of memory" in events[-1].error
    assert engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)) == greedy_reference(
        lm64, [5, 6, 7], 4
    )
    engine.stop()


def test_sampling_is_seeded_and_validation_is_clear(lm64):
    engine = Engine(lm64)
    params = SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    assert engine.generate([9, 10, 11], params) == engine.generate([9, 10, 11], params)
    with pytest.raises(ValueError, match="context"):
        engine.submit([1] * 10, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(ValueError, match="at least one token"):
        engine.submit([], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    engine.stop()


def test_detokenizer_never_emits_broken_utf8_and_loses_nothing():
    tokenizer = load_tokenizer()
    text = "naïve café ✓ 日本語 — ok 🙂 end"
    ids = tokenizer(text).input_ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text should split characters across tokens"
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer("prompt:").input_ids)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    assert "" in deltas, "some tokens complete no character and must emit nothing"


def test_detokenizer_window_stays_bounded_on_bytes_that_never_form_a_character():
    """A model may emit invalid UTF-8 forever; holding it back forever would make each push slower."""
    from course.serving.detok import CONTEXT_TOKENS, MAX_HELD_TOKENS

    tokenizer = load_tokenizer()
    lone_byte = next(
        i
        for i in range(tokenizer.vocab_size)
        if tokenizer.decode([i]) == "\ufffd" and tokenizer.decode([i, i]) == "\ufffd" * 2
    )
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer("x").input_ids)
    for _ in range(200):
        detok.push(lone_byte)
        assert len(detok.ids) - detok.prefix_offset <= CONTEXT_TOKENS + 2 * MAX_HELD_TOKENS
    assert detok.text.count("\ufffd") >= 200 - MAX_HELD_TOKENS
