"""GR00T-N1.5's flow-matching action head (upstream ``FlowmatchingActionHead``).

Pieces (upstream names): ``vlln`` (LayerNorm over the VL features), ``vl_self_attention``
(adapter), ``state_encoder`` / ``action_decoder`` (embodiment-specific 2-layer ReLU MLPs),
``action_encoder`` (embodiment-specific W1, W2, W3 with a sinusoidal encoding of the
timestep bucket), ``future_tokens``, ``position_embedding`` (on the action tokens only) and
the DiT ``model``.

Embodiment-specific layers hold one weight slice per embodiment slot: ``W`` [slots, in, out],
``b`` [slots, out]; each sample uses the slice of its ``embodiment_id`` (a gather, so
gradients only reach used slices).

``velocity(...)`` is one DiT evaluation: tokens = [state (1), future tokens, noisy actions
(horizon)], output = the decoder applied to the last ``horizon`` tokens.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from embodied_jax.config_registry import register
from embodied_jax.models.dit import DiT, DiTConfig, SelfAttentionTransformer, VLSelfAttentionConfig
from embodied_jax.nn.compute import Compute
from embodied_jax.nn.embeddings import LearnedPositions
from embodied_jax.nn.norms import LayerNorm
from embodied_jax.parallel.partition import gather_parameter, shard_tokens


class CategorySpecificLinear(nnx.Module):
    """Per-embodiment linear: ``x @ W[id] + b[id]``; x [B, T, in]."""

    def __init__(
        self, num_slots: int, in_dim: int, out_dim: int, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.dtype = dtype
        w = 0.02 * jax.random.normal(rngs.params(), (num_slots, in_dim, out_dim), param_dtype)
        self.W = nnx.Param(w, out_sharding=("embodiments", "embed", "mlp"))
        self.b = nnx.Param(jnp.zeros((num_slots, out_dim), param_dtype), out_sharding=("embodiments", "mlp"))

    def __call__(self, x, slot_ids):
        dtype = self.dtype or self.W.dtype
        w = jnp.take(gather_parameter(self.W, dtype), slot_ids, axis=0)  # [B, in, out]
        b = jnp.take(gather_parameter(self.b, dtype), slot_ids, axis=0)
        return jnp.einsum("bti,bio->bto", x.astype(dtype), w) + b[:, None, :]


class CategorySpecificMLP(nnx.Module):
    def __init__(
        self,
        num_slots: int,
        in_dim: int,
        hidden: int,
        out_dim: int,
        *,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layer1 = CategorySpecificLinear(num_slots, in_dim, hidden, **kw)
        self.layer2 = CategorySpecificLinear(num_slots, hidden, out_dim, **kw)

    def __call__(self, x, slot_ids):
        return self.layer2(jax.nn.relu(self.layer1(x, slot_ids)), slot_ids)


def bucket_encoding(buckets, dim: int):
    """Upstream ``SinusoidalPositionalEncoding``: concat[sin, cos](t * 10000^(-k/half)), k < half."""
    half = dim // 2
    freqs = jnp.exp(-jnp.arange(half, dtype=jnp.float32) * (math.log(10000.0) / half))
    angle = jnp.asarray(buckets, jnp.float32)[..., None] * freqs
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


class MultiEmbodimentActionEncoder(nnx.Module):
    """``W3(swish(W2([W1(a), enc(bucket)])))`` with embodiment-specific W1, W2, W3."""

    def __init__(
        self, num_slots: int, action_dim: int, width: int, *, dtype=None, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.width = width
        self.W1 = CategorySpecificLinear(num_slots, action_dim, width, **kw)
        self.W2 = CategorySpecificLinear(num_slots, 2 * width, width, **kw)
        self.W3 = CategorySpecificLinear(num_slots, width, width, **kw)

    def __call__(self, actions, buckets, slot_ids):
        a = self.W1(actions, slot_ids)
        tau = bucket_encoding(buckets, self.width)[:, None, :]
        tau = jnp.broadcast_to(tau, a.shape[:2] + tau.shape[-1:]).astype(a.dtype)
        return self.W3(jax.nn.silu(self.W2(jnp.concatenate([a, tau], axis=-1), slot_ids)), slot_ids)


@register
@dataclasses.dataclass(frozen=True)
class ActionHeadConfig:
    """The head's own sizes (upstream ``action_head_cfg``). What it shares with the rest of the
    policy is passed when building it: ``action_dim``, ``max_state_dim`` and the backbone width
    (``vlln``, the adapter and the DiT cross-attention; upstream ``backbone_embedding_dim``)."""

    hidden_size: int = 1024
    input_embedding_dim: int = 1536
    max_num_embodiments: int = 32
    num_future_tokens: int = 32
    max_seq_len: int = 1024
    add_pos_embed: bool = True
    use_vlln: bool = True
    dit: DiTConfig = DiTConfig()
    vl_self_attention: VLSelfAttentionConfig = VLSelfAttentionConfig()


class Gr00tActionHead(nnx.Module):
    def __init__(
        self,
        config: ActionHeadConfig,
        *,
        action_dim: int,
        max_state_dim: int,
        backbone_width: int,
        compute: Compute,
        lora: Any = None,
        rngs: nnx.Rngs,
    ):
        """``lora`` (an ``nn.lora.LoRAConfig``) adds adapters to every Dense of the DiT blocks."""
        if config.dit.inner_dim != config.input_embedding_dim:
            raise ValueError(
                f"ActionHeadConfig.dit.num_heads * head_dim = {config.dit.inner_dim} must equal "
                f"input_embedding_dim={config.input_embedding_dim}"
            )
        if config.dit.output_dim != config.hidden_size:
            raise ValueError(
                f"ActionHeadConfig.dit.output_dim={config.dit.output_dim} must equal "
                f"hidden_size={config.hidden_size} (the action decoder's input)"
            )
        vl = config.vl_self_attention
        if config.use_vlln and vl.num_heads * vl.head_dim != backbone_width:
            raise ValueError(
                f"ActionHeadConfig.vl_self_attention.num_heads * head_dim = {vl.num_heads * vl.head_dim} "
                f"must equal the backbone width {backbone_width}"
            )
        self.config = config
        kw = dict(rngs=rngs, **compute.dtypes)
        self.model = DiT(config.dit, compute, cross_attention_dim=backbone_width, lora=lora, rngs=rngs)
        slots = config.max_num_embodiments
        self.state_encoder = CategorySpecificMLP(
            slots, max_state_dim, config.hidden_size, config.input_embedding_dim, **kw
        )
        self.action_encoder = MultiEmbodimentActionEncoder(slots, action_dim, config.input_embedding_dim, **kw)
        self.action_decoder = CategorySpecificMLP(slots, config.hidden_size, config.hidden_size, action_dim, **kw)
        self.future_tokens = LearnedPositions(
            config.num_future_tokens, config.input_embedding_dim, param_dtype=compute.weight_dtype, rngs=rngs
        )
        if config.use_vlln:
            self.vlln = LayerNorm(backbone_width, eps=1e-5, **compute.dtypes)
            self.vl_self_attention = SelfAttentionTransformer(vl, compute, rngs=rngs)
        else:
            self.vlln = self.vl_self_attention = None
        if config.add_pos_embed:
            self.position_embedding = LearnedPositions(
                config.max_seq_len, config.input_embedding_dim, param_dtype=compute.weight_dtype, rngs=rngs
            )
        else:
            self.position_embedding = None

    def process_backbone_output(self, features, segment_ids, key=None, bounds=None):
        """VL LayerNorm + adapter over [R, S, D] features; ``segment_ids`` [R, S] mask the adapter
        (``bounds``: packed rows, see ``nn.block_sparse``)."""
        if self.vlln is None:
            return features
        return self.vl_self_attention(self.vlln(features), segment_ids, key, bounds)

    def encode_state(self, state, slot_ids):
        """state [B, S] (or [B, 1, S]) -> [B, 1, D]."""
        state = state[:, None, :] if state.ndim == 2 else state
        return self.state_encoder(state, slot_ids)

    def velocity(
        self,
        state_features,
        noisy_actions,
        buckets,
        slot_ids,
        vl_features,
        *,
        q_segment_ids,
        kv_segment_ids,
        context_gather=None,
        key=None,
    ):
        """Predicted velocity [B, horizon, action_dim] for noisy actions at timestep ``buckets`` [B]."""
        b, horizon, _ = noisy_actions.shape
        action_features = self.action_encoder(noisy_actions, buckets, slot_ids)
        if self.position_embedding is not None:
            action_features = action_features + self.position_embedding(jnp.arange(horizon))[None].astype(
                action_features.dtype
            )
        future = jnp.broadcast_to(self.future_tokens()[None], (b,) + self.future_tokens.embedding.shape)
        sequence = shard_tokens(
            jnp.concatenate(
                [state_features, future.astype(action_features.dtype), action_features.astype(state_features.dtype)],
                axis=1,
            )
        )
        q_seg = jnp.broadcast_to(q_segment_ids[:, None], sequence.shape[:2])
        out = self.model(
            sequence,
            buckets,
            vl_features,
            q_segment_ids=q_seg,
            kv_segment_ids=kv_segment_ids,
            context_gather=context_gather,
            key=key,
        )
        return self.action_decoder(out, slot_ids)[:, -horizon:].astype(jnp.float32)
