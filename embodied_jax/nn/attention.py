"""Segment-id attention: the mask rule, its backends and the KV-cache form.

The one attention rule of the project (DESIGN.md): query token i attends key token j iff
``q_seg[i] == kv_seg[j] != 0 and kv_block[j] <= q_block[i]``. Segment id 0 is padding;
block ids default to zeros (full attention inside a segment); causal attention is the
special case block ids == positions. Cross-attention (queries and keys from different
streams, different lengths) follows the same rule. A query row with no visible key
returns zeros, never NaN. ``attention_mask`` is the only place a dense mask is built.

Backends (``impl``):

- ``"xla"``: the reference. Dense [B, 1, T, S] mask as an additive bias, logits and
  softmax in float32; grouped-query heads are computed by folding each KV head's query
  group into the query axis ([B, K, G·T, H]) so K/V are never repeated; its own VJP
  keeps the probabilities and applies softmax's backward in closed form. Runs everywhere.
- ``"blocksparse"``: portable (XLA) attention over packed rows that computes only query
  block x key block pairs of the same segment (``nn/block_sparse.py``); needs the static
  ``bounds`` (``SegmentBounds``: segments per row, longest segment) the packing config
  guarantees. Equal to the reference to float32 rounding, forward and backward.
- ``"pallas"`` (GPU): a fused flash attention written in Pallas (Triton) that applies the
  whole rule, segment and block ids, inside the kernel and skips key blocks no query of
  the block can see (``nn/pallas_attention.py``, which says why it is the GPU kernel of
  choice); the default on a GPU for packed rows (``bounds`` given).
- ``"cudnn"`` (GPU, float16/bfloat16, head_dim % 8 == 0 and <= 256): with block ids
  ``None`` (or ``causal_blocks=True``), JAX's private cuDNN varlen path over packed
  segments (``q_seqlen``/``q_offsets``), so padding and other segments cost no work;
  segments must be contiguous runs (what the packer emits), at most ``bounds.max_segments``
  per row. With general block ids it calls ``jax.nn.dot_product_attention(
  implementation="cudnn")`` with the dense mask (fused kernel, mask as a bias).
- ``"te"`` (GPU with Transformer Engine): ``DotProductAttention`` in THD layout with a
  ``SequenceDescriptor`` from segment ids and within-segment positions. It expresses
  block ids ``None`` (padding mask) or ``causal_blocks=True`` (padding-causal) only.
- ``"auto"``: on a GPU, pallas for packed rows (``bounds`` given), else cudnn when legal;
  otherwise blocksparse for packed rows, else xla. It logs once per distinct reason why it
  fell back from a GPU kernel. An explicit impl that is unavailable or illegal raises ``ValueError``.

``causal_blocks=True`` is a static promise by the caller that the block ids equal the
within-segment positions (causal attention); it lets the fused backends use their causal
kernels. Without it, block ids are treated as a general block structure.
``whole_segments=True`` promises that the block ids are equal within each segment (every
query sees its whole segment): the block-sparse form then drops them and takes its tiles for
full attention (``nn/block_sparse.py``); the other backends get the block ids as given.

KV cache: ``KVCache`` holds the prefix's k, v, segment ids and block ids. Pass
``cache=...`` to ``attention`` to let the suffix queries attend the cached prefix followed
by the suffix's own k/v (the rule applies to the concatenation); ``extend_kv`` returns that
concatenation explicitly (e.g. to cache prefix + suffix).

Inputs and output are pinned to the batch axes of the mesh (``partition.constrain`` with
``Q_AXES``/``KV_AXES``), so under FSDP the partitioner never trades the batch split of the
attention for a split of the weights that produced it. They are also named for remat
policies (``attention_q``, ``attention_k``, ``attention_v``, ``attention_out``; see
``nn.stack``).
"""

from __future__ import annotations

import logging
from typing import Literal

import jax
import jax.numpy as jnp
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from embodied_jax.nn import pallas_attention
from embodied_jax.nn.block_sparse import SegmentBounds, block_sparse_attention
from embodied_jax.parallel import partition

log = logging.getLogger(__name__)

AttentionImpl = Literal["auto", "xla", "blocksparse", "pallas", "cudnn", "te"]
# Logical axes of queries/outputs and keys/values: batch-split like the residual stream.
Q_AXES = ("batch", "act_length", "act_heads", "act_head_dim")
KV_AXES = ("batch", "act_length", "act_kv_heads", "act_head_dim")
ATTENTION_NAMES = ("attention_q", "attention_k", "attention_v", "attention_out")  # checkpoint names
IMPLS = ("auto", "xla", "blocksparse", "pallas", "cudnn", "te")

