"""Prefix caching for the reference server: the KV of full prompt blocks, keyed as vLLM keys them.

vLLM V1 (|version|) reuses the KV cache of a prompt's leading blocks when an earlier request computed
the same tokens in the same place. The rules, from ``vllm/v1/core/kv_cache_utils.py`` and
``vllm/v1/core/kv_cache_manager.py``:

* a prompt is cut into blocks of ``block_size`` tokens (16 by default in 0.32, 64 in 0.34:
  ``CacheConfig.DEFAULT_BLOCK_SIZE``, ``vllm/config/cache.py``); **only full blocks** are hashed and cached, a
  partial last block never is;
* a block's hash covers its tokens *and the hash of the block before it*
  (``hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys)`` =
  ``hash_function((parent_block_hash, tuple(curr_block_token_ids), extra_keys))``), so one hash names the
  whole prefix up to the end of its block: a token changed anywhere changes the hash of its block and of
  every block after it. The first block's parent is ``NONE_HASH``; ``extra_keys`` carry LoRA names,
  multimodal inputs and a request's ``cache_salt`` (none of the first two here, so ``None`` for every
  block of an unsalted prompt);
* a request's ``cache_salt`` goes into the extra keys of its **first block only**, as
  ``(("cache_salt", salt),)`` (``generate_block_hash_extra_keys``: ``if start_token_idx == 0 and
  request.cache_salt``); every later block's hash chains to the first, so a salt changes the hash of every
  block, and two requests share blocks only if they send the same salt (or none). An empty salt counts as
  none; the server refuses one anyway, as vLLM's ``validate_cache_salt`` does;
* the default hash function is ``sha256`` (``prefix_caching_hash_algo``; ``vllm/utils/hashing.py``:
  SHA-256 of the pickled tuple), and ``NONE_HASH`` is ``sha256("vllm-none-hash")``, or ``sha256`` of
  ``$PYTHONHASHSEED`` when that is set (``init_none_hash``), so the hashes here are byte for byte vLLM's
  (``tests/oracle/test_prefix_hash.py`` checks them against vLLM's own functions);
* a lookup takes the longest run of leading blocks whose hashes are cached, but never the whole prompt:
  "When all tokens hit the cache, we must recompute the last token to obtain logits"
  (``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length = request.num_tokens - 1``), so a
  prompt of exactly N full blocks reuses at most N - 1 of them;
* ``vllm:prefix_cache_queries`` counts every prompt token looked up and ``vllm:prefix_cache_hits`` the
  tokens found, once per request at admission (``vllm/v1/metrics/stats.py``, ``PrefixCacheStats``;
  ``vllm/v1/metrics/loggers.py``);
* cached blocks nobody uses are evicted least recently used first, and among blocks freed together the
  end of a prompt before its beginning (``vllm/v1/core/block_pool.py``, ``FreeKVCacheBlockQueue``).

vLLM keeps its KV cache in a pool of blocks, and a cached block *is* a block of that pool, shared by
every request that hits it. This server keeps each running request's cache in a padded row
(:mod:`course.serving.batch_cache`), so :class:`PrefixCache` is a separate store: it holds a *copy* of
every full prompt block, ``(layers, 2, kv_heads, block_size, head_dim)`` tensors on the model's device,
under a byte budget; a request that hits copies its blocks into its own cache and prefills only the
rest of its prompt. The copies cost memory vLLM does not spend, and a block is cached once its whole
prompt is prefilled (vLLM caches a block as soon as it is allocated, so a second request in the same
step already hits the first's blocks, and it caches the full blocks of generated tokens too).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

# tokens per block: vLLM 0.32's default (CacheConfig.DEFAULT_BLOCK_SIZE, vllm/config/cache.py), the release the
# oracle runs this cache beside; 0.34 uses 64 (course.kv.vllm.RULES), so its hits land on 64-token boundaries
BLOCK_SIZE = 16
DEFAULT_CAPACITY_BYTES = 1 << 30  # course serve --enable-prefix-caching's budget (--prefix-cache-gib)
NONE_HASH_SEED = "vllm-none-hash"  # DEFAULT_NONE_HASH_SEED, vllm/v1/core/kv_cache_utils.py

__all__ = [
    "BLOCK_SIZE",
    "PrefixCache",
    "block_hashes",
    "cache_hit_blocks",
    "hash_block_tokens",
    "none_hash",
    "salt_keys",
    "sha256",
]


def sha256(value: Any) -> bytes:
    """vLLM's default block hash function (``vllm/utils/hashing.py``, ``sha256``): SHA-256 of the value
    pickled with the highest protocol; 32 bytes."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent hash of a prompt's first block (``init_none_hash`` with ``sha256``): the hash of
    ``$PYTHONHASHSEED`` if that is set, else of the fixed seed ``"vllm-none-hash"``."""
    return sha256(os.environ.get("PYTHONHASHSEED", NONE_HASH_SEED))


def hash_block_tokens(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
    """The hash of one full block: its ``tokens`` chained to its ``parent`` block's hash (None: the
    first block, whose parent is :func:`none_hash`), as vLLM's ``hash_block_tokens`` computes it."""
    return sha256((parent or none_hash(), tuple(int(t) for t in tokens), extra_keys))


