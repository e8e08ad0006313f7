"""Multi-expert Gemma: several weight sets ("experts") sharing one joint attention per layer.

π0's mixture of transformer weights: each token stream (e.g. the VLM prefix and the action
suffix) has its own norms, Q/K/V/O projections and GeGLU MLP, but every layer runs ONE softmax
attention over the concatenation of all present streams, under the project's segment/block mask
rule. A stream can be absent from a call (``None``): the prefix alone fills a KV cache, the suffix
alone then attends that cache. Experts with ``use_adarms`` use AdaRMSNorm conditioned per sample
(π0.5's time conditioning) and gate their residual branches; others use Gemma's ``(1 + scale)``
RMSNorm. Heads, KV heads, head_dim and depth must agree between experts; widths and MLP sizes
are free, and nothing assumes ``num_heads * head_dim == width``.

Parameters (upstream Gemma names): ``embed_tokens.embedding`` (stream 0's vocabulary, optional),
``layers[.i].experts.<e>.{input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm,
mlp.{gate,up,down}_proj}`` and ``final_norms.<e>``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from embodied_jax.config_registry import register
from embodied_jax.nn.attention import KVCache, attention
from embodied_jax.nn.block_sparse import SegmentBounds
from embodied_jax.nn.compute import Compute
from embodied_jax.nn.dense import Dense
from embodied_jax.nn.embeddings import Embed
from embodied_jax.nn.lora import LoRAConfig
from embodied_jax.nn.mlp import GatedMLP
from embodied_jax.nn.norms import AdaRMSNorm, RMSNorm
from embodied_jax.nn.rope import apply_rope
from embodied_jax.nn.stack import PerLayer, build_stack, run_stack
from embodied_jax.parallel.partition import shard_tokens


@register
@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    width: int
    depth: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    use_adarms: bool = False
    cond_dim: int | None = None  # AdaRMS conditioning width (default: width)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"GemmaConfig: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )


def _norm(config: GemmaConfig, eps, compute: Compute, rngs):
    if config.use_adarms:
        return AdaRMSNorm(config.width, config.cond_dim or config.width, eps=eps, rngs=rngs, **compute.dtypes)
    return RMSNorm(config.width, eps=eps, zero_centered=True, **compute.dtypes)


def _apply_norm(norm, x, cond):
    """(normed x, gate or None). A cond [B, M, C] conditions M equal consecutive groups of tokens."""
    if isinstance(norm, RMSNorm):
        return norm(x), None
    if cond.ndim == 3:
        b, t, d = x.shape
        groups = cond.shape[1]
        y, gate = norm(x.reshape(b, groups, t // groups, d), cond)
        return y.reshape(b, t, d), jnp.broadcast_to(gate, (b, groups, t // groups, d)).reshape(b, t, d)
    return norm(x, cond)


def _gated(residual, update, gate):
    return residual + update if gate is None else residual + update * gate


class GemmaAttentionWeights(nnx.Module):
    def __init__(self, config: GemmaConfig, *, compute: Compute, lora, rngs):
        common = dict(use_bias=False, lora=lora, rngs=rngs, **compute.dense)
        q_out = config.num_heads * config.head_dim
        kv_out = config.num_kv_heads * config.head_dim
        self.q_proj = Dense(config.width, q_out, axes=("embed", "heads"), **common)
        self.k_proj = Dense(config.width, kv_out, axes=("embed", "kv_heads"), **common)
        self.v_proj = Dense(config.width, kv_out, axes=("embed", "kv_heads"), **common)
        self.o_proj = Dense(q_out, config.width, axes=("heads", "embed"), **common)


class GemmaExpertBlock(nnx.Module):
    """One expert's weights in one layer."""

    def __init__(self, config: GemmaConfig, *, eps, compute: Compute, lora, rngs):
        self.input_layernorm = _norm(config, eps, compute, rngs)
        self.self_attn = GemmaAttentionWeights(config, compute=compute, lora=lora, rngs=rngs)
        self.post_attention_layernorm = _norm(config, eps, compute, rngs)
        self.mlp = GatedMLP(config.width, config.mlp_dim, activation="gelu_tanh", lora=lora, rngs=rngs, **compute.dense)


@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """Ids of the tokens whose queries run in a call (present streams concatenated in order).

    ``block_ids`` None means full attention inside each segment: with contiguous segments the
    fused backends then take their variable-length path, where padding costs no work.
    ``bounds`` (static, packed rows) size the block-sparse attention and the varlen kernels.
    """

    segment_ids: jax.Array  # int32 [B, T]
    block_ids: jax.Array | None  # int32 [B, T]
    positions: jax.Array  # int32 [B, T]
    bounds: SegmentBounds | None = None


jax.tree_util.register_dataclass(
    TokenLayout, data_fields=["segment_ids", "block_ids", "positions"], meta_fields=["bounds"]
)


