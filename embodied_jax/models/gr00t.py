"""GR00T-N1.5 policy: config, flow-matching loss and sampling, freezing (the attention layout of
unpacked and packed batches: ``gr00t_layout.py``).

``Gr00tPolicy`` = ``backbone`` (Eagle 2.5: SigLIP + ``mlp1`` + truncated Qwen3) and
``action_head`` (VL LayerNorm + adapter, embodiment-specific encoders/decoder, DiT).

Flow matching as upstream: t = (s - Beta(a, b)) / s with (a, b) = ``time_beta`` = (1.5, 1) and
s = ``time_scale`` = 0.999 (t = 0 noise, t = 1 data), x_t = (1 - t) noise + t actions,
target = actions - noise, timestep bucket floor(1000 t) for the DiT and the action encoder,
MSE masked by ``action_mask``.
Sampling: backbone + adapter once, K Euler steps (bucket int(k / K * 1000)) of the DiT.

Batch (DESIGN.md observation + training keys):
  ``images`` {camera: [B, H, W, 3] in [-1, 1]} (cameras in ``Gr00tConfig.camera_names`` order),
  ``tokens`` int32 [B, L], ``token_mask`` bool [B, L] (the prompt from ``gr00t_inputs``),
  ``state`` [B, max_state_dim], ``embodiment_id`` int32 [B], ``actions`` [B, horizon,
  action_dim], ``action_mask`` [B, horizon, action_dim] (optional; all ones).
Packed rows (``data/packing.py``, ``mask_vl_padding=True`` only): ``tokens``, ``segment_ids``,
``positions`` [R, L] hold up to M samples per row (each sample's own cameras only),
``images`` [R, I, H, W, 3] with ``image_segment_ids`` [R, I], and the per-sample values
``state``, ``actions``, ``action_mask``, ``embodiment_id`` stacked [R, M, ...] with
``sample_mask`` [R, M]. The action head runs on the R·M sample slots (empty ones carry no
loss); the LLM and the adapter use block-sparse attention within each sample's segment and
the DiT cross-attends only a window of ``max_token_len`` tokens at its sample's segment.

``image_masks`` are not used: upstream GR00T has no missing-camera masking (every camera's
image-context tokens are filled from its image).

``mask_vl_padding=False`` reproduces upstream exactly: the LLM masks padded keys (padded
query rows still attend the real tokens before them, as HF does) while the VL adapter and
the DiT cross-attention attend every VL token, padding included.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.assets import AssetError
from embodied_jax.config_registry import register
from embodied_jax.models.dit import DiTConfig, VLSelfAttentionConfig
from embodied_jax.models.eagle import EagleBackbone, EagleConfig
from embodied_jax.models.gr00t_action_head import ActionHeadConfig, Gr00tActionHead
from embodied_jax.models.gr00t_layout import vl_layout
from embodied_jax.models.qwen3 import Qwen3Config
from embodied_jax.models.siglip import SiglipConfig
from embodied_jax.nn import flow, rtc
from embodied_jax.nn.block_sparse import BlockSparseTiling
from embodied_jax.nn.lora import LoRAConfig
from embodied_jax.policy import DatasetFeatures, PolicyConfig

PER_SAMPLE_KEYS = ("state", "actions", "action_mask", "embodiment_id")

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
    num_timestep_buckets: int = 1000
    time_beta: tuple[float, float] = (1.5, 1.0)  # flow-matching time t = (time_scale - Beta(*time_beta)) / time_scale
    time_scale: float = 0.999
    mask_vl_padding: bool = True  # False: upstream's adapter and DiT attend padded VL tokens too
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
    # Runs saved before these fields read back with 1 draw and the platform's tiling (config_registry).
    ADDED_FIELDS = ("flow_samples_per_obs", "block_sparse_tiling")

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

    def make(self, rngs: nnx.Rngs) -> Gr00tPolicy:
        return Gr00tPolicy(self, rngs=rngs)

    def freeze_regexes(self) -> tuple[str, ...]:
        return freeze_regexes(self)

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
        from embodied_jax.models.gr00t_inputs import Gr00tInputBuilder

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

    def training_flops(self, batch) -> dict[str, float]:
        """Analytic training FLOPs of one step on ``batch`` (NumPy; unpacked or packed rows):
        ``weights`` (weight matmuls of every token the batch carries, padding included) and
        ``attention`` (q·k and p·v: dense over an unpacked row, per sample in packed rows;
        the DiT cross-attends its sample's window). Frozen modules before every trainable
        one run forward only (``tune_*``)."""
        from embodied_jax.nn import flops

        llm, head = self.llm, self.action_head
        dit, vl = head.dit, head.vl_self_attention
        tokens = np.asarray(batch["tokens"])
        rows, length = tokens.shape
        patches = self.vision.num_patches
        if "segment_ids" in batch:
            seg = np.asarray(batch["segment_ids"])
            images = rows * int(np.asarray(batch["images"]).shape[1])
            slots = int(np.asarray(batch["sample_mask"]).size)
            pairs = sum(flops.attention_pairs(np.bincount(r[r > 0])[1:].tolist()) for r in seg)
            window = min(length, self.max_token_len)
        else:
            images, slots = rows * len(self.camera_names), rows
            pairs = rows * flops.attention_pairs((), dense_length=length)
            window = length
        vl_tokens = rows * length
        dit_tokens = 1 + head.num_future_tokens + self.action_horizon
        inner = dit.inner_dim
        weights, attention = flops.Tally(), flops.Tally()
        weights.add(
            flops.siglip(self.vision, images) + 2 * images * patches * self.vision.width * llm.width,
            trains=self.tune_visual,
        )
        attention.add(0.0, trains=self.tune_visual)
        llm_dims = dict(width=llm.width, heads=llm.num_heads, kv_heads=llm.num_kv_heads, head_dim=llm.head_dim)
        weights.add(
            self.select_layer * flops.transformer_layer(vl_tokens, 0, mlp_dim=llm.mlp_dim, gated=True, **llm_dims),
            trains=self.tune_llm,
        )
        attention.add(self.select_layer * 4 * pairs * llm.num_heads * llm.head_dim, trains=self.tune_llm)
        vl_dims = dict(width=llm.width, heads=vl.num_heads, kv_heads=vl.num_heads, head_dim=vl.head_dim)
        weights.add(
            vl.num_layers * flops.transformer_layer(vl_tokens, 0, mlp_dim=4 * llm.width, gated=False, **vl_dims),
            trains=True,
        )
        attention.add(vl.num_layers * 4 * pairs * vl.num_heads * vl.head_dim, trains=True)
        dit_dims = dict(
            width=inner,
            heads=dit.num_heads,
            kv_heads=dit.num_heads,
            head_dim=dit.head_dim,
            mlp_dim=4 * inner,
            gated=False,
        )
        cross = dit.num_layers // 2 if dit.interleave_self_attention else dit.num_layers
        draws = slots * self.flow_samples_per_obs  # the DiT runs once per (slot, flow draw)
        tokens_dit = draws * dit_tokens
        # cross-attention keys/values are projected once per VL token of a row (upstream: per sample);
        # with several flow draws, once per draw of each sample's tokens (its window when packed)
        if self.flow_samples_per_obs == 1:
            context_tokens = vl_tokens
        else:
            context_tokens = draws * window if "segment_ids" in batch else vl_tokens * self.flow_samples_per_obs
        dit_flops = cross * flops.transformer_layer(
            tokens_dit, 0, context_tokens=context_tokens, context_width=llm.width, **dit_dims
        ) + (dit.num_layers - cross) * flops.transformer_layer(tokens_dit, 0, **dit_dims)
        hidden, emb = head.hidden_size, head.input_embedding_dim
        head_flops = 2 * slots * (self.max_state_dim * hidden + hidden * emb)  # state encoder, once per slot
        head_flops += (
            2
            * draws
            * self.action_horizon
            * (self.action_dim * emb + 3 * emb**2 + hidden * hidden + hidden * self.action_dim)
        )
        head_flops += 2 * draws * inner * 2 * inner * (dit.num_layers + 1)  # AdaLayerNorms and proj_out_1, per draw
        weights.add(dit_flops + head_flops, trains=self.tune_diffusion_model or self.tune_projector)
        attention.add(
            4
            * draws
            * dit_tokens
            * (cross * window + (dit.num_layers - cross) * dit_tokens)
            * dit.num_heads
            * dit.head_dim,
            trains=self.tune_diffusion_model,
        )
        return {"weights": weights.total, "attention": attention.total}

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


def _dtype(name: str):
    return jnp.dtype(name)


class Gr00tPolicy(nnx.Module):
    def __init__(self, config: Gr00tConfig, *, rngs: nnx.Rngs):
        self.config = config
        # one source for what every module shares: precision, attention kernel, layer stacking
        common = dict(
            dtype=_dtype(config.dtype),
            param_dtype=_dtype(config.param_dtype),
            fp8=config.fp8,
            attention_impl=config.attention_impl,
            scan_layers=config.scan_layers,
            remat_policy=config.remat_policy,
            rngs=rngs,
        )
        self.backbone = EagleBackbone(config.eagle_config(), **common)
        lora = LoRAConfig(config.lora_rank, config.lora_alpha) if config.lora_rank else None
        self.action_head = Gr00tActionHead(
            config.action_head,
            action_dim=config.action_dim,
            max_state_dim=config.max_state_dim,
            backbone_width=config.llm.width,
            lora=lora,
            **common,
        )

    # ----- VL side
    def _images(self, obs):
        """[R, k, H, W, 3]: a packed row's image slots, or an unpacked sample's cameras."""
        images = obs["images"]
        if not isinstance(images, dict):
            return jnp.asarray(images)
        names = self.config.camera_names
        missing = [c for c in names if c not in images]
        if missing:
            raise KeyError(f"observation['images'] lacks cameras {missing}; Gr00tConfig.camera_names {names}")
        return jnp.stack([jnp.asarray(images[c]) for c in names], axis=1)

    def vl_features(self, obs, key=None):
        """Adapter output [R, S, D] and the per-sample attention layout for the DiT."""
        layout = vl_layout(self.config, obs)
        features = self.backbone(
            self._images(obs),
            layout["tokens"],
            layout["positions"],
            layout["llm_q"],
            layout["llm_kv"],
            causal_blocks=layout["causal"],
            bounds=layout["bounds"],
        )
        features = self.action_head.process_backbone_output(features, layout["adapter"], key, layout["bounds"])
        return features, layout

    @staticmethod
    def per_sample(batch) -> tuple[dict[str, jax.Array], jax.Array]:
        """The action-side values one per sample slot ([R·M, ...] for packed rows) and each slot's
        presence (float32; all ones unpacked)."""
        out = {k: jnp.asarray(batch[k]) for k in PER_SAMPLE_KEYS if k in batch}
        if "sample_mask" not in batch:
            return out, jnp.ones(jnp.asarray(batch["embodiment_id"]).shape[:1], jnp.float32)
        present = jnp.asarray(batch["sample_mask"], bool)
        flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in out.items()}
        return flat, present.reshape(-1).astype(jnp.float32)

    # ----- flow matching
    def sample_time(self, key, batch_size: int):
        alpha, beta = self.config.time_beta
        s = self.config.time_scale
        return (s - jax.random.beta(key, alpha, beta, (batch_size,))) / s

    def per_sample_losses(self, batch, rng, *, noise=None, time=None, dropout: bool = True):
        """(per-sample masked squared-error sums [N], per-sample mask counts [N]); N = R·M slots for
        packed rows (an empty slot counts 0). With K = ``flow_samples_per_obs`` the backbone and
        the VL adapter run once and the DiT K times per slot, and both sums add over the K draws;
        explicit ``noise`` is [N, horizon, A] or [N, K, horizon, A], ``time`` [N] or [N, K].

        ``dropout=False`` turns off the DiT/adapter dropout (deterministic evaluation). As upstream,
        a frozen DiT (``tune_diffusion_model=False``) runs without dropout (eval mode)."""
        samples, present = self.per_sample(batch)
        actions = samples["actions"].astype(jnp.float32)
        n, horizon, adim = actions.shape
        k = self.config.flow_samples_per_obs
        k_noise, k_time, k_adapter, k_dit = jax.random.split(rng, 4)
        head_config = self.config.action_head
        train_dropout = dropout and (head_config.dit.dropout > 0 or head_config.vl_self_attention.dropout > 0)
        if noise is None:
            noise = jax.random.normal(k_noise, (n * k, horizon, adim))
        noise = jnp.asarray(noise, jnp.float32).reshape(n * k, horizon, adim)
        t = self.sample_time(k_time, n * k) if time is None else jnp.asarray(time, jnp.float32).reshape(n * k)
        vl, layout = self.vl_features(batch, k_adapter if train_dropout else None)
        slots = samples["embodiment_id"].astype(jnp.int32)
        head = self.action_head
        state_features = head.encode_state(samples["state"].astype(jnp.float32), slots)
        # Draw j of slot i is row i·K + j; the DiT of every draw cross-attends its slot's VL tokens.
        draws = functools.partial(jnp.repeat, repeats=k, axis=0)
        if k > 1:
            if layout["context_gather"] is not None:  # packed rows: each slot's window, then its draws
                rows, index = layout["context_gather"]
                vl, layout = vl[rows[:, None], index], {**layout, "context_gather": None}
            vl = draws(vl)
            layout = {**layout, "dit_q": draws(layout["dit_q"]), "dit_kv": draws(layout["dit_kv"])}
            actions, state_features, slots = draws(actions), draws(state_features), draws(slots)
        x_t = (1.0 - t[:, None, None]) * noise + t[:, None, None] * actions
        buckets = jnp.floor(t * self.config.num_timestep_buckets).astype(jnp.int32)
        velocity = head.velocity(
            state_features,
            x_t,
            buckets,
            slots,
            vl,
            q_segment_ids=layout["dit_q"],
            kv_segment_ids=layout["dit_kv"],
            context_gather=layout["context_gather"],
            key=k_dit if train_dropout and self.config.tune_diffusion_model else None,
        )
        mask = samples.get("action_mask", jnp.ones((n, horizon, adim))).astype(jnp.float32) * present[:, None, None]
        sq = jnp.square(velocity - (actions - noise)).reshape(n, k, horizon, adim) * mask[:, None]
        return sq.sum(axis=(1, 2, 3)), k * mask.sum(axis=(1, 2))

    def velocity(self, observation, noisy_actions, time):
        """The DiT's velocity prediction [B, horizon, action_dim] at x_t = ``noisy_actions``, t = ``time`` [B]."""
        vl, layout = self.vl_features(observation)
        slots = jnp.asarray(observation["embodiment_id"], jnp.int32)
        head = self.action_head
        state_features = head.encode_state(jnp.asarray(observation["state"], jnp.float32), slots)
        buckets = jnp.floor(jnp.asarray(time, jnp.float32) * self.config.num_timestep_buckets).astype(jnp.int32)
        return head.velocity(
            state_features,
            jnp.asarray(noisy_actions, jnp.float32),
            buckets,
            slots,
            vl,
            q_segment_ids=layout["dit_q"],
            kv_segment_ids=layout["dit_kv"],
            context_gather=layout["context_gather"],
        )

    def loss(self, batch, rng, *, noise=None, time=None):
        errors, counts = self.per_sample_losses(batch, rng, noise=noise, time=time)
        loss = errors.sum() / jnp.maximum(counts.sum(), 1.0)
        seg = batch["segment_ids"] if "segment_ids" in batch else batch["token_mask"]
        tokens = jnp.sum(jnp.asarray(seg) > 0)
        examples = (
            jnp.sum(jnp.asarray(batch["sample_mask"]), dtype=jnp.int32)
            if "sample_mask" in batch
            else jnp.int32(errors.shape[0])
        )
        return loss, {"loss": loss, "tokens": tokens, "examples": examples}

    def sample_actions(
        self,
        observation,
        rng,
        *,
        num_steps=None,
        noise=None,
        prefix_actions=None,
        prefix_weights=None,
        max_guidance=5.0,
        trace=False,
    ):
        """Actions [B, horizon, action_dim]: Euler from t=0 (noise) to t=1 (actions) (``nn/flow.py``).

        Real-time chunking (``nn/rtc.py``): ``prefix_actions`` [B, horizon, action_dim] (normalised, usually the
        previous chunk shifted by the executed steps) guide the chunk towards them with ``prefix_weights``
        [horizon] or [B, horizon] and maximum guidance weight ``max_guidance``, through the clean estimate
        x_t + (1 - t)·v; steps of weight 1 are returned as the prefix. None: plain sampling. ``trace``: a
        ``flow.FlowTrace`` with every step's state and velocity."""
        config = self.config
        k = int(num_steps or config.num_inference_steps)
        b = jnp.asarray(observation["embodiment_id"]).shape[0]
        shape = (b, config.action_horizon, config.action_dim)
        x = jax.random.normal(rng, shape) if noise is None else jnp.asarray(noise, jnp.float32)
        vl, layout = self.vl_features(observation)
        slots = jnp.asarray(observation["embodiment_id"], jnp.int32)
        state_features = self.action_head.encode_state(jnp.asarray(observation["state"], jnp.float32), slots)
        # upstream: int(k / K * num_timestep_buckets) in Python floats
        buckets = jnp.asarray(np.array([int(i / k * config.num_timestep_buckets) for i in range(k)], np.int32))
        dt = jnp.float32(1.0 / k)
        schedule = flow.FlowSchedule(times=jnp.arange(k, dtype=jnp.float32) * dt, dt=dt, clean_time=1.0)

        def velocity(head, x, i):  # head: the action head, rebuilt inside the loop (nn/traced.py)
            return head.velocity(
                state_features,
                x,
                jnp.full((b,), buckets[i]),
                slots,
                vl,
                q_segment_ids=layout["dit_q"],
                kv_segment_ids=layout["dit_kv"],
                context_gather=layout["context_gather"],
            )

        guidance = None
        if prefix_actions is None:
            rtc.check_unguided(prefix_weights)
        else:
            y, w = rtc.guidance_inputs(
                prefix_actions, prefix_weights, batch=b, horizon=config.action_horizon, width=config.action_dim
            )
            guidance = flow.Guidance(y, w, max_guidance)
        return flow.sample(self.action_head, velocity, x, schedule, guidance=guidance, trace=trace)
