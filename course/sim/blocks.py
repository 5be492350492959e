"""The paged KV cache: fixed-size blocks, a free list, block tables, and optional prefix caching.

The KV cache is cut into ``num_blocks`` blocks of ``block_size`` token slots each (vLLM's default on
CUDA is 16). A request owns a *block table*, the list of blocks that hold its tokens in order; it
takes a new block only when its last one is full, so at most ``block_size - 1`` slots per request
are wasted (PagedAttention, SOSP'23, https://arxiv.org/abs/2309.06180).

Prefix caching follows vLLM V1 (``vllm/v1/core/block_pool.py``, ``kv_cache_utils.py``):

* only **full** blocks are cached; a block's hash covers its tokens *and its parent's hash*, so
  one hash names the whole prefix up to that block (``hash_block_tokens(parent_hash, tokens)``);
* a request looks up the longest chain of its block hashes that is cached, at most
  ``num_tokens - 1`` tokens (the last token is always recomputed to get its logits);
* freed blocks keep their hash and go to the tail of the free queue, the request's last block
  first, so the free queue is an LRU list whose front is evicted first; a cache hit on a free
  block pulls it back out of the queue ("touch"); eviction is lazy, when a block is reused.

This module is the library's reference. Module 3's exercise 3.1 rebuilds its basic part (free
list, allocate, append, free, utilisation), and the graded tests make sure an answer does not
call it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from course.units import cdiv


def prompt_block_hashes(
    request_id: str, prompt_tokens: int, block_size: int, segments: Sequence[tuple[str, int]] = ()
) -> list[int]:
    """Chained hashes of the prompt's full blocks, without materialising any token.

    A prompt is described by named ``segments`` ``(name, tokens)`` in order: two requests whose
    segments share a name hold the same tokens there (a shared system prompt). With no segments
    the whole prompt is unique to the request. Block ``k`` covers tokens ``[k*block_size,
    (k+1)*block_size)``; its content key lists the pieces of segments it covers with their offsets
    inside the segment, and its hash is ``hash((parent_hash, content_key))``, so a block that
    starts the same text at a different offset, or follows a different prefix, hashes differently.
    """
    if not segments:
        segments = ((f"unique prompt of request {request_id}", prompt_tokens),)
    hashes: list[int] = []
    parent: Hashable = None
    pieces: list[tuple[str, int, int]] = []  # (segment name, start, end) inside the current block
    filled = 0
    for name, length in segments:
        offset = 0
        while offset < length:
            take = min(length - offset, block_size - filled)
            pieces.append((name, offset, offset + take))
            offset += take
            filled += take
            if filled == block_size:
                parent = hash((parent, tuple(pieces)))
                hashes.append(parent)
                pieces, filled = [], 0
    return hashes


class BlockManager:
    """A paged KV cache of ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        num_blocks: blocks in the cache (vLLM: KV memory // (block bytes x layers)).
        block_size: token slots per block.
        enable_prefix_caching: keep freed full blocks with their hash for reuse (LRU eviction).

    Block ids are ``0 .. num_blocks - 1``. Without prefix caching a block is either free or owned
    by exactly one request. With it, a block can be shared (a reference count) or sit in the free
    queue while still holding a cached prefix; such a block counts as free (evictable), as in vLLM.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # With prefix caching the free queue is in LRU order (the front is taken, and its cached
        # prefix evicted, first); without it any free block will do, and a plain list is faster.
        self._free: OrderedDict[int, None] | list[int] = (
            OrderedDict.fromkeys(range(num_blocks)) if enable_prefix_caching else list(range(num_blocks - 1, -1, -1))
        )
        self._ref = [0] * num_blocks  # owners of each block; kept with prefix caching only (shared blocks)
        self._hash: list[Hashable | None] = [None] * num_blocks
        self._cached: dict[Hashable, int] = {}  # block hash -> block holding that prefix
        self._tables: dict[str, list[int]] = {}
        self._tokens: dict[str, int] = {}  # tokens each request has room reserved for
        self._hashed: dict[str, int] = {}  # leading blocks of each request already registered in the cache
        self._held: list[int] = []  # blocks taken for no request yet (hold / release)
        self.evictions = 0

    # --- state -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (with prefix caching: including evictable cached ones)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose prefix hash is registered (in use or evictable)."""
        return len(self._cached)

    def utilisation(self) -> float:
        """Fraction of blocks held by requests (vLLM's ``kv_cache_usage``), 0..1."""
        return self.num_used_blocks / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's blocks in token order (a copy)."""
        return list(self._table(request_id))

    def num_tokens(self, request_id: str) -> int:
        """Tokens the request has room reserved for."""
        self._table(request_id)
        return self._tokens[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def _table(self, request_id: str) -> list[int]:
        try:
            return self._tables[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no blocks; allocate() it first") from None

    # --- allocation ----------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    def blocks_to_allocate(self, num_tokens: int, cached_blocks: Sequence[int] = ()) -> int:
        """Free blocks a new request of ``num_tokens`` tokens would take (vLLM's ``get_num_blocks_to_allocate``):
        the blocks beyond its prefix-cache hits, plus the hits that sit in the free queue (touching them
        takes them out of it)."""
        if not cached_blocks:
            return cdiv(num_tokens, self.block_size)
        evictable_hits = sum(1 for block in cached_blocks if self._ref[block] == 0)
        return self.blocks_needed(num_tokens) - len(cached_blocks) + evictable_hits

    def allocate(self, request_id: str, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give a new request room for ``num_tokens`` tokens; False (and no change) if blocks run out.

        ``cached_blocks`` are prefix-cache hits from :meth:`lookup`: they become the first entries
        of the table and are shared, not copied. A hit that sits in the free queue stops being free,
        so it counts against the free blocks too (vLLM's ``num_evictable_computed_blocks``).
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks; use append() to grow it")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if len(cached_blocks) * self.block_size > num_tokens:
            raise ValueError("cached_blocks hold more tokens than the request asks room for")
        if self.blocks_to_allocate(num_tokens, cached_blocks) > len(self._free):
            return False
        new = self.blocks_needed(num_tokens) - len(cached_blocks)
        for block in cached_blocks:  # touch: a hit is in use again, and no longer evictable
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1
        self._tables[request_id] = list(cached_blocks) + self._take(new)
        self._tokens[request_id] = num_tokens
        self._hashed[request_id] = len(cached_blocks)
        return True

    def append(self, request_id: str, num_new_tokens: int = 1) -> bool:
        """Room for ``num_new_tokens`` more tokens; a block is taken only when the last one is full."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return self.reserve(request_id, self.num_tokens(request_id) + num_new_tokens)

    def reserve(self, request_id: str, total_tokens: int) -> bool:
        """Room for ``total_tokens`` tokens in all (vLLM's ``allocate_slots``); False if blocks run out."""
        table = self._table(request_id)
        new = self.blocks_needed(total_tokens) - len(table)
        if new > len(self._free):
            return False
        if new > 0:
            table.extend(self._take(new))
        if total_tokens > self._tokens[request_id]:
            self._tokens[request_id] = total_tokens
        return True

    def _take(self, count: int) -> list[int]:
        if not self.enable_prefix_caching:  # one owner per block: the tables say who, no count to keep
            blocks = self._free[len(self._free) - count :]
            del self._free[len(self._free) - count :]
            return blocks
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old = self._hash[block]
            if old is not None:  # lazy eviction: the cached prefix is overwritten now
                if self._cached.get(old) == block:
                    del self._cached[old]
                self._hash[block] = None
                self.evictions += 1
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def hold(self, count: int) -> bool:
        """Take ``count`` blocks for requests not named yet (the fast engine's decodes, which name their
        blocks only when they stop decoding); False (and no change) if fewer are free. No prefix
        caching: which block a request gets must not matter."""
        if self.enable_prefix_caching:
            raise ValueError("hold() is for a cache without prefix caching, where block ids do not matter")
        if count > len(self._free):
            return False
        self._held.extend(self._take(count))
        return True

    def release(self, count: int) -> None:
        """Give ``count`` held blocks back to the free list (a request then takes them by name)."""
        if not 0 <= count <= len(self._held):
            raise ValueError(f"cannot release {count} blocks: {len(self._held)} are held")
        if count:
            blocks = self._held[len(self._held) - count :]
            del self._held[len(self._held) - count :]
            self._free.extend(blocks)

    def free(self, request_id: str) -> None:
        """Release the request's blocks (finished or preempted).

        Blocks go to the tail of the free queue in reverse order, so the end of a prefix chain is
        evicted before its beginning; cached blocks keep their hash until they are reused.
        """
        table = self._tables.pop(request_id, None)
        if table is None:
            raise KeyError(f"request {request_id!r} holds no blocks; was it freed twice?")
        del self._tokens[request_id]
        del self._hashed[request_id]
        if not self.enable_prefix_caching:
            self._free.extend(reversed(table))
            return
        for block in reversed(table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    # --- prefix caching ------------------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[Hashable], max_blocks: int | None = None) -> list[int]:
        """Blocks holding the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for block_hash in block_hashes[:max_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_full_blocks(self, request_id: str, block_hashes: Sequence[Hashable], num_computed_tokens: int) -> None:
        """Register the request's blocks that are full after ``num_computed_tokens`` tokens.

        ``block_hashes`` are the chained hashes of the request's full prompt blocks; blocks past them
        (generated tokens) are not cached here. As in vLLM, blocks are registered when the step that
        fills them is scheduled, so a request admitted later in the same step can already hit them.
        """
        if not self.enable_prefix_caching:
            return
        table = self._table(request_id)
        full = min(num_computed_tokens // self.block_size, len(block_hashes), len(table))
        for index in range(self._hashed[request_id], full):
            block, block_hash = table[index], block_hashes[index]
            if self._hash[block] is None and block_hash not in self._cached:
                self._hash[block] = block_hash
                self._cached[block_hash] = block
        if full > self._hashed[request_id]:
            self._hashed[request_id] = full

    def check(self) -> None:
        """Assert the internal invariants (tests call this after every operation)."""
        owned = [block for table in self._tables.values() for block in table] + self._held
        counts: dict[int, int] = {}
        for block in owned:
            counts[block] = counts.get(block, 0) + 1
        if self.enable_prefix_caching:
            for block in range(self.num_blocks):
                assert self._ref[block] == counts.get(block, 0), f"block {block}: ref count {self._ref[block]}"
                assert (self._ref[block] == 0) == (block in self._free), f"block {block}: free-queue membership"
        else:
            assert len(set(owned)) == len(owned), "a block is owned twice without prefix caching"
            assert not set(owned) & set(self._free), "a block is both owned and free"
            assert len(owned) + len(self._free) == self.num_blocks, "a block is neither owned nor free"
        for request_id, table in self._tables.items():
            need = self.blocks_needed(self._tokens[request_id])
            assert len(table) == need, f"request {request_id}: {len(table)} blocks for {need} blocks of tokens"
        for block_hash, block in self._cached.items():
            assert self._hash[block] == block_hash, f"cached hash of block {block} is stale"
