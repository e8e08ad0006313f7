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
segment's key blocks [J, B, C, b, ...] (block-major, so the loop below slices without a
transpose); a ``lax.map`` over query blocks runs logits, mask and softmax for a few blocks
at a time (their logits stay in cache), and the outputs are gathered back to the original
token order (zeros where a query sees no key). The loop has its own VJP with flash
attention's arithmetic: the forward pass keeps each query's log-sum-exp, the backward pass
recomputes the probabilities from it (no softmax to differentiate, no normalised
probabilities stored).

Cost: at most T x max_kv_len query-key pairs per row (plus the block rounding), against
B x L^2 for the same samples padded to L; with static shapes the bound is the worst case
of the packing config, so rows of short samples still pay for ``max_kv_len`` keys.

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

    rows = jnp.arange(b)[None, :, None]

    def by_block(x, layout, block):  # [B, T, ...] -> [J, B, block, ...], gathered in that order
        xp = jnp.concatenate([x, jnp.zeros((b, 1, *x.shape[2:]), x.dtype)], axis=1)  # index T: a zero row
        index = jnp.swapaxes(layout.source.reshape(b, -1, block), 0, 1)
        return xp[rows, index]

    qv = by_block(q, ql, bq)  # [Jq, B, bq, N, H]
    q_seg_v = by_block(jnp.asarray(q_segment_ids, jnp.int32), ql, bq)  # 0 in empty slots (the zero row)
    q_blk_v = by_block(q_blk, ql, bq)
    kv_layout = lambda x: jnp.swapaxes(by_block(x, kl, bk), 0, 1)  # noqa: E731  [B, Jk, bk, ...]
    kv_seg_v, kv_blk_v = kv_layout(jnp.asarray(kv_segment_ids, jnp.int32)), kv_layout(kv_blk)
    kvv = kv_layout(k), kv_layout(v)

    # Key blocks of each query block: its segment's run on the key side.
    seg_j = ql.block_segment  # [B, Jq]
    match = (kl.run_segment[:, None, :] == seg_j[:, :, None]) & (seg_j[:, :, None] != 0)  # [B, Jq, R]
    kv_run = jnp.argmax(match, axis=-1)
    has = match.any(-1)
    first = jnp.take_along_axis(kl.run_first_block, kv_run, axis=1)
    count = jnp.where(has, jnp.take_along_axis(kl.run_blocks, kv_run, axis=1), 0)
    step = jnp.arange(c, dtype=jnp.int32)
    kv_index = jnp.swapaxes(jnp.minimum(first[..., None] + step, jk - 1), 0, 1)  # [Jq, B, C]
    kv_valid = jnp.swapaxes(step[None, None, :] < count[..., None], 0, 1)

    def take_blocks(x):  # [B, Jk, ...] -> [Jq, B, C, ...]
        return x[rows, kv_index]

    kb, vb = take_blocks(kvv[0]), take_blocks(kvv[1])  # [Jq, B, C, bk, K, H]
    kb_seg, kb_blk = take_blocks(kv_seg_v), take_blocks(kv_blk_v)  # [Jq, B, C, bk]
    mask = (
        (q_seg_v[..., None, None] == kb_seg[:, :, None])
        & (kb_seg[:, :, None] != 0)
        & (kb_blk[:, :, None] <= q_blk_v[..., None, None])
        & kv_valid[:, :, None, :, None]
    )  # [Jq, B, bq, C, bk]
    qg = qv.reshape(jq, b, bq, kv_heads, g, h)
    out = _query_blocks(qg, kb, vb, mask, float(scale))  # [Jq, B, bq, K, G, H]
    out = jnp.concatenate([out.reshape(jq, b, bq, n, h), jnp.zeros((1, b, bq, n, h), out.dtype)], axis=0)
    dest = ql.dest  # [B, T]: virtual slot, jq * bq for padding (-> the zero block)
    return out[dest // bq, jnp.arange(b)[:, None], dest % bq].astype(q.dtype)


# One query block against its gathered key blocks: q [B, bq, K, G, H], k/v [B, C, bk, K, H],
# mask [B, bq, C, bk]. Flash attention's arithmetic (softmax statistics saved, probabilities
# recomputed in the backward pass) costs about a third of the elementwise work that
# differentiating a masked softmax costs, and elementwise work is what bounds this on a CPU.
_LOGITS = "bqkgh,bctkh->bkgqct"
_NEG = float(jnp.finfo(jnp.float32).min)


def _logits(q, k, mask, scale):
    s = jnp.einsum(_LOGITS, q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, None], s, _NEG)  # [B, K, G, bq, C, bk]


def _block_forward(q, k, v, mask, scale):
    s = _logits(q, k, mask, scale)
    m = jnp.max(s, axis=(-2, -1), keepdims=True)
    m = jnp.where(m > _NEG, m, 0.0)  # a query that sees nothing: every exp is 0, output 0
    p = jnp.exp(s - m)
    total = jnp.sum(p, axis=(-2, -1))  # [B, K, G, bq]
    out = jnp.einsum("bkgqct,bctkh->bqkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    seen = total > 0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, total, 1.0), 0.0)
    out = out * jnp.moveaxis(inv, 3, 1)[..., None]
    lse = jnp.where(seen, m[..., 0, 0] + jnp.log(jnp.where(seen, total, 1.0)), jnp.inf)
    return out, lse


def _block_backward(q, k, v, mask, out, lse, g, scale):
    s = _logits(q, k, mask, scale)
    p = jnp.exp(s - lse[..., None, None])  # masked logits and unseen queries: exactly 0
    dv = jnp.einsum("bkgqct,bqkgh->bctkh", p.astype(g.dtype), g, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bqkgh,bctkh->bkgqct", g, v, preferred_element_type=jnp.float32)
    delta = jnp.moveaxis(jnp.sum(g.astype(jnp.float32) * out, axis=-1), 1, 3)  # [B, K, G, bq]
    ds = p * (dp - delta[..., None, None]) * scale
    dq = jnp.einsum("bkgqct,bctkh->bqkgh", ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgqct,bqkgh->bctkh", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
    return dq, dk, dv


# Query blocks per loop iteration: a few blocks give XLA:CPU larger ops (both cores busy)
# while the logits of one iteration still fit in cache.
_QUERY_BLOCKS_PER_STEP = 4


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _query_blocks(q, k, v, mask, scale: float):
    """Attention of every query block [Jq, ...] against its own key blocks (one loop)."""
    return _query_blocks_fwd(q, k, v, mask, scale)[0]


def _query_blocks_fwd(q, k, v, mask, scale):
    out, lse = jax.lax.map(
        lambda a: _block_forward(*a, scale), (q, k, v, mask), batch_size=min(_QUERY_BLOCKS_PER_STEP, q.shape[0])
    )
    return out.astype(q.dtype), (q, k, v, mask, out, lse)


def _query_blocks_bwd(scale, residuals, g):
    q, k, v, mask, out, lse = residuals
    dq, dk, dv = jax.lax.map(
        lambda a: _block_backward(*a, scale),
        (q, k, v, mask, out, lse, g),
        batch_size=min(_QUERY_BLOCKS_PER_STEP, q.shape[0]),
    )
    zero_mask = np.zeros(mask.shape, jax.dtypes.float0)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), zero_mask


_query_blocks.defvjp(_query_blocks_fwd, _query_blocks_bwd)
