"""Eagle 2.5 VL backbone as GR00T-N1.5 uses it: SigLIP tower -> ``mlp1`` -> truncated Qwen3.

``Eagle25`` mirrors upstream ``eagle_model`` (``vision_model``, ``mlp1``, ``language_model``):
image embeddings (after the projector) replace the embeddings of the ``<IMG_CONTEXT>``
image-context tokens, in order: the k-th such token of the token stream (row-major over
the batch) receives the k-th image token of the images (image-major), exactly like
upstream's ``input_embeds[selected] = vit_embeds.reshape(-1, C)``. This also holds for
packed rows as long as samples appear in the rows in sample order. Unpacked batches (each
row's images are its own cameras) take the same values row by row, which keeps a
batch-sharded step local. The language model is
built with ``select_layer`` layers; the features are its final RMSNorm output.

``EagleBackbone`` is upstream's ``backbone`` (``eagle_linear`` is the identity in N1.5:
``project_to_dim=None``, so it holds no parameters).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from embodied_jax.models.qwen3 import Qwen3Config, Qwen3Model
from embodied_jax.models.siglip import SiglipConfig, SiglipVisionModel
from embodied_jax.nn.dense import Dense
from embodied_jax.parallel.partition import shard_tokens


@dataclasses.dataclass(frozen=True)
class EagleConfig:
    vision: SiglipConfig
    llm: Qwen3Config  # num_layers = the layers kept (upstream select_layer)
    image_token_id: int = 151669


def replace_image_tokens(embeddings, tokens, image_embeddings, image_token_id: int, images_per_row: int | None = None):
    """Put image_embeddings [N, P, D] (flattened in order) at the image-context tokens of [R, L].

    ``images_per_row``: when row r's image tokens are exactly images r·k .. r·k + k - 1 (an
    unpacked batch with k cameras), the fill runs row by row, so a batch-sharded step keeps
    it local; the global fill (``None``) needs the whole batch on every device."""
    r, length, d = embeddings.shape
    if images_per_row is not None:
        rows = image_embeddings.reshape(r, -1, d)
        is_image = tokens == image_token_id
        index = jnp.clip(jnp.cumsum(is_image.astype(jnp.int32), axis=1) - 1, 0, rows.shape[1] - 1)
        gathered = jnp.take_along_axis(rows, index[..., None], axis=1).astype(embeddings.dtype)
        return jnp.where(is_image[..., None], gathered, embeddings)
    flat_tokens = tokens.reshape(-1)
    is_image = flat_tokens == image_token_id
    image_flat = image_embeddings.reshape(-1, d)
    index = jnp.clip(jnp.cumsum(is_image.astype(jnp.int32)) - 1, 0, image_flat.shape[0] - 1)
    gathered = jnp.take(image_flat, index, axis=0).astype(embeddings.dtype)
    out = jnp.where(is_image[:, None], gathered, embeddings.reshape(-1, d))
    return out.reshape(r, length, d)


class Eagle25(nnx.Module):
    def __init__(self, cfg: EagleConfig, *, dtype: Any = None, param_dtype: Any = jnp.float32, fp8: str = "none",
                 attention_impl: str = "auto", scan_layers: bool = True, remat_policy: str = "none",
                 rngs: nnx.Rngs):
        self.cfg = cfg
        common = dict(dtype=dtype, param_dtype=param_dtype, fp8=fp8, attention_impl=attention_impl,
                      scan_layers=scan_layers, remat_policy=remat_policy, rngs=rngs)
        self.vision_model = SiglipVisionModel(cfg.vision, **common)
        self.mlp1 = Dense(cfg.vision.width, cfg.llm.width, axes=("embed", "mlp"), fp8=fp8, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
        self.language_model = Qwen3Model(cfg.llm, **common)

    def image_features(self, images):
        """images [N, H, W, 3] in [-1, 1] -> projected image tokens [N, P, D_llm]."""
        return self.mlp1(self.vision_model(images))

    def __call__(self, images, tokens, positions, q_segment_ids, kv_segment_ids=None, *, causal_blocks=True,
                 images_per_row: int | None = None):
        emb = self.language_model.embed(tokens)
        if images is not None:
            emb = replace_image_tokens(emb, tokens, self.image_features(images), self.cfg.image_token_id,
                                       images_per_row)
        return self.language_model(shard_tokens(emb), positions, q_segment_ids, kv_segment_ids, causal_blocks=causal_blocks)


class EagleBackbone(nnx.Module):
    """Upstream ``backbone``: holds ``eagle_model``; features = its final-normed hidden states."""

    def __init__(self, cfg: EagleConfig, **kwargs):
        self.eagle_model = Eagle25(cfg, **kwargs)

    def __call__(self, *args, **kwargs) -> jax.Array:
        return self.eagle_model(*args, **kwargs)
