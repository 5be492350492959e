"""The reference server's prefix cache (``course.serving.prefix_cache``) against vLLM's own code.

The block hashes are compared byte for byte with the ones vLLM's request block hasher computes
(``vllm/v1/core/kv_cache_utils.py``: ``init_none_hash``, ``get_request_block_hasher``); the hit rule with
what vLLM's scheduler, with prefix caching on, leaves to compute for each of a sequence of prompts
(``Scheduler.schedule()`` after ``KVCacheManager.get_computed_blocks``): the prompt's tokens minus its hit.
"""

from __future__ import annotations

import random

import pytest
import torch

from course.models import save_tiny_model
from course.serving.prefix_cache import BLOCK_SIZE, PrefixCache, block_hashes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="module")
def vllm_hasher(installed_vllm):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK_SIZE, sha256)


def _request(rid: str, tokens: list[int], hasher):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1, ignore_eos=True)
    return Request(rid, tokens, params, None, arrival_time=0.0, block_hasher=hasher)


def test_block_hashes_are_byte_identical_to_vllms(vllm_hasher):
    rng = random.Random(0)
    for n in (1, 15, 16, 17, 48, 100, 257):
        tokens = [rng.randrange(0, 2048) for _ in range(n)]
        assert _request(f"h{n}", tokens, vllm_hasher).block_hashes == block_hashes(tokens), n


def test_salted_block_hashes_are_byte_identical_to_vllms(vllm_hasher):
    """A request's cache_salt goes into its first block's extra keys (``generate_block_hash_extra_keys``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    rng = random.Random(1)
    tokens = [rng.randrange(0, 2048) for _ in range(3 * BLOCK_SIZE + 7)]
    for salt in ("tenant-a", "b", "key-" + "0" * 64 + "@s"):
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        theirs = Request("s", tokens, params, None, arrival_time=0.0, block_hasher=vllm_hasher, cache_salt=salt)
        assert theirs.block_hashes == block_hashes(tokens, cache_salt=salt), salt
        assert theirs.block_hashes[0] != block_hashes(tokens)[0]


def _scheduler(model_dir):
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    blocks = 4096  # memory is never the limit: every block of every prompt stays cached
    scheduler_config = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048, enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), max_model_len=2048, dtype="float32"),
        scheduler_config=scheduler_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
    )
    config.cache_config.num_gpu_blocks = blocks
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
    layout = KVCacheConfig(
        num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn"], spec)]
    )
    return Scheduler(config, layout, StructuredOutputManager(config), block_size=BLOCK_SIZE)


def test_hits_match_what_vllms_scheduler_leaves_to_compute(model_dir, vllm_hasher):
    """Prompts one after another: identical prefixes, a partly shared one, a timestamp in front, a prompt
    shorter than a block, one of whole blocks seen before, and the same blocks after a different first one."""
    system = list(range(100, 140))
    a, b, c = list(range(500, 516)), list(range(600, 616)), list(range(700, 716))
    prompts = [
        system + [1, 2, 3],
        system + [4, 5, 6, 7],  # two blocks of the system prompt
        system[:20] + [9] * 30,  # one block in common
        [42] + system + [1, 2, 3],  # a timestamp in front: nothing
        list(range(2000, 2012)),  # shorter than one block
        list(range(3000, 3048)),  # three whole blocks ...
        list(range(3000, 3048)),  # ... again: two are reused, the last token is computed
        list(range(3000, 3049)),  # one token more: all three
        a + b + [1],
        c + b + [1],  # b after a different block: nothing
        a + c + b + [2],  # a only
    ]
    theirs = _scheduler(model_dir)
    ours = PrefixCache(capacity_bytes=1 << 30)
    for i, tokens in enumerate(prompts):
        rid = f"p{i}"
        theirs.add_request(_request(rid, tokens, vllm_hasher))
        scheduled = theirs.schedule().num_scheduled_tokens[rid]
        hashes = block_hashes(tokens)
        hit = len(ours.lookup(hashes, len(tokens))) * BLOCK_SIZE
        ours.insert(hashes, lambda j: torch.zeros(1, 2, 1, BLOCK_SIZE, 1))
        assert hit == len(tokens) - scheduled, f"prompt {i}: course {hit} hit, vLLM {scheduled} of {len(tokens)} to do"
    assert ours.hits > 0
