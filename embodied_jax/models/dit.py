"""GR00T-N1.5's transformers: the flow-matching DiT and the VL self-attention adapter.

Both are stacks of diffusers-style ``BasicTransformerBlock``s (pre-norm attention with
biases, pre-norm GELU-tanh feed-forward of width 4x, residuals):

- ``DiT``: AdaLayerNorm ``norm1`` conditioned on the timestep embedding (chunks scale,
  shift), affine-free ``norm3``; with ``interleave_self_attention`` even blocks
  cross-attend to the VL tokens and odd blocks self-attend over the action-head tokens.
  Output: ``proj_out_1(silu(temb))`` -> (shift, scale) around an affine-free LayerNorm
  (eps 1e-6), then ``proj_out_2``.
- ``SelfAttentionTransformer`` (``vl_self_attention``): affine LayerNorms, self-attention.

Interleaved DiT blocks have different key/value shapes, so a scanned DiT stacks *pairs*
(``transformer_blocks.cross_block`` = upstream block 2i, ``.self_block`` = block 2i+1).

Names map to upstream as ``attn1.to_out`` <- ``attn1.to_out.0``, ``ff.proj_in`` <-
``ff.net.0.proj``, ``ff.proj_out`` <- ``ff.net.2`` (see ``models/gr00t/weights.py``).

Masking: queries and keys carry segment ids (``nn.attention``). Cross-attention takes the
VL ``context`` per *row* (``[R, S, D]``) and optionally ``context_gather`` = (rows [B],
token indices [B, W]): sample b's keys/values are tokens ``index[b]`` of row ``rows[b]``,
so several samples' VL sequences can share one packed row. Keys/values are projected once
per row and only each sample's window of W tokens (its segment) is gathered, so a sample's
cross-attention costs its own tokens, not the row's.

Dropout (upstream 0.2 in both): the attention output passes ``to_out``'s dropout and the
block's ``final_dropout`` (rate p twice, applied here as one draw of rate 1-(1-p)^2, the
same distribution); the feed-forward drops after the activation and after ``net.2``. A block
draws the uniforms of all three sites at once, 16 bits each (``dropout_masks``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from embodied_jax.config_registry import register
from embodied_jax.nn.attention import attention
from embodied_jax.nn.compute import Compute
from embodied_jax.nn.dense import Dense
from embodied_jax.nn.embeddings import timestep_embedding
from embodied_jax.nn.norms import AdaLayerNorm, LayerNorm, layer_normalize
from embodied_jax.nn.stack import PerLayer, build_stack, run_stack
from embodied_jax.parallel.partition import shard_tokens


def dropout_masks(key, lead_shape: tuple[int, ...], sites: tuple[tuple[float, int], ...]):
    """Keep masks of a block's dropout ``sites`` ((rate, features), ...) for activations
    ``lead_shape + (features,)``: one (bool mask, kept fraction) per site, None for a site of
    rate 0 or when ``key`` is None.

    One draw of 16-bit uniforms covers every site (each 32-bit random word gives two
    features): on a CPU the random bits, not the masking, are dropout's cost. A feature is
    kept when its uniform is >= round(rate * 2^16), so the realised rate is within 2^-17 of
    ``rate`` and ``dropout`` rescales by the realised kept fraction (unbiased)."""
    for rate, _ in sites:
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    thresholds = [round(rate * 65536) for rate, _ in sites]
    total = sum(features for (_, features), t in zip(sites, thresholds, strict=True) if t)
    if key is None or not total:
        return tuple(None for _ in sites)
    words = jax.random.bits(key, (*lead_shape, -(-total // 2)), jnp.uint32)  # bits for the sites that drop
    uniforms = jax.lax.bitcast_convert_type(words, jnp.uint16).reshape(*lead_shape, -1)
    masks, start = [], 0
    for (_, features), threshold in zip(sites, thresholds, strict=True):
        if not threshold:
            masks.append(None)
            continue
        masks.append((uniforms[..., start : start + features] >= threshold, 1.0 - threshold / 65536))
        start += features
    return tuple(masks)


def dropout(x, keep):
    """Inverted dropout with ``keep`` = (mask, kept fraction) from ``dropout_masks``; None: identity."""
    if keep is None:
        return x
    mask, kept = keep
    return jnp.where(mask, x / kept, 0).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """What a block needs beyond its shapes (shared by every block of a stack)."""

    compute: Compute = Compute()
    dropout: float = 0.0
    lora: Any = None  # nn.lora.LoRAConfig for every attention / feed-forward Dense, or None


class Attention(nnx.Module):
    """diffusers ``Attention`` with biases: ``to_q``, ``to_k``, ``to_v``, ``to_out``."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, context_dim: int | None, spec: BlockSpec, *, rngs: nnx.Rngs
    ):
        self.heads, self.head_dim, self.impl = heads, head_dim, spec.compute.attention_impl
        inner = heads * head_dim
        common = dict(lora=spec.lora, rngs=rngs, **spec.compute.dense)
        self.to_q = Dense(dim, inner, axes=("embed", "heads"), **common)
        self.to_k = Dense(context_dim or dim, inner, axes=("embed", "heads"), **common)
        self.to_v = Dense(context_dim or dim, inner, axes=("embed", "heads"), **common)
        self.to_out = Dense(inner, dim, axes=("heads", "embed"), **common)

    def __call__(self, x, q_segment_ids, context=None, kv_segment_ids=None, context_gather=None, bounds=None):
        b, t, _ = x.shape
        source = x if context is None else context
        q = self.to_q(x).reshape(b, t, self.heads, self.head_dim)
        k = self.to_k(source)
        v = self.to_v(source).astype(k.dtype)
        if context_gather is not None:  # rows -> samples' windows, after projecting each row once
            rows, index = context_gather
            k, v = k[rows[:, None], index], v[rows[:, None], index]
        s = k.shape[1]
        k = k.reshape(b, s, self.heads, self.head_dim)
        v = v.reshape(b, s, self.heads, self.head_dim)
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        # Explicit zero block ids: full attention within a segment, and the mask path of the
        # fused backends (their varlen path needs the same segment numbering on both sides);
        # the block-sparse form drops them (whole_segments) for its full-attention tiles.
        out = attention(
            q,
            k.astype(q.dtype),
            v.astype(q.dtype),
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_block_ids=jnp.zeros_like(q_segment_ids),
            kv_block_ids=jnp.zeros_like(kv_segment_ids),
            impl=self.impl,
            whole_segments=True,
            bounds=bounds,
        )
        return self.to_out(out.reshape(b, t, self.heads * self.head_dim))


