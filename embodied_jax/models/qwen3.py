"""Qwen3 decoder (the language model inside Eagle 2.5): segment-id causal attention, QK-norm.

Parameter names follow HF ``Qwen3Model``: ``embed_tokens``, ``layers.N.{input_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}``
and ``norm``. Kernels are [in, out] (HF stores [out, in]; the importer transposes).

Attention follows the project rule (``nn.attention``): a query attends a key iff their
segment ids match and are non-zero and the key's block id (its position) is not after the
query's. ``hidden_states`` returns the final RMSNorm applied to the last built layer, so a
model built with fewer layers than the published one is the truncated LLM GR00T uses.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from embodied_jax.config_registry import register
from embodied_jax.nn.attention import attention
from embodied_jax.nn.compute import Compute
from embodied_jax.nn.dense import Dense
from embodied_jax.nn.embeddings import Embed
from embodied_jax.nn.mlp import GatedMLP
from embodied_jax.nn.norms import RMSNorm
from embodied_jax.nn.rope import apply_rope
from embodied_jax.nn.stack import build_stack, run_stack
from embodied_jax.parallel.partition import shard_tokens


@register
@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    width: int = 2048
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    mlp_dim: int = 6144
    vocab_size: int = 151680
    rope_theta: float = 1_000_000.0
    eps: float = 1e-6


class Qwen3Attention(nnx.Module):
    def __init__(self, config: Qwen3Config, *, compute: Compute, rngs: nnx.Rngs):
        self.config = config
        self.impl = compute.attention_impl
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        common = dict(use_bias=False, rngs=rngs, **compute.dense)
        self.q_proj = Dense(config.width, q_dim, axes=("embed", "heads"), **common)
        self.k_proj = Dense(config.width, kv_dim, axes=("embed", "kv_heads"), **common)
        self.v_proj = Dense(config.width, kv_dim, axes=("embed", "kv_heads"), **common)
        self.o_proj = Dense(q_dim, config.width, axes=("heads", "embed"), **common)
        norm = dict(eps=config.eps, zero_centered=False, **compute.dtypes)
        self.q_norm = RMSNorm(config.head_dim, **norm)
        self.k_norm = RMSNorm(config.head_dim, **norm)

    def __call__(self, x, positions, q_segment_ids, kv_segment_ids, causal_blocks: bool, bounds=None):
        b, t, _ = x.shape
        config = self.config
        q = self.q_norm(self.q_proj(x).reshape(b, t, config.num_heads, config.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, config.num_kv_heads, config.head_dim))
        v = self.v_proj(x).reshape(b, t, config.num_kv_heads, config.head_dim)
        q = apply_rope(q, positions, theta=config.rope_theta).astype(v.dtype)
        k = apply_rope(k, positions, theta=config.rope_theta).astype(v.dtype)
        out = attention(
            q,
            k,
            v,
            q_segment_ids=q_segment_ids,
            kv_segment_ids=kv_segment_ids,
            q_block_ids=positions,
            kv_block_ids=positions,
            causal_blocks=causal_blocks,
            impl=self.impl,
            bounds=bounds,
        )
        return self.o_proj(out.reshape(b, t, config.num_heads * config.head_dim))


class Qwen3DecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3Config, *, compute: Compute, rngs: nnx.Rngs):
        norm = dict(eps=config.eps, zero_centered=False, **compute.dtypes)
        self.input_layernorm = RMSNorm(config.width, **norm)
        self.self_attn = Qwen3Attention(config, compute=compute, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(config.width, **norm)
        self.mlp = GatedMLP(config.width, config.mlp_dim, activation="silu", rngs=rngs, **compute.dense)

    def __call__(self, x, positions, q_segment_ids, kv_segment_ids, causal_blocks: bool = True, bounds=None):
        h = self.self_attn(self.input_layernorm(x), positions, q_segment_ids, kv_segment_ids, causal_blocks, bounds)
        x = shard_tokens(x + h.astype(x.dtype))
        return shard_tokens(x + self.mlp(self.post_attention_layernorm(x)).astype(x.dtype))


class Qwen3Model(nnx.Module):
    """Token embedding, ``num_layers`` decoder layers and the final RMSNorm."""

    def __init__(self, config: Qwen3Config, *, compute: Compute, rngs: nnx.Rngs):
        self.config = config
        self.compute = compute
        self.embed_tokens = Embed(config.vocab_size, config.width, rngs=rngs, **compute.dtypes)
        self.layers = build_stack(
            lambda r: Qwen3DecoderLayer(config, compute=compute, rngs=r),
            config.num_layers,
            scan=compute.scan_layers,
            rngs=rngs,
        )
        self.norm = RMSNorm(config.width, eps=config.eps, zero_centered=False, **compute.dtypes)

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.embed_tokens(tokens)

    def __call__(
        self, embeddings, positions, q_segment_ids, kv_segment_ids=None, *, causal_blocks: bool = True, bounds=None
    ):
        """Final-normed hidden states [B, T, D] of the last layer.

        ``kv_segment_ids`` defaults to ``q_segment_ids``; passing all-ones query ids with the
        padding mask as key ids reproduces HF's behaviour for padded query rows (they still
        attend the real tokens before them). ``causal_blocks`` promises ``positions`` are
        the within-segment positions of contiguous segments (lets fused kernels run causal).
        ``bounds`` (``nn.block_sparse.SegmentBounds``) mark packed rows (block-sparse attention).
        """
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        x = run_stack(
            self.layers,
            embeddings,
            positions,
            q_segment_ids,
            kv_segment_ids,
            causal_blocks=causal_blocks,
            bounds=bounds,
            **self.compute.stack,
        )
        return self.norm(x)