_LOGGED_FALLBACKS: set[str] = set()


@struct.dataclass
class KVCache:
    """Keys/values of a cached prefix: k, v [B, S, K, H]; segment_ids, block_ids int32 [B, S]."""

    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array
    block_ids: jax.Array


def extend_kv(cache: KVCache, k, v, segment_ids, block_ids=None) -> KVCache:
    """Return the cache followed by new k/v (and their ids) along the key axis."""
    if block_ids is None:
        block_ids = jnp.zeros_like(segment_ids)
    return KVCache(
        k=jnp.concatenate([cache.k, k.astype(cache.k.dtype)], axis=1),
        v=jnp.concatenate([cache.v, v.astype(cache.v.dtype)], axis=1),
        segment_ids=jnp.concatenate([cache.segment_ids, segment_ids.astype(jnp.int32)], axis=1),
        block_ids=jnp.concatenate([cache.block_ids, block_ids.astype(jnp.int32)], axis=1),
    )


def attention_mask(q_segment_ids, kv_segment_ids, q_block_ids=None, kv_block_ids=None):
    """Bool [B, 1, T, S]: True where query i may attend key j (the project's one mask rule)."""
    q_seg = jnp.asarray(q_segment_ids)[:, :, None]
    kv_seg = jnp.asarray(kv_segment_ids)[:, None, :]
    mask = (q_seg == kv_seg) & (kv_seg != 0)
    if q_block_ids is not None or kv_block_ids is not None:
        q_blk = jnp.zeros_like(q_segment_ids) if q_block_ids is None else q_block_ids
        kv_blk = jnp.zeros_like(kv_segment_ids) if kv_block_ids is None else kv_block_ids
        mask = mask & (jnp.asarray(kv_blk)[:, None, :] <= jnp.asarray(q_blk)[:, :, None])
    return mask[:, None, :, :]


def segment_positions(segment_ids):
    """Position of each token inside its (contiguous) segment, 0 for padding. int32 [B, T].

    For packed rows: the count restarts at every change of segment id (and after padding).
    Compare ``mask_positions``, which counts a row's real tokens across padding holes."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    idx = jnp.arange(seg.shape[1], dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return jnp.where(seg != 0, idx - start_idx, 0)


def mask_positions(mask):
    """Rank of each real token (``mask`` != 0) among its row's real tokens, 0 for padding. int32 [B, T].

    For one sample per row with a padding mask: ``cumsum(mask) - 1`` (the rule Hugging Face
    uses for position ids from an attention mask), so padding anywhere in the row (left, right,
    holes) does not shift the positions of the tokens after it. On a row whose real tokens are
    one contiguous run it equals ``segment_positions``."""
    real = jnp.asarray(mask) != 0
    return jnp.where(real, jnp.cumsum(real, axis=1, dtype=jnp.int32) - 1, 0)


def _check_shapes(q, k, v, q_segment_ids, kv_segment_ids, q_block_ids, kv_block_ids):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention: q, k, v must be [B, T, N, H]; got q{q.shape} k{k.shape} v{v.shape}")
    b, t, n, h = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != h:
        raise ValueError(f"attention: k{k.shape} and v{v.shape} must be [B={b}, S, K, H={h}]")
    if n % k.shape[2]:
        raise ValueError(f"attention: q heads {n} must be a multiple of kv heads {k.shape[2]}")
    for name, ids, want in (
        ("q_segment_ids", q_segment_ids, (b, t)),
        ("kv_segment_ids", kv_segment_ids, (b, k.shape[1])),
        ("q_block_ids", q_block_ids, (b, t)),
        ("kv_block_ids", kv_block_ids, (b, k.shape[1])),
    ):
        if ids is not None and tuple(ids.shape) != want:
            raise ValueError(f"attention: {name} has shape {tuple(ids.shape)}, expected {want}")


def xla_attention(q, k, v, mask, scale):
    """Reference dense-mask attention; mask bool [B, 1, T, S]; GQA without repeating K/V.

    Queries go heads-major with each KV head's query group folded into the query axis, so
    the logits are one [G·T, S] matrix per (row, KV head): plain batched matmuls, no
    transposed copy of the logits. The mask enters as one additive bias of float32's lowest
    value, so a hidden key's probability underflows to exactly 0; a query with no visible
    key gets zeros from a [B, T] select on the output. Logits, softmax and the backward
    pass run in float32 under ``_dense_attention``'s VJP."""
    bias = jnp.where(mask[:, 0], 0.0, jnp.finfo(jnp.float32).min)  # [B, T, S]
    # the scale goes on the queries ([T, H] per head), not on the [T, S] logits, which XLA:CPU
    # would multiply by a materialised broadcast of the scalar
    out = _dense_attention(q * jnp.asarray(scale, q.dtype), k, v, bias)
    has_key = mask[:, 0].any(-1)[:, :, None, None]  # [B, T, 1, 1]
    return jnp.where(has_key, out, 0.0).astype(q.dtype)


