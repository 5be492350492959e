"""The reference server's prefix cache: vLLM's block hashes and hit rule, LRU eviction under a byte
budget, and greedy output that does not change when a prompt's prefix comes from the cache."""

from __future__ import annotations

import hashlib
import pickle

import httpx
import pytest
import torch
from helpers import generate_staggered, one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.api.background import BackgroundServer
from course.serving.api.server import create_app
from course.serving.engine import Engine, SamplingParams
from course.serving.prefix_cache import (
    BLOCK_SIZE,
    PrefixCache,
    block_hashes,
    cache_hit_blocks,
    hash_block_tokens,
    none_hash,
)
from course.serving.testing import ForwardLog, chatty_tiny_model, greedy_reference
from course.vllm_lab import PREFIX_HITS, PREFIX_QUERIES, metric_value, parse_metrics


@pytest.fixture(scope="module")
def lm64():
    # float64 so that a prefix computed in another forward pass agrees to the last greedy decision
    return chatty_tiny_model(seed=5, dtype=torch.float64)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(4, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    """Submit every prompt, then step the engine until they are done (all admitted in one iteration)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.submit(p, params) for p in prompts]
    while engine.num_unfinished:
        engine.step()
    return [r.output_ids for r in requests]


def _one_by_one(engine: Engine, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    return [_run(engine, [p], max_tokens)[0] for p in prompts]


# --- hashes and the hit rule --------------------------------------------------------------------------


def test_block_hashes_are_vllms_chained_sha256_of_full_blocks(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    seed_hash = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert none_hash() == seed_hash
    tokens = _tokens(2 * BLOCK_SIZE + 5, seed=1)
    hashes = block_hashes(tokens)
    assert len(hashes) == 2, "only full blocks are hashed: the 5 tokens after them get no hash"
    first = hashlib.sha256(
        pickle.dumps((seed_hash, tuple(tokens[:16]), None), protocol=pickle.HIGHEST_PROTOCOL)
    ).digest()
    assert hashes[0] == first == hash_block_tokens(None, tokens[:16])
    assert hashes[1] == hash_block_tokens(first, tokens[16:32])
    # A token changed in the second block changes its hash only; in the first block, every hash after it.
    later = list(tokens)
    later[20] += 1
    assert block_hashes(later)[0] == hashes[0] and block_hashes(later)[1] != hashes[1]
    earlier = list(tokens)
    earlier[0] += 1
    assert all(a != b for a, b in zip(block_hashes(earlier), hashes))
    # The same 16 tokens after a different first block hash differently (the chain names the whole prefix).
    assert block_hashes(earlier[:16] + tokens[16:32])[1] != hashes[1]
    monkeypatch.setenv("PYTHONHASHSEED", "7")  # vLLM seeds NONE_HASH from it when it is set
    assert none_hash() == hashlib.sha256(pickle.dumps("7", protocol=pickle.HIGHEST_PROTOCOL)).digest()
    assert block_hashes(tokens)[0] != hashes[0]


@pytest.mark.parametrize(
    ("num_tokens", "cached", "expected"),
    [
        (48, 3, 2),  # exactly three full blocks, all cached: the last block is recomputed for the last token's logits
        (49, 3, 3),  # one token more: all three blocks are reused
        (47, 3, 2),  # the third block is not full: it was never hashed
        (15, 3, 0),  # shorter than one block
        (16, 3, 0),  # exactly one block: its last token must be computed
        (17, 3, 1),
        (64, 0, 0),
    ],
)
def test_cache_hit_blocks_never_covers_the_last_token(num_tokens, cached, expected):
    hashes = block_hashes(_tokens(num_tokens, seed=2))
    present = set(hashes[:cached])
    assert cache_hit_blocks(hashes, present.__contains__, num_tokens, BLOCK_SIZE) == expected


def test_a_hit_is_the_leading_run_only():
    hashes = block_hashes(_tokens(80, seed=3))
    present = {hashes[0], hashes[2], hashes[3]}  # block 1 evicted: blocks 2 and 3 cannot be reached
    assert cache_hit_blocks(hashes, present.__contains__, 80, BLOCK_SIZE) == 1


def _block(value: float, size: int = BLOCK_SIZE) -> torch.Tensor:
    return torch.full((2, 2, 1, size, 4), float(value))  # (layers, 2, kv_heads, block_size, head_dim): 1 KiB in float32


def test_lru_eviction_keeps_the_budget_and_evicts_a_prompts_end_first():
    size = _block(0).numel() * 4
    cache = PrefixCache(capacity_bytes=3 * size)
    a, b = block_hashes(_tokens(64, seed=4)), block_hashes(_tokens(64, seed=5))
    assert cache.insert(a[:2], lambda j: _block(j)) == 2
    assert cache.insert(b[:2], lambda j: _block(10 + j)) == 2  # room for one more: A's second block goes
    assert a[1] not in cache and a[0] in cache and cache.bytes_used == 3 * size and cache.evictions == 1
    hit = cache.lookup(a[:2], 40)  # A's first block is used: B's blocks are now the oldest
    assert len(hit) == 1 and torch.equal(hit[0], _block(0))
    assert (cache.queries, cache.hits) == (40, 16)
    cache.insert(block_hashes(_tokens(16, seed=6)), lambda j: _block(20))
    assert b[1] not in cache and b[0] in cache and a[0] in cache, "B's end goes before B's start and before A"
    assert cache.bytes_used <= cache.capacity_bytes
    calls = []
    cache.insert(a[:1], lambda j: calls.append(j) or _block(0))
    assert calls == [], "a block already cached is not copied again"
    tiny = PrefixCache(capacity_bytes=size - 1)
    assert tiny.insert(a[:1], lambda j: _block(0)) == 0 and len(tiny) == 0, "a block over the whole budget"
    for bad in (0, -1):
        with pytest.raises(ValueError, match="capacity_bytes"):
            PrefixCache(bad)


# --- the engine: same greedy tokens with and without the cache -------------------------------------


ON = 1 << 30  # a prefix cache of 1 GiB (course serve --enable-prefix-caching's default)


def _engine(lm, prefix_cache_bytes: int = ON, **options) -> Engine:
    return Engine(lm, background=False, max_batch_size=8, prefix_cache_bytes=prefix_cache_bytes, **options)


def test_identical_prefix_reuses_its_full_blocks_and_keeps_the_tokens(lm64):
    system = _tokens(40, seed=10)  # two full blocks and 8 tokens
    prompts = [system + _tokens(n, seed=11 + n) for n in (5, 9, 13)]
    engine = _engine(lm64)
    with ForwardLog(lm64) as log:
        got = _one_by_one(engine, prompts)
    assert got == [greedy_reference(lm64, p, 6) for p in prompts]
    stats = engine.stats()
    assert stats["prefix_cache_queries"] == sum(map(len, prompts))
    assert stats["prefix_cache_hits"] == 2 * 32, "the 2nd and 3rd reuse the two full blocks of the system prompt"
    prefills = [n for _, n in log.shapes if n > 1]
    assert prefills == [45, 49 - 32, 53 - 32], f"only the tokens after the hit are prefilled: {log.shapes}"
    assert stats["prefix_cache_blocks"] == 2 + 1 + 1, "blocks 0-1 shared, each prompt's third block its own"


def test_partly_shared_prefix_reuses_only_the_blocks_before_the_first_difference(lm64):
    first = _tokens(64, seed=20)
    second = first[:24] + _tokens(40, seed=21)  # same first 24 tokens: one full block in common
    engine = _engine(lm64)
    assert _one_by_one(engine, [first, second]) == [greedy_reference(lm64, p, 6) for p in (first, second)]
    assert engine.stats()["prefix_cache_hits"] == 16


def test_a_timestamp_in_front_misses_every_block(lm64):
    body = _tokens(64, seed=22)
    prompts = [[100 + i] + body for i in range(3)]  # one different token at the very front
    engine = _engine(lm64)
    assert _one_by_one(engine, prompts) == [greedy_reference(lm64, p, 6) for p in prompts]
    assert engine.stats()["prefix_cache_hits"] == 0 and engine.stats()["prefix_cache_blocks"] == 3 * 4


def test_a_prompt_shorter_than_a_block_is_never_cached(lm64):
    prompt = _tokens(BLOCK_SIZE - 1, seed=23)
    engine = _engine(lm64)
    assert _one_by_one(engine, [prompt, prompt]) == [greedy_reference(lm64, prompt, 6)] * 2
    stats = engine.stats()
    assert (stats["prefix_cache_hits"], stats["prefix_cache_blocks"]) == (0, 0)
    assert stats["prefix_cache_queries"] == 2 * len(prompt)


def test_a_prompt_of_whole_blocks_recomputes_its_last_block(lm64):
    prompt = _tokens(3 * BLOCK_SIZE, seed=24)
    engine = _engine(lm64)
    with ForwardLog(lm64) as log:
        got = _one_by_one(engine, [prompt, prompt])
    assert got == [greedy_reference(lm64, prompt, 6)] * 2
    assert engine.stats()["prefix_cache_hits"] == 2 * BLOCK_SIZE, "two of three blocks: the last token is computed"
    assert [n for _, n in log.shapes if n > 1] == [48, 16], "the second prefill computes the last block only"


def test_eviction_under_the_budget_keeps_the_tokens_right(lm64):
    probe = _engine(lm64)
    _run(probe, [_tokens(BLOCK_SIZE + 1, seed=25)])
    block_bytes = probe.stats()["prefix_cache_bytes"]
    engine = _engine(lm64, prefix_cache_bytes=2 * block_bytes)  # room for two blocks
    a, b = _tokens(50, seed=26), _tokens(50, seed=27)  # three full blocks each
    got = _one_by_one(engine, [a, b, a])
    assert got == [greedy_reference(lm64, p, 6) for p in (a, b, a)]
    stats = engine.stats()
    assert stats["prefix_cache_bytes"] <= 2 * block_bytes and stats["prefix_cache_blocks"] == 2
    assert stats["prefix_cache_hits"] == 0, "B evicted A's blocks before A came back"
    assert stats["prefix_cache_evictions"] == 3 * 3 - 2, "nine blocks went in, two are left"


def test_two_requests_with_one_prefix_in_the_same_batch(lm64):
    system = _tokens(48, seed=30)
    prompts = [system + _tokens(7, seed=31), system + _tokens(11, seed=32)]
    engine = _engine(lm64)
    assert _run(engine, prompts) == [greedy_reference(lm64, p, 6) for p in prompts]
    # Admitted in the same iteration, both were looked up before either was prefilled (vLLM, which caches
    # a block when it allocates it, would let the second hit the first's blocks in the same step).
    assert engine.stats()["prefix_cache_hits"] == 0 and engine.stats()["prefix_cache_blocks"] == 3
    third = system + _tokens(9, seed=33)
    assert _run(engine, [third, prompts[1]]) == [greedy_reference(lm64, p, 6) for p in (third, prompts[1])]
    assert engine.stats()["prefix_cache_hits"] == 48 + 48


def test_the_blocks_of_a_padded_batch_prefill_come_from_each_prompts_own_row(lm64):
    prompts = [_tokens(37, seed=70), _tokens(52, seed=71), _tokens(20, seed=72)]  # left-padded to 52 together
    expected = [greedy_reference(lm64, p, 6) for p in prompts]
    engine = _engine(lm64)
    assert _run(engine, prompts) == expected
    assert _run(engine, prompts) == expected, "each prompt again, from its own cached blocks"
    assert engine.stats()["prefix_cache_hits"] == 32 + 48 + 16


def test_hits_with_chunked_prefill_the_transformers_runner_and_a_running_batch(lm64):
    system = _tokens(70, seed=40)
    prompts = [system + _tokens(n, seed=41 + n) for n in (3, 20, 37, 5, 60, 11)]
    outputs = [9, 4, 12, 7, 3, 10]
    expected = [greedy_reference(lm64, p, n) for p, n in zip(prompts, outputs)]
    for runner in ("auto", "transformers"):
        # A 24-token budget: the tokens after a hit are prefilled over several iterations, beside running rows.
        engine = Engine(lm64, max_batch_size=4, max_prefill_tokens=24, runner=runner, prefix_cache_bytes=ON)
        try:
            assert generate_staggered(engine, prompts, outputs, gap=0.003) == expected, runner
            stats = engine.stats()
        finally:
            engine.stop()
        assert stats["prefix_cache_hits"] >= 64, f"{runner}: later requests should hit the system prompt: {stats}"
        assert stats["cache_tokens"] == 0 and stats["unfinished"] == 0


def test_prefix_caching_is_off_by_default(lm64):
    engine = Engine(lm64, background=False)
    prompt = _tokens(40, seed=50)
    assert _one_by_one(engine, [prompt, prompt]) == [greedy_reference(lm64, prompt, 6)] * 2
    stats = engine.stats()
    assert stats["prefix_caching"] == "turned off" and engine.prefix_cache is None
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (0, 0), "vLLM counts no query when off"
    with pytest.raises(ValueError, match="prefix_cache_bytes"):
        Engine(lm64, background=False, prefix_cache_bytes=-1)


# --- /metrics and the command line ---------------------------------------------------------------------


def test_the_engine_core_process_reports_its_prefix_cache(lm64):
    """course serve runs the engine in its own process: its counters reach the server with its stats."""
    from course.serving.engine_process import EngineProcess

    core = EngineProcess(lm64, max_batch_size=2, prefix_cache_bytes=ON)
    try:
        system = _tokens(40, seed=80)
        for tail in (3, 5):
            core.generate(system + _tokens(tail, seed=81 + tail), SamplingParams(max_tokens=2, ignore_eos=True))
        stats = core.stats()  # the core sends a fresh snapshot with the events of the step that leaves it idle
    finally:
        core.stop()
    assert stats["prefix_caching"] == "on" and stats["prefix_cache_hits"] == 32
    assert stats["prefix_cache_queries"] == 43 + 45


def test_metrics_count_queried_and_hit_tokens_under_vllms_names(lm64):
    engine = Engine(lm64, max_batch_size=4, max_model_len=256, prefix_cache_bytes=ON)
    server = BackgroundServer(create_app(engine=engine, model_name="pc")).start()
    system = _tokens(40, seed=60)
    prompts = [system + _tokens(6, seed=61), system + _tokens(9, seed=62)]
    try:
        for prompt in prompts:
            body = {"model": "pc", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
            assert httpx.post(server.base_url + "/completions", json=body, timeout=60).status_code == 200
        page = parse_metrics(httpx.get(server.url + "/metrics", timeout=10).text)
    finally:
        server.stop()
    assert metric_value(page, PREFIX_QUERIES) == len(prompts[0]) + len(prompts[1])
    assert metric_value(page, PREFIX_HITS) == 32


def test_serve_flags_turn_prefix_caching_off_or_size_it():
    import argparse

    from course.serving.api.cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    default = parser.parse_args([])
    assert not default.enable_prefix_caching and default.prefix_cache_gib == 1.0
    assert parser.parse_args(["--enable-prefix-caching"]).enable_prefix_caching
    assert parser.parse_args(["--prefix-cache-gib", "0.25"]).prefix_cache_gib == 0.25
