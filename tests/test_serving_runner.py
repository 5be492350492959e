"""The serving engine's lean Llama-family runner computes what the transformers model computes."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.models import build_tiny_model, forward, new_cache
from course.serving.engine import Engine, SamplingParams
from course.serving.runner import LlamaRunner, TransformersRunner, runner_for, unsupported_reason
from course.serving.testing import ForwardLog, chatty_tiny_model, greedy_reference


def _qwen2_model():
    """A random Qwen2 (biases on q, k, v; tied embeddings; 3 KV groups) in float64."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        rope_theta=1e6,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # non-zero biases, or the test would not see them
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


MODELS = {
    "llama": lambda: chatty_tiny_model(seed=5, dtype=torch.float64).model,
    "qwen2": _qwen2_model,
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_ragged_prefill_then_decode_matches_transformers(kind):
    model = MODELS[kind]()
    runner = runner_for(model)
    assert isinstance(runner, LlamaRunner)
    reference = TransformersRunner(model)
    lengths = [9, 4, 13]
    width = max(lengths)
    generator = torch.Generator().manual_seed(1)
    ids = torch.zeros((3, width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(5, model.config.vocab_size, (n,), generator=generator)
    mask = (torch.arange(width)[None, :] >= (width - torch.tensor(lengths))[:, None]).long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        ours, our_cache = runner(ids, runner.new_cache(), attention_mask=mask, position_ids=positions)
        theirs, their_cache = reference(ids, reference.new_cache(), attention_mask=mask, position_ids=positions)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)
        for step in range(6):
            token = theirs[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones((3, 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
            ours, our_cache = runner(token, our_cache, attention_mask=mask, position_ids=positions)
            theirs, their_cache = reference(token, their_cache, attention_mask=mask, position_ids=positions)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9, msg=f"decode step {step}")
    real = mask.bool()  # padding columns hold whatever each implementation left there; they are never read
    for ours_layer, their_layer in zip(our_cache.layers, their_cache.layers):
        for row in range(3):
            torch.testing.assert_close(
                ours_layer.keys[row][:, real[row]], their_layer.keys[row][:, real[row]], rtol=0, atol=1e-9
            )


def test_unpadded_prefill_and_cache_growth_past_its_room():
    model = MODELS["llama"]()
    runner, reference = LlamaRunner(model), TransformersRunner(model)
    ids = torch.randint(5, 2000, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours, cache = runner(ids, runner.new_cache())
        theirs, their_cache = reference(ids, reference.new_cache())
        buffers = set()
        for _ in range(40):  # past the first buffer's spare room: it must regrow and keep every token
            token = theirs.argmax(-1)
            ours, cache = runner(token, cache)
            theirs, their_cache = reference(token, their_cache)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-9)
            buffers.add(cache.layers[0]._key_buffer.data_ptr())
    assert cache.layers[0].keys.shape[-2] == 47
    assert 1 < len(buffers) < 10, "the cache should grow into spare room, not reallocate at every step"


def test_engine_uses_the_lean_runner_and_matches_greedy():
    lm = chatty_tiny_model(seed=3, dtype=torch.float64)
    prompts = [[5, 6, 7, 8], list(range(10, 40)), [99]]
    for prefer, name in (("auto", "llama"), ("transformers", "transformers")):
        engine = Engine(lm, runner=prefer)
        requests = [engine.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        outputs = [[e.token for e in r] for r in requests]
        assert engine.stats()["runner"] == name
        engine.stop()
        assert outputs == [greedy_reference(lm, p, 12) for p in prompts], prefer


def test_forward_log_still_sees_every_pass_of_the_lean_runner():
    lm = build_tiny_model()
    engine = Engine(lm)
    with ForwardLog(lm) as log:
        engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.stop()
    assert log.shapes == [(1, 3), (1, 1), (1, 1), (1, 1)]


def test_other_architectures_fall_back_to_the_transformers_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=64)).eval()
    assert "gpt2" in unsupported_reason(gpt2)
    assert isinstance(runner_for(gpt2), TransformersRunner)
    with pytest.raises(ValueError, match="gpt2"):
        LlamaRunner(gpt2)
    with pytest.raises(ValueError, match="'auto' or 'transformers'"):
        runner_for(gpt2, "fast")
    ids = torch.tensor([[1, 2, 3]])
    runner = runner_for(gpt2)
    with torch.inference_mode():
        logits, _ = runner(ids, runner.new_cache())
        expected, _ = forward(gpt2, ids, new_cache(gpt2))
    torch.testing.assert_close(logits, expected[:, -1:])


def test_the_model_is_left_untouched_and_savable(tmp_path):
    lm = build_tiny_model()
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    LlamaRunner(lm.model)
    lm.model.save_pretrained(tmp_path)
    for key, value in lm.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def _slowed(product, seconds: float):
    """``product`` (a kernel method of the runner's linear layers) that takes ``seconds`` longer per call, and
    counts the rows of the calls it gets."""
    import time

    calls = []

    def slow(self, x):
        calls.append(x.numel() // x.shape[-1])
        time.sleep(seconds)
        return product(self, x)

    return slow, calls


@pytest.mark.parametrize("slow_side", ["plain_product", "packed_product"])
def test_a_single_row_takes_the_kernel_measured_faster_on_this_host(monkeypatch, slow_side):
    # Which kernel multiplies one row faster is the host's answer (the 170 M model: plain 10 % faster on one
    # machine, packed 40 % faster on another), so the runner measures it; a fixed choice loses on one of them.
    from course.kernels import PACKED, STOCK, packed_path_available
    from course.serving import runner as runner_module

    lm = build_tiny_model()
    if reason := packed_path_available(lm.model):
        pytest.skip(reason)
    slow, calls = _slowed(getattr(runner_module._PackedLinear, slow_side), 2e-4)
    monkeypatch.setattr(runner_module._PackedLinear, slow_side, slow)
    runner = LlamaRunner(lm.model)
    assert runner.kernel == PACKED
    assert runner.one_row == (PACKED if slow_side == "plain_product" else STOCK)
    calls.clear()
    reference = TransformersRunner(lm.model)
    with torch.inference_mode():
        one_row, _ = runner(torch.tensor([[5, 6, 7]]), runner.new_cache())
        expected, _ = reference(torch.tensor([[5, 6, 7]]), reference.new_cache())
        two_rows, _ = runner(torch.tensor([[5, 6, 7], [8, 9, 10]]), runner.new_cache())
    torch.testing.assert_close(one_row, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(two_rows[:1], expected, rtol=1e-4, atol=1e-4)
    if slow_side == "plain_product":  # packed won: no row of either pass goes to the plain kernel
        assert calls == []
    else:  # plain won: the prefill's three token rows are packed; the lone decode rows would be plain
        assert calls and all(rows > 1 for rows in calls)
        calls.clear()
        with torch.inference_mode():
            runner(torch.tensor([[5]]), runner.new_cache())
        assert calls == [], "a single row should take the plain kernel, measured faster"


def test_a_lone_row_leaves_the_plain_kernel_where_that_is_the_slower_one(monkeypatch):
    # The behaviour as a learner's server shows it, whatever the runner's internals: with PyTorch's plain kernel
    # (``F.linear``) made slower than oneDNN's, a decode step of one sequence must not call it. The runner that
    # sent every single row to F.linear (before the measurement) fails here.
    import time

    import torch.nn.functional as F

    from course.kernels import packed_path_available

    lm = build_tiny_model()
    if reason := packed_path_available(lm.model):
        pytest.skip(reason)
    plain, counting = F.linear, []

    def slow_linear(x, weight, bias=None):
        if counting:
            counting.append(x.shape)
        time.sleep(2e-4)
        return plain(x, weight, bias)

    monkeypatch.setattr(F, "linear", slow_linear)
    runner = LlamaRunner(lm.model)
    with torch.inference_mode():
        _, cache = runner(torch.tensor([[5, 6, 7]]), runner.new_cache())
        counting.append("start")
        runner(torch.tensor([[8]]), cache)
    assert counting == ["start"], f"a lone decode row went to the slower plain kernel: {counting[1:4]}"
