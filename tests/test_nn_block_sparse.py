"""Block-sparse segment attention vs the dense-mask reference (float32, forward and gradients),
the KV-cache form, dispatch, and the cost: XLA-counted FLOPs close to the visible block pairs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.nn import attention as attn
from embodied_jax.nn.block_sparse import (
    BlockSparseTiling,
    SegmentBounds,
    _tile_blocks,
    block_sparse_attention,
    default_tiling,
)
from embodied_jax.parallel.hlo import dot_flops


def random_packing(rng, batch, length, max_len, structure):
    """Packed rows: contiguous segments 1.. of 1..max_len tokens, a padding tail, an empty row
    when batch > 2; block ids of the given structure."""
    seg = np.zeros((batch, length), np.int32)
    blk = np.zeros((batch, length), np.int32)
    for b in range(batch):
        if batch > 2 and b == batch - 1:
            continue  # an empty row
        pos, sid = 0, 1
        while pos < length:
            n = min(int(rng.choice([1, rng.integers(1, max_len + 1)])), length - pos)  # one-token segments too
            if rng.random() < 0.1 and sid > 1:
                break
            seg[b, pos : pos + n] = sid
            if structure == "causal":
                blk[b, pos : pos + n] = np.arange(n)
            elif structure == "general":
                blk[b, pos : pos + n] = rng.integers(0, 3, n)
            pos, sid = pos + n, sid + 1
    return seg, blk


def dense(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale):
    return attn.xla_attention(q, k, v, attn.attention_mask(q_seg, kv_seg, q_blk, kv_blk), scale)


def check_equal(q, k, v, q_seg, kv_seg, q_blk, kv_blk, bounds, scale=0.25):
    weights = jnp.asarray(np.random.default_rng(0).standard_normal(q.shape).astype(np.float32))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * weights)

    sparse = jax.jit(
        lambda q, k, v: block_sparse_attention(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale=scale, bounds=bounds)
    )
    ref = jax.jit(lambda q, k, v: dense(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale))
    np.testing.assert_allclose(np.asarray(sparse(q, k, v)), np.asarray(ref(q, k, v)), atol=1e-6, rtol=1e-6)
    got = jax.jit(jax.grad(loss(sparse), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "structure,heads,kv_heads,block",
    # ("causal", 6, 6, 2): tiles of eight blocks, runs of up to ten (the last tile moved back);
    # ("none", 1, 1, 1): whole-segment tiles of sixteen blocks, runs of up to nineteen
    [
        ("none", 4, 1, 8),
        ("causal", 4, 2, 4),
        ("general", 2, 2, 16),
        ("causal", 8, 1, 32),
        ("causal", 6, 6, 2),
        ("none", 1, 1, 1),
    ],
)
def test_self_attention_equals_dense(structure, heads, kv_heads, block):
    rng = np.random.default_rng([heads, kv_heads, block])
    b, t, max_len = 4, 61, 19  # segments straddle block edges (block sizes 4..16)
    seg, blk = random_packing(rng, b, t, max_len, structure)
    segments = int(seg.max())
    q = rng.standard_normal((b, t, heads, 8)).astype(np.float32)
    k = rng.standard_normal((b, t, kv_heads, 8)).astype(np.float32)
    v = rng.standard_normal((b, t, kv_heads, 8)).astype(np.float32)
    bounds = SegmentBounds(max_segments=segments, max_q_len=max_len, max_kv_len=max_len, block_size=block)
    blk_arg = None if structure == "none" else blk
    check_equal(q, k, v, seg, seg, blk_arg, blk_arg, bounds)


@pytest.mark.parametrize(
    "tiling",
    [
        BlockSparseTiling(tile_rows=16, max_tile_blocks=2, step_blocks=2, step_logits=64, parallel_loops=1),
        BlockSparseTiling(whole_tile_rows=64, max_whole_tile_blocks=3, key_blocks_per_step=1, parallel_loops=3),
    ],
    ids=["small_tiles_one_loop", "small_chunks_three_loops"],
)
def test_any_tiling_gives_the_same_attention(tiling):
    """Tile and chunk sizes are platform tuning (a config field): they change how the work is cut, never
    the result."""
    rng = np.random.default_rng(7)
    b, t, max_len = 3, 45, 13
    for structure in ("causal", "none"):
        seg, blk = random_packing(rng, b, t, max_len, structure)
        q = rng.standard_normal((b, t, 2, 8)).astype(np.float32)
        k = rng.standard_normal((b, t, 1, 8)).astype(np.float32)
        v = rng.standard_normal((b, t, 1, 8)).astype(np.float32)
        bounds = SegmentBounds(int(seg.max()), max_len, max_len, block_size=4, tiling=tiling)
        blk_arg = None if structure == "none" else blk
        check_equal(q, k, v, seg, seg, blk_arg, blk_arg, bounds)


def test_tiling_defaults_are_per_platform_and_checked():
    assert default_tiling("cpu") == BlockSparseTiling()
    assert default_tiling("gpu") == BlockSparseTiling()  # unmeasured there: the CPU's until a benchmark says
    with pytest.raises(ValueError, match="tile_rows must be >= 1"):
        BlockSparseTiling(tile_rows=0)


def test_kv_cache_form_equals_dense():
    """π0.5's suffix: queries = per-sample action tokens (block 1), keys = the cached packed prefix
    followed by the suffix, so a key segment is two runs (prefix, then suffix)."""
    rng = np.random.default_rng(1)
    b, p_len, hzn, m = 3, 40, 5, 3
    prefix_seg, _ = random_packing(rng, b, p_len, 16, "none")
    prefix_seg = np.minimum(prefix_seg, m)  # at most m samples (the last runs merge: still contiguous)
    present = np.stack([(prefix_seg == i).any(1) for i in range(1, m + 1)], 1)
    suffix_seg = np.repeat(np.where(present, np.arange(1, m + 1), 0), hzn, axis=1).astype(np.int32)
    suffix_blk = np.ones_like(suffix_seg)
    prefix_blk = np.zeros_like(prefix_seg)
    n, kh, h = 4, 1, 8
    q = rng.standard_normal((b, m * hzn, n, h)).astype(np.float32)
    k_all = rng.standard_normal((b, p_len + m * hzn, kh, h)).astype(np.float32)
    v_all = rng.standard_normal((b, p_len + m * hzn, kh, h)).astype(np.float32)
    cache = attn.KVCache(
        k=jnp.asarray(k_all[:, :p_len]),
        v=jnp.asarray(v_all[:, :p_len]),
        segment_ids=jnp.asarray(prefix_seg),
        block_ids=jnp.asarray(prefix_blk),
    )
    longest = int(max((prefix_seg == i).sum(1).max() for i in range(1, m + 1)))
    bounds = SegmentBounds(max_segments=m, max_q_len=hzn, max_kv_len=longest + hzn, block_size=8)
    kwargs = dict(
        q_segment_ids=suffix_seg,
        kv_segment_ids=suffix_seg,
        q_block_ids=suffix_blk,
        kv_block_ids=suffix_blk,
        cache=cache,
        scale=0.3,
    )
    got = jax.jit(lambda q, k, v: attn.attention(q, k, v, impl="auto", bounds=bounds, **kwargs))(
        q, k_all[:, p_len:], v_all[:, p_len:]
    )
    want = jax.jit(lambda q, k, v: attn.attention(q, k, v, impl="xla", **kwargs))(q, k_all[:, p_len:], v_all[:, p_len:])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    seg = np.concatenate([prefix_seg, suffix_seg], 1)
    blk = np.concatenate([prefix_blk, suffix_blk], 1)
    check_equal(q, k_all, v_all, suffix_seg, seg, suffix_blk, blk, bounds, scale=0.3)


@pytest.mark.hlo
def test_whole_segments_promise_takes_full_attention_tiles():
    """``whole_segments=True`` with zero block ids: the same result as the dense reference,
    through the block-sparse form's larger full-attention tiles (a different program)."""
    rng = np.random.default_rng(3)
    seg, _ = random_packing(rng, 2, 96, 40, "none")
    zeros = np.zeros_like(seg)
    q = rng.standard_normal((2, 96, 2, 8)).astype(np.float32)
    bounds = SegmentBounds(max_segments=int(seg.max()), max_q_len=40, max_kv_len=40, block_size=2)
    kwargs = dict(q_segment_ids=seg, kv_segment_ids=seg, q_block_ids=zeros, kv_block_ids=zeros)

    def sparse(whole):
        return jax.jit(
            lambda q: attn.attention(q, q, q, impl="blocksparse", bounds=bounds, whole_segments=whole, **kwargs)
        )

    want = np.asarray(attn.attention(q, q, q, impl="xla", **kwargs))
    for whole in (False, True):
        np.testing.assert_allclose(np.asarray(sparse(whole)(q)), want, atol=1e-6, rtol=1e-6)
    assert sparse(True).lower(q).as_text() != sparse(False).lower(q).as_text()


