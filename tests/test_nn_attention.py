"""Segment-id attention vs an independent NumPy dense-mask float32 reference."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.nn import attention as attn
from embodied_jax.parallel import hlo


def brute_force_mask(q_seg, kv_seg, q_blk, kv_blk):
    b, t = q_seg.shape
    s = kv_seg.shape[1]
    out = np.zeros((b, 1, t, s), bool)
    for bi in range(b):
        for i in range(t):
            for j in range(s):
                out[bi, 0, i, j] = q_seg[bi, i] == kv_seg[bi, j] != 0 and kv_blk[bi, j] <= q_blk[bi, i]
    return out


def reference_attention(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale=None):
    """Float64 NumPy attention with repeated K/V heads and an explicit loop-built mask."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n, kh = q.shape[2], k.shape[2]
    k = np.repeat(k, n // kh, axis=2)
    v = np.repeat(v, n // kh, axis=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    logits = np.einsum("btnh,bsnh->bnts", q, k) * scale
    mask = brute_force_mask(q_seg, kv_seg, q_blk, kv_blk)
    out = np.zeros_like(q)
    for bi in range(q.shape[0]):
        for hi in range(n):
            for i in range(q.shape[1]):
                visible = mask[bi, 0, i]
                if not visible.any():
                    continue
                row = logits[bi, hi, i][visible]
                p = np.exp(row - row.max())
                p /= p.sum()
                out[bi, i, hi] = p @ v[bi, visible, hi]
    return out


def packed_ids(rng, batch, length, structure):
    """Random packed segment ids (1.., 0 = padding tail) and block ids of a given structure."""
    seg = np.zeros((batch, length), np.int32)
    blk = np.zeros((batch, length), np.int32)
    for b in range(batch):
        pos, sid = 0, 1
        while pos < length - 1:
            n = int(rng.integers(1, max(2, length // 2)))
            n = min(n, length - pos)
            if rng.random() < 0.15 and sid > 1:
                break  # leave a padding tail
            seg[b, pos : pos + n] = sid
            if structure == "causal":
                blk[b, pos : pos + n] = np.arange(n)
            elif structure == "prefix_lm":
                cut = int(rng.integers(0, n + 1))
                blk[b, pos + cut : pos + n] = np.arange(1, n - cut + 1) // 2 + 1
            pos += n
            sid += 1
    return seg, blk


def random_qkv(rng, b, t, s, n, kh, h, dtype=np.float32):
    q = rng.standard_normal((b, t, n, h)).astype(dtype)
    k = rng.standard_normal((b, s, kh, h)).astype(dtype)
    v = rng.standard_normal((b, s, kh, h)).astype(dtype)
    return q, k, v


def test_mask_rule_matches_brute_force_loop():
    rng = np.random.default_rng(0)
    for structure in ("none", "causal", "prefix_lm"):
        q_seg, q_blk = packed_ids(rng, 3, 11, structure)
        got = np.asarray(attn.attention_mask(q_seg, q_seg, q_blk, q_blk))
        np.testing.assert_array_equal(got, brute_force_mask(q_seg, q_seg, q_blk, q_blk))
    # cross-attention with different lengths and arbitrary block ids
    q_seg = rng.integers(0, 3, (2, 5)).astype(np.int32)
    kv_seg = rng.integers(0, 3, (2, 8)).astype(np.int32)
    q_blk = rng.integers(0, 3, (2, 5)).astype(np.int32)
    kv_blk = rng.integers(0, 3, (2, 8)).astype(np.int32)
    got = np.asarray(attn.attention_mask(q_seg, kv_seg, q_blk, kv_blk))
    np.testing.assert_array_equal(got, brute_force_mask(q_seg, kv_seg, q_blk, kv_blk))
    # block ids None means zeros
    got = np.asarray(attn.attention_mask(q_seg, kv_seg))
    zeros_q, zeros_kv = np.zeros_like(q_seg), np.zeros_like(kv_seg)
    np.testing.assert_array_equal(got, brute_force_mask(q_seg, kv_seg, zeros_q, zeros_kv))


@pytest.mark.parametrize(
    "structure,heads,kv_heads",
    [("none", 4, 1), ("causal", 4, 2), ("prefix_lm", 4, 4), ("prefix_lm", 6, 2)],
)
def test_self_attention_packed_matches_reference(structure, heads, kv_heads):
    rng = np.random.default_rng([len(structure), heads, kv_heads])
    seg, blk = packed_ids(rng, 2, 13, structure)
    q, k, v = random_qkv(rng, 2, 13, 13, heads, kv_heads, 8)
    blk_arg = None if structure == "none" else blk
    got = attn.attention(
        q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_block_ids=blk_arg, kv_block_ids=blk_arg, impl="xla"
    )
    assert got.shape == q.shape and got.dtype == jnp.float32
    want = reference_attention(q, k, v, seg, seg, blk, blk)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_cross_attention_different_lengths_and_scale():
    rng = np.random.default_rng(3)
    q_seg = np.array([[1, 1, 2, 2, 0], [1, 1, 1, 1, 1]], np.int32)
    kv_seg = np.array([[1, 1, 1, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
    q_blk = np.array([[1, 1, 0, 2, 0], [0, 1, 2, 3, 4]], np.int32)
    kv_blk = np.array([[0, 1, 2, 0, 1, 2, 0, 0, 0], [0, 0, 1, 1, 2, 2, 3, 0, 0]], np.int32)
    q, k, v = random_qkv(rng, 2, 5, 9, 4, 2, 16)
    got = attn.attention(
        q,
        k,
        v,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        q_block_ids=q_blk,
        kv_block_ids=kv_blk,
        impl="auto",
        scale=0.3,
    )
    want = reference_attention(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


def test_kv_cache_suffix_equals_joint_attention():
    """Suffix queries against a cached prefix == the suffix rows of one joint attention."""
    rng = np.random.default_rng(4)
    b, p_len, s_len, n, kh, h = 2, 7, 4, 4, 1, 8
    prefix_seg = np.array([[1] * 5 + [0] * 2, [1] * 3 + [2] * 4], np.int32)
    suffix_seg = np.array([[1] * 4, [2] * 3 + [0]], np.int32)
    prefix_blk = np.zeros((b, p_len), np.int32)
    suffix_blk = np.ones((b, s_len), np.int32)  # π0.5: the action suffix is one block after the prefix
    q, k, v = random_qkv(rng, b, p_len + s_len, p_len + s_len, n, kh, h)
    seg = np.concatenate([prefix_seg, suffix_seg], 1)
    blk = np.concatenate([prefix_blk, suffix_blk], 1)
    cache = attn.KVCache(
        k=jnp.asarray(k[:, :p_len]),
        v=jnp.asarray(v[:, :p_len]),
        segment_ids=jnp.asarray(prefix_seg),
        block_ids=jnp.asarray(prefix_blk),
    )
    got = attn.attention(
        q[:, p_len:],
        k[:, p_len:],
        v[:, p_len:],
        q_segment_ids=suffix_seg,
        kv_segment_ids=suffix_seg,
        q_block_ids=suffix_blk,
        kv_block_ids=suffix_blk,
        cache=cache,
        impl="xla",
    )
    want = reference_attention(q, k, v, seg, seg, blk, blk)[:, p_len:]
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    extended = attn.extend_kv(cache, k[:, p_len:], v[:, p_len:], suffix_seg, suffix_blk)
    np.testing.assert_array_equal(np.asarray(extended.segment_ids), seg)
    np.testing.assert_array_equal(np.asarray(extended.k), k)


def test_fully_masked_rows_are_zero_with_finite_gradients():
    rng = np.random.default_rng(5)
    q_seg = np.array([[1, 1, 3, 0]], np.int32)  # segment 3 has no keys; 0 is padding
    kv_seg = np.array([[1, 1, 2, 0, 0]], np.int32)
    q, k, v = random_qkv(rng, 1, 4, 5, 2, 1, 8)

    def loss(q, k, v):
        out = attn.attention(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, impl="xla")
        return jnp.sum(out**2), out

    grads, out = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out[0, 2:]), 0.0)
    assert not np.allclose(np.asarray(out[0, :2]), 0.0)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(grads[0][0, 2:]), 0.0)


def naive_attention(q, k, v, mask, scale):
    """Repeated K/V heads, a select on the logits and on the probabilities: jnp, any dtype."""
    n, kh = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, n // kh, axis=2), jnp.repeat(v, n // kh, axis=2)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    logits = jnp.where(mask, logits, -jnp.inf)
    probs = jnp.exp(logits - jnp.max(jnp.where(mask, logits, 0.0), axis=-1, keepdims=True))
    probs = jnp.where(mask, probs, 0.0)
    probs = probs / jnp.maximum(probs.sum(-1, keepdims=True), 1e-300)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_xla_gradients_match_float64_autodiff_of_a_naive_attention(kv_heads):
    """The dense path's own VJP against autodiff of an independent float64 formulation:
    cross-attention lengths, grouped heads, general blocks, a query segment with no key."""
    rng = np.random.default_rng(kv_heads)
    q_seg = np.array([[1, 1, 2, 2, 3, 0], [1, 1, 1, 1, 1, 1]], np.int32)  # segment 3: no keys
    kv_seg = np.array([[1, 1, 1, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0, 0]], np.int32)
    q_blk = np.array([[1, 1, 0, 2, 0, 0], [0, 1, 2, 3, 4, 5]], np.int32)
    kv_blk = np.array([[0, 1, 2, 0, 1, 2, 0, 0, 0], [0, 0, 1, 1, 2, 2, 3, 0, 0]], np.int32)
    q, k, v = random_qkv(rng, 2, 6, 9, 4, kv_heads, 8)
    cotangent = rng.standard_normal(q.shape)
    mask = brute_force_mask(q_seg, kv_seg, q_blk, kv_blk)

    def ours(q, k, v):
        out = attn.attention(
            q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_block_ids=q_blk, kv_block_ids=kv_blk, impl="xla"
        )
        return jnp.sum(out * cotangent.astype(np.float32))

    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(q, k, v)
    with jax.enable_x64(True):
        want = jax.grad(
            lambda q, k, v: jnp.sum(naive_attention(q, k, v, mask, 8**-0.5) * cotangent), argnums=(0, 1, 2)
        )(*(jnp.asarray(a, jnp.float64) for a in (q, k, v)))
        want = [np.asarray(w) for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), w, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(np.asarray(got[0][0, 4]), 0.0)  # the query without keys


@pytest.mark.hlo
def test_one_kv_head_keeps_the_probabilities_where_they_are():
    """With one KV head (π0.5), no layout copy of the [G·T, S] probabilities in the compiled
    forward and backward: XLA:CPU copied them between two layouts that differ only in where a
    size-1 KV-head axis sits (the same bytes), once per pass."""
    b, t, heads, head_dim = 2, 48, 4, 16
    q, k, v = random_qkv(np.random.default_rng(1), b, t, t, heads, 1, head_dim)
    segments = np.ones((b, t), np.int32)

    def loss(q, k, v):
        out = attn.attention(q, k, v, q_segment_ids=segments, kv_segment_ids=segments, impl="xla")
        return jnp.sum(jnp.sin(out))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    probabilities = b * heads * t * t
    layout_copies = [
        (i.name, i.result)
        for i in hlo.instructions(text)
        if "copy" in i.body and i.body <= {"parameter", "bitcast", "copy"} and i.elements >= probabilities
    ]
    assert not layout_copies, layout_copies


def test_bfloat16_inputs_follow_float32_reference():
    rng = np.random.default_rng(6)
    seg, blk = packed_ids(rng, 2, 10, "prefix_lm")
    q, k, v = random_qkv(rng, 2, 10, 10, 4, 2, 16)
    qb, kb, vb = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    got = attn.attention(
        qb, kb, vb, q_segment_ids=seg, kv_segment_ids=seg, q_block_ids=blk, kv_block_ids=blk, impl="auto"
    )
    assert got.dtype == jnp.bfloat16
    want = reference_attention(*(np.asarray(a, np.float32) for a in (qb, kb, vb)), seg, seg, blk, blk)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)


def test_segment_positions_restart_per_segment():
    seg = np.array([[1, 1, 1, 2, 2, 3, 0, 0], [1, 2, 2, 2, 2, 2, 2, 2]], np.int32)
    want = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        count = 0
        for i in range(seg.shape[1]):
            count = 0 if i == 0 or seg[b, i] != seg[b, i - 1] else count + 1
            want[b, i] = count if seg[b, i] else 0
    np.testing.assert_array_equal(np.asarray(attn.segment_positions(seg)), want)


def test_mask_positions_count_real_tokens_across_padding():
    mask = np.array([[1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1], [0, 0, 0, 0, 0, 0]], np.int32)
    want = np.array([[0, 1, 2, 0, 0, 0], [0, 0, 0, 1, 2, 3], [0, 0, 1, 2, 0, 3], [0, 0, 0, 0, 0, 0]])
    got = np.asarray(attn.mask_positions(mask))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(attn.mask_positions(mask.astype(bool))), want)
    # The formulas the models used before: π0.5's prefix (real tokens, padding 0) exactly; GR00T's
    # (padding kept the last real rank, which no attention reads) on the real tokens.
    pi05 = np.maximum(np.cumsum(mask, axis=1) - 1, 0) * mask
    np.testing.assert_array_equal(got, pi05)
    gr00t = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    np.testing.assert_array_equal(got[mask != 0], gr00t[mask != 0])
    # One contiguous run of real tokens per row: the same as the within-segment positions.
    contiguous = mask[:2]
    np.testing.assert_array_equal(got[:2], np.asarray(attn.segment_positions(contiguous)))
    # Holes: segment_positions restarts after one, mask_positions keeps counting.
    assert np.asarray(attn.segment_positions(mask[2:3]))[0, 2] == 0 and got[2, 2] == 1


def test_dispatch_on_cpu(caplog):
    assert jax.default_backend() == "cpu"
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 1, 4, 4, 2, 1, 8)
    seg = np.ones((1, 4), np.int32)
    attn._LOGGED_FALLBACKS.clear()
    with caplog.at_level(logging.INFO, logger=attn.__name__):
        auto = attn.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl="auto")
        attn.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl="auto")
    fallback_lines = [r.getMessage() for r in caplog.records if "uses xla" in r.getMessage()]
    assert len(fallback_lines) == 1 and "GPU" in fallback_lines[0]
    xla = attn.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
    for impl in ("cudnn", "te"):
        with pytest.raises(ValueError, match=f"impl='{impl}' unavailable.*GPU"):
            attn.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl=impl)
    with pytest.raises(ValueError, match="impl='flash'"):
        attn.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl="flash")
    with pytest.raises(ValueError, match="kv_segment_ids"):
        attn.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg[:, :3], impl="xla")
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attn.attention(q, np.repeat(k, 3, 2), np.repeat(v, 3, 2), q_segment_ids=seg, kv_segment_ids=seg)
