"""Properties of the KV-cache calculator that must hold for every model, length and batch (hypothesis)."""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from course import geometry, kv

DTYPES = st.sampled_from(sorted(name for name, d in kv.KV_DTYPES.items() if d.mla_token_bytes is None))
MODELS = st.sampled_from(sorted(kv.MODELS))


@st.composite
def geometries(draw):
    """Random valid decoder geometries: MHA, GQA or MQA, sometimes with sliding windows."""
    kv_heads = draw(st.integers(1, 16))
    group = draw(st.integers(1, 8))
    layers = draw(st.integers(1, 96))
    window = draw(st.one_of(st.none(), st.integers(2, 8192)))
    kinds = None
    if window is not None and draw(st.booleans()):
        kinds = tuple(draw(st.sampled_from([geometry.SLIDING, geometry.FULL])) for _ in range(layers))
    return geometry.ModelGeometry(
        "random",
        num_layers=layers,
        num_query_heads=kv_heads * group,
        num_kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([32, 64, 80, 96, 128, 256])),
        hidden_size=4096,
        sliding_window=window,
        layer_types=kinds,
    )


@settings(max_examples=150, deadline=None)
@given(g=geometries(), dtype=DTYPES, a=st.integers(0, 200_000), b=st.integers(0, 200_000), batch=st.integers(1, 512))
def test_bytes_grow_with_length_and_batch(g, dtype, a, b, batch):
    short, long = sorted((a, b))
    assert kv.sequence_bytes(g, short, dtype) <= kv.sequence_bytes(g, long, dtype)
    assert kv.batch_bytes(g, long, batch, dtype) <= kv.batch_bytes(g, long, batch + 1, dtype)
    assert kv.sequence_bytes(g, long, dtype) <= long * kv.bytes_per_token(g, dtype)  # windows only ever save


@settings(max_examples=150, deadline=None)
@given(g=geometries(), dtype=DTYPES, tokens=st.integers(0, 100_000))
def test_gqa_never_exceeds_mha(g, dtype, tokens):
    from dataclasses import replace

    mha = replace(g, num_kv_heads=g.num_query_heads)
    assert kv.sequence_bytes(g, tokens, dtype) <= kv.sequence_bytes(mha, tokens, dtype)
    assert kv.bytes_per_token(g, dtype) * g.num_query_heads == kv.bytes_per_token(mha, dtype) * g.num_kv_heads


@settings(max_examples=300, deadline=None)
@given(tokens=st.integers(0, 1_000_000), block_size=st.integers(1, 256))
def test_blocks_cover_the_tokens_and_waste_less_than_one_block(tokens, block_size):
    p = kv.paged_blocks(tokens, block_size)
    assert p.blocks * p.block_size == p.slots >= tokens
    assert 0 <= p.waste_tokens < block_size and p.slots - p.waste_tokens == tokens
    assert p.blocks == 0 or (p.blocks - 1) * block_size < tokens  # no block more than needed


@settings(max_examples=100, deadline=None)
@given(
    name=MODELS,
    gpu=st.sampled_from(sorted(kv.hardware.GPUS)),
    utilization=st.floats(0.05, 1.0),
    dtype=DTYPES,
    block_size=st.sampled_from([1, 8, 16, 32, 64, 128]),
    context=st.integers(1, 200_000),
    tp=st.sampled_from([1, 2, 4, 8, 16]),
)
def test_budget_never_hands_out_more_than_it_has(name, gpu, utilization, dtype, block_size, context, tp):
    g = kv.MODELS[name]
    assume(g.num_query_heads % tp == 0 and (g.is_mla or g.num_kv_heads % tp == 0 or tp % g.num_kv_heads == 0))
    b = kv.budget(g, gpu, utilization=utilization, kv_dtype=dtype, block_size=block_size, max_model_len=4096, tp=tp)
    assert b.num_blocks * b.page_bytes <= max(0.0, b.kv_memory)
    assert b.max_batch(context) * b.blocks_for(context) <= b.num_blocks
    assert (b.max_batch(context) + 1) * b.blocks_for(context) > b.num_blocks  # and no fewer than fit
    assert b.num_tokens == int(b.max_concurrency * b.max_model_len)  # vLLM's "GPU KV cache size"
    if len(b.groups) == 1 and b.groups[0].kind == "full_attention":  # full attention: blocks of every layer
        assert b.blocks_for(context) == -(-context // block_size)