def test_whole_sample_tiles_only_with_one_query_head_per_key_head():
    """Whole-segment tiles grow to a whole sample (up to 1024 rows) only with one query head
    per key head; with 8 query heads over 1 (π0.5) or 2 the general 512-row tiles are kept."""
    assert _tile_blocks(14, 1, 64, whole=True) == 14  # GR00T's adapter: a 14-block sample per tile
    assert _tile_blocks(14, 1, 64, whole=False) == 8
    assert _tile_blocks(16, 8, 64, whole=True) == _tile_blocks(16, 8, 64, whole=False) == 1
    assert _tile_blocks(16, 2, 64, whole=True) == 4


@pytest.mark.hlo
def test_dispatch_uses_block_sparse_for_packed_rows_on_cpu():
    rng = np.random.default_rng(2)
    seg, _ = random_packing(rng, 2, 24, 8, "none")
    q = rng.standard_normal((2, 24, 2, 8)).astype(np.float32)
    bounds = SegmentBounds(max_segments=int(seg.max()), max_q_len=8, max_kv_len=8, block_size=4)
    kwargs = dict(q_segment_ids=seg, kv_segment_ids=seg)
    auto = jax.jit(lambda q: attn.attention(q, q, q, impl="auto", bounds=bounds, **kwargs))
    hlo = auto.lower(q).as_text()
    dense_hlo = jax.jit(lambda q: attn.attention(q, q, q, impl="xla", **kwargs)).lower(q).as_text()
    assert "24x24" in dense_hlo and "24x24" not in hlo  # no row x row mask
    np.testing.assert_allclose(
        np.asarray(auto(q)), np.asarray(attn.attention(q, q, q, impl="xla", **kwargs)), atol=1e-6
    )
    with pytest.raises(ValueError, match="needs bounds"):
        attn.attention(q, q, q, impl="blocksparse", **kwargs)
    with pytest.raises(ValueError, match="max_segments"):
        SegmentBounds(max_segments=0, max_q_len=1, max_kv_len=1)


