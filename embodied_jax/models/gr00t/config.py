"""The gr00t configuration: sizes, training options and the Policy contract's hooks (``policy.PolicyConfig``).

The package docstring (``models/gr00t/__init__.py``) describes the model."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import numpy as np

from embodied_jax.assets import AssetError
from embodied_jax.config_registry import register
from embodied_jax.models.dit import DiTConfig, VLSelfAttentionConfig
from embodied_jax.models.eagle import EagleConfig
from embodied_jax.models.gr00t.action_head import ActionHeadConfig
from embodied_jax.models.qwen3 import Qwen3Config
from embodied_jax.models.siglip import SiglipConfig
from embodied_jax.nn.block_sparse import BlockSparseTiling
from embodied_jax.nn.compute import Compute
from embodied_jax.policy import DatasetFeatures, PolicyConfig, check_noise_scale

# Eagle 2.5's towers as GR00T-N1.5 ships them (reference README: Eagle25VLConfig)
EAGLE_SIGLIP = SiglipConfig(
    width=1152, depth=27, num_heads=16, mlp_dim=4304, patch_size=14, image_size=224, layer_norm_eps=1e-6
)  # so400m/14 at 224: 256 tokens per image
QWEN3_1_7B = Qwen3Config(
    width=2048,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    mlp_dim=6144,
    vocab_size=151680,
    rope_theta=1_000_000.0,
    eps=1e-6,
)
# upstream action_head_cfg (diffusion_model_cfg, vl_self_attention_cfg)
GR00T_N15_HEAD = ActionHeadConfig(
    hidden_size=1024,
    input_embedding_dim=1536,
    max_num_embodiments=32,
    num_future_tokens=32,
    max_seq_len=1024,
    dit=DiTConfig(
        num_layers=16, num_heads=32, head_dim=48, output_dim=1024, interleave_self_attention=True, dropout=0.2
    ),
    vl_self_attention=VLSelfAttentionConfig(num_layers=4, num_heads=32, head_dim=64, dropout=0.2),
)


@register
@dataclasses.dataclass(frozen=True)
class Gr00tConfig(PolicyConfig):
    """GR00T-N1.5 sizes and training options; defaults are the published GR00T-N1.5-3B.

    Backbone (upstream ``backbone_cfg``): ``vision`` (SigLIP), ``mlp1`` and ``llm`` (Qwen3-1.7B,
    its published depth) built with its first ``select_layer`` layers. Action head (upstream
    ``action_head_cfg``): ``action_head`` with its ``dit`` and ``vl_self_attention``; its backbone
    width is ``llm.width`` and ``action_dim`` / ``max_state_dim`` are the top-level fields.
    Precision and performance fields apply to every module.
    """

    vision: SiglipConfig = EAGLE_SIGLIP  # Eagle 2.5's SigLIP tower
    llm: Qwen3Config = QWEN3_1_7B  # Qwen3 at its published depth; built with its first select_layer layers
    select_layer: int = 12  # LLM layers kept (upstream backbone_cfg.select_layer)
    image_token_id: int = 151669  # <IMG_CONTEXT>
    camera_names: tuple[str, ...] = ("ego_view",)  # image slots, in prompt order
    max_token_len: int = 320  # padded prompt length (image blocks + text)
    action_head: ActionHeadConfig = GR00T_N15_HEAD  # upstream action_head_cfg: sizes, DiT, VL adapter
    action_horizon: int = 16
    action_dim: int = 32
    max_state_dim: int = 64
    num_inference_steps: int = 4
    # Sampling starts from noise drawn from N(0, noise_scale^2): 1 is the flow's own (upstream);
    # 0 starts every chunk at the flow's centre (deterministic). Training never reads it.
    noise_scale: float = 1.0
    num_timestep_buckets: int = 1000
    time_beta: tuple[float, float] = (1.5, 1.0)  # flow-matching time t = (time_scale - Beta(*time_beta)) / time_scale
    time_scale: float = 0.999
    mask_vl_padding: bool = True  # False: upstream's adapter and DiT attend padded VL tokens too
    # the compute settings (dtype, param_dtype, fp8, attention_impl, scan_layers, remat_policy): ``compute``
    dtype: str = "bfloat16"  # compute dtype (every module)
    param_dtype: str = "float32"
    fp8: str = "none"
    attention_impl: str = "auto"
    scan_layers: bool = True
    remat_policy: str = "none"
    tune_visual: bool = False  # freezing: upstream's finetune defaults
    tune_llm: bool = False
    tune_projector: bool = True
    tune_diffusion_model: bool = True
    lora_rank: int = 0  # LoRA on the DiT (0: none)
    lora_alpha: float = 16.0
    synthetic_text_tokens: tuple[int, int] = (24, 38)  # synthetic batches: text tokens around the image blocks
    tokenizer_path: str | None = None  # input builder (real datasets): a local Qwen3 tokenizer.json
    asset_fields: ClassVar[tuple[str, ...]] = ("tokenizer_path",)
    embodiment_id: int = 31  # the data's embodiment slot (upstream "new_embodiment" = 31 for a new robot)
    flow_samples_per_obs: int = 1  # K (noise, time) draws per observation share one backbone pass (upstream: 1)
    block_sparse_tiling: BlockSparseTiling | None = None  # packed rows' attention (None: the platform's)
    # Runs saved before these fields read back with 1 draw, the platform's tiling, N(0, 1) noise (config_registry).
    ADDED_FIELDS = ("flow_samples_per_obs", "block_sparse_tiling", "noise_scale")

    def __post_init__(self):
        head, llm = self.action_head, self.llm
        if not 1 <= self.select_layer <= llm.num_layers:
            raise ValueError(
                f"Gr00tConfig.select_layer={self.select_layer} must be in [1, llm.num_layers={llm.num_layers}]"
            )
        if self.image_token_id >= llm.vocab_size:
            raise ValueError(f"Gr00tConfig.image_token_id={self.image_token_id} >= llm.vocab_size={llm.vocab_size}")
        if head.dit.inner_dim != head.input_embedding_dim:
            raise ValueError(
                f"Gr00tConfig.action_head.dit.num_heads * head_dim = {head.dit.inner_dim} must equal "
                f"action_head.input_embedding_dim={head.input_embedding_dim}"
            )
        if head.dit.output_dim != head.hidden_size:
            raise ValueError(
                f"Gr00tConfig.action_head.dit.output_dim={head.dit.output_dim} must equal "
                f"action_head.hidden_size={head.hidden_size}"
            )
        if head.dit.interleave_self_attention and head.dit.num_layers % 2:
            raise ValueError(
                f"Gr00tConfig.action_head.dit.num_layers={head.dit.num_layers} must be even with "
                "interleave_self_attention"
            )
        vl = head.vl_self_attention
        if head.use_vlln and vl.num_heads * vl.head_dim != llm.width:
            raise ValueError(
                f"Gr00tConfig.action_head.vl_self_attention.num_heads * head_dim = "
                f"{vl.num_heads * vl.head_dim} must equal llm.width={llm.width}"
            )
        if head.add_pos_embed and self.action_horizon > head.max_seq_len:
            raise ValueError(
                f"Gr00tConfig.action_horizon={self.action_horizon} > action_head.max_seq_len="
                f"{head.max_seq_len} (the action position table)"
            )
        if self.flow_samples_per_obs < 1:
            raise ValueError(f"Gr00tConfig.flow_samples_per_obs={self.flow_samples_per_obs} must be >= 1")
        check_noise_scale(self)
        lo, hi = self.synthetic_text_tokens
        if not 2 <= lo <= hi:
            raise ValueError(f"Gr00tConfig.synthetic_text_tokens={self.synthetic_text_tokens} must be 2 <= lo <= hi")
        if self.max_token_len < self.image_block_tokens + hi:
            raise ValueError(
                f"Gr00tConfig.max_token_len={self.max_token_len} is shorter than the image blocks "
                f"({self.image_block_tokens}) plus {hi} text tokens"
            )

    @property
    def image_block_tokens(self) -> int:
        """``<img>`` + image tokens + ``</img>`` for every camera."""
        return len(self.camera_names) * (self.vision.num_patches + 2)

    # ----- module configs
    def eagle_config(self) -> EagleConfig:
        """The backbone as built: ``llm`` truncated to its first ``select_layer`` layers."""
        llm = dataclasses.replace(self.llm, num_layers=self.select_layer)
        return EagleConfig(vision=self.vision, llm=llm, image_token_id=self.image_token_id)

    @property
    def compute(self) -> Compute:
        """What every module computes with, from the six fields ``dtype`` .. ``remat_policy`` (``nn/compute.py``)."""
        return Compute.of(self)

    def freeze_regexes(self) -> tuple[str, ...]:
        return freeze_regexes(self)

    def action_expert_regexes(self) -> tuple[str, ...]:
        """The action head (DiT, state/action encoders and decoder, the VL self-attention and norm);
        the Eagle backbone (vision and language model) is not."""
        return (r"^action_head/",)

    def fit_to_dataset(self, features: DatasetFeatures) -> Gr00tConfig:
        """The image slots are the dataset's cameras under their modality.json video names (as
        upstream GR00T reads them), the prompt keeping its text room; state and actions must fit
        the padded widths of the state encoder and action head."""
        if features.camera_names is None:
            raise ValueError(
                "GR00T names its image slots after the cameras' video names in meta/modality.json, "
                f"and the dataset has none for {list(features.camera_keys)}: write one (python -m "
                "embodied_jax.sim.collect does) or map the cameras with --data.inputs.cameras KEY SLOT ..."
            )
        if features.state_dim > self.max_state_dim:
            raise ValueError(
                f"the state has {features.state_dim} dims, more than GR00T's max_state_dim={self.max_state_dim} "
                "(the width of its state encoder, fixed by pretrained weights)"
            )
        if features.action_dim > self.action_dim:
            raise ValueError(
                f"the action has {features.action_dim} dims, more than GR00T's action_dim={self.action_dim} "
                "(the width of its action encoder and decoder, fixed by pretrained weights)"
            )
        text_room = self.max_token_len - self.image_block_tokens
        names = tuple(features.camera_names)
        image_blocks = len(names) * (self.vision.num_patches + 2)
        return dataclasses.replace(self, camera_names=names, max_token_len=image_blocks + text_room)

    def input_builder(self, packed: bool = False):
        """The per-sample input builder (Eagle prompt, images, padded state/actions, embodiment id);
        ``packed``: variable-length samples (only the cameras a sample has) for ``data/packing.py``."""
        from embodied_jax.models.gr00t.inputs import Gr00tInputBuilder

        if self.tokenizer_path is None:
            raise AssetError(
                "model.tokenizer_path is not set: give --model.tokenizer-path (Qwen3's tokenizer.json) "
                "or --init-from weights that carry one"
            )
        slots = self.action_head.max_num_embodiments
        if not 0 <= self.embodiment_id < slots:
            raise ValueError(
                f"Gr00tConfig.embodiment_id={self.embodiment_id} must be in [0, "
                f"action_head.max_num_embodiments={slots})"
            )
        return Gr00tInputBuilder.for_config(self, self.tokenizer_path, embodiment_id=self.embodiment_id, packed=packed)

    def synthetic_batch(self, batch_size: int, seed: int = 0) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        b, length = batch_size, self.max_token_len
        tokens = np.zeros((b, length), np.int32)
        mask = np.zeros((b, length), bool)
        text_vocab = min(self.llm.vocab_size, self.image_token_id)
        lo, hi = self.synthetic_text_tokens
        for i in range(b):  # template/task text split around the image block(s), as in the Eagle prompt
            n_text = int(rng.integers(lo, hi + 1))
            n_before = min(n_text // 2, 16)
            blocks = []
            for _ in self.camera_names:
                blocks += [
                    rng.integers(0, text_vocab, 1),
                    np.full(self.vision.num_patches, self.image_token_id),
                    rng.integers(0, text_vocab, 1),
                ]
            row = np.concatenate(
                [rng.integers(0, text_vocab, n_before), *blocks, rng.integers(0, text_vocab, n_text - n_before)]
            )
            tokens[i, : len(row)] = row
            mask[i, : len(row)] = True
        shape = (b, self.vision.image_size, self.vision.image_size, 3)
        return {
            "images": {c: rng.uniform(-1, 1, shape).astype(np.float32) for c in self.camera_names},
            "image_masks": {c: np.ones((b,), bool) for c in self.camera_names},
            "tokens": tokens,
            "token_mask": mask,
            "state": rng.normal(size=(b, self.max_state_dim)).astype(np.float32),
            "embodiment_id": rng.integers(0, self.action_head.max_num_embodiments, b).astype(np.int32),
            "actions": rng.normal(size=(b, self.action_horizon, self.action_dim)).astype(np.float32),
            "action_mask": np.ones((b, self.action_horizon, self.action_dim), bool),
        }


def freeze_regexes(config: Gr00tConfig) -> tuple[str, ...]:
    """Trainer freeze regexes (on "a/b/c" parameter paths) for the upstream tune_* switches.

    The VL LayerNorm, the VL adapter and the future tokens always train. With LoRA the DiT's
    base weights are frozen and only its ``lora_a``/``lora_b`` train.
    """
    patterns = []
    if not config.tune_visual:
        patterns.append(r"^backbone/eagle_model/(vision_model|mlp1)/")
    if not config.tune_llm:
        patterns.append(r"^backbone/eagle_model/language_model/")
    if not config.tune_projector:
        patterns.append(r"^action_head/(state_encoder|action_encoder|action_decoder|position_embedding)/")
    if not config.tune_diffusion_model:
        patterns.append(r"^action_head/model/")
    elif config.lora_rank:
        patterns.append(r"^action_head/model/(?!(.*/)?lora_[ab]$)")
    return tuple(patterns)
