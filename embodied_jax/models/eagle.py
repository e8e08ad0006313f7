"""Eagle 2.5 VL backbone as GR00T-N1.5 uses it: SigLIP tower -> ``mlp1`` -> truncated Qwen3.

``Eagle25`` mirrors upstream ``eagle_model`` (``vision_model``, ``mlp1``, ``language_model``):
image embeddings (after the projector) replace the embeddings of the ``<IMG_CONTEXT>``
image-context tokens, in order, row by row: the k-th such token of row r receives the
k-th image token of row r's images (``nn.embeddings.fill_image_tokens``). For an unpacked
batch (a row's images are its sample's cameras) that is exactly upstream's batch-wide
``input_embeds[selected] = vit_embeds.reshape(-1, C)``; for a packed row it is each
sample's images at its own tokens. The language model is built with ``select_layer``
layers; the features are its final RMSNorm output.

``EagleBackbone`` is upstream's ``backbone`` (``eagle_linear`` is the identity in N1.5:
``project_to_dim=None``, so it holds no parameters).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from embodied_jax.config_registry import register
from embodied_jax.models.qwen3 import Qwen3Config, Qwen3Model
from embodied_jax.models.siglip import SiglipConfig, SiglipVisionModel
from embodied_jax.nn.compute import Compute
from embodied_jax.nn.dense import Dense
from embodied_jax.nn.embeddings import fill_image_tokens
from embodied_jax.parallel.partition import shard_tokens


@register
@dataclasses.dataclass(frozen=True)
class EagleConfig:
    vision: SiglipConfig
    llm: Qwen3Config  # num_layers = the layers kept (upstream select_layer)
    image_token_id: int = 151669


class Eagle25(nnx.Module):
    def __init__(self, config: EagleConfig, *, compute: Compute, rngs: nnx.Rngs):
        self.config = config
        self.vision_model = SiglipVisionModel(config.vision, compute=compute, rngs=rngs)
        self.mlp1 = Dense(config.vision.width, config.llm.width, axes=("embed", "mlp"), rngs=rngs, **compute.dense)
        self.language_model = Qwen3Model(config.llm, compute=compute, rngs=rngs)

    def image_features(self, images):
        """images [N, H, W, 3] in [-1, 1] -> projected image tokens [N, P, D_llm]."""
        return self.mlp1(self.vision_model(images))

    def __call__(
        self, images, tokens, positions, q_segment_ids, kv_segment_ids=None, *, causal_blocks=True, bounds=None
    ):
        """images [R, k, H, W, 3] (row r's image-context tokens take its k images in order) or None."""
        emb = self.language_model.embed(tokens)
        if images is not None:
            r, k = images.shape[:2]
            features = self.image_features(images.reshape(r * k, *images.shape[2:]))
            rows = features.reshape(r, k * features.shape[1], features.shape[-1])
            emb = fill_image_tokens(emb, tokens == self.config.image_token_id, rows)
        return self.language_model(
            shard_tokens(emb), positions, q_segment_ids, kv_segment_ids, causal_blocks=causal_blocks, bounds=bounds
        )


class EagleBackbone(nnx.Module):
    """Upstream ``backbone``: holds ``eagle_model``; features = its final-normed hidden states."""

    def __init__(self, config: EagleConfig, *, compute: Compute, rngs: nnx.Rngs):
        self.eagle_model = Eagle25(config, compute=compute, rngs=rngs)

    def __call__(self, *args, **kwargs) -> jax.Array:
        return self.eagle_model(*args, **kwargs)