def _flops(fn, *args):
    """XLA's matmul FLOPs of the compiled program, every loop body times its trip count."""
    return dot_flops(jax.jit(fn).lower(*args).compile().as_text())


@pytest.mark.parametrize("blocks", ["none", "zeros"])
def test_flops_of_eight_equal_segments_near_visible_block_pairs(blocks):
    """Whole segments (no block ids) and explicit zero block ids (tiles for a general block
    structure); segments of two blocks, so that every tile needs one key chunk and the count
    (the data-dependent inner loop counted once) is the whole work."""
    t, length, block, n, h = 1024, 128, 64, 4, 64
    seg = np.repeat(np.arange(1, 9, dtype=np.int32), length)[None]
    q = jnp.zeros((1, t, n, h), jnp.float32)
    k = jnp.zeros((1, t, 1, h), jnp.float32)
    bounds = SegmentBounds(max_segments=8, max_q_len=length, max_kv_len=length, block_size=block)
    ids = None if blocks == "none" else np.zeros_like(seg)
    sparse = _flops(lambda q, k: block_sparse_attention(q, k, k, seg, seg, ids, ids, scale=0.1, bounds=bounds), q, k)
    visible_pairs = 8 * (length // block) ** 2
    pair_flops = 2 * 2 * block * block * n * h  # q·k and p·v of one block pair
    ratio = sparse / (visible_pairs * pair_flops)
    dense_ratio = _flops(lambda q, k: dense(q, k, k, seg, seg, None, None, 0.1), q, k) / (visible_pairs * pair_flops)
    assert 1.0 <= ratio <= 1.3, ratio
    assert dense_ratio > 7.5  # the dense mask pays for all 8 x 8 segment pairs