class FeedForward(nnx.Module):
    """diffusers ``FeedForward`` with ``gelu-approximate``: ``proj_out(gelu_tanh(proj_in(x)))``."""

    def __init__(self, dim: int, spec: BlockSpec, *, mult: int = 4, rngs: nnx.Rngs):
        common = dict(lora=spec.lora, rngs=rngs, **spec.compute.dense)
        self.proj_in = Dense(dim, mult * dim, axes=("embed", "mlp"), **common)
        self.proj_out = Dense(mult * dim, dim, axes=("mlp", "embed"), **common)

    def __call__(self, x, keep_hidden=None, keep_out=None):
        """``keep_*``: dropout masks (``dropout_masks``) after the activation and after ``proj_out``."""
        h = shard_tokens(dropout(jax.nn.gelu(self.proj_in(x), approximate=True), keep_hidden), "act_mlp")
        return dropout(self.proj_out(h), keep_out)


class BasicTransformerBlock(nnx.Module):
    """One pre-norm attention + feed-forward block (``ada_norm`` for the DiT, affine LN otherwise)."""

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        spec: BlockSpec,
        *,
        context_dim: int | None = None,
        ada_norm: bool = False,
        rngs: nnx.Rngs,
    ):
        self.ada_norm = ada_norm
        self.rate = spec.dropout
        self.is_cross = context_dim is not None
        dtypes = spec.compute.dtypes
        if ada_norm:
            self.norm1 = AdaLayerNorm(dim, dim, eps=1e-5, chunk_order=("scale", "shift"), rngs=rngs, **dtypes)
        else:
            self.norm1 = LayerNorm(dim, eps=1e-5, **dtypes)
        self.attn1 = Attention(dim, heads, head_dim, context_dim, spec, rngs=rngs)
        affine = not ada_norm  # DiT blocks: norm_elementwise_affine=False
        self.norm3 = LayerNorm(dim, eps=1e-5, use_scale=affine, use_bias=affine, **dtypes)
        self.ff = FeedForward(dim, spec, rngs=rngs)

    def __call__(
        self,
        x,
        temb=None,
        q_segment_ids=None,
        context=None,
        kv_segment_ids=None,
        context_gather=None,
        key=None,
        bounds=None,
    ):
        h = self.norm1(x, temb) if self.ada_norm else self.norm1(x)
        if self.is_cross:
            h = self.attn1(h, q_segment_ids, context, kv_segment_ids, context_gather)
        else:
            h = self.attn1(h, q_segment_ids, bounds=bounds)
        dim = x.shape[-1]
        sites = ((1.0 - (1.0 - self.rate) ** 2, dim), (self.rate, self.ff.proj_in.out_features), (self.rate, dim))
        keep_attn, keep_hidden, keep_out = dropout_masks(key, x.shape[:-1], sites)
        x = shard_tokens(x + dropout(h, keep_attn).astype(x.dtype))
        return shard_tokens(x + self.ff(self.norm3(x), keep_hidden, keep_out).astype(x.dtype))