def _heads_major(x, kv_heads: int):
    """[B, T, N, H] -> [B, K, G·T, H]: the G query heads of each KV head stacked along the query axis."""
    b, t, n, h = x.shape
    return x.reshape(b, t, kv_heads, n // kv_heads, h).transpose(0, 2, 3, 1, 4).reshape(b, kv_heads, -1, h)


def _tokens_major(x, length: int):
    """The inverse of ``_heads_major``: [B, K, G·T, H] -> [B, T, N, H]."""
    b, kv_heads, m, h = x.shape
    return x.reshape(b, kv_heads, m // length, length, h).transpose(0, 3, 1, 2, 4).reshape(b, length, -1, h)


def _dense_probs(qh, k, bias):
    """Softmax probabilities float32 [B, K, G·T, S] of heads-major, already scaled queries against
    keys [B, S, K, H]."""
    b, kv_heads, m, _ = qh.shape
    t = bias.shape[1]
    logits = _heads_einsum("bkmh,bskh->bkms", qh, k, preferred_element_type=jnp.float32).astype(jnp.float32)
    # every (KV head, query head) pair's [T, S] logits on one axis: no size-1 axis for one KV head
    logits = logits.reshape(b, kv_heads * (m // t), t, -1) + bias[:, None]
    return jax.nn.softmax(logits, axis=-1).reshape(b, kv_heads, m, -1)


def _heads_einsum(spec: str, x, y, **kwargs):
    """``jnp.einsum(spec, x, y)`` of two operands with a KV-head axis ``k``. With one KV head
    (π0.5) the product runs without that axis and the result gets it back: XLA:CPU drops a
    size-1 batch axis of a dot, then lays it out elsewhere than the consumer and copies the
    [G·T, S] probabilities between two layouts of the same bytes (40 MB per layer and pass
    of a pi05_bench step)."""
    inputs, out = spec.split("->")
    x_spec, y_spec = inputs.split(",")
    if x.shape[x_spec.index("k")] != 1:
        return jnp.einsum(spec, x, y, **kwargs)
    x, y = jnp.squeeze(x, x_spec.index("k")), jnp.squeeze(y, y_spec.index("k"))
    without_heads = ",".join(sub.replace("k", "") for sub in (x_spec, y_spec)) + "->" + out.replace("k", "")
    return jnp.expand_dims(jnp.einsum(without_heads, x, y, **kwargs), out.index("k"))


@jax.custom_vjp
def _dense_attention(q, k, v, bias):
    """Softmax attention of scaled queries q [B, T, N, H] over k, v [B, S, K, H] + bias [B, T, S]."""
    return _dense_attention_fwd(q, k, v, bias)[0]


def _dense_attention_fwd(q, k, v, bias):
    qh = _heads_major(q, k.shape[2])
    probs = _dense_probs(qh, k, bias)
    out = _heads_einsum("bkms,bskh->bkmh", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _tokens_major(out, q.shape[1]), (qh, k, v, bias, probs, out)


def _dense_attention_bwd(residuals, d_out):
    # softmax's backward in closed form on the kept probabilities: one elementwise pass
    # dS = P (dP - rowsum(dO O)), where autodiff differentiates the max, exp, sum and divide
    qh, k, v, bias, probs, out = residuals
    d_out = _heads_major(d_out.astype(jnp.float32), k.shape[2])
    f32 = dict(preferred_element_type=jnp.float32)
    dv = _heads_einsum("bkms,bkmh->bskh", probs, d_out, **f32)
    dp = _heads_einsum("bkmh,bskh->bkms", d_out, v.astype(jnp.float32), **f32)
    ds = probs * (dp - jnp.sum(d_out * out, axis=-1, keepdims=True))
    dq = _heads_einsum("bkms,bskh->bkmh", ds, k.astype(jnp.float32), **f32)
    dk = _heads_einsum("bkms,bkmh->bskh", ds, qh.astype(jnp.float32), **f32)
    dq = _tokens_major(dq, bias.shape[1])
    return dq.astype(qh.dtype), dk.astype(k.dtype), dv.astype(v.dtype), jnp.zeros_like(bias)


_dense_attention.defvjp(_dense_attention_fwd, _dense_attention_bwd)


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _cudnn_illegal_reason(q, k, v) -> str | None:
    """Why the cuDNN fused kernel cannot run these inputs here, or None when it can."""
    if not _on_gpu():
        return f"cudnn needs a GPU (default backend is {jax.default_backend()!r})"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"cudnn needs float16/bfloat16 q, k, v (got {q.dtype}, {k.dtype}, {v.dtype})"
    h = q.shape[-1]
    if h % 8 or h > 256:
        return f"cudnn needs head_dim % 8 == 0 and <= 256 (got {h})"
    return None


def _te_illegal_reason(q, general_blocks: bool) -> str | None:
    if not _on_gpu():
        return f"te needs a GPU (default backend is {jax.default_backend()!r})"
    if general_blocks:
        return "te expresses only padding or causal masks; general block ids need causal_blocks=True or xla/cudnn"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"te needs float16/bfloat16 inputs (got {q.dtype})"
    try:
        import transformer_engine.jax  # noqa: F401
    except Exception as exc:  # ImportError or a CUDA library failing to load
        return f"te: transformer_engine.jax is not importable ({exc.__class__.__name__}: {exc})"
    return None


def _log_fallback_once(reason: str, impl: str) -> None:
    if reason not in _LOGGED_FALLBACKS:
        _LOGGED_FALLBACKS.add(reason)
        log.info("attention impl='auto' uses %s: %s", impl, reason)


def _segment_offsets(segment_ids, max_segments: int):
    """Per-row offsets [B, M+1] and lengths [B, M] of segments 1..M (contiguous runs), -1 if absent."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    length = seg.shape[1]
    ids = jnp.arange(1, max_segments + 1, dtype=jnp.int32)
    member = seg[:, None, :] == ids[None, :, None]  # [B, M, T]
    counts = member.sum(-1).astype(jnp.int32)
    first = jnp.argmax(member, axis=-1).astype(jnp.int32)
    present = counts > 0
    # cuDNN expects present segments first; packers number segments 1..n in order, so the
    # present ones are a prefix of 1..M and absent entries are filled with -1.
    seqlen = jnp.where(present, counts, -1)
    offsets = jnp.where(present, first, -1)
    total = jnp.where(present, first + counts, 0).max(-1, keepdims=True)
    offsets = jnp.concatenate([offsets, jnp.full_like(offsets[:, :1], -1)], axis=1)
    n_present = present.sum(-1)
    offsets = offsets.at[jnp.arange(seg.shape[0]), n_present].set(jnp.minimum(total[:, 0], length))
    return offsets, seqlen


def _cudnn_attention(q, k, v, q_seg, kv_seg, q_blk, kv_blk, scale, causal_blocks, max_segments):
    mask = attention_mask(q_seg, kv_seg, q_blk, kv_blk)
    general_blocks = (q_blk is not None or kv_blk is not None) and not causal_blocks
    if general_blocks:
        out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="cudnn")
    else:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa

        m = max_segments or min(q.shape[1], k.shape[1])
        q_off, q_len = _segment_offsets(q_seg, m)
        kv_off, kv_len = _segment_offsets(kv_seg, m)
        mask_type = cudnn_fa.MaskType.CAUSAL if causal_blocks else cudnn_fa.MaskType.NO_MASK
        out = cudnn_fa.dot_product_attention(
            q,
            k,
            v,
            q_seqlen=q_len,
            kv_seqlen=kv_len,
            q_offsets=q_off,
            kv_offsets=kv_off,
            scale=scale,
            mask_type=mask_type,
            qkv_layout="BTNH",
        )
    has_key = mask.any(-1)[:, 0, :, None, None]  # [B, T, 1, 1]
    return jnp.where(has_key, out, 0).astype(q.dtype)


def _te_attention(q, k, v, q_seg, kv_seg, scale, causal_blocks):
    from transformer_engine.jax.attention import SequenceDescriptor
    from transformer_engine.jax.flax import DotProductAttention

    n, h, kv_heads = q.shape[2], q.shape[3], k.shape[2]
    module = DotProductAttention(
        head_dim=h,
        num_attention_heads=n,
        num_gqa_groups=kv_heads,
        attn_mask_type="padding_causal" if causal_blocks else "padding",
        qkv_layout="THD_THD_THD",
        transpose_batch_sequence=False,
        scale_factor=scale,
        attention_dropout=0.0,
    )
    descriptor = SequenceDescriptor.from_segment_ids_and_pos(
        (q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)),
        (segment_positions(q_seg), segment_positions(kv_seg)),
    )
    out = module.apply({}, q, k, v, sequence_descriptor=descriptor, deterministic=True)
    mask = attention_mask(q_seg, kv_seg)
    has_key = mask.any(-1)[:, 0, :, None, None]
    return jnp.where(has_key, out.reshape(q.shape), 0).astype(q.dtype)


def attention(
    q,
    k,
    v,
    *,
    q_segment_ids,
    kv_segment_ids,
    q_block_ids=None,
    kv_block_ids=None,
    impl: AttentionImpl = "auto",
    scale: float | None = None,
    cache: KVCache | None = None,
    causal_blocks: bool = False,
    whole_segments: bool = False,
    bounds: SegmentBounds | None = None,
):
    """Segment-id attention. q [B, T, N, H]; k, v [B, S, K, H]; returns [B, T, N, H] in q.dtype.

    With ``cache``, keys are the cached prefix followed by ``k``/``v`` (whose ids are
    ``kv_segment_ids``/``kv_block_ids``). See the module docstring for backends.
    """
    if impl not in IMPLS:
        raise ValueError(f"attention: impl={impl!r} is not one of {IMPLS}")
    if cache is not None:
        full = extend_kv(cache, k, v, kv_segment_ids, kv_block_ids)
        k, v, kv_segment_ids, kv_block_ids = full.k, full.v, full.segment_ids, full.block_ids
        if q_block_ids is None:
            q_block_ids = jnp.zeros_like(q_segment_ids)
    _check_shapes(q, k, v, q_segment_ids, kv_segment_ids, q_block_ids, kv_block_ids)
    q = checkpoint_name(partition.constrain(q, Q_AXES), "attention_q")
    k = checkpoint_name(partition.constrain(k, KV_AXES), "attention_k")
    v = checkpoint_name(partition.constrain(v, KV_AXES), "attention_v")
    scale = float(q.shape[-1]) ** -0.5 if scale is None else scale
    general_blocks = (q_block_ids is not None or kv_block_ids is not None) and not causal_blocks

    if impl == "auto":
        pallas_reason = pallas_attention.unavailable_reason(q) if bounds is not None else "unpacked"
        if pallas_reason is None:
            impl = "pallas"
        else:
            reason = _cudnn_illegal_reason(q, k, v)
            impl = ("blocksparse" if bounds is not None else "xla") if reason else "cudnn"
            if reason:
                _log_fallback_once(reason, impl)
    elif impl == "pallas":
        reason = pallas_attention.unavailable_reason(q)
        if reason:
            raise ValueError(f"attention impl='pallas' unavailable: {reason}; use impl='auto' or 'blocksparse'")
    elif impl == "blocksparse" and bounds is None:
        raise ValueError(
            "attention impl='blocksparse' needs bounds=SegmentBounds(...) (segments per row, "
            "longest segment); use impl='auto' or 'xla' for unpacked inputs"
        )
    elif impl == "cudnn":
        reason = _cudnn_illegal_reason(q, k, v)
        if reason:
            raise ValueError(f"attention impl='cudnn' unavailable: {reason}; use impl='auto' or 'xla'")
    elif impl == "te":
        reason = _te_illegal_reason(q, general_blocks)
        if reason:
            raise ValueError(f"attention impl='te' unavailable: {reason}; use impl='auto' or 'xla'")

    if impl == "xla":
        mask = attention_mask(q_segment_ids, kv_segment_ids, q_block_ids, kv_block_ids)
        out = xla_attention(q, k, v, mask, scale)
    elif impl == "blocksparse":
        blocks = (None, None) if whole_segments else (q_block_ids, kv_block_ids)
        out = block_sparse_attention(q, k, v, q_segment_ids, kv_segment_ids, *blocks, scale=scale, bounds=bounds)
    elif impl == "pallas":
        out = pallas_attention.flash_segment_attention(
            q, k, v, q_segment_ids, kv_segment_ids, q_block_ids, kv_block_ids, scale=scale
        )
    elif impl == "cudnn":
        max_segments = bounds.max_segments if bounds is not None else None
        out = _cudnn_attention(
            q, k, v, q_segment_ids, kv_segment_ids, q_block_ids, kv_block_ids, scale, causal_blocks, max_segments
        )
    else:
        out = _te_attention(q, k, v, q_segment_ids, kv_segment_ids, scale, causal_blocks)
    return checkpoint_name(partition.constrain(out, Q_AXES), "attention_out")
