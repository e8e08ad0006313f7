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
``ceil(max_kv_len / b)`` key blocks, those of its own segment's run.

Compute. The query blocks are sorted by how many key blocks they need (up to the last one
holding a visible key: a causal query block needs those up to itself, a short sample's
only its own few), neediest first; a batch's rows share the order (the neediest of their
blocks at each index). Loop steps take four query blocks each, dealt to two independent
loops that run side by side; inside a step a loop with a data-dependent trip count gathers
four key blocks at a time from the keys' virtual layout, as many as the step's first
(neediest) block needs, with an online softmax. The loops have their own VJP with flash
attention's arithmetic: the forward pass keeps each query's log-sum-exp, the backward
pass recomputes the probabilities from it (no softmax to differentiate, none stored) and
scatter-adds key and value gradients into the layout. Inside the loops the queries are
heads-major ([K, G, block, H]), so the logits and the output need no transposed copy per
step. The outputs are gathered back to the original token order (zeros where a query sees
no key).

Cost: the visible block pairs, rounded up to groups of four key blocks and to the
neediest of four sorted query blocks (about the real query-key pairs of the row's
samples, half of them for causal attention), against B x L^2 for the same samples padded
to L. Memory: the virtual layouts (O(T)) and one loop step's logits.

Everything is gathers, einsums and exponentials, so XLA compiles it on CPU and GPU. The
bounds must hold: a row with more segments than ``max_segments`` or a segment longer than
its bound loses keys silently (the packer and the model configs guarantee them).
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
    groups = -(-jq // (qb * _PARALLEL_LOOPS)) * _PARALLEL_LOOPS
    batch = jnp.arange(b)[:, None]

    def by_block(x, layout, block, extra):  # [B, T, ...] -> [B, J + extra, block, ...] (extra empty blocks)
        xp = jnp.concatenate([x, jnp.zeros((b, 1, *x.shape[2:]), x.dtype)], axis=1)  # index T: a zero row
        index = layout.source.reshape(b, -1, block)
        index = jnp.concatenate([index, jnp.full((b, extra, block), x.shape[1], index.dtype)], axis=1)
        return xp[batch[..., None], index]

    # Keys/values and their ids in the virtual layout, ck empty blocks appended so that a
    # chunk starting in the last blocks never runs past the end.
    kv_seg_v = by_block(jnp.asarray(kv_segment_ids, jnp.int32), kl, bk, ck)  # [B, Jk + ck, bk]
    kv_blk_v = by_block(kv_blk, kl, bk, ck)
    k_v, v_v = by_block(k, kl, bk, ck), by_block(v, kl, bk, ck)  # [B, Jk + ck, bk, K, H]
    q_seg_v = by_block(jnp.asarray(q_segment_ids, jnp.int32), ql, bq, 1)  # [B, Jq + 1, bq]; 0 = empty
    q_blk_v = by_block(q_blk, ql, bq, 1)

    # Each query block's key blocks (the last query block is empty): its segment's run, up to
    # the last block holding a key it can see (a causal block's: those up to itself).
    seg_j = jnp.concatenate([ql.block_segment, jnp.zeros((b, 1), jnp.int32)], axis=1)  # [B, Jq + 1]
    match = (kl.run_segment[:, None, :] == seg_j[:, :, None]) & (seg_j[:, :, None] != 0)  # [B, Jq + 1, R]
    kv_run = jnp.argmax(match, axis=-1)
    first = jnp.take_along_axis(kl.run_first_block, kv_run, axis=1)
    count = jnp.where(match.any(-1), jnp.take_along_axis(kl.run_blocks, kv_run, axis=1), 0)
    big = jnp.iinfo(jnp.int32).max
    lowest_key = jnp.min(jnp.where(kv_seg_v != 0, kv_blk_v, big), axis=-1)  # [B, Jk + ck]
    highest_query = jnp.max(jnp.where(q_seg_v != 0, q_blk_v, -1), axis=-1)  # [B, Jq + 1]
    step = jnp.arange(c, dtype=jnp.int32)
    candidate = jnp.take_along_axis(lowest_key, jnp.minimum(first[..., None] + step, jk - 1).reshape(b, -1), axis=1)
    sees = (candidate.reshape(b, jq + 1, c) <= highest_query[..., None]) & (step < count[..., None])
    need = jnp.max(jnp.where(sees, step + 1, 0), axis=(0, 2))[:jq]  # [Jq]: over the batch's rows

    # Neediest query blocks first; a loop step's chunk count is what its first block needs.
    order = jnp.argsort(-need, stable=True).astype(jnp.int32)
    order = jnp.concatenate([order, jnp.full((groups * qb - jq,), jq, jnp.int32)])  # pad with the empty block
    need_sorted = jnp.concatenate([need, jnp.zeros((1,), need.dtype)])[order]
    chunks = (need_sorted.reshape(groups, qb)[:, 0] + ck - 1) // ck  # [groups]

    def grouped(x):  # [B, Jq + 1, ...] -> [groups, qb, B, ...] in sorted order
        x = jnp.swapaxes(x[:, order], 0, 1)
        return x.reshape(groups, qb, *x.shape[1:])

    # Queries heads-major inside the loops ([.., K, G, bq, H]: a key head's G·bq queries are one
    # matrix, so no loop step transposes the logits or the output) and scaled (the loops'
    # logits need no multiply: elementwise work bounds them on a CPU).
    qv = by_block(q, ql, bq, 1).reshape(b, jq + 1, bq, kv_heads, g, h).transpose(0, 1, 3, 4, 2, 5)
    qv = qv * jnp.asarray(scale, qv.dtype)
    query = (grouped(qv), grouped(q_seg_v), grouped(q_blk_v), grouped(first), grouped(count), chunks)
    out = _attend(query, (k_v, v_v, kv_seg_v, kv_blk_v), ck)  # [groups, qb, B, K, G, bq, H]
    out = out.transpose(0, 1, 2, 5, 3, 4, 6).reshape(groups * qb, b, bq, n, h)
    out = jnp.concatenate([out, jnp.zeros((1, b, bq, n, h), out.dtype)], axis=0)
    # virtual block -> its place in the sorted order; the padding index jq -> the zero block
    place = jnp.zeros((jq + 1,), jnp.int32).at[order].set(jnp.arange(groups * qb, dtype=jnp.int32))
    place = place.at[jq].set(groups * qb)
    dest = ql.dest  # [B, T]: virtual slot, jq * bq for padding (-> the zero block)
    return out[place[dest // bq], jnp.arange(b)[:, None], dest % bq].astype(q.dtype)


# Query and key blocks per loop step: a few blocks give XLA:CPU larger ops (both cores
# busy) while the logits of one step still fit in cache.
_QUERY_BLOCKS_PER_STEP = 4
_KEY_BLOCKS_PER_STEP = 4
# Loop steps are dealt round-robin to this many independent loops, which XLA:CPU runs side by
# side (a loop's small ops alone leave a core idle).
_PARALLEL_LOOPS = 2
_NEG = float(jnp.finfo(jnp.float32).min)
_LOGITS = "jbkgqh,jbctkh->jbkgqct"


# A loop step: qb query blocks q [qb, B, K, G, bq, H] (ids [qb, B, bq]), each against its own
# key run (``first``, ``count`` [qb, B] blocks of the virtual key layout), ck key blocks per
# inner step, as many steps as ``chunks``. Flash attention's arithmetic: an online softmax
# forward that keeps each query's log-sum-exp, and a backward pass that recomputes the
# probabilities from it (no softmax to differentiate, none stored): elementwise work is
# what bounds attention on a CPU. Key chunks are gathered from the layout inside the loop,
# so no [query block x key block] copy of the keys exists.
def _key_chunk(keys, first, count, i, ck):
    """Chunk i of every query block's key run: (index [qb, B, ck], k, v, mask inputs)."""
    k_v, v_v, seg_v, blk_v = keys
    offset = i * ck + jnp.arange(ck, dtype=jnp.int32)
    index = first[..., None] + offset  # [qb, B, ck]
    rows = jnp.arange(first.shape[1])[None, :, None]
    valid = offset < count[..., None]
    return index, k_v[rows, index], v_v[rows, index], seg_v[rows, index], blk_v[rows, index], valid


def _mask(q_seg, q_blk, k_seg, k_blk, valid):  # [qb, B, bq, ck, bk]
    return (
        (q_seg[..., None, None] == k_seg[:, :, None])
        & (k_seg[:, :, None] != 0)
        & (k_blk[:, :, None] <= q_blk[..., None, None])
        & valid[:, :, None, :, None]
    )


def _logits(q, k, mask):
    s = jnp.einsum(_LOGITS, q, k, preferred_element_type=jnp.float32)
    return jnp.where(mask[:, :, None, None], s, _NEG)  # [qb, B, K, G, bq, ck, bk]


def _step_forward(query, keys, ck):
    q, q_seg, q_blk, first, count, chunks = query
    stats = q.shape[:-1]  # [qb, B, K, G, bq]

    def body(i, carry):
        m, total, acc = carry
        _, k_i, v_i, k_seg, k_blk, valid = _key_chunk(keys, first, count, i, ck)
        s = _logits(q, k_i, _mask(q_seg, q_blk, k_seg, k_blk, valid))
        m_new = jnp.maximum(m, jnp.max(s, axis=(-2, -1)))
        shift = jnp.where(m_new > _NEG, m_new, 0.0)  # nothing seen yet: every exp is 0
        p = jnp.exp(s - shift[..., None, None])
        alpha = jnp.exp(m - shift)
        total = total * alpha + jnp.sum(p, axis=(-2, -1))
        pv = jnp.einsum("jbkgqct,jbctkh->jbkgqh", p.astype(v_i.dtype), v_i, preferred_element_type=jnp.float32)
        acc = acc * alpha[..., None] + pv
        return m_new, total, acc

    init = (jnp.full(stats, _NEG, jnp.float32), jnp.zeros(stats, jnp.float32), jnp.zeros(q.shape, jnp.float32))
    m, total, acc = jax.lax.fori_loop(0, chunks, body, init)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = acc * jnp.where(seen, 1.0 / safe, 0.0)[..., None]
    lse = jnp.where(seen, jnp.where(m > _NEG, m, 0.0) + jnp.log(safe), jnp.inf)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attend(query, keys, ck: int):
    """Every loop step's (scaled) query blocks [groups, qb, ...] against their key runs."""
    return _attend_fwd(query, keys, ck)[0]


def _deal(tree, i):  # loop i's steps: i, i + P, i + 2P, ...
    return jax.tree.map(lambda x: x[i::_PARALLEL_LOOPS], tree)


def _gather_back(parts):  # [groups / P, ...] per loop -> [groups, ...] in step order
    return jnp.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:])


def _attend_fwd(query, keys, ck):
    parts = [jax.lax.map(lambda a: _step_forward(a, keys, ck), _deal(query, i)) for i in range(_PARALLEL_LOOPS)]
    out, lse = _gather_back([p[0] for p in parts]), _gather_back([p[1] for p in parts])
    return out.astype(query[0].dtype), (query, keys, out, lse)


def _attend_bwd(ck, residuals, g_out):
    query, keys, out, lse = residuals
    k_v, v_v = keys[0], keys[1]
    rows = jnp.arange(k_v.shape[0])[None, :, None]

    def step(carry, xs):  # one loop step's query blocks; dk, dv of the whole layout carried
        (q, q_seg, q_blk, first, count, chunks), out_j, lse_j, g = xs
        delta = jnp.sum(g.astype(jnp.float32) * out_j, axis=-1)  # [qb, B, K, G, bq]

        def body(i, inner):
            dq, dk, dv = inner
            index, k_i, v_i, k_seg, k_blk, valid = _key_chunk(keys, first, count, i, ck)
            s = _logits(q, k_i, _mask(q_seg, q_blk, k_seg, k_blk, valid))
            p = jnp.exp(s - lse_j[..., None, None])  # masked logits and unseen queries: exactly 0
            dv_i = jnp.einsum("jbkgqct,jbkgqh->jbctkh", p.astype(g.dtype), g, preferred_element_type=jnp.float32)
            dp = jnp.einsum("jbkgqh,jbctkh->jbkgqct", g, v_i, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[..., None, None])
            dq = dq + jnp.einsum(
                "jbkgqct,jbctkh->jbkgqh", ds.astype(k_i.dtype), k_i, preferred_element_type=jnp.float32
            )
            dk_i = jnp.einsum("jbkgqct,jbkgqh->jbctkh", ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
            return dq, dk.at[rows, index].add(dk_i), dv.at[rows, index].add(dv_i)

        dq, dk, dv = jax.lax.fori_loop(0, chunks, body, (jnp.zeros(q.shape, jnp.float32), *carry))
        return (dk, dv), dq

    zero = (jnp.zeros(k_v.shape, jnp.float32), jnp.zeros(v_v.shape, jnp.float32))
    parts = [jax.lax.scan(step, zero, _deal((query, out, lse, g_out), i)) for i in range(_PARALLEL_LOOPS)]
    dk, dv = sum(p[0][0] for p in parts), sum(p[0][1] for p in parts)
    dq = _gather_back([p[1] for p in parts])
    float0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    d_query = (dq.astype(query[0].dtype), *(float0(x) for x in query[1:]))
    return d_query, (dk.astype(k_v.dtype), dv.astype(v_v.dtype), float0(keys[2]), float0(keys[3]))


_attend.defvjp(_attend_fwd, _attend_bwd)
