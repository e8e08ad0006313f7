"""Block-sparse segment attention: only (query block, key block) pairs of the same segment.

The portable (XLA, any backend) form of the project's attention rule for packed rows: query
token i attends key token j iff ``q_seg[i] == kv_seg[j] != 0 and kv_block[j] <= q_block[i]``.
Each side is rearranged into a virtual row where tokens are grouped by segment (a stable sort)
and every segment starts at a block boundary; static sizes come from ``SegmentBounds`` (what
the packing config guarantees). Queries go in tiles of consecutive blocks of one segment's run,
dealt to parallel loops; each loop step takes chunks of its segment's key blocks with an online
softmax, and the loops have flash attention's VJP (the log-sum-exp kept, the probabilities
recomputed). How large tiles and chunks are is ``BlockSparseTiling`` (a model config field;
per-platform defaults). The bounds must hold: a row with more segments than ``max_segments`` or
a segment longer than its bound loses keys or queries silently (the packer and the model
configs guarantee them). ``docs/packing.md`` has the layout in full, the cost model and the
measurements behind the tiling defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.config_registry import register


@register
@dataclasses.dataclass(frozen=True)
class BlockSparseTiling:
    """How the work is cut (``docs/packing.md`` has the measurements behind the defaults, taken on a
    2-core XLA:CPU): a tile has about ``tile_rows`` rows of logits per key head (at most
    ``max_tile_blocks`` query blocks), or ``whole_tile_rows`` / ``max_whole_tile_blocks`` when
    every query sees its whole segment and each query head has its own key head; a loop step takes
    up to ``step_blocks`` query blocks and key chunks of about ``step_logits`` logits per key head
    (at most ``key_blocks_per_step`` blocks); steps are dealt to ``parallel_loops`` loops."""

    tile_rows: int = 512
    max_tile_blocks: int = 8
    whole_tile_rows: int = 1024
    max_whole_tile_blocks: int = 16
    step_blocks: int = 4
    step_logits: int = 512 * 256
    key_blocks_per_step: int = 4
    parallel_loops: int = 2

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 1:
                raise ValueError(f"BlockSparseTiling.{field.name} must be >= 1, got {getattr(self, field.name)}")


# Per platform (``jax.default_backend()``): only XLA:CPU has been measured; other platforms take
# the same until a benchmark on them says otherwise (``experiments/benchmarks/packing.py``).
PLATFORM_TILING = {"cpu": BlockSparseTiling()}


def default_tiling(platform: str | None = None) -> BlockSparseTiling:
    """The tiling of ``platform`` (default: the backend JAX runs on)."""
    return PLATFORM_TILING.get(platform or jax.default_backend(), BlockSparseTiling())


@dataclasses.dataclass(frozen=True)
class SegmentBounds:
    """Static facts about packed rows that size the block-sparse computation.

    ``max_segments``: segments per row (either side); ``max_q_len`` / ``max_kv_len``: the
    longest query / key segment (tokens); ``block_size``: tokens per block; ``tiling``: how the
    work is cut (None: the platform's ``default_tiling``).
    """

    max_segments: int
    max_q_len: int
    max_kv_len: int
    block_size: int = 64
    tiling: BlockSparseTiling | None = None

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
    return _Layout(source, dest, run_segment, run_first_block, run_blocks)


def block_sparse_attention(
    q, k, v, q_segment_ids, kv_segment_ids, q_block_ids, kv_block_ids, *, scale: float, bounds: SegmentBounds
):
    """q [B, T, N, H]; k, v [B, S, K, H]; ids [B, T] / [B, S] (block ids may be None = zeros)."""
    tiling = bounds.tiling or default_tiling()
    b, t, n, h = q.shape
    s, kv_heads = k.shape[1], k.shape[2]
    g = n // kv_heads
    bq, bk = bounds.block(min(bounds.max_q_len, t)), bounds.block(min(bounds.max_kv_len, s))
    r = bounds.max_segments
    jq = virtual_blocks(t, r, bq)
    jk = virtual_blocks(s, r, bk)
    c = min(jk, math.ceil(bounds.max_kv_len / bk))  # key blocks one query block can need
    # without block ids every query sees its whole segment: no causal waste in a large tile
    whole = q_block_ids is None and kv_block_ids is None
    run_blocks = math.ceil(min(bounds.max_q_len, t) / bq)  # of the longest query run
    tq = _tile_blocks(run_blocks, g, bq, whole, tiling)  # query blocks per tile
    ck = _chunk_blocks(c, g * tq * bq, bk, tiling)  # key blocks per inner step
    # tiles per row: a run of n blocks has ceil(n / tq) of them
    nt = min(virtual_blocks(t, r, tq * bq), r * -(-run_blocks // tq))
    q_seg = jnp.asarray(q_segment_ids, jnp.int32)
    kv_seg = jnp.asarray(kv_segment_ids, jnp.int32)
    q_blk = jnp.zeros((b, t), jnp.int32) if q_block_ids is None else jnp.asarray(q_block_ids, jnp.int32)
    kv_blk = jnp.zeros((b, s), jnp.int32) if kv_block_ids is None else jnp.asarray(kv_block_ids, jnp.int32)
    ql = _layout(q_seg, r, bq, jq)
    kl = _layout(kv_seg, r, bk, jk)
    rows = jnp.arange(b)[:, None]

    def virtual(x, layout, slots):  # [B, T, ...] -> [B, slots, ...] in the virtual order, zeros when empty
        xp = jnp.concatenate([x, jnp.zeros((b, 1, *x.shape[2:]), x.dtype)], axis=1)  # index T: a zero row
        pad = jnp.full((b, slots - layout.source.shape[1]), x.shape[1], layout.source.dtype)
        return xp[rows, jnp.concatenate([layout.source, pad], axis=1)]

    # Keys heads-major ([B, K, slots, H]: a chunk of one row is a contiguous slice per head), with
    # empty blocks appended so that a tile's longest key run (span) stays inside from any start.
    span = -(-c // ck) * ck * bk
    key_slots = jk * bk + span
    keys = (
        virtual(k, kl, key_slots).transpose(0, 2, 1, 3),
        virtual(v, kl, key_slots).transpose(0, 2, 1, 3),
        virtual(kv_seg, kl, key_slots),  # 0 = empty
        virtual(kv_blk, kl, key_slots),
    )

    # Tiles: tq consecutive query blocks of one segment's run; a run of n blocks has ceil(n / tq)
    # tiles, the last one moved back to end with the run (overlapping its predecessor) unless the
    # run is shorter than a tile. Rows of a tile that belong to another segment see no key.
    tiles = jnp.where(ql.run_segment != 0, (ql.run_blocks + tq - 1) // tq, 0)  # [B, R]
    tile_end = jnp.cumsum(tiles, axis=1)
    index = jnp.arange(nt, dtype=jnp.int32)
    run = jnp.sum(tile_end[:, None, :] <= index[None, :, None], axis=-1)  # [B, nt]; R = no tile
    real = run < r
    run = jnp.minimum(run, r - 1)

    def of_run(x):  # [B, R] -> each tile's run's value [B, nt]
        return jnp.take_along_axis(x, run, axis=1)

    local = index[None] - (of_run(tile_end) - of_run(tiles))
    start = of_run(ql.run_first_block) + jnp.minimum(local * tq, jnp.maximum(of_run(ql.run_blocks) - tq, 0))
    start = jnp.where(real, start, jq)  # no tile: the empty blocks after the layout
    segment = jnp.where(real, of_run(ql.run_segment), 0)
    query_slots = (jq + tq) * bq
    slot = start[..., None] * bq + jnp.arange(tq * bq, dtype=jnp.int32)  # [B, nt, tq·bq]

    def tiled(x):  # [B, T, ...] -> each tile's rows [B, nt, tq·bq, ...]
        return virtual(x, ql, query_slots)[rows[..., None], slot]

    tile_seg, tile_blk = tiled(q_seg), tiled(q_blk)
    own = (tile_seg == segment[..., None]) & (segment[..., None] != 0)  # rows this tile answers for

    # Each tile's key run (its segment's) and how many of its blocks it needs: up to the last
    # one holding a key some row of the tile can see (a causal tile: those up to its last row).
    match = (kl.run_segment[:, None, :] == segment[..., None]) & (segment[..., None] != 0)  # [B, nt, R]
    kv_run = jnp.argmax(match, axis=-1)
    first = jnp.take_along_axis(kl.run_first_block, kv_run, axis=1)
    count = jnp.where(match.any(-1), jnp.take_along_axis(kl.run_blocks, kv_run, axis=1), 0)
    big = jnp.iinfo(jnp.int32).max
    lowest_key = jnp.min(jnp.where(keys[2] != 0, keys[3], big).reshape(b, -1, bk), axis=-1)  # per key block
    highest_query = jnp.max(jnp.where(own, tile_blk, -1), axis=-1)  # [B, nt]
    step = jnp.arange(c, dtype=jnp.int32)
    candidate = jnp.take_along_axis(lowest_key, jnp.minimum(first[..., None] + step, jk - 1).reshape(b, -1), axis=1)
    sees = (candidate.reshape(b, nt, c) <= highest_query[..., None]) & (step < count[..., None])
    need = jnp.max(jnp.where(sees, step + 1, 0), axis=-1)  # [B, nt] key blocks
    trips = (need + ck - 1) // ck

    # Steps: every row's tiles, most key chunks first, qb tiles per step (one tile of four or
    # more query blocks, or four of one when a block alone has ``tile_rows`` rows), the steps
    # dealt round-robin to the parallel loops.
    total = b * nt
    loops = tiling.parallel_loops
    qb = max(1, min(total, tiling.step_blocks // tq))
    steps = -(-total // (qb * loops)) * loops * qb  # tiles in all steps
    order = jnp.argsort(-trips.reshape(-1), stable=True).astype(jnp.int32)
    order = jnp.concatenate([order, jnp.full((steps - total,), total, jnp.int32)])  # pad: an empty tile

    def sorted_steps(x):  # [B, nt, ...] -> [steps / qb, qb, ...]; the padding tiles are zeros
        x = x.reshape(total, *x.shape[2:])
        x = jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])[order]
        return x.reshape(steps // qb, qb, *x.shape[1:])

    tile_rows = tq * bq
    q_tiles = tiled(q).reshape(b, nt, tile_rows, kv_heads, g, h).transpose(0, 1, 3, 4, 2, 5)  # heads-major
    q_tiles = q_tiles * jnp.asarray(scale, q_tiles.dtype)  # the loops' logits need no multiply
    tile = (
        sorted_steps(q_tiles),
        sorted_steps(tile_seg),
        sorted_steps(tile_blk),
        sorted_steps(jnp.broadcast_to(rows, (b, nt)).astype(jnp.int32)),
        sorted_steps(first * bk),
        sorted_steps(trips),
    )
    out = _attend(tile, keys, (ck * bk, span, loops))  # [steps / qb, qb, K, G, tq·bq, H]
    out = out.reshape(steps, kv_heads, g, tile_rows, h).transpose(0, 3, 1, 2, 4).reshape(steps * tile_rows, n, h)
    out = jnp.concatenate([out, jnp.zeros((1, n, h), out.dtype)])

    # Each virtual query slot -> the row of a tile that answers for it (either, where two overlap).
    place = jnp.zeros((total + 1,), jnp.int32).at[order].set(jnp.arange(steps, dtype=jnp.int32))[:total]
    answer = place.reshape(b, nt, 1) * tile_rows + jnp.arange(tile_rows, dtype=jnp.int32)
    none = steps * tile_rows  # the zero row
    where = jnp.full((b, query_slots + 1), none, jnp.int32)
    where = where.at[rows[..., None], jnp.where(own, slot, query_slots)].min(answer)
    return out[where[rows, ql.dest]].astype(q.dtype)  # padding tokens (dest jq·bq) -> the zero row


def _tile_blocks(
    query_blocks: int, group: int, block: int, whole: bool, tiling: BlockSparseTiling | None = None
) -> int:
    """Query blocks per tile: about ``tile_rows`` rows of logits per key head (``group`` query
    heads share one; ``whole_tile_rows`` when queries see whole segments and ``group`` is 1),
    at most ``max_tile_blocks`` (``max_whole_tile_blocks``) and the blocks of the longest run."""
    tiling = tiling or BlockSparseTiling()
    large = whole and group == 1
    rows = tiling.whole_tile_rows if large else tiling.tile_rows
    most = tiling.max_whole_tile_blocks if large else tiling.max_tile_blocks
    return max(1, min(query_blocks, most, rows // (group * block)))


def _chunk_blocks(key_blocks: int, rows: int, block: int, tiling: BlockSparseTiling) -> int:
    """Key blocks per inner step: about ``step_logits`` logits per key head for a tile of
    ``rows`` rows per key head, at most ``key_blocks_per_step``."""
    return max(1, min(key_blocks, tiling.key_blocks_per_step, tiling.step_logits // (rows * block)))


_NEG = float(jnp.finfo(jnp.float32).min)


# One step: qb tiles' (scaled) queries q [qb, K, G, rows, H] with ids [qb, rows], each tile's
# batch row, first slot of its key run and trip count [qb], against chunks of ``width`` key
# slots sliced from the heads-major layout (contiguous: no gather, no transposed copy; a tile
# past its trip count sees no key). Flash attention's arithmetic: an online softmax forward
# that keeps each query's log-sum-exp, and a backward pass that recomputes the probabilities
# from it (no softmax to differentiate, none stored): elementwise work is what bounds
# attention on a CPU.
def _key_runs(keys, row, first_slot, trips, span, width):
    """A step's tiles (rows, first slots) and the ids of each one's key run [qb, span], none past
    its trip count. The ids are sliced once per step: sliced per chunk, XLA:CPU fused the slices
    into the exponentials and recomputed them for every logit."""
    _, _, seg_l, blk_l = keys

    def ids(j):
        seg = jax.lax.dynamic_slice(seg_l, (row[j], first_slot[j]), (1, span))
        blk = jax.lax.dynamic_slice(blk_l, (row[j], first_slot[j]), (1, span))
        return jnp.where(jnp.arange(span) < trips[j] * width, seg, 0), blk

    parts = [ids(j) for j in range(row.shape[0])]
    return row, first_slot, jnp.concatenate([p[0] for p in parts]), jnp.concatenate([p[1] for p in parts])


def _key_chunk(keys, runs, i, width):
    """Chunk i of every tile's key run: k, v [qb, K, C, H] and ids [qb, C]."""
    k_l, v_l = keys[0], keys[1]
    row, first_slot, seg, blk = runs
    heads, depth = k_l.shape[1], k_l.shape[3]

    def one(x, j):
        return jax.lax.dynamic_slice(x, (row[j], 0, first_slot[j] + i * width, 0), (1, heads, width, depth))

    tiles = range(row.shape[0])
    return (
        jnp.concatenate([one(k_l, j) for j in tiles]),
        jnp.concatenate([one(v_l, j) for j in tiles]),
        jax.lax.dynamic_slice_in_dim(seg, i * width, width, axis=1),
        jax.lax.dynamic_slice_in_dim(blk, i * width, width, axis=1),
    )


def _logits(q, q_seg, q_blk, k_i, seg, blk):
    mask = (q_seg[..., None] == seg[:, None]) & (seg[:, None] != 0) & (blk[:, None] <= q_blk[..., None])
    s = jnp.einsum("jkgqh,jkch->jkgqc", q, k_i, preferred_element_type=jnp.float32)
    return jnp.where(mask[:, None, None], s, _NEG)  # mask [qb, rows, C]


def _tile_forward(tile, keys, sizes):
    q, q_seg, q_blk, row, first_slot, trips = tile
    width = sizes[0]
    runs = _key_runs(keys, row, first_slot, trips, sizes[1], width)
    stats = q.shape[:-1]  # [qb, K, G, rows]

    def body(i, carry):
        m, total, acc = carry
        k_i, v_i, seg, blk = _key_chunk(keys, runs, i, width)
        s = _logits(q, q_seg, q_blk, k_i, seg, blk)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = jnp.where(m_new > _NEG, m_new, 0.0)  # nothing seen yet: every exp is 0
        p = jnp.exp(s - shift[..., None])
        alpha = jnp.exp(m - shift)
        total = total * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("jkgqc,jkch->jkgqh", p.astype(v_i.dtype), v_i, preferred_element_type=jnp.float32)
        return m_new, total, acc * alpha[..., None] + pv

    init = (jnp.full(stats, _NEG, jnp.float32), jnp.zeros(stats, jnp.float32), jnp.zeros(q.shape, jnp.float32))
    m, total, acc = jax.lax.fori_loop(0, jnp.max(trips), body, init)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = acc * jnp.where(seen, 1.0 / safe, 0.0)[..., None]
    lse = jnp.where(seen, jnp.where(m > _NEG, m, 0.0) + jnp.log(safe), jnp.inf)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _attend(tile, keys, sizes: tuple[int, int, int]):
    """Every step's tiles [steps, qb, K, G, rows, H] against their key runs; ``sizes``: key
    slots per chunk, at most per run, and the parallel loops."""
    return _attend_fwd(tile, keys, sizes)[0]


def _deal(tree, i, loops):  # loop i's steps: i, i + P, i + 2P, ...
    return jax.tree.map(lambda x: x[i::loops], tree)


def _gather_back(parts):  # [steps / P, ...] per loop -> [steps, ...] in step order
    return jnp.stack(parts, axis=1).reshape(-1, *parts[0].shape[1:])


def _attend_fwd(tile, keys, sizes):
    loops = sizes[2]
    parts = [jax.lax.map(lambda a: _tile_forward(a, keys, sizes[:2]), _deal(tile, i, loops)) for i in range(loops)]
    out, lse = _gather_back([p[0] for p in parts]), _gather_back([p[1] for p in parts])
    return out.astype(tile[0].dtype), (tile, keys, out, lse)


def _attend_bwd(sizes, residuals, g_out):
    tile, keys, out, lse = residuals
    k_l, v_l = keys[0], keys[1]
    width, span, loops = sizes

    # A tile's key and value gradients gather in buffers of its run's size ([K, H, span],
    # transposed: the probabilities need no transposed copy), added to the layout's after its
    # loop: the loop does not carry (and copy) the whole layout's.
    def step(carry, xs):  # one tile; dk, dv of the whole layout carried
        (q, q_seg, q_blk, row, first_slot, trips), out_j, lse_j, g = xs
        delta = jnp.sum(g.astype(jnp.float32) * out_j, axis=-1)  # [qb, K, G, rows]
        runs = _key_runs(keys, row, first_slot, trips, span, width)

        def body(i, inner):
            dq, dk, dv = inner
            k_i, v_i, seg, blk = _key_chunk(keys, runs, i, width)
            p = jnp.exp(_logits(q, q_seg, q_blk, k_i, seg, blk) - lse_j[..., None])  # masked, unseen: 0
            dv_i = jnp.einsum("jkgqh,jkgqc->jkhc", g, p.astype(g.dtype), preferred_element_type=jnp.float32)
            dp = jnp.einsum("jkgqh,jkch->jkgqc", g, v_i, preferred_element_type=jnp.float32)
            ds = p * (dp - delta[..., None])
            dq = dq + jnp.einsum("jkgqc,jkch->jkgqh", ds.astype(k_i.dtype), k_i, preferred_element_type=jnp.float32)
            dk_i = jnp.einsum("jkgqh,jkgqc->jkhc", q, ds.astype(q.dtype), preferred_element_type=jnp.float32)
            at = (0, 0, 0, i * width)
            return dq, _add_at(dk, dk_i, at), _add_at(dv, dv_i, at)

        run = jnp.zeros((q.shape[0], k_l.shape[1], k_l.shape[3], span), jnp.float32)  # [qb, K, H, span]
        dq, dk, dv = jax.lax.fori_loop(0, jnp.max(trips), body, (jnp.zeros(q.shape, jnp.float32), run, run))
        for j in range(q.shape[0]):  # tiles of one step may share keys: added one after another
            at = (row[j], 0, 0, first_slot[j])
            carry = (_add_at(carry[0], dk[j : j + 1], at), _add_at(carry[1], dv[j : j + 1], at))
        return carry, dq

    transposed = (*k_l.shape[:2], k_l.shape[3], k_l.shape[2])  # [B, K, H, slots]
    zero = (jnp.zeros(transposed, jnp.float32), jnp.zeros(transposed, jnp.float32))
    parts = [jax.lax.scan(step, zero, _deal((tile, out, lse, g_out), i, loops)) for i in range(loops)]
    dk, dv = (sum(p[0][i] for p in parts).swapaxes(2, 3) for i in (0, 1))
    dq = _gather_back([p[1] for p in parts])
    float0 = lambda x: np.zeros(x.shape, jax.dtypes.float0)  # noqa: E731
    d_tile = (dq.astype(tile[0].dtype), *(float0(x) for x in tile[1:]))
    return d_tile, (dk.astype(k_l.dtype), dv.astype(v_l.dtype), float0(keys[2]), float0(keys[3]))


def _add_at(total, part, index):  # total[index : index + part.shape] += part
    return jax.lax.dynamic_update_slice(total, jax.lax.dynamic_slice(total, index, part.shape) + part, index)


_attend.defvjp(_attend_fwd, _attend_bwd)
