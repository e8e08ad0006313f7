"""SigLIP vision tower (the HF ``SiglipVisionModel`` architecture), every size from config.

Pre-LN ViT: patch embedding (a stride-``patch`` convolution, computed as a patchify + einsum)
plus learned positions, ``depth`` encoder layers (LayerNorm -> MHA with biases -> residual,
LayerNorm -> ``fc1``/``fc2`` MLP -> residual) and an optional final ``post_layernorm``. No
pooling head. Images are NHWC in [-1, 1]; a side that is not a multiple of the patch is cropped,
as a VALID convolution would. Used by π0.5 (PaliGemma) and GR00T (Eagle).

Parameter names follow HF: ``embeddings.patch_embedding.{kernel [P, P, C, D], bias}``,
``embeddings.position_embedding.embedding``, ``encoder.layers[.i].{layer_norm1, self_attn.
{q,k,v,out}_proj, layer_norm2, mlp.{fc1, fc2}}``, ``post_layernorm``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx

from embodied_jax.config_registry import register
from embodied_jax.nn.attention import attention
from embodied_jax.nn.compute import Compute
from embodied_jax.nn.dense import Dense
from embodied_jax.nn.embeddings import LearnedPositions
from embodied_jax.nn.lora import LoRAConfig
from embodied_jax.nn.mlp import MLP
from embodied_jax.nn.norms import LayerNorm
from embodied_jax.nn.stack import build_stack, run_stack
from embodied_jax.parallel.partition import cast_parameter, shard_tokens


@register
@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    width: int = 1152
    depth: int = 27
    num_heads: int = 16
    mlp_dim: int = 4304
    patch_size: int = 14
    image_size: int = 224
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    activation: str = "gelu_tanh"
    post_layernorm: bool = True

    def __post_init__(self):
        if self.width % self.num_heads:
            raise ValueError(f"SiglipConfig: width {self.width} is not divisible by num_heads {self.num_heads}")
        if self.image_size < self.patch_size:
            raise ValueError(f"SiglipConfig: image_size {self.image_size} < patch_size {self.patch_size}")

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid


class PatchEmbedding(nnx.Module):
    """Non-overlapping patch convolution: kernel [P, P, C, D] (HWIO), bias [D]."""

    def __init__(self, patch: int, channels: int, width: int, *, dtype: Any, param_dtype: Any, rngs: nnx.Rngs):
        self.patch = patch
        self.dtype = dtype
        fan_in_init = nnx.initializers.lecun_normal(in_axis=(0, 1, 2), out_axis=3)
        self.kernel = nnx.Param(
            fan_in_init(rngs.params(), (patch, patch, channels, width), param_dtype),
            out_sharding=("conv", "conv", "channels", "embed"),
        )
        self.bias = nnx.Param(jnp.zeros((width,), param_dtype), out_sharding=("embed",))

    def __call__(self, images):
        b, h, w, c = images.shape
        p = self.patch
        gh, gw = h // p, w // p
        dtype = self.dtype or self.kernel.dtype
        # patches as rows [B·N, P·P·C] and one 2-D matmul, like Dense: the kernel's gradient then
        # contracts one axis and reads the output gradient as it is; contracting (b, h, w) of
        # the 6-D einsum had XLA:CPU write that gradient transposed, fused with the sum of every
        # layer's residual gradient (21 ms of a pi05_bench step)
        x = images[:, : gh * p, : gw * p].reshape(b, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = x.reshape(b * gh * gw, p * p * c).astype(dtype)
        kernel = cast_parameter(self.kernel, dtype).reshape(p * p * c, -1)
        out = jnp.einsum("ni,io->no", x, kernel) + self.bias[...].astype(dtype)
        return out.reshape(b, gh * gw, -1)


class SiglipEmbeddings(nnx.Module):
    def __init__(self, config: SiglipConfig, *, compute: Compute, rngs: nnx.Rngs):
        self.patch_embedding = PatchEmbedding(
            config.patch_size, config.num_channels, config.width, rngs=rngs, **compute.dtypes
        )
        self.position_embedding = LearnedPositions(
            config.num_patches, config.width, param_dtype=compute.weight_dtype, rngs=rngs
        )

    def __call__(self, images):
        x = self.patch_embedding(images)
        if x.shape[1] != self.position_embedding.embedding.shape[0]:
            raise ValueError(
                f"SigLIP: images {images.shape[1:3]} give {x.shape[1]} patches, the position table has "
                f"{self.position_embedding.embedding.shape[0]}: set SiglipConfig.image_size"
            )
        return shard_tokens(x + self.position_embedding().astype(x.dtype)[None])


class SiglipAttention(nnx.Module):
    def __init__(self, config: SiglipConfig, *, compute: Compute, lora: LoRAConfig | None, rngs: nnx.Rngs):
        self.num_heads = config.num_heads
        self.head_dim = config.width // config.num_heads
        self.attention_impl = compute.attention_impl
        common = dict(use_bias=True, lora=lora, rngs=rngs, **compute.dense)
        self.q_proj = Dense(config.width, config.width, axes=("embed", "heads"), **common)
        self.k_proj = Dense(config.width, config.width, axes=("embed", "heads"), **common)
        self.v_proj = Dense(config.width, config.width, axes=("embed", "heads"), **common)
        self.out_proj = Dense(config.width, config.width, axes=("heads", "embed"), **common)

    def __call__(self, x):
        b, t, _ = x.shape
        q, k, v = (
            proj(x).reshape(b, t, self.num_heads, self.head_dim) for proj in (self.q_proj, self.k_proj, self.v_proj)
        )
        segments = jnp.ones((b, t), jnp.int32)  # every patch sees every patch of its image
        out = attention(q, k, v, q_segment_ids=segments, kv_segment_ids=segments, impl=self.attention_impl)
        return self.out_proj(out.reshape(b, t, -1))


class SiglipEncoderLayer(nnx.Module):
    def __init__(self, config: SiglipConfig, *, compute: Compute, lora: LoRAConfig | None, rngs: nnx.Rngs):
        norm = dict(eps=config.layer_norm_eps, **compute.dtypes)
        self.layer_norm1 = LayerNorm(config.width, **norm)
        self.self_attn = SiglipAttention(config, compute=compute, lora=lora, rngs=rngs)
        self.layer_norm2 = LayerNorm(config.width, **norm)
        self.mlp = MLP(
            config.width,
            config.mlp_dim,
            activation=config.activation,
            use_bias=True,
            lora=lora,
            rngs=rngs,
            **compute.dense,
        )

    def __call__(self, x):
        x = shard_tokens(x + self.self_attn(self.layer_norm1(x)))
        return shard_tokens(x + self.mlp(self.layer_norm2(x)))


class SiglipEncoder(nnx.Module):
    def __init__(self, config: SiglipConfig, *, compute: Compute, lora: LoRAConfig | None, rngs: nnx.Rngs):
        self.compute = compute
        self.layers = build_stack(
            lambda r: SiglipEncoderLayer(config, compute=compute, lora=lora, rngs=r),
            config.depth,
            scan=compute.scan_layers,
            rngs=rngs,
        )

    def __call__(self, x):
        return run_stack(self.layers, x, **self.compute.stack)


class SiglipVisionModel(nnx.Module):
    """images [B, H, W, C] in [-1, 1] -> patch features [B, num_patches, width]."""

    def __init__(self, config: SiglipConfig, *, compute: Compute, lora: LoRAConfig | None = None, rngs: nnx.Rngs):
        self.config = config
        self.embeddings = SiglipEmbeddings(config, compute=compute, rngs=rngs)
        self.encoder = SiglipEncoder(config, compute=compute, lora=lora, rngs=rngs)
        self.post_layernorm = (
            LayerNorm(config.width, eps=config.layer_norm_eps, **compute.dtypes) if config.post_layernorm else None
        )

    def __call__(self, images):
        if images.ndim != 4 or images.shape[-1] != self.config.num_channels:
            raise ValueError(f"SigLIP: images must be [B, H, W, {self.config.num_channels}], got {images.shape}")
        x = self.encoder(self.embeddings(images))
        return self.post_layernorm(x) if self.post_layernorm is not None else x
