"""Fused segment attention for GPUs: a Pallas (Triton) flash attention with the whole rule.

Query i attends key j iff ``q_seg[i] == kv_seg[j] != 0 and kv_block[j] <= q_block[i]``
(DESIGN.md), inside the kernel, for any segment and block ids: π0.5's prefix/suffix
structure, GR00T's causal LLM, cross-attention and a KV cache alike.

Why Pallas and not the other two GPU options:

- cuDNN through JAX's public API (``jax.nn.dot_product_attention(implementation="cudnn")``)
  takes a padding length or a causal flag, or a dense [T, S] mask as a bias: a general
  block structure over packed rows then costs every (query, key) pair of the row. Its
  segment-aware varlen path is reachable only through a private module.
- Transformer Engine's THD layout describes segments, but only with padding or causal
  masks; π0.5's block ids (a bidirectional prefix followed by a suffix block) and
  cross-attention against a cached prefix are not expressible.
- A Pallas kernel reads the ids directly and skips every key block whose segment range
  does not meet the query block's, so packed rows cost only their segments' blocks.

Forward: grid (batch, heads, query blocks); each program keeps its query block in SRAM and
runs an online softmax over the key blocks it can see, writing the output and the
log-sum-exp. Backward (FlashAttention-2): one kernel accumulates dQ per query block, one
accumulates dK and dV per key block over the query heads that share it (grouped-query
attention). Rows without a visible key give zeros. Softmax statistics are float32; q, k,
v may be bfloat16/float16 (or float32). Sequence lengths are padded to the block size and
head_dim to a power of two >= 16 outside the kernel (Triton's tile constraints).

``interpret=True`` runs the same kernels on any backend through Pallas' interpreter: the
CPU tests check the kernel logic there against the dense reference; the ``gpu``-marked test
checks the compiled Triton kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

NEG = -1e30  # masked logit: finite, so fully masked blocks never produce NaN
BIG = 2**30


def _pad(x, axis: int, multiple: int):
    size = x.shape[axis]
    target = -(-size // multiple) * multiple
    if target == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, target - size)
    return jnp.pad(x, widths)


def _head_pad(h: int) -> int:
    return max(16, 1 << (h - 1).bit_length())


def _block_ranges(seg, block: int):
    """Per block: the smallest non-zero and the largest segment id (BIG, 0 for an empty block)."""
    b, t = seg.shape
    blocks = seg.reshape(b, t // block, block)
    lo = jnp.min(jnp.where(blocks > 0, blocks, BIG), axis=-1)
    return lo.astype(jnp.int32), jnp.max(blocks, axis=-1).astype(jnp.int32)


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """A tile matmul with float32 accumulation (Triton's dot; jnp under the interpreter)."""
    a = a.T if trans_a else a
    b = b.T if trans_b else b
    return jnp.dot(a, b, preferred_element_type=jnp.float32)


def _mask(qs, qb, ks, kb):
    return (qs[:, None] == ks[None, :]) & (ks[None, :] != 0) & (kb[None, :] <= qb[:, None])


def _fwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    qs_ref,
    qb_ref,
    ks_ref,
    kb_ref,
    klo_ref,
    khi_ref,
    o_ref,
    lse_ref,
    *,
    scale: float,
    block_k: int,
    num_k_blocks: int,
):
    q = q_ref[...]
    qs, qb = qs_ref[...], qb_ref[...]
    q_lo = jnp.min(jnp.where(qs > 0, qs, BIG))
    q_hi = jnp.max(qs)
    bq, h = q.shape

    def body(j, carry):
        def visit(carry):
            acc, m, denom = carry
            sl = pl.ds(j * block_k, block_k)
            k, v = k_ref[sl, :], v_ref[sl, :]
            mask = _mask(qs, qb, ks_ref[sl], kb_ref[sl])
            s = jnp.where(mask, _dot(q, k, trans_b=True).astype(jnp.float32) * scale, NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
            correction = jnp.exp(m - m_new)
            denom = denom * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[:, None] + _dot(p.astype(v.dtype), v).astype(jnp.float32)
            return acc, m_new, denom

        visible = (klo_ref[j] <= q_hi) & (khi_ref[j] >= q_lo)
        return lax.cond(visible, visit, lambda c: c, carry)

    init = (jnp.zeros((bq, h), jnp.float32), jnp.full((bq,), NEG, jnp.float32), jnp.zeros((bq,), jnp.float32))
    acc, m, denom = lax.fori_loop(0, num_k_blocks, body, init)
    seen = denom > 0
    o_ref[...] = jnp.where(seen[:, None], acc / jnp.where(seen, denom, 1.0)[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -NEG)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qs_ref,
    qb_ref,
    ks_ref,
    kb_ref,
    klo_ref,
    khi_ref,
    dq_ref,
    *,
    scale: float,
    block_k: int,
    num_k_blocks: int,
):
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qs, qb = qs_ref[...], qb_ref[...]
    q_lo = jnp.min(jnp.where(qs > 0, qs, BIG))
    q_hi = jnp.max(qs)

    def body(j, dq):
        def visit(dq):
            sl = pl.ds(j * block_k, block_k)
            k, v = k_ref[sl, :], v_ref[sl, :]
            mask = _mask(qs, qb, ks_ref[sl], kb_ref[sl])
            s = _dot(q, k, trans_b=True).astype(jnp.float32) * scale
            p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
            dp = _dot(do, v, trans_b=True).astype(jnp.float32)
            ds = p * (dp - delta[:, None])
            return dq + _dot(ds.astype(k.dtype), k).astype(jnp.float32) * scale

        visible = (klo_ref[j] <= q_hi) & (khi_ref[j] >= q_lo)
        return lax.cond(visible, visit, lambda d: d, dq)

    dq = lax.fori_loop(0, num_k_blocks, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qs_ref,
    qb_ref,
    ks_ref,
    kb_ref,
    qlo_ref,
    qhi_ref,
    dk_ref,
    dv_ref,
    *,
    scale: float,
    block_q: int,
    num_q_blocks: int,
    group: int,
):
    k, v = k_ref[...], v_ref[...]
    ks, kb = ks_ref[...], kb_ref[...]
    k_lo = jnp.min(jnp.where(ks > 0, ks, BIG))
    k_hi = jnp.max(ks)
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for g in range(group):  # the query heads sharing this key/value head

        def body(i, carry, g=g):
            def visit(carry):
                dk, dv = carry
                sl = pl.ds(i * block_q, block_q)
                q, do = q_ref[g, sl, :], do_ref[g, sl, :]
                lse, delta = lse_ref[g, sl], delta_ref[g, sl]
                mask = _mask(qs_ref[sl], qb_ref[sl], ks, kb)
                s = _dot(q, k, trans_b=True).astype(jnp.float32) * scale
                p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
                dv = dv + _dot(p.astype(do.dtype), do, trans_a=True).astype(jnp.float32)
                dp = _dot(do, v, trans_b=True).astype(jnp.float32)
                ds = p * (dp - delta[:, None])
                dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True).astype(jnp.float32) * scale
                return dk, dv

            visible = (qlo_ref[i] <= k_hi) & (qhi_ref[i] >= k_lo)
            return lax.cond(visible, visit, lambda c: c, carry)

        dk, dv = lax.fori_loop(0, num_q_blocks, body, (dk, dv))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _flash(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale, block_q, block_k, interpret):
    return _forward(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale, block_q, block_k, interpret)[0]


