"""The tiny offline model, its tokenizer, the cache helpers and load_model's fallbacks."""

import pytest
import torch

from course import models
from course.geometry import from_hf_config


@pytest.fixture(scope="module")
def tiny():
    return models.build_tiny_model(seed=0)


def test_tiny_model_is_a_gqa_llama(tiny):
    config = tiny.model.config
    assert config.model_type == "llama"
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (4, 4, 2)
    assert tiny.geometry.attention == "GQA" and tiny.geometry.head_dim == 64
    assert tiny.vocab_size == len(tiny.tokenizer) == 2048


def test_same_seed_same_weights_other_seed_other_weights(tiny):
    again = models.build_tiny_model(seed=0)
    other = models.build_tiny_model(seed=1)
    pairs = list(zip(tiny.model.parameters(), again.model.parameters()))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not all(torch.equal(a, b) for a, b in zip(tiny.model.parameters(), other.model.parameters()))


def test_building_does_not_disturb_the_callers_random_state():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    models.build_tiny_model(seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_round_trips_text_including_unicode(tiny):
    text = "Prefill and decode are two different jobs: déjà vu, 東京, ✓ 🚀"
    ids = tiny.tokenizer(text).input_ids
    assert tiny.tokenizer.decode(ids) == text
    assert max(ids) < tiny.vocab_size


def test_random_prompt_ids_avoid_special_tokens_and_are_reproducible(tiny):
    ids = tiny.random_ids(3, 50, seed=4)
    assert ids.shape == (3, 50) and int(ids.min()) >= len(models.SPECIAL_TOKENS)
    assert torch.equal(ids, tiny.random_ids(3, 50, seed=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", [1, 3])
def test_cache_bytes_equal_the_textbook_formula(tiny, dtype, batch):
    lm = models.build_tiny_model(seed=0, dtype=dtype)
    with torch.inference_mode():
        logits, cache = models.forward(lm.model, lm.random_ids(batch, 37), models.new_cache(lm.model))
        _, cache = models.forward(lm.model, logits[:, -1:].argmax(-1), cache)  # one decode step
    per_token = lm.geometry.kv_bytes_per_token(dtype.itemsize)
    assert models.cache_nbytes(cache) == per_token * 38 * batch
    keys, values = models.cache_layers(cache)[0]
    assert keys.shape == values.shape == (batch, 2, 38, 64)


def test_decode_with_cache_matches_recomputing_without_it(tiny):
    ids = tiny.random_ids(1, 20)
    with torch.inference_mode():
        logits, cache = models.forward(tiny.model, ids[:, :-1], models.new_cache(tiny.model))
        step_logits, _ = models.forward(tiny.model, ids[:, -1:], cache)
        full = tiny.model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(step_logits[:, -1], full[:, -1], atol=1e-4)


def test_forward_uses_past_key_values_on_older_transformers(monkeypatch, tiny):
    """transformers 5.0-5.2x name the keyword past_key_values (5.24 renamed it to cache)."""
    seen = {}

    class OldStyle(torch.nn.Module):
        config = tiny.model.config

        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            seen["cache"] = past_key_values
            from transformers.modeling_outputs import CausalLMOutputWithPast

            return CausalLMOutputWithPast(logits=torch.zeros(1, 1, 2), past_key_values=past_key_values)

    logits, cache = models.forward(OldStyle(), torch.zeros(1, 1, dtype=torch.long))
    assert cache is seen["cache"] and cache is not None and logits.shape == (1, 1, 2)


def test_saved_tiny_model_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.save_tiny_model(tmp_path / "tiny")
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    original = models.build_tiny_model()
    ids = original.random_ids(1, 8)
    with torch.inference_mode():
        assert torch.equal(reloaded(input_ids=ids).logits, original.model(input_ids=ids).logits)
    assert tokenizer.decode(tokenizer("hello world").input_ids) == "hello world"
    assert from_hf_config(path).num_kv_heads == 2


def test_load_model_on_cpu_uses_the_tiny_model_and_says_why(capsys):
    lm = models.load_model()
    assert lm.name == models.TINY_NAME
    assert "tiny offline model: CPU runtime" in capsys.readouterr().out


def test_load_model_falls_back_when_the_hub_fails_on_a_gpu_runtime(monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def unreachable(name, device, dtype=None):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(models, "load_hub_model", unreachable)
    # device="cpu" keeps the tensors here; allow_hub=True is what a GPU runtime decides.
    lm = models.load_model(device="cpu", allow_hub=True)
    out = capsys.readouterr().out
    assert lm.name == models.TINY_NAME
    assert f"could not load {models.HUB_MODEL} from the Hub (OSError: We couldn't connect" in out


def test_load_model_respects_hub_offline(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(models, "load_hub_model", lambda *a, **k: pytest.fail("must not touch the Hub"))
    lm = models.load_model(device="cpu", allow_hub=True)
    assert lm.name == models.TINY_NAME and "HF_HUB_OFFLINE is set" in capsys.readouterr().out


def test_load_model_builds_the_prose_model_offline_with_the_tiny_models_context(monkeypatch, capsys):
    monkeypatch.setattr(models, "load_hub_model", lambda *a, **k: pytest.fail("must not touch the Hub"))
    lm = models.load_model(offline=models.PROSE_NAME)
    assert lm.name == models.PROSE_NAME
    assert lm.model.config.max_position_embeddings == models.TINY_CONFIG["max_position_embeddings"]
    assert "prose offline model: CPU runtime" in capsys.readouterr().out
    by_name = models.load_model(models.PROSE_NAME, device="cpu", allow_hub=True, verbose=False)
    assert by_name.name == models.PROSE_NAME  # asked for by name: built offline even where the Hub is allowed


def test_load_model_refuses_an_unknown_offline_model():
    with pytest.raises(ValueError, match="offline must be one of course-tiny-llama, course-prose-llama; got 'tiny'"):
        models.load_model(offline="tiny")


def test_load_model_returns_the_hub_model_when_it_loads(monkeypatch, tiny):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(models, "load_hub_model", lambda name, device, dtype=None: tiny)
    assert models.load_model(device="cpu", allow_hub=True, verbose=False) is tiny
