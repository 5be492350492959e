"""The tiny model trained on the course's prose (module 5): shipped, meaningful, reproducible."""

import hashlib
import math

import pytest
import torch

from course import models


def held_out_perplexity(lm, tokens: int = 512, window: int = 64) -> float:
    _, held = models.prose_corpus()
    ids = lm.encode(held)[0][:tokens].view(-1, window)
    with torch.no_grad():
        return math.exp(float(lm.model(input_ids=ids, labels=ids).loss))


def test_corpus_is_split_without_overlap():
    train, held = models.prose_corpus()
    assert len(held) > 3000 and len(train) > 10 * len(held) / 2
    held_paragraphs = set(held.split("\n\n"))
    assert not held_paragraphs & set(train.split("\n\n"))


def test_the_shipped_weights_were_trained_on_the_shipped_corpus():
    """The weights ship with the sha256 of the corpus they were trained on, so an edited corpus cannot
    silently keep weights trained on the old text (what the model generates, and its held-out split)."""
    digest, name = (models.PROSE_WEIGHTS_FILE.parent / "course_prose_llama.sha256").read_text().split()
    assert name == models.PROSE_CORPUS_FILE.name
    assert hashlib.sha256(models.PROSE_CORPUS_FILE.read_bytes()).hexdigest() == digest, (
        "course_prose.txt changed since the weights were trained: retrain (model, _ = models.train_prose_model(); "
        "save its state_dict in fp16 without lm_head.weight to models.PROSE_WEIGHTS_FILE) and write the "
        "corpus's sha256 to course/data/course_prose_llama.sha256"
    )


def test_shipped_prose_model_predicts_held_out_text_far_better_than_chance():
    lm = models.build_prose_model(verbose=False)
    assert lm.name == models.PROSE_NAME and "course_prose_llama.pt" in lm.source
    assert lm.geometry.num_kv_heads == 2 and lm.geometry.num_query_heads == 4  # GQA like the tiny model
    trained = held_out_perplexity(lm)
    random = held_out_perplexity(
        models.LanguageModel(models.build_tiny_model().model, lm.tokenizer, "r", "", lm.geometry)
    )
    assert trained < 200 < len(lm.tokenizer) < random  # chance is ~vocab size (2,048); measured ~109
    ids = lm.encode("Prefill feeds")
    out = lm.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id)
    words = lm.tokenizer.decode(out[0, ids.shape[1] :]).split()
    assert sum(w.strip(".,;:()").isalpha() for w in words) >= len(words) - 2  # English words, not byte soup


def test_training_is_deterministic_and_learns():
    _, first = models.train_prose_model(steps=6)
    _, second = models.train_prose_model(steps=6)
    assert first == second
    assert first[-1] < first[0]


def test_a_longer_context_gives_the_same_outputs_and_the_text_degrades_past_the_training_windows():
    # Default RoPE: no weight depends on max_position_embeddings, so raising it (module 2 serves 2,048-token
    # prompts) changes nothing below 512 positions; what the model learnt still stops at its 64-token windows.
    short, long = models.build_prose_model(verbose=False), models.build_prose_model(verbose=False, max_positions=4096)
    assert (short.model.config.max_position_embeddings, long.model.config.max_position_embeddings) == (512, 4096)
    _, held = models.prose_corpus()
    ids = long.encode(held)[:, :2048]
    with torch.no_grad():
        assert torch.equal(short.model(input_ids=ids[:, :300]).logits, long.model(input_ids=ids[:, :300]).logits)
        logits = long.model(input_ids=ids).logits[0, :-1]
    losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
    window = models.PROSE_TRAINING["seq_len"]
    inside, far = math.exp(float(losses[:window].mean())), math.exp(float(losses[512:].mean()))
    assert inside < far < len(long.tokenizer)  # measured ~131 and ~192: worse past the windows, far from chance


def test_max_positions_must_be_a_positive_count():
    for bad in (0, -5, 2.5, True, "4096"):
        with pytest.raises(ValueError, match="max_positions must be a positive number of tokens"):
            models.build_prose_model(verbose=False, max_positions=bad)


def test_random_prompt_ids_of_the_prose_model_avoid_special_tokens():
    ids = models.build_prose_model(verbose=False).random_ids(8, 1000, seed=3)  # 8,000 draws of 2,048 ids
    assert int(ids.min()) >= len(models.SPECIAL_TOKENS)
