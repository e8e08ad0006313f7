"""Block-sparse segment attention: only (query block, key block) pairs of the same segment.

The portable (XLA, any backend) form of the project's attention rule for packed rows: query
token i attends key token j iff ``q_seg[i] == kv_seg[j] != 0 and kv_block[j] <= q_block[i]``.
A dense mask over a packed row costs rows x rows however many samples share it; here the
cost is the sum over segments of (query blocks) x (key blocks) of that segment.

Layout. Each side (queries; keys/values) is rearranged into a *virtual* row where tokens
are grouped by segment (a stable sort, so a segment split into several runs, e.g. a
cached prefix followed by its suffix, becomes one run) and every segment starts at a
block boundary; padding tokens are dropped. Static sizes come from ``SegmentBounds``
(what the packing config guarantees): with at most R segments per row the virtual row
needs ``min(T, (T + R (b - 1)) // b)`` blocks, and a query block needs at most
``ceil(max_kv_len / b)`` key blocks, those of its own segment. Query block j gathers its
segment's key blocks [J, B, C, b, ...] (block-major, so the loop slices without a
transpose).

Compute. The query blocks are sorted by how many key blocks they need (up to the last one
holding a visible key: a causal query block needs those up to itself, a short sample's
only its own few), longest first. A ``lax.map`` takes four query blocks per step; inside
it a loop with a data-dependent trip count takes four key blocks at a time, as many as
the step's first (neediest) block needs, with an online softmax. The loop has its own VJP
with flash attention's arithmetic: the forward pass keeps each query's log-sum-exp, the
backward pass recomputes the probabilities from it (no softmax to differentiate, none
stored). The outputs are gathered back to the original token order (zeros where a query
sees no key).

Cost: the visible block pairs, rounded up to groups of four key blocks and to the
neediest of four sorted query blocks (about the real query-key pairs of the row's
samples, half of them for causal attention), against B x L^2 for the same samples padded
to L. Memory is static: the gathered key blocks are sized by ``max_kv_len``.

Everything is gathers, einsums and exponentials: XLA compiles it on CPU and GPU, and JAX
differentiates the gathers (scatter-adds into the gathered blocks). The bounds must
hold: a row with more segments than ``max_segments`` or a segment longer than its bound
loses keys silently (the packer and the model configs guarantee them).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SegmentBounds:
    """Static facts about packed rows that size the block-sparse computation.

    ``max_segments``: segments per row (either side); ``max_q_len`` / ``max_kv_len``: the
    longest query / key segment (tokens); ``block_size``: tokens per block.
    """

    max_segments: int
    max_q_len: int
    max_kv_len: int
    block_size: int = 64

    def __post_init__(self):
        for name in ("max_segments", "max_q_len", "max_kv_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SegmentBounds.{name} must be >= 1, got {getattr(self, name)}")

    def block(self, longest: int) -> int:
        """Tokens per block on a side whose longest segment is ``longest``: ``block_size``, or
        the power of two that holds the segment when that is smaller."""
        return min(self.block_size, 1 << max(0, longest - 1).bit_length())


def virtual_blocks(length: int, max_segments: int, block: int) -> int:
    """Blocks of the virtual row: every segment rounded up to whole blocks."""
    return max(1, min(length, (length + max_segments * (block - 1)) // block))


@dataclasses.dataclass
class _Layout:
    source: jax.Array  # int32 [B, V]: token index per virtual slot, `length` for an empty slot
    dest: jax.Array  # int32 [B, T]: virtual slot per token, V for padding (dropped)
    run_segment: jax.Array  # int32 [B, R]: segment id of each run, 0 when absent
    run_first_block: jax.Array  # int32 [B, R]
    run_blocks: jax.Array  # int32 [B, R]
    block_segment: jax.Array  # int32 [B, J]: segment id of each virtual block, 0 when empty


def _layout(segment_ids, max_segments: int, block: int, num_blocks: int) -> _Layout:
    seg = jnp.asarray(segment_ids, jnp.int32)
    b, t = seg.shape
    v = num_blocks * block
    big = jnp.iinfo(jnp.int32).max
    order = jnp.argsort(jnp.where(seg == 0, big, seg), axis=1, stable=True)
    sorted_seg = jnp.take_along_axis(seg, order, axis=1)
    idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones((b, 1), bool), sorted_seg[:, 1:] != sorted_seg[:, :-1]], axis=1)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # [B, T], 0-based
    real = sorted_seg != 0
    run = jnp.where(real, jnp.minimum(run, max_segments - 1), max_segments)  # padding -> a dump run
    rows = jnp.arange(b)[:, None]
    run_len = jnp.zeros((b, max_segments + 1), jnp.int32).at[rows, run].add(1)[:, :max_segments]
    run_start = jnp.full((b, max_segments + 1), t, jnp.int32).at[rows, run].min(idx)[:, :max_segments]
    run_segment = jnp.zeros((b, max_segments + 1), jnp.int32).at[rows, run].max(sorted_seg)[:, :max_segments]
    run_blocks = (run_len + block - 1) // block
    run_first_block = jnp.cumsum(run_blocks, axis=1) - run_blocks
    run_c = jnp.minimum(run, max_segments - 1)
    rank = idx - jnp.take_along_axis(run_start, run_c, axis=1)
    slot = jnp.take_along_axis(run_first_block, run_c, axis=1) * block + rank
    slot = jnp.where(real & (slot < v), slot, v)
    dest = jnp.zeros((b, t), jnp.int32).at[rows, order].set(slot)
    source = jnp.full((b, v + 1), t, jnp.int32).at[rows, slot].set(order.astype(jnp.int32))[:, :v]
    block_index = jnp.arange(num_blocks, dtype=jnp.int32)
    inside = (block_index[None, None, :] >= run_first_block[:, :, None]) & (
        block_index[None, None, :] < (run_first_block + run_blocks)[:, :, None]
    )  # [B, R, J]
    block_segment = jnp.max(jnp.where(inside, run_segment[:, :, None], 0), axis=1)
    return _Layout(source, dest, run_segment, run_first_block, run_blocks, block_segment)


def block_sparse_attention(
    q, k, v, q_segment_ids, kv_segment_ids, q_block_ids, kv_block_ids, *, scale: float, bounds: SegmentBounds
):
    """q [B, T, N, H]; k, v [B, S, K, H]; ids [B, T] / [B, S] (block ids may be None = zeros)."""
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    g = n // kv_heads
    bq, bk = bounds.block(min(bounds.max_q_len, t)), bounds.block(min(bounds.max_kv_len, s))
    r = bounds.max_segments
    jq = virtual_blocks(t, r, bq)
    jk = virtual_blocks(s, r, bk)
    c = min(jk, math.ceil(bounds.max_kv_len / bk))
    q_blk = jnp.zeros((b, t), jnp.int32) if q_block_ids is None else jnp.asarray(q_block_ids, jnp.int32)
    kv_blk = jnp.zeros((b, s), jnp.int32) if kv_block_ids is None else jnp.asarray(kv_block_ids, jnp.int32)
    ql = _layout(q_segment_ids, r, bq, jq)
    kl = _layout(kv_segment_ids, r, bk, jk)

    qb = min(_QUERY_BLOCKS_PER_STEP, jq)  # query blocks per loop step
    ck = min(_KEY_BLOCKS_PER_STEP, c)  # key blocks per inner step
    c = -(-c // ck) * ck
    groups = -(-jq // qb)
    rows = jnp.arange(b)[None, :, None]

    def by_block(x, layout, block, order=None):  # [B, T, ...] -> [J(+1), B, block, ...]
        xp = jnp.concatenate([x, jnp.zeros((b, 1, *x.shape[2:]), x.dtype)], axis=1)  # index T: a zero row
        index = layout.source.reshape(b, -1, block)
        index = jnp.concatenate([index, jnp.full((b, 1, block), x.shape[1], index.dtype)], axis=1)  # an empty block
        index = jnp.swapaxes(index if order is None else index[:, order], 0, 1)
        return xp[rows, index]

    kv_layout = lambda x: jnp.swapaxes(by_block(x, kl, bk)[:-1], 0, 1)  # noqa: E731  [B, Jk, bk, ...]
    kv_seg_v, kv_blk_v = kv_layout(jnp.asarray(kv_segment_ids, jnp.int32)), kv_layout(kv_blk)

    # Key blocks of each query block (the last one empty): its segment's run on the key side.
    seg_j = jnp.concatenate([ql.block_segment, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, Jq + 1]
    match = (kl.run_segment[:, None, :] == seg_j[:, :, None]) & (seg_j[:, :, None] != 0)  # [B, Jq + 1, R]
    kv_run = jnp.argmax(match, axis=-1)
    first = jnp.take_along_axis(kl.run_first_block, kv_run, axis=1)
    count = jnp.where(match.any(-1), jnp.take_along_axis(kl.run_blocks, kv_run, axis=1), 0)
    step = jnp.arange(c, dtype=jnp.int32)
    kv_index = jnp.minimum(first[..., None] + step, jk - 1)  # [B, Jq + 1, C]
    kv_valid = step[None, None, :] < count[..., None]

    def take_blocks(x, order=slice(None)):  # [B, Jk, ...] -> [J, B, C, ...]
        return jnp.swapaxes(x[jnp.arange(b)[:, None, None], kv_index[:, order]], 0, 1)

    def visible(order=slice(None)):  # [J, B, bq, C, bk]
        q_seg_v = by_block(jnp.asarray(q_segment_ids, jnp.int32), ql, bq)[order]  # 0 in empty slots
        q_blk_v = by_block(q_blk, ql, bq)[order]
        kb_seg, kb_blk = take_blocks(kv_seg_v, order), take_blocks(kv_blk_v, order)
        return (
            (q_seg_v[..., None, None] == kb_seg[:, :, None])
            & (kb_seg[:, :, None] != 0)
            & (kb_blk[:, :, None] <= q_blk_v[..., None, None])
            & jnp.swapaxes(kv_valid[:, order], 0, 1)[:, :, None, :, None]
        )

    # The key blocks a query block really needs (up to its last visible one: a causal query
    # block needs only those up to itself). Query blocks are processed longest first, so the
    # blocks of one loop step need about equally many and the loop stops at what they need.
    seen = visible().any(axis=(1, 2, 4))  # [Jq + 1, C]
    need = jnp.max(jnp.where(seen, step + 1, 0), axis=1)[:jq]
    order = jnp.argsort(-need, stable=True).astype(jnp.int32)
    order = jnp.concatenate([order, jnp.full((groups * qb - jq,), jq, jnp.int32)])  # pad with the empty block
    need_sorted = jnp.concatenate([need, jnp.zeros((1,), need.dtype)])[order]
    chunks = (need_sorted.reshape(groups, qb)[:, 0] + ck - 1) // ck  # [groups]: sorted, the first needs most

    def grouped(x):
        return x.reshape(groups, qb, *x.shape[1:])

    qg = grouped(by_block(q, ql, bq, order).reshape(groups * qb, b, bq, kv_heads, g, h))
    kvv = kv_layout(k), kv_layout(v)
    kb, vb = grouped(take_blocks(kvv[0], order)), grouped(take_blocks(kvv[1], order))  # [G', qb, B, C, bk, K, H]
    mask = grouped(visible(order))  # [G', qb, B, bq, C, bk]
    out = _query_blocks(qg, kb, vb, mask, chunks, float(scale), ck)  # [G', qb, B, bq, K, G, H]
    out = jnp.concatenate([out.reshape(groups * qb, b, bq, n, h), jnp.zeros((1, b, bq, n, h), out.dtype)], axis=0)
    # virtual block -> its place in the sorted order; the padding index jq -> the zero block
    place = jnp.zeros((jq + 1,), jnp.int32).at[order].set(jnp.arange(groups * qb, dtype=jnp.int32))
    place = place.at[jq].set(groups * qb)
    dest = ql.dest  # [B, T]: virtual slot, jq * bq for padding (-> the zero block)
    return out[place[dest // bq], jnp.arange(b)[:, None], dest % bq].astype(q.dtype)


# Query and key blocks per loop step: a few blocks give XLA:CPU larger ops (both cores
# busy) while the logits of one step still fit in cache.
_QUERY_BLOCKS_PER_STEP = 4
_KEY_BLOCKS_PER_STEP = 4
_NEG = float(jnp.finfo(jnp.float32).min)
_LOGITS = "jbqkgh,jbctkh->jbkgqct"


# A loop step: qb query blocks q [qb, B, bq, K, G, H], each against its own key blocks k, v
# [qb, B, C, bk, K, H] under mask [qb, B, bq, C, bk]; the inner loop runs over groups of ck key
# blocks, only as many as the step's blocks need (``chunks``). Flash attention's arithmetic:
# an online softmax forward that keeps each query's log-sum-exp, and a backward pass that
# recomputes the probabilities from it (no softmax to differentiate, none stored): elementwise
# work is what bounds attention on a CPU.
def _chunk(x, i, ck, axis):
    return jax.lax.dynamic_slice_in_dim(x, i * ck, ck, axis=axis)


def _logits(q, k, mask, scale):
    s = jnp.einsum(_LOGITS, q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, :, None, None], s, _NEG)  # [qb, B, K, G, bq, ck, bk]


def _step_forward(q, k, v, mask, chunks, scale, ck):
    qb, b, bq, kh, g, h = q.shape
    stats = (qb, b, kh, g, bq)

    def body(i, carry):
        m, total, acc = carry
        s = _logits(q, _chunk(k, i, ck, 2), _chunk(mask, i, ck, 3), scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=(-2, -1)))
        shift = jnp.where(m_new > _NEG, m_new, 0.0)  # nothing seen yet: every exp is 0
        p = jnp.exp(s - shift[..., None, None])
        alpha = jnp.exp(m - shift)
        total = total * alpha + jnp.sum(p, axis=(-2, -1))
        pv = jnp.einsum(
            "jbkgqct,jbctkh->jbqkgh", p.astype(v.dtype), _chunk(v, i, ck, 2), preferred_element_type=jnp.float32
        )
        acc = acc * jnp.moveaxis(alpha, 4, 2)[..., None] + pv
        return m_new, total, acc

    init = (jnp.full(stats, _NEG, jnp.float32), jnp.zeros(stats, jnp.float32), jnp.zeros(q.shape, jnp.float32))
    m, total, acc = jax.lax.fori_loop(0, chunks, body, init)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = acc * jnp.moveaxis(jnp.where(seen, 1.0 / safe, 0.0), 4, 2)[..., None]
    lse = jnp.where(seen, jnp.where(m > _NEG, m, 0.0) + jnp.log(safe), jnp.inf)
    return out, lse


def _step_backward(q, k, v, mask, chunks, out, lse, g, scale, ck):
    delta = jnp.moveaxis(jnp.sum(g.astype(jnp.float32) * out, axis=-1), 2, 4)  # [qb, B, K, G, bq]

    def body(i, carry):
        dq, dk, dv = carry
        k_i, v_i = _chunk(k, i, ck, 2), _chunk(v, i, ck, 2)
        s = _logits(q, k_i, _chunk(mask, i, ck, 3), scale)
        p = jnp.exp(s - lse[..., None, None])  # masked logits and unseen queries: exactly 0
        dv_i = jnp.einsum("jbkgqct,jbqkgh->jbctkh", p.astype(g.dtype), g, preferred_element_type=jnp.float32)
        dp = jnp.einsum("jbqkgh,jbctkh->jbkgqct", g, v_i, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[..., None, None]) * scale
        dq = dq + jnp.einsum("jbkgqct,jbctkh->jbqkgh", ds.astype(k.dtype), k_i, preferred_element_type=jnp.float32)
        dk_i = jnp.einsum("jbkgqct,jbqkgh->jbctkh", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
        dk = jax.lax.dynamic_update_slice_in_dim(dk, dk_i, i * ck, axis=2)
        dv = jax.lax.dynamic_update_slice_in_dim(dv, dv_i, i * ck, axis=2)
        return dq, dk, dv

    init = (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    return jax.lax.fori_loop(0, chunks, body, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _query_blocks(q, k, v, mask, chunks, scale: float, ck: int):
    """Attention of every loop step's query blocks [G', qb, ...] against their own key blocks."""
    return _query_blocks_fwd(q, k, v, mask, chunks, scale, ck)[0]


def _query_blocks_fwd(q, k, v, mask, chunks, scale, ck):
    out, lse = jax.lax.map(lambda a: _step_forward(*a, scale, ck), (q, k, v, mask, chunks))
    return out.astype(q.dtype), (q, k, v, mask, chunks, out, lse)


def _query_blocks_bwd(scale, ck, residuals, g):
    q, k, v, mask, chunks, out, lse = residuals
    dq, dk, dv = jax.lax.map(lambda a: _step_backward(*a, scale, ck), (q, k, v, mask, chunks, out, lse, g))
    zeros = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zeros(mask), zeros(chunks)


_query_blocks.defvjp(_query_blocks_fwd, _query_blocks_bwd)
