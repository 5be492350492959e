"""Tenants and the prefix cache: vLLM's ``cache_salt``, per-key isolation, and ``/metrics`` behind a key.

A prompt prefix another client sent is cached, and a cache hit is visible twice: as a shorter time to
first token, and in ``/metrics``' hit counter. vLLM's answer is ``cache_salt``: the salt goes into the
hash of a prompt's first block (``vllm/v1/core/kv_cache_utils.py``, ``generate_block_hash_extra_keys``),
so every block's chained hash differs and only requests with the same salt share blocks. These tests
check the hashes, the hits an engine counts with and without salts, the server's checks of the field (as
vLLM's ``validate_cache_salt``), per-key isolation (each API key's requests salted with the key), and the
probe of the issue (which of 8 candidate blocks did another tenant send?), answered by ``/metrics`` when
tenants share the cache and not under isolation; and ``/metrics`` behind a key of its own.
"""

from __future__ import annotations

import argparse

import httpx
import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse: one torch thread in this module)

from course.serving.api.background import BackgroundServer
from course.serving.api.operator import tenant_of, tenant_salt
from course.serving.api.server import create_app
from course.serving.engine import Engine, SamplingParams
from course.serving.prefix_cache import BLOCK_SIZE, block_hashes, hash_block_tokens, none_hash, sha256
from course.serving.testing import chatty_tiny_model
from course.vllm_lab import PREFIX_HITS, metric_value, parse_metrics

CACHE = 1 << 26  # 64 MiB of prefix cache: every block of these tests stays cached


