"""The tiny model trained on the course's prose (module 5): shipped, meaningful, reproducible."""

import math

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


def test_shipped_prose_model_predicts_held_out_text_far_better_than_chance():
    lm = models.build_prose_model(verbose=False)
    assert lm.name == models.PROSE_NAME and "course_prose_llama.pt" in lm.source
    assert lm.geometry.num_kv_heads == 2 and lm.geometry.num_query_heads == 4  # GQA like the tiny model
    trained = held_out_perplexity(lm)
    random = held_out_perplexity(
        models.LanguageModel(models.build_tiny_model().model, lm.tokenizer, "r", "", lm.geometry)
    )
    assert trained < 200 < len(lm.tokenizer) < random  # chance is ~vocab size (2,052); measured ~80
    ids = lm.encode("Prefill feeds")
    out = lm.model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id)
    words = lm.tokenizer.decode(out[0, ids.shape[1] :]).split()
    assert sum(w.strip(".,;:()").isalpha() for w in words) >= len(words) - 2  # English words, not byte soup


def test_training_is_deterministic_and_learns():
    _, first = models.train_prose_model(steps=6)
    _, second = models.train_prose_model(steps=6)
    assert first == second
    assert first[-1] < first[0]