@register
@dataclasses.dataclass(frozen=True)
class DiTConfig:
    num_layers: int = 16
    num_heads: int = 32
    head_dim: int = 48
    output_dim: int = 1024
    interleave_self_attention: bool = True
    dropout: float = 0.2
    timestep_channels: int = 256

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.head_dim


class TimestepEmbedding(nnx.Module):
    """diffusers ``TimestepEmbedding``: ``linear_2(silu(linear_1(x)))``."""

    def __init__(self, in_dim: int, dim: int, compute: Compute, *, rngs: nnx.Rngs):
        common = dict(rngs=rngs, **compute.dtypes)  # no FP8 or LoRA: only the blocks take them
        self.linear_1 = Dense(in_dim, dim, axes=("cond", "embed"), **common)
        self.linear_2 = Dense(dim, dim, axes=("embed", "cond"), **common)

    def __call__(self, x):
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class TimestepEncoder(nnx.Module):
    """Timestep bucket -> diffusers sinusoid (cos first, shift 1) -> ``timestep_embedder``."""

    def __init__(self, dim: int, channels: int, compute: Compute, *, rngs: nnx.Rngs):
        self.channels = channels
        self.timestep_embedder = TimestepEmbedding(channels, dim, compute, rngs=rngs)

    def __call__(self, timesteps):
        proj = timestep_embedding(timesteps, self.channels, flip_sin_to_cos=True, downscale_freq_shift=1.0)
        return self.timestep_embedder(proj)


class DiTBlockPair(nnx.Module):
    """Upstream blocks 2i (cross-attention) and 2i+1 (self-attention) as one scan step."""

    def __init__(self, config: DiTConfig, spec: BlockSpec, *, cross_attention_dim: int, rngs: nnx.Rngs):
        dim = config.inner_dim
        self.cross_block = BasicTransformerBlock(
            dim, config.num_heads, config.head_dim, spec, ada_norm=True, context_dim=cross_attention_dim, rngs=rngs
        )
        self.self_block = BasicTransformerBlock(dim, config.num_heads, config.head_dim, spec, ada_norm=True, rngs=rngs)

    def __call__(self, x, temb, q_segment_ids, self_segment_ids, context, kv_segment_ids, context_gather, key=None):
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        x = self.cross_block(x, temb, q_segment_ids, context, kv_segment_ids, context_gather, k1)
        return self.self_block(x, temb, self_segment_ids, key=k2)