def salt_keys(cache_salt: str | None) -> tuple | None:
    """The extra keys of a prompt's first block for ``cache_salt`` (None: unsalted, and so is ""), as
    ``generate_block_hash_extra_keys`` makes them: ``(("cache_salt", salt),)``."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE, cache_salt: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids`` (``len(token_ids) // block_size`` of
    them; a partial last block gets none), as ``get_request_block_hasher`` computes a request's;
    ``cache_salt`` goes into the first block's hash (:func:`salt_keys`), and so into every hash after it."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[bytes] = []
    parent = none_hash()  # computed once per prompt, not once per block
    extra_keys = salt_keys(cache_salt)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = sha256((parent, tuple(int(t) for t in token_ids[start : start + block_size]), extra_keys))
        hashes.append(parent)
        extra_keys = None  # the salt is in the first block's hash only; the chain carries it on
    return hashes


def cache_hit_blocks(hashes: Sequence[bytes], cached: Callable[[bytes], bool], num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt of ``num_tokens`` tokens (with full-block ``hashes``) come
    from the cache: the longest run of leading hashes for which ``cached(hash)`` holds, but at most
    ``(num_tokens - 1) // block_size`` blocks, so that the last prompt token is always computed
    (``get_computed_blocks``: ``max_cache_hit_length = num_tokens - 1``)."""
    limit = min(len(hashes), max(num_tokens - 1, 0) // block_size)
    hits = 0
    while hits < limit and cached(hashes[hits]):
        hits += 1
    return hits


class PrefixCache:
    """Full prompt blocks' keys and values under a byte budget, least recently used evicted first.

    Args:
        capacity_bytes: the most bytes the cached blocks may hold (> 0).
        block_size: tokens per block.

    A block is one tensor ``(layers, 2, kv_heads, block_size, head_dim)`` (keys then values, every layer),
    stored under its chained hash (:func:`block_hashes`). The counters mirror vLLM's:
    ``queries`` and ``hits`` are prompt tokens looked up and found (``vllm:prefix_cache_queries`` and
    ``vllm:prefix_cache_hits``), ``evictions`` counts blocks evicted to make room.
    """

    def __init__(self, capacity_bytes: int, block_size: int = BLOCK_SIZE) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.capacity_bytes = int(capacity_bytes)
        self.block_size = block_size
        self._blocks: OrderedDict[bytes, Any] = OrderedDict()  # front: evicted first
        self.bytes_used = 0
        self.queries = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._blocks

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The chained hashes of the full blocks of ``token_ids``, salted with ``cache_salt`` (None: unsalted)."""
        return block_hashes(token_ids, self.block_size, cache_salt)

    def lookup(self, hashes: Sequence[bytes], num_tokens: int) -> list[Any]:
        """The cached blocks of the longest cached prefix of a prompt of ``num_tokens`` tokens whose
        full blocks hash to ``hashes`` (:func:`cache_hit_blocks`); counts the query and its hits.

        Call it once per request, when it is admitted. Returns the block tensors in prompt order.
        """
        found = cache_hit_blocks(hashes, self._blocks.__contains__, num_tokens, self.block_size)
        self.queries += num_tokens
        self.hits += found * self.block_size
        blocks = [self._blocks[h] for h in hashes[:found]]
        self._touch(hashes[:found])
        return blocks

    def insert(self, hashes: Sequence[bytes], block: Callable[[int], Any]) -> int:
        """Cache a prefilled prompt's full blocks: ``hashes[j]`` is block ``j``'s hash and ``block(j)``
        makes its tensor (called only for blocks not cached yet). Returns the blocks added.

        The prompt's blocks become the most recently used, its first block last of all, so that
        eviction takes the end of a prompt before its beginning. A block larger than the whole
        budget is not cached.
        """
        added = 0
        for j in reversed(range(len(hashes))):
            block_hash = hashes[j]
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                continue
            tensor = block(j)
            size = tensor.numel() * tensor.element_size()
            if size > self.capacity_bytes:
                return added
            self._evict(self.capacity_bytes - size)
            self._blocks[block_hash] = tensor
            self.bytes_used += size
            added += 1
        return added

    def clear(self) -> None:
        """Drop every cached block (the counters stay)."""
        self._blocks.clear()
        self.bytes_used = 0

    def stats(self) -> dict[str, int]:
        """Counters for ``Engine.stats()`` and ``/metrics``: queries and hits in tokens, blocks and bytes held."""
        return {
            "prefix_cache_queries": self.queries,
            "prefix_cache_hits": self.hits,
            "prefix_cache_blocks": len(self._blocks),
            "prefix_cache_bytes": self.bytes_used,
            "prefix_cache_evictions": self.evictions,
        }

    def _touch(self, hashes: Sequence[bytes]) -> None:
        for block_hash in reversed(hashes):  # the first block ends up most recently used
            self._blocks.move_to_end(block_hash)

    def _evict(self, keep_at_most: int) -> None:
        """Evict least recently used blocks until at most ``keep_at_most`` bytes are held."""
        while self._blocks and self.bytes_used > keep_at_most:
            _, tensor = self._blocks.popitem(last=False)
            self.bytes_used -= tensor.numel() * tensor.element_size()
            self.evictions += 1