@pytest.fixture(scope="module")
def lm():
    return chatty_tiny_model(seed=7)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(4, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# --- the hashes ------------------------------------------------------------------------------------------


def test_a_salt_goes_into_the_first_blocks_hash_only_and_changes_every_block():
    tokens = _tokens(3 * BLOCK_SIZE + 4, seed=1)
    plain, salted = block_hashes(tokens), block_hashes(tokens, cache_salt="tenant-a")
    first = sha256((none_hash(), tuple(tokens[:BLOCK_SIZE]), (("cache_salt", "tenant-a"),)))
    assert salted[0] == first, "the first block carries (('cache_salt', salt),) as its extra keys, as in vLLM"
    for j in (1, 2):  # later blocks: no extra keys, chained to the salted one
        assert salted[j] == hash_block_tokens(salted[j - 1], tokens[j * BLOCK_SIZE : (j + 1) * BLOCK_SIZE])
    other = block_hashes(tokens, cache_salt="tenant-b")
    assert not set(plain) & set(salted) and not set(salted) & set(other) and not set(plain) & set(other)
    assert block_hashes(tokens, cache_salt="tenant-a") == salted
    assert block_hashes(tokens, cache_salt="") == plain, "an empty salt is no salt (vLLM: `if cache_salt`)"


# --- the engine --------------------------------------------------------------------------------------------


def test_different_salts_share_no_block_and_the_same_salt_hits(lm):
    engine = Engine(lm, background=False, prefix_cache_bytes=CACHE)
    prompt = _tokens(3 * BLOCK_SIZE + 5, seed=2)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    def run(salt: str | None) -> tuple[list[int], int]:
        hits = engine.prefix_cache.hits
        request = engine.submit(prompt, params, cache_salt=salt)
        while engine.num_unfinished:
            engine.step()
        return request.output_ids, engine.prefix_cache.hits - hits

    tokens_a, hit = run("a")
    assert hit == 0
    blocks = len(engine.prefix_cache)
    for salt in ("b", None, "a-but-longer"):
        tokens, hit = run(salt)
        assert hit == 0 and tokens == tokens_a, f"salt {salt!r} hit another salt's blocks"
    assert len(engine.prefix_cache) == 4 * blocks, "each salt's blocks are cached apart"
    tokens, hit = run("a")
    assert hit == 3 * BLOCK_SIZE and tokens == tokens_a
    tokens, hit = run(None)
    assert hit == 3 * BLOCK_SIZE and tokens == tokens_a


def test_the_salt_crosses_to_the_engine_core_process(lm):
    from course.serving.engine_process import EngineProcess

    core = EngineProcess(lm, max_batch_size=2, prefix_cache_bytes=CACHE)
    try:
        prompt = _tokens(2 * BLOCK_SIZE + 3, seed=3)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        for salt in ("x", "y", "x"):
            list(core.submit(prompt, params, cache_salt=salt))
        stats = core.stats()
    finally:
        core.stop()
    assert stats["prefix_cache_hits"] == 2 * BLOCK_SIZE, "only the third request (salt x again) hits"


# --- the server: the field, per-key isolation, /metrics --------------------------------------------------


def _hits(server: BackgroundServer, headers: dict | None = None) -> float:
    page = httpx.get(server.url + "/metrics", headers=headers or {}, timeout=10)
    assert page.status_code == 200, page.text
    return metric_value(parse_metrics(page.text), PREFIX_HITS)


def _complete(server: BackgroundServer, prompt: list[int], key: str | None = None, **fields) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "t", "prompt": prompt, "max_tokens": 1, **fields}
    return httpx.post(server.base_url + "/completions", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("salt", "words"),
    [
        ("", "non-empty string"),
        (5, "non-empty string"),
        (["a"], "non-empty string"),
        ("x" * 129, "at most 128 characters"),
        ("a@b", "must not contain"),
        ("a/b", "must not contain"),
        ("a\\b", "must not contain"),
        ("a\x00b", "must not contain"),
    ],
    ids=["empty", "number", "array", "129 characters", "at", "slash", "backslash", "NUL"],
)
def test_a_bad_cache_salt_is_a_400_in_vllms_words(lm, salt, words):
    with BackgroundServer(create_app(engine=Engine(lm, max_batch_size=2), model_name="t")) as server:
        refused = _complete(server, [5, 6, 7], cache_salt=salt)
        accepted = _complete(server, [5, 6, 7], cache_salt="x" * 128)
        chat = httpx.post(
            server.base_url + "/chat/completions",
            json={"model": "t", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": salt},
            timeout=60,
        )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"
    assert words in refused.json()["error"]["message"] and refused.json()["error"]["message"].startswith(
        "Parameter 'cache_salt' must"
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "cache_salt"
    assert accepted.status_code == 200


def test_the_servers_cache_salt_keeps_clients_apart(lm):
    engine = Engine(lm, max_batch_size=2, prefix_cache_bytes=CACHE)
    prompt = _tokens(2 * BLOCK_SIZE + 3, seed=4)
    with BackgroundServer(create_app(engine=engine, model_name="t")) as server:
        for salt, expected in ((None, 0), ("s1", 0), ("s2", 0), ("s1", 32), (None, 32)):
            before = _hits(server)
            fields = {} if salt is None else {"cache_salt": salt}
            assert _complete(server, prompt, **fields).status_code == 200
            assert _hits(server) - before == expected, (salt, expected)


def _isolated_server(lm, **options) -> BackgroundServer:
    engine = Engine(lm, max_batch_size=2, prefix_cache_bytes=CACHE)
    app = create_app(engine=engine, model_name="t", api_key=["key-a", "key-b"], cache_isolation="per-key", **options)
    return BackgroundServer(app)


def test_per_key_isolation_salts_every_request_with_its_key(lm):
    prompt = _tokens(2 * BLOCK_SIZE + 3, seed=5)
    with _isolated_server(lm) as server:
        steps = [
            ("key-a", {}, 0),
            ("key-a", {}, 32),  # a tenant hits its own blocks
            ("key-b", {}, 0),  # not the other tenant's
            ("key-b", {}, 32),
            ("key-b", {"cache_salt": "s"}, 0),  # a tenant's own salt splits its cache further
            ("key-a", {"cache_salt": "s"}, 0),  # the same salt from another key is still another tenant
            ("key-a", {"cache_salt": "s"}, 32),
        ]
        for key, fields, expected in steps:
            before = _hits(server)
            assert _complete(server, prompt, key, **fields).status_code == 200
            assert _hits(server) - before == expected, (key, fields, expected)
        assert _complete(server, prompt).status_code == 401
    # the salt is the key's SHA-256 then the client's salt after an '@', which no client salt may contain
    assert tenant_salt(tenant_of("key-a"), None) == f"key-{tenant_of('key-a')}@"
    assert tenant_of("key-a") != tenant_of("key-b") and "key-a" not in tenant_salt(tenant_of("key-a"), "s")


def _probe(server: BackgroundServer, victim_key: str | None, attacker_key: str | None) -> list[float]:
    """The issue's probe: the victim sends one of 8 candidate 16-token blocks (then its question); the
    attacker sends each candidate and reads /metrics' hit counter after each. Returns the 8 deltas."""
    candidates = [_tokens(BLOCK_SIZE, seed=100 + i) for i in range(8)]
    question = _tokens(5, seed=99)
    assert _complete(server, candidates[5] + question, victim_key).status_code == 200
    deltas = []
    for candidate in candidates:
        before = _hits(server)
        assert _complete(server, candidate + question, attacker_key).status_code == 200
        deltas.append(_hits(server) - before)
    return deltas


def test_the_probe_of_another_tenants_block_reads_nothing_under_isolation(lm):
    """Tenants sharing the cache (vLLM's default) let /metrics tell which candidate another sent; with
    per-key isolation no candidate hits, so the counter says nothing about the other tenant."""
    with BackgroundServer(create_app(engine=Engine(lm, prefix_cache_bytes=CACHE), model_name="t")) as shared:
        assert _probe(shared, None, None) == [0, 0, 0, 0, 0, BLOCK_SIZE, 0, 0], "the shared cache leaks: control"
    with _isolated_server(lm) as isolated:
        assert _probe(isolated, "key-a", "key-b") == [0] * 8


def test_metrics_behind_their_own_key(lm):
    with _isolated_server(lm, metrics_api_key="scraper") as server:
        for headers in ({}, {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer wrong"}):
            refused = httpx.get(server.url + "/metrics", headers=headers, timeout=10)
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "AuthenticationError"
        assert _hits(server, {"Authorization": "Bearer scraper"}) == 0
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # probes need no key
        refused = _complete(server, [5, 6, 7], "scraper")
        assert refused.status_code == 401, "the metrics key is not a tenant's key"
    with _isolated_server(lm) as server:  # no metrics key: open, as in vLLM
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200


def test_per_key_isolation_needs_keys(lm):
    from course.serving.api.cli import add_serve_arguments, serve

    with pytest.raises(ValueError, match="per-key"):
        create_app(engine=Engine(lm, background=False), model_name="t", cache_isolation="per-key")
    with pytest.raises(ValueError, match="cache_isolation"):
        create_app(engine=Engine(lm, background=False), model_name="t", api_key="k", cache_isolation="yes")
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["--cache-isolation", "per-key"])
    assert serve(args) == 2
    args = parser.parse_args(["--api-key", "k1", "k2", "--cache-isolation", "per-key", "--metrics-api-key", "m"])
    assert args.api_key == ["k1", "k2"] and args.cache_isolation == "per-key" and args.metrics_api_key == "m"
    assert parser.parse_args([]).cache_isolation == "shared"