class CrossBlock(nnx.Module):
    """A non-interleaved DiT block: cross-attention only (same call signature as a pair)."""

    def __init__(self, config: DiTConfig, spec: BlockSpec, *, cross_attention_dim: int, rngs: nnx.Rngs):
        self.block = BasicTransformerBlock(
            config.inner_dim,
            config.num_heads,
            config.head_dim,
            spec,
            ada_norm=True,
            context_dim=cross_attention_dim,
            rngs=rngs,
        )

    def __call__(self, x, temb, q_segment_ids, self_segment_ids, context, kv_segment_ids, context_gather, key=None):
        del self_segment_ids
        return self.block(x, temb, q_segment_ids, context, kv_segment_ids, context_gather, key)


class DiT(nnx.Module):
    """``cross_attention_dim``: the width of the VL context (GR00T: the backbone's); ``lora`` (an
    ``nn.lora.LoRAConfig``) adds adapters to every attention and feed-forward Dense of its blocks."""

    def __init__(
        self, config: DiTConfig, compute: Compute, *, cross_attention_dim: int, lora: Any = None, rngs: nnx.Rngs
    ):
        if config.interleave_self_attention and config.num_layers % 2:
            raise ValueError(f"DiTConfig.num_layers={config.num_layers} must be even with interleave_self_attention")
        self.config, self.compute = config, compute
        dim = config.inner_dim
        spec = BlockSpec(compute, config.dropout, lora)
        self.timestep_encoder = TimestepEncoder(dim, config.timestep_channels, compute, rngs=rngs)
        block = DiTBlockPair if config.interleave_self_attention else CrossBlock
        self.num_steps = config.num_layers // 2 if config.interleave_self_attention else config.num_layers
        self.transformer_blocks = build_stack(
            lambda r: block(config, spec, cross_attention_dim=cross_attention_dim, rngs=r),
            self.num_steps,
            scan=compute.scan_layers,
            rngs=rngs,
        )
        common = dict(rngs=rngs, **compute.dtypes)
        self.proj_out_1 = Dense(dim, 2 * dim, axes=("cond", "embed"), **common)
        self.proj_out_2 = Dense(dim, config.output_dim, axes=("embed", "mlp"), **common)

    def __call__(self, x, timesteps, context, *, q_segment_ids, kv_segment_ids, context_gather=None, key=None):
        """x [B, T, D]; timesteps int [B]; context [R, S, Dc]; q_segment_ids [B, T] (the
        sample's segment in its context row); kv_segment_ids [B, W] (already per sample)."""
        temb = shard_tokens(self.timestep_encoder(timesteps))  # [B, D]: split like the batch, not the weights
        self_segment_ids = jnp.ones(x.shape[:2], jnp.int32)
        keys = PerLayer(jax.random.split(key, self.num_steps)) if key is not None else None
        x = run_stack(
            self.transformer_blocks,
            x,
            temb,
            q_segment_ids,
            self_segment_ids,
            context,
            kv_segment_ids,
            context_gather,
            keys,
            **self.compute.stack,
        )
        shift, scale = jnp.split(self.proj_out_1(jax.nn.silu(temb)).astype(jnp.float32), 2, axis=-1)
        h = layer_normalize(x, 1e-6) * (1.0 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(h.astype(x.dtype))


@register
@dataclasses.dataclass(frozen=True)
class VLSelfAttentionConfig:
    num_layers: int = 4
    num_heads: int = 32
    head_dim: int = 64
    dropout: float = 0.2


class SelfAttentionTransformer(nnx.Module):
    """``vl_self_attention``: affine-LayerNorm self-attention blocks over the VL tokens."""

    def __init__(self, config: VLSelfAttentionConfig, compute: Compute, *, rngs: nnx.Rngs):
        self.config, self.compute = config, compute
        dim = config.num_heads * config.head_dim
        spec = BlockSpec(compute, config.dropout)
        self.transformer_blocks = build_stack(
            lambda r: BasicTransformerBlock(dim, config.num_heads, config.head_dim, spec, rngs=r),
            config.num_layers,
            scan=compute.scan_layers,
            rngs=rngs,
        )

    def __call__(self, x, segment_ids, key=None, bounds=None):
        keys = PerLayer(jax.random.split(key, self.config.num_layers)) if key is not None else None
        return run_stack(
            self.transformer_blocks,
            x,
            None,
            segment_ids,
            key=keys,
            bounds=bounds,
            **self.compute.stack,
        )
