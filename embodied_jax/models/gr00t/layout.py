"""The attention layout of a GR00T batch: who sees whom in the LLM, the VL adapter and the DiT.

``vl_layout(config, obs)`` gives the token positions and the segment ids of every
attention of the policy for an unpacked batch (padding masked with
``mask_vl_padding=True``, or attended as upstream with ``False``) or for packed rows
(``data/packing.py``: each sample its own segment; each sample slot's DiT cross-attends a
window of ``max_token_len`` tokens where its segment starts; ``bounds`` sizes the
block-sparse attention).
"""

from __future__ import annotations

import jax.numpy as jnp

from embodied_jax.nn.attention import mask_positions
from embodied_jax.nn.block_sparse import SegmentBounds

PACKED_KEYS = ("segment_ids", "positions", "images", "image_segment_ids", "sample_mask")


def vl_layout(config, obs) -> dict:
    """Segment ids and positions for the LLM, the adapter and the DiT cross-attention."""
    tokens = jnp.asarray(obs["tokens"], jnp.int32)
    if "segment_ids" in obs:
        return _packed_layout(config, obs, tokens)
    mask = jnp.asarray(obs["token_mask"], bool)
    b, length = tokens.shape
    seg = mask.astype(jnp.int32)
    if config.mask_vl_padding:
        positions, llm_q, causal, visible = mask_positions(seg), seg, True, seg
    else:  # upstream: HF cache positions; padded queries, the adapter and the DiT see padding too
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
        llm_q, causal, visible = jnp.ones((b, length), jnp.int32), False, jnp.ones((b, length), jnp.int32)
    return dict(
        tokens=tokens,
        context_gather=None,
        bounds=None,
        positions=positions,
        llm_q=llm_q,
        llm_kv=seg,
        causal=causal,
        adapter=visible,
        dit_q=jnp.ones((b,), jnp.int32),
        dit_kv=visible,
    )


def _packed_layout(config, obs, tokens) -> dict:
    if not config.mask_vl_padding:
        raise ValueError("packed GR00T batches (segment_ids) need Gr00tConfig.mask_vl_padding=True")
    missing = [k for k in PACKED_KEYS if k not in obs]
    if missing:
        raise KeyError(f"packed GR00T batch lacks {missing} (needs all of {PACKED_KEYS})")
    seg = jnp.asarray(obs["segment_ids"], jnp.int32)
    present = jnp.asarray(obs["sample_mask"], bool)
    r, length = seg.shape
    m = present.shape[1]
    ids = jnp.arange(1, m + 1, dtype=jnp.int32)
    # Sample slot (row, m) cross-attends the window of its segment: it starts where segment m does.
    member = seg[:, None, :] == ids[None, :, None]  # [R, M, L]
    start = jnp.argmax(member, axis=-1).reshape(-1)
    window = min(length, config.max_token_len)
    index = jnp.minimum(start[:, None], length - window) + jnp.arange(window, dtype=jnp.int32)
    rows = jnp.repeat(jnp.arange(r, dtype=jnp.int32), m)
    dit_q = jnp.where(present, ids[None], 0).reshape(-1)
    longest = config.max_token_len
    bounds = SegmentBounds(max_segments=m, max_q_len=longest, max_kv_len=longest, tiling=config.block_sparse_tiling)
    return dict(
        tokens=tokens,
        positions=jnp.asarray(obs["positions"], jnp.int32),
        llm_q=seg,
        llm_kv=seg,
        causal=True,
        adapter=seg,
        dit_q=dit_q,
        dit_kv=seg[rows[:, None], index],
        context_gather=(rows, index),
        bounds=bounds,
    )
