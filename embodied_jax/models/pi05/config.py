"""The pi05 configuration: sizes, training options and the Policy contract's hooks (``policy.PolicyConfig``).

The package docstring (``models/pi05/__init__.py``) describes the model."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from embodied_jax.assets import AssetError
from embodied_jax.config_registry import register
from embodied_jax.models.gemma import GemmaConfig
from embodied_jax.models.siglip import SiglipConfig
from embodied_jax.nn.block_sparse import BlockSparseTiling
from embodied_jax.nn.compute import Compute
from embodied_jax.nn.lora import LORA_FREEZE_REGEX
from embodied_jax.policy import DatasetFeatures, PolicyConfig, check_noise_scale

GEMMA_2B = GemmaConfig(width=2048, depth=18, mlp_dim=16_384, num_heads=8, num_kv_heads=1, head_dim=256)
GEMMA_300M = GemmaConfig(width=1024, depth=18, mlp_dim=4096, num_heads=8, num_kv_heads=1, head_dim=256, use_adarms=True)
SIGLIP_SO400M = SiglipConfig(width=1152, depth=27, num_heads=16, mlp_dim=4304, patch_size=14, image_size=224)


@register
@dataclasses.dataclass(frozen=True)
class Pi05Config(PolicyConfig):
    """π0.5 sizes and training options; defaults are the published π0.5 (``lerobot/pi05_base``)."""

    vision: SiglipConfig = SIGLIP_SO400M
    vlm: GemmaConfig = GEMMA_2B
    expert: GemmaConfig = GEMMA_300M
    vocab_size: int = 257_152
    camera_names: tuple[str, ...] = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    max_token_len: int = 200
    action_horizon: int = 50
    max_action_dim: int = 32
    action_dim: int = 32  # real action dims (loss mask) when the batch has no action_dim_mask
    max_state_dim: int = 32
    num_inference_steps: int = 10
    # Sampling starts from noise drawn from N(0, noise_scale^2): 1 is the flow's own (upstream);
    # 0 starts every chunk at the flow's centre (deterministic). Training never reads it.
    noise_scale: float = 1.0
    flow_samples_per_obs: int = 1
    joint_forward: bool = False
    time_beta: tuple[float, float] = (1.5, 1.0)
    time_scale: float = 0.999
    time_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0
    # the compute settings (dtype, param_dtype, fp8, attention_impl, scan_layers, remat_policy): ``compute``
    dtype: str = "float32"  # compute dtype; "bfloat16" on GPU
    param_dtype: str = "float32"
    attention_impl: str = "auto"
    block_sparse_tiling: BlockSparseTiling | None = None  # packed rows' attention (None: the platform's)
    scan_layers: bool = True
    remat_policy: str = "none"
    fp8: str = "none"
    lora_rank: int = 0
    lora_alpha: float = 16.0
    synthetic_prompt_len: int = 0  # real prompt tokens per synthetic sample (0: a quarter of max_token_len)
    tokenizer_path: str | None = None  # local SentencePiece model (PaliGemma's tokenizer.model)
    # A training-only head reading the image tokens: it regresses a privileged feature of the
    # frame (``--data.inputs.privileged-key``; Meta-World's object and goal positions) with this
    # weight beside the flow loss, so that the vision tower learns where things are. Sampling
    # never runs it. 0: no head. The width is the dataset's (``fit_to_dataset``).
    privileged_weight: float = 0.0
    privileged_state_dim: int = 0
    asset_fields: ClassVar[tuple[str, ...]] = ("tokenizer_path",)
    # runs saved before them read back with the platform's tiling, no head and N(0, 1) noise (config_registry)
    ADDED_FIELDS = ("block_sparse_tiling", "privileged_weight", "privileged_state_dim", "noise_scale")

    def __post_init__(self):
        if not self.expert.use_adarms:
            raise ValueError("Pi05Config.expert.use_adarms must be True (π0.5 conditions the expert on time)")
        if (self.expert.cond_dim or self.expert.width) != self.expert.width:
            raise ValueError("Pi05Config.expert.cond_dim must equal expert.width (the time MLP width)")
        if self.joint_forward and self.flow_samples_per_obs != 1:
            raise ValueError("Pi05Config: joint_forward=True needs flow_samples_per_obs=1")
        if self.flow_samples_per_obs < 1:
            raise ValueError("Pi05Config: flow_samples_per_obs must be >= 1")
        if not 0 < self.action_dim <= self.max_action_dim:
            raise ValueError(f"Pi05Config: action_dim {self.action_dim} must be in 1..max_action_dim")
        if self.privileged_weight < 0 or self.privileged_state_dim < 0:
            raise ValueError("Pi05Config: privileged_weight and privileged_state_dim must be >= 0")
        check_noise_scale(self)

    @property
    def compute(self) -> Compute:
        """What every module computes with, from the six fields ``dtype`` .. ``remat_policy`` (``nn/compute.py``)."""
        return Compute.of(self)

    def fit_to_dataset(self, features: DatasetFeatures) -> Pi05Config:
        """``action_dim`` = the dataset's action width (the loss mask); state and actions must fit
        the padded widths. The image slots stay the model's (the data maps cameras onto them)."""
        if features.state_dim > self.max_state_dim:
            raise ValueError(
                f"the state has {features.state_dim} dims, more than π0.5's max_state_dim={self.max_state_dim} "
                "(--model.max-state-dim)"
            )
        if features.action_dim > self.max_action_dim:
            raise ValueError(
                f"the action has {features.action_dim} dims, more than π0.5's max_action_dim={self.max_action_dim} "
                "(the width of its action projections, fixed by pretrained weights)"
            )
        if self.privileged_weight and not features.privileged_dim:
            raise ValueError(
                f"--model.privileged-weight {self.privileged_weight}: the head needs a feature to regress; "
                "name it with --data.inputs.privileged-key KEY (Meta-World: observation.environment_state)"
            )
        return dataclasses.replace(self, action_dim=features.action_dim, privileged_state_dim=features.privileged_dim)

    @property
    def trains_privileged_head(self) -> bool:
        return self.privileged_weight > 0

    def freeze_regexes(self) -> tuple[str, ...]:
        """Trainer freeze regexes: with LoRA (``lora_rank`` > 0) only ``lora_a``/``lora_b`` train."""
        return (LORA_FREEZE_REGEX,) if self.lora_rank else ()

    def action_expert_regexes(self) -> tuple[str, ...]:
        """The action expert: its Gemma stream (expert 1 of the joint layers, its final norm), the
        action and time projections; the vision tower, the projector and the VLM's stream are not."""
        return (r"^llm/(layers/experts|final_norms)/1/", r"^(action_in_proj|action_out_proj|time_mlp_in|time_mlp_out)/")

    @property
    def image_token_id(self) -> int:
        """Image-token id in packed token streams: PaliGemma's ``<image>``, just past the vocabulary."""
        return self.vocab_size

    @property
    def max_prefix_len(self) -> int:
        """The longest prefix of one sample: every camera's image tokens and a full prompt."""
        return len(self.camera_names) * self.vision.num_patches + self.max_token_len

    def input_builder(self, packed: bool = False):
        """The per-sample input builder (prompt with discrete state, images, padded actions);
        ``packed``: variable-length samples for ``data/packing.py``."""
        from embodied_jax.models.pi05.inputs import Pi05InputBuilder

        if self.tokenizer_path is None:
            raise AssetError(
                "model.tokenizer_path is not set: give --model.tokenizer-path (PaliGemma's tokenizer.model) "
                "or --init-from weights that carry one"
            )
        size = self.vision.image_size
        return Pi05InputBuilder(
            tokenizer_path=self.tokenizer_path,
            camera_names=self.camera_names,
            image_size=tuple(size) if isinstance(size, (tuple, list)) else (size, size),
            max_token_len=self.max_token_len,
            max_state_dim=self.max_state_dim,
            max_action_dim=self.max_action_dim,
            packed=packed,
            image_tokens=self.vision.num_patches,
            image_token_id=self.image_token_id,
        )

    def synthetic_batch(self, batch_size: int, seed: int = 0) -> dict[str, Any]:
        from embodied_jax.models.pi05.inputs import synthetic_pi05_batch

        return synthetic_pi05_batch(self, batch_size, seed)
