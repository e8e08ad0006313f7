"""The Pallas (Triton) segment flash attention against the dense-mask reference.

On CPU the kernels run in Pallas' interpreter (the kernel logic: block skipping, online
softmax, FlashAttention-2 backward, grouped-query heads, padding to the tile sizes); the
``gpu``-marked test compiles them with Triton and checks bfloat16 inputs
(``JAX_PLATFORMS=cuda,cpu python -m pytest -m gpu tests/test_nn_pallas_attention.py``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.nn import attention as attn
from embodied_jax.nn.block_sparse import SegmentBounds
from embodied_jax.nn.pallas_attention import flash_segment_attention


def _case(seed, t=40, s=None, structure="general"):
    """Packed rows (one with a padding tail, one whose last segment starts mid-block) and ids of
    π0.5's prefix/suffix structure, GR00T's causal one, or random blocks."""
    rng = np.random.default_rng(seed)
    s = s or t
    q_seg = np.zeros((2, t), np.int32)
    q_seg[0, :15], q_seg[0, 15:33] = 1, 2
    q_seg[1, :], q_seg[1, 29:] = 1, 3
    kv_seg = q_seg if s == t else np.sort(rng.integers(0, 4, (2, s)), axis=1).astype(np.int32)
    if structure == "causal":
        q_blk = np.concatenate([np.arange(t)[None]] * 2).astype(np.int32)
    elif structure == "prefix_suffix":
        q_blk = (np.arange(t) % 20 >= 14).astype(np.int32)[None].repeat(2, 0)
    else:
        q_blk = rng.integers(0, 3, (2, t)).astype(np.int32)
    kv_blk = q_blk if s == t else rng.integers(0, 3, (2, s)).astype(np.int32)
    return rng, q_seg, kv_seg, q_blk, kv_blk


def _compare(q, k, v, ids, tol, interpret):
    q_seg, kv_seg, q_blk, kv_blk = ids
    rng = np.random.default_rng(1)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    mask = attn.attention_mask(q_seg, kv_seg, q_blk, kv_blk)

    def ref(q, k, v):
        return attn.xla_attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask, 0.3)

    def fused(q, k, v):
        return flash_segment_attention(
            q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale=0.3, block_q=16, block_k=16, interpret=interpret
        ).astype(jnp.float32)

    np.testing.assert_allclose(np.asarray(jax.jit(fused)(q, k, v)), np.asarray(jax.jit(ref)(q, k, v)), **tol)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * weights)

    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), **tol)


@pytest.mark.parametrize(
    "structure,heads,kv_heads,head_dim,kv_len",
    [("general", 4, 2, 24, None), ("causal", 2, 1, 16, None), ("prefix_suffix", 2, 2, 8, 24)],
)
def test_interpreted_kernel_equals_dense_reference(structure, heads, kv_heads, head_dim, kv_len):
    rng, *ids = _case(heads + kv_heads, structure=structure, s=kv_len)
    t, s = ids[0].shape[1], ids[1].shape[1]
    q = rng.standard_normal((2, t, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((2, s, kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((2, s, kv_heads, head_dim)).astype(np.float32)
    _compare(q, k, v, ids, dict(atol=2e-5, rtol=2e-5), interpret=True)


def test_dispatch_refuses_pallas_without_a_gpu():
    q = jnp.zeros((1, 8, 2, 16))
    seg = jnp.ones((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="impl='pallas' unavailable.*GPU"):
        attn.attention(q, q, q, q_segment_ids=seg, kv_segment_ids=seg, impl="pallas")


@pytest.mark.gpu
@pytest.mark.parametrize("structure", ["general", "causal", "prefix_suffix"])
def test_compiled_kernel_equals_dense_reference_in_bfloat16(structure):
    rng, *ids = _case(7, t=300, structure=structure)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 300, n, 64)), jnp.bfloat16) for n in (8, 2, 2))
    _compare(q, k, v, ids, dict(atol=3e-2, rtol=3e-2), interpret=False)
    bounds = SegmentBounds(max_segments=3, max_q_len=300, max_kv_len=300)
    out = attn.attention(
        q,
        k,
        v,
        q_segment_ids=ids[0],
        kv_segment_ids=ids[1],
        q_block_ids=ids[2],
        kv_block_ids=ids[3],
        impl="auto",
        bounds=bounds,
        scale=0.3,
    )
    assert out.dtype == jnp.bfloat16