def _forward(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale, block_q, block_k, interpret):
    """q [B, N, T, H], k/v [B, K, S, H] (padded), ids [B, T] / [B, S] -> (out, lse [B, N, T])."""
    b, n, t, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    group = n // kh
    klo, khi = _block_ranges(kv_seg, block_k)
    kernel = functools.partial(_fwd_kernel, scale=scale, block_k=block_k, num_k_blocks=s // block_k)
    return pl.pallas_call(
        kernel,
        grid=(b, n, t // block_q),
        in_specs=[
            pl.BlockSpec((None, None, block_q, h), lambda bi, ni, qi: (bi, ni, qi, 0)),
            pl.BlockSpec((None, None, s, h), lambda bi, ni, qi: (bi, ni // group, 0, 0)),
            pl.BlockSpec((None, None, s, h), lambda bi, ni, qi: (bi, ni // group, 0, 0)),
            pl.BlockSpec((None, block_q), lambda bi, ni, qi: (bi, qi)),
            pl.BlockSpec((None, block_q), lambda bi, ni, qi: (bi, qi)),
            pl.BlockSpec((None, s), lambda bi, ni, qi: (bi, 0)),
            pl.BlockSpec((None, s), lambda bi, ni, qi: (bi, 0)),
            pl.BlockSpec((None, s // block_k), lambda bi, ni, qi: (bi, 0)),
            pl.BlockSpec((None, s // block_k), lambda bi, ni, qi: (bi, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_q, h), lambda bi, ni, qi: (bi, ni, qi, 0)),
            pl.BlockSpec((None, None, block_q), lambda bi, ni, qi: (bi, ni, qi)),
        ],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, n, t), jnp.float32)],
        interpret=interpret,
        name="segment_flash_attention_fwd",
    )(q, k, v, q_seg, q_blk, kv_seg, kv_blk, klo, khi)


def _flash_fwd(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale, block_q, block_k, interpret):
    out, lse = _forward(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale, block_q, block_k, interpret)
    return out, (q, k, v, q_seg, kv_seg, q_blk, kv_blk, out, lse)


def _flash_bwd(scale, block_q, block_k, interpret, residuals, do):
    q, k, v, q_seg, kv_seg, q_blk, kv_blk, out, lse = residuals
    b, n, t, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    group = n // kh
    delta = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, N, T]
    klo, khi = _block_ranges(kv_seg, block_k)
    qlo, qhi = _block_ranges(q_seg, block_q)
    ids_q = pl.BlockSpec((None, block_q), lambda bi, ni, qi: (bi, qi))
    full_kv = pl.BlockSpec((None, None, s, h), lambda bi, ni, qi: (bi, ni // group, 0, 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=block_k, num_k_blocks=s // block_k),
        grid=(b, n, t // block_q),
        in_specs=[
            pl.BlockSpec((None, None, block_q, h), lambda bi, ni, qi: (bi, ni, qi, 0)),
            full_kv,
            full_kv,
            pl.BlockSpec((None, None, block_q, h), lambda bi, ni, qi: (bi, ni, qi, 0)),
            pl.BlockSpec((None, None, block_q), lambda bi, ni, qi: (bi, ni, qi)),
            pl.BlockSpec((None, None, block_q), lambda bi, ni, qi: (bi, ni, qi)),
            ids_q,
            ids_q,
            pl.BlockSpec((None, s), lambda bi, ni, qi: (bi, 0)),
            pl.BlockSpec((None, s), lambda bi, ni, qi: (bi, 0)),
            pl.BlockSpec((None, s // block_k), lambda bi, ni, qi: (bi, 0)),
            pl.BlockSpec((None, s // block_k), lambda bi, ni, qi: (bi, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, block_q, h), lambda bi, ni, qi: (bi, ni, qi, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
        name="segment_flash_attention_dq",
    )(q, k, v, do, lse, delta, q_seg, q_blk, kv_seg, kv_blk, klo, khi)

    grouped = lambda x: x.reshape(b, kh, group, *x.shape[2:])  # noqa: E731
    ids_k = pl.BlockSpec((None, block_k), lambda bi, ki, kj: (bi, kj))
    all_q = pl.BlockSpec((None, None, group, t, h), lambda bi, ki, kj: (bi, ki, 0, 0, 0))
    all_stats = pl.BlockSpec((None, None, group, t), lambda bi, ki, kj: (bi, ki, 0, 0))
    kv_block = pl.BlockSpec((None, None, block_k, h), lambda bi, ki, kj: (bi, ki, kj, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=block_q, num_q_blocks=t // block_q, group=group),
        grid=(b, kh, s // block_k),
        in_specs=[
            all_q,
            kv_block,
            kv_block,
            all_q,
            all_stats,
            all_stats,
            pl.BlockSpec((None, t), lambda bi, ki, kj: (bi, 0)),
            pl.BlockSpec((None, t), lambda bi, ki, kj: (bi, 0)),
            ids_k,
            ids_k,
            pl.BlockSpec((None, t // block_q), lambda bi, ki, kj: (bi, 0)),
            pl.BlockSpec((None, t // block_q), lambda bi, ki, kj: (bi, 0)),
        ],
        out_specs=[kv_block, kv_block],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        interpret=interpret,
        name="segment_flash_attention_dkv",
    )(grouped(q), k, v, grouped(do), grouped(lse), grouped(delta), q_seg, q_blk, kv_seg, kv_blk, qlo, qhi)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_segment_attention(
    q,
    k,
    v,
    q_segment_ids,
    kv_segment_ids,
    q_block_ids=None,
    kv_block_ids=None,
    *,
    scale: float,
    block_q: int = 64,
    block_k: int = 64,
    interpret: bool = False,
):
    """q [B, T, N, H]; k, v [B, S, K, H]; int ids [B, T] / [B, S] (block ids None = zeros) -> [B, T, N, H]."""
    b, t, n, h = q.shape
    s = k.shape[1]
    block_q = min(block_q, max(16, 1 << (t - 1).bit_length()))
    block_k = min(block_k, max(16, 1 << (s - 1).bit_length()))
    hp = _head_pad(h)
    q_blk = jnp.zeros((b, t), jnp.int32) if q_block_ids is None else q_block_ids
    kv_blk = jnp.zeros((b, s), jnp.int32) if kv_block_ids is None else kv_block_ids
    ids = [
        _pad(jnp.asarray(x, jnp.int32), 1, m)
        for x, m in ((q_segment_ids, block_q), (kv_segment_ids, block_k), (q_blk, block_q), (kv_blk, block_k))
    ]

    def heads_first(x, multiple):
        return _pad(_pad(jnp.swapaxes(x, 1, 2), 2, multiple), 3, hp)

    out = _flash(
        heads_first(q, block_q),
        heads_first(k, block_k),
        heads_first(v, block_k),
        *ids,
        float(scale),
        block_q,
        block_k,
        interpret,
    )
    return jnp.swapaxes(out[:, :, :t, :h], 1, 2)


def unavailable_reason(q) -> str | None:
    """Why the compiled kernel cannot run here (None when it can)."""
    if jax.default_backend() != "gpu":
        return f"pallas needs a GPU (default backend is {jax.default_backend()!r}); interpret=True runs anywhere"
    if q.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"pallas needs float16/bfloat16/float32 inputs (got {q.dtype})"
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except Exception as exc:  # jaxlib without Triton support
        return f"pallas: Triton lowering is not available ({exc.__class__.__name__}: {exc})"
    return None


__all__ = ["flash_segment_attention", "unavailable_reason"]