class JointGemmaLayer(nnx.Module):
    def __init__(self, configs: Sequence[GemmaConfig], *, eps, rope_theta, compute: Compute, lora, rngs):
        self.num_heads = configs[0].num_heads
        self.num_kv_heads = configs[0].num_kv_heads
        self.head_dim = configs[0].head_dim
        self.rope_theta = rope_theta
        self.attention_impl = compute.attention_impl
        self.experts = nnx.List([GemmaExpertBlock(c, eps=eps, compute=compute, lora=lora, rngs=rngs) for c in configs])

    def __call__(self, xs, layout: TokenLayout, conds, cache_k=None, cache_v=None, cache_ids=None, *, return_kv=False):
        """xs: per-stream [B, T_i, D_i] or None. Returns (new xs, (k, v) of these tokens or None)."""
        qs, ks, vs, gates = [], [], [], []
        for block, x, cond in zip(self.experts, xs, conds, strict=True):
            if x is None:
                gates.append(None)
                continue
            b, t, _ = x.shape
            h, gate = _apply_norm(block.input_layernorm, x, cond)
            gates.append(gate)
            attn = block.self_attn
            qs.append(attn.q_proj(h).reshape(b, t, self.num_heads, self.head_dim))
            ks.append(attn.k_proj(h).reshape(b, t, self.num_kv_heads, self.head_dim))
            vs.append(attn.v_proj(h).reshape(b, t, self.num_kv_heads, self.head_dim))
        q = apply_rope(jnp.concatenate(qs, axis=1), layout.positions, theta=self.rope_theta)
        k = apply_rope(jnp.concatenate(ks, axis=1), layout.positions, theta=self.rope_theta)
        v = jnp.concatenate(vs, axis=1)
        cache = None
        if cache_k is not None:
            cache = KVCache(k=cache_k, v=cache_v, segment_ids=cache_ids[0], block_ids=cache_ids[1])
        out = attention(
            q,
            k,
            v,
            q_segment_ids=layout.segment_ids,
            kv_segment_ids=layout.segment_ids,
            q_block_ids=layout.block_ids,
            kv_block_ids=layout.block_ids,
            cache=cache,
            impl=self.attention_impl,
            scale=self.head_dim**-0.5,
            bounds=layout.bounds,
        )
        out = out.reshape(*out.shape[:2], self.num_heads * self.head_dim)
        new_xs, start = [], 0
        for block, x, cond, gate in zip(self.experts, xs, conds, gates, strict=True):
            if x is None:
                new_xs.append(None)
                continue
            t = x.shape[1]
            attn_out = block.self_attn.o_proj(out[:, start : start + t])
            start += t
            x = shard_tokens(_gated(x, attn_out.astype(x.dtype), gate))
            h, gate2 = _apply_norm(block.post_attention_layernorm, x, cond)
            x = shard_tokens(_gated(x, block.mlp(h).astype(x.dtype), gate2))
            new_xs.append(x)
        return tuple(new_xs), ((k, v) if return_kv else None)


class MultiExpertGemma(nnx.Module):
    """Gemma decoder with one weight set per stream and a joint attention per layer."""

    def __init__(
        self,
        configs: Sequence[GemmaConfig],
        *,
        vocab_size: int = 0,
        eps: float = 1e-6,
        rope_theta: float = 10_000.0,
        compute: Compute,
        lora: LoRAConfig | None = None,
        rngs: nnx.Rngs,
    ):
        configs = tuple(configs)
        first = configs[0]
        for i, c in enumerate(configs[1:], 1):
            for field in ("depth", "num_heads", "num_kv_heads", "head_dim"):
                if getattr(c, field) != getattr(first, field):
                    raise ValueError(
                        f"MultiExpertGemma: expert {i} has {field}={getattr(c, field)}, "
                        f"expert 0 has {getattr(first, field)}; joint attention needs them equal"
                    )
        self.configs = configs
        self.compute = compute
        self.embed_tokens = Embed(vocab_size, first.width, rngs=rngs, **compute.dtypes) if vocab_size else None
        self.layers = build_stack(
            lambda r: JointGemmaLayer(configs, eps=eps, rope_theta=rope_theta, compute=compute, lora=lora, rngs=r),
            first.depth,
            scan=compute.scan_layers,
            rngs=rngs,
        )
        self.final_norms = nnx.List([_norm(c, eps, compute, rngs) for c in configs])

    def embed(self, tokens):
        """Stream-0 token embeddings scaled by sqrt(width) (Gemma's input scaling, done here for text only)."""
        x = self.embed_tokens(tokens)
        return x * jnp.asarray(self.configs[0].width ** 0.5, x.dtype)

    def __call__(self, xs, layout: TokenLayout, conds=None, *, cache=None, return_kv=False):
        """Run all layers on the present streams and apply each stream's final norm.

        ``cache``: per-layer prefix keys/values ``(k, v)`` each [L, B, S, K, H] plus their
        ``(segment_ids, block_ids)`` [B, S], as ``((k, v), (seg, blk))``; the present tokens attend
        the cache followed by themselves. Returns (per-stream outputs, (k, v) stacked over layers
        or None).
        """
        xs = tuple(xs)
        conds = tuple(conds) if conds is not None else (None,) * len(xs)
        if len(xs) != len(self.configs):
            raise ValueError(f"MultiExpertGemma: got {len(xs)} streams for {len(self.configs)} experts")
        for i, (x, cond, c) in enumerate(zip(xs, conds, self.configs, strict=True)):
            if x is not None and c.use_adarms and cond is None:
                raise ValueError(f"MultiExpertGemma: stream {i} uses AdaRMS and needs a condition")
        cache_k = cache_v = cache_ids = None
        if cache is not None:
            (k, v), cache_ids = cache
            cache_k, cache_v = PerLayer(k), PerLayer(v)
        carry, kv = run_stack(
            self.layers,
            xs,
            layout,
            conds,
            cache_k,
            cache_v,
            cache_ids,
            with_outputs=True,
            return_kv=return_kv,
            **self.compute.stack,
        )
        outs = tuple(
            None if x is None else _apply_norm(norm, x, cond)[0]
            for norm, x, cond in zip(self.final_norms, carry, conds, strict=True)
        )
        return outs, kv
