"""GR00T-N1.5 policy: config, flow-matching loss and sampling, VL masking/packing, freezing.

``Gr00tPolicy`` = ``backbone`` (Eagle 2.5: SigLIP + ``mlp1`` + truncated Qwen3) and
``action_head`` (VL LayerNorm + adapter, embodiment-specific encoders/decoder, DiT).

Flow matching as upstream: t = (s - Beta(1.5, 1)) / s with s = 0.999 (t = 0 noise, t = 1
data), x_t = (1 - t) noise + t actions, target = actions - noise, timestep bucket
floor(1000 t) for the DiT and the action encoder, MSE masked by ``action_mask``.
Sampling: backbone + adapter once, K Euler steps (bucket int(k / K * 1000)) of the DiT.

Batch (DESIGN.md observation + training keys):
  ``images`` {camera: [B, H, W, 3] in [-1, 1]} (cameras in ``Gr00tConfig.cameras`` order),
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.models.dit import DiTConfig, VLSelfAttentionConfig
from embodied_jax.models.eagle import EagleBackbone, EagleConfig
from embodied_jax.models.gr00t_action_head import ActionHeadConfig, Gr00tActionHead
from embodied_jax.models.qwen3 import Qwen3Config
from embodied_jax.models.siglip import SiglipConfig
from embodied_jax.nn.block_sparse import SegmentBounds
from embodied_jax.nn.lora import LoRAConfig

PACKED_KEYS = ("segment_ids", "positions", "images", "image_segment_ids", "sample_mask")
PER_SAMPLE_KEYS = ("state", "actions", "action_mask", "embodiment_id")


@dataclasses.dataclass(frozen=True)
class Gr00tConfig:
    # Eagle 2.5 vision tower (SigLIP so400m/14 at 224: 256 tokens per image)
    image_size: int = 224
    patch_size: int = 14
    vision_width: int = 1152
    vision_layers: int = 27
    vision_heads: int = 16
    vision_mlp_dim: int = 4304
    vision_eps: float = 1e-6
    cameras: tuple[str, ...] = ("ego_view",)
    # Qwen3-1.7B, truncated to its first ``select_layer`` layers
    llm_width: int = 2048
    llm_layers: int = 28
    select_layer: int = 12
    llm_heads: int = 16
    llm_kv_heads: int = 8
    llm_head_dim: int = 128
    llm_mlp_dim: int = 6144
    vocab_size: int = 151680
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    image_token_id: int = 151669
    max_token_len: int = 320
    # action head
    action_dim: int = 32
    action_horizon: int = 16
    max_state_dim: int = 64
    hidden_size: int = 1024
    input_embedding_dim: int = 1536
    max_num_embodiments: int = 32
    num_future_tokens: int = 32
    max_seq_len: int = 1024
    dit_layers: int = 16
    dit_heads: int = 32
    dit_head_dim: int = 48
    dit_output_dim: int = 1024
    dit_dropout: float = 0.2
    interleave_self_attention: bool = True
    vl_layers: int = 4
    vl_heads: int = 32
    vl_head_dim: int = 64
    vl_dropout: float = 0.2
    # flow matching
    num_inference_steps: int = 4
    num_timestep_buckets: int = 1000
    noise_beta_alpha: float = 1.5
    noise_beta_beta: float = 1.0
    noise_s: float = 0.999
    mask_vl_padding: bool = True
    # precision and performance
    param_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    fp8: str = "none"
    attention_impl: str = "auto"
    scan_layers: bool = True
    remat_policy: str = "none"
    # freezing (upstream finetune defaults) and LoRA on the DiT
    tune_visual: bool = False
    tune_llm: bool = False
    tune_projector: bool = True
    tune_diffusion_model: bool = True
    lora_rank: int = 0
    lora_alpha: float = 16.0
    # synthetic batches: range of text tokens (template + task) around the image block(s)
    synthetic_text_tokens: tuple[int, int] = (24, 38)
    # input builder (real datasets): local Qwen3 tokenizer.json and the embodiment slot of the
    # data (upstream's "new_embodiment" = 31 for finetuning on a new robot)
    tokenizer_path: str | None = None
    embodiment_id: int = 31

    def __post_init__(self):
        if not 1 <= self.select_layer <= self.llm_layers:
            raise ValueError(f"Gr00tConfig.select_layer={self.select_layer} must be in [1, llm_layers="
                             f"{self.llm_layers}]")
        if self.image_token_id >= self.vocab_size:
            raise ValueError(f"Gr00tConfig.image_token_id={self.image_token_id} >= vocab_size={self.vocab_size}")
        lo, hi = self.synthetic_text_tokens
        if not 2 <= lo <= hi:
            raise ValueError(f"Gr00tConfig.synthetic_text_tokens={self.synthetic_text_tokens} must be 2 <= lo <= hi")
        if self.max_token_len < self.image_block_tokens + hi:
            raise ValueError(f"Gr00tConfig.max_token_len={self.max_token_len} is shorter than the image blocks "
                             f"({self.image_block_tokens}) plus {hi} text tokens")

    # ----- derived sub-configs
    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_block_tokens(self) -> int:
        """``<img>`` + image tokens + ``</img>`` for every camera."""
        return len(self.cameras) * (self.image_tokens + 2)

    def eagle_config(self) -> EagleConfig:
        vision = SiglipConfig(
            image_size=self.image_size, patch_size=self.patch_size, width=self.vision_width,
            depth=self.vision_layers, num_heads=self.vision_heads, mlp_dim=self.vision_mlp_dim,
            layer_norm_eps=self.vision_eps,
        )
        llm = Qwen3Config(
            width=self.llm_width, num_layers=self.select_layer, num_heads=self.llm_heads,
            num_kv_heads=self.llm_kv_heads, head_dim=self.llm_head_dim, mlp_dim=self.llm_mlp_dim,
            vocab_size=self.vocab_size, rope_theta=self.rope_theta, eps=self.rms_eps,
        )
        return EagleConfig(vision=vision, llm=llm, image_token_id=self.image_token_id)

    def action_head_config(self) -> ActionHeadConfig:
        return ActionHeadConfig(
            action_dim=self.action_dim, action_horizon=self.action_horizon, max_state_dim=self.max_state_dim,
            hidden_size=self.hidden_size, input_embedding_dim=self.input_embedding_dim,
            backbone_embedding_dim=self.llm_width, max_num_embodiments=self.max_num_embodiments,
            num_future_tokens=self.num_future_tokens, max_seq_len=self.max_seq_len,
            num_timestep_buckets=self.num_timestep_buckets,
            dit=DiTConfig(
                num_layers=self.dit_layers, num_heads=self.dit_heads, head_dim=self.dit_head_dim,
                output_dim=self.dit_output_dim, cross_attention_dim=self.llm_width,
                interleave_self_attention=self.interleave_self_attention, dropout=self.dit_dropout,
            ),
            vl_self_attention=VLSelfAttentionConfig(
                num_layers=self.vl_layers, num_heads=self.vl_heads, head_dim=self.vl_head_dim,
                dropout=self.vl_dropout,
            ),
        )

    def make(self, rngs: nnx.Rngs) -> "Gr00tPolicy":
        return Gr00tPolicy(self, rngs=rngs)

    def freeze_regexes(self) -> tuple[str, ...]:
        return freeze_regexes(self)

    def input_builder(self, packed: bool = False):
        """The per-sample input builder (Eagle prompt, images, padded state/actions, embodiment id);
        ``packed``: variable-length samples (only the cameras a sample has) for ``data/packing.py``."""
        from embodied_jax.models.gr00t_inputs import Gr00tInputBuilder

        if self.tokenizer_path is None:
            raise ValueError("Gr00tConfig.tokenizer_path: set it to a local Qwen3 tokenizer.json")
        if not 0 <= self.embodiment_id < self.max_num_embodiments:
            raise ValueError(f"Gr00tConfig.embodiment_id={self.embodiment_id} must be in [0, max_num_embodiments="
                             f"{self.max_num_embodiments})")
        return Gr00tInputBuilder.for_config(self, self.tokenizer_path, embodiment_id=self.embodiment_id,
                                            packed=packed)

    def training_flops(self, batch) -> dict[str, float]:
        """Analytic training FLOPs of one step on ``batch`` (NumPy; unpacked or packed rows):
        ``weights`` (weight matmuls of every token the batch carries, padding included) and
        ``attention`` (q·k and p·v: dense over an unpacked row, per sample in packed rows;
        the DiT cross-attends its sample's window). Frozen modules before every trainable
        one run forward only (``tune_*``)."""
        from embodied_jax.nn import flops

        tokens = np.asarray(batch["tokens"])
        rows, length = tokens.shape
        patches = self.image_tokens
        if "segment_ids" in batch:
            seg = np.asarray(batch["segment_ids"])
            images = rows * int(np.asarray(batch["images"]).shape[1])
            slots = int(np.asarray(batch["sample_mask"]).size)
            pairs = sum(flops.attention_pairs(np.bincount(r[r > 0])[1:].tolist()) for r in seg)
            window = min(length, self.max_token_len)
        else:
            images, slots = rows * len(self.cameras), rows
            pairs = rows * flops.attention_pairs((), dense_length=length)
            window = length
        vl_tokens = rows * length
        dit_tokens = 1 + self.num_future_tokens + self.action_horizon
        inner = self.dit_heads * self.dit_head_dim
        vision = self.eagle_config().vision
        weights, attention = flops.Tally(), flops.Tally()
        weights.add(flops.siglip(vision, images) + 2 * images * patches * self.vision_width * self.llm_width,
                    trains=self.tune_visual)
        attention.add(0.0, trains=self.tune_visual)
        llm = dict(width=self.llm_width, heads=self.llm_heads, kv_heads=self.llm_kv_heads, head_dim=self.llm_head_dim)
        weights.add(self.select_layer * flops.transformer_layer(vl_tokens, 0, mlp_dim=self.llm_mlp_dim, gated=True,
                                                                **llm), trains=self.tune_llm)
        attention.add(self.select_layer * 4 * pairs * self.llm_heads * self.llm_head_dim, trains=self.tune_llm)
        vl = dict(width=self.llm_width, heads=self.vl_heads, kv_heads=self.vl_heads, head_dim=self.vl_head_dim)
        weights.add(self.vl_layers * flops.transformer_layer(vl_tokens, 0, mlp_dim=4 * self.llm_width, gated=False,
                                                             **vl), trains=True)
        attention.add(self.vl_layers * 4 * pairs * self.vl_heads * self.vl_head_dim, trains=True)
        dit = dict(width=inner, heads=self.dit_heads, kv_heads=self.dit_heads, head_dim=self.dit_head_dim,
                   mlp_dim=4 * inner, gated=False)
        cross = self.dit_layers // 2 if self.interleave_self_attention else self.dit_layers
        tokens_dit = slots * dit_tokens
        # cross-attention keys/values are projected once per VL token of a row (upstream: per sample)
        dit_flops = (cross * flops.transformer_layer(tokens_dit, 0, context_tokens=vl_tokens,
                                                     context_width=self.llm_width, **dit)
                     + (self.dit_layers - cross) * flops.transformer_layer(tokens_dit, 0, **dit))
        head = 2 * slots * (self.max_state_dim * self.hidden_size + self.hidden_size * self.input_embedding_dim
                            + self.action_horizon * (self.action_dim * self.input_embedding_dim
                                                     + 3 * self.input_embedding_dim ** 2
                                                     + self.hidden_size * self.hidden_size
                                                     + self.hidden_size * self.action_dim))
        head += 2 * slots * inner * 2 * inner * (self.dit_layers + 1)  # AdaLayerNorms and proj_out_1, per sample
        weights.add(dit_flops + head, trains=self.tune_diffusion_model or self.tune_projector)
        attention.add(4 * slots * dit_tokens * (cross * window + (self.dit_layers - cross) * dit_tokens)
                      * self.dit_heads * self.dit_head_dim, trains=self.tune_diffusion_model)
        return {"weights": weights.total, "attention": attention.total}

    def synthetic_batch(self, batch_size: int, seed: int = 0) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        b, length = batch_size, self.max_token_len
        tokens = np.zeros((b, length), np.int32)
        mask = np.zeros((b, length), bool)
        text_vocab = min(self.vocab_size, self.image_token_id)
        lo, hi = self.synthetic_text_tokens
        for i in range(b):  # template/task text split around the image block(s), as in the Eagle prompt
            n_text = int(rng.integers(lo, hi + 1))
            n_before = min(n_text // 2, 16)
            blocks = []
            for _ in self.cameras:
                blocks += [rng.integers(0, text_vocab, 1), np.full(self.image_tokens, self.image_token_id),
                           rng.integers(0, text_vocab, 1)]
            row = np.concatenate([rng.integers(0, text_vocab, n_before), *blocks,
                                  rng.integers(0, text_vocab, n_text - n_before)])
            tokens[i, : len(row)] = row
            mask[i, : len(row)] = True
        shape = (b, self.image_size, self.image_size, 3)
        return {
            "images": {c: rng.uniform(-1, 1, shape).astype(np.float32) for c in self.cameras},
            "image_masks": {c: np.ones((b,), bool) for c in self.cameras},
            "tokens": tokens,
            "token_mask": mask,
            "state": rng.normal(size=(b, self.max_state_dim)).astype(np.float32),
            "embodiment_id": rng.integers(0, self.max_num_embodiments, b).astype(np.int32),
            "actions": rng.normal(size=(b, self.action_horizon, self.action_dim)).astype(np.float32),
            "action_mask": np.ones((b, self.action_horizon, self.action_dim), bool),
        }


def freeze_regexes(cfg: Gr00tConfig) -> tuple[str, ...]:
    """Trainer freeze regexes (on "a/b/c" parameter paths) for the upstream tune_* switches.

    The VL LayerNorm, the VL adapter and the future tokens always train. With LoRA the DiT's
    base weights are frozen and only its ``lora_a``/``lora_b`` train.
    """
    patterns = []
    if not cfg.tune_visual:
        patterns.append(r"^backbone/eagle_model/(vision_model|mlp1)/")
    if not cfg.tune_llm:
        patterns.append(r"^backbone/eagle_model/language_model/")
    if not cfg.tune_projector:
        patterns.append(r"^action_head/(state_encoder|action_encoder|action_decoder|position_embedding)/")
    if not cfg.tune_diffusion_model:
        patterns.append(r"^action_head/model/")
    elif cfg.lora_rank:
        patterns.append(r"^action_head/model/(?!(.*/)?lora_[ab]$)")
    return tuple(patterns)


def _dtype(name: str):
    return jnp.dtype(name)


class Gr00tPolicy(nnx.Module):
    def __init__(self, cfg: Gr00tConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        common = dict(dtype=_dtype(cfg.compute_dtype), param_dtype=_dtype(cfg.param_dtype), fp8=cfg.fp8,
                      attention_impl=cfg.attention_impl, scan_layers=cfg.scan_layers,
                      remat_policy=cfg.remat_policy, rngs=rngs)
        self.backbone = EagleBackbone(cfg.eagle_config(), **common)
        lora = LoRAConfig(cfg.lora_rank, cfg.lora_alpha) if cfg.lora_rank else None
        self.action_head = Gr00tActionHead(cfg.action_head_config(), lora=lora, **common)

    # ----- VL side
    def _vl_layout(self, obs):
        """Segment ids and positions for the LLM, the adapter and the DiT cross-attention."""
        tokens = jnp.asarray(obs["tokens"], jnp.int32)
        if "segment_ids" in obs:
            return self._packed_layout(obs, tokens)
        mask = jnp.asarray(obs["token_mask"], bool)
        b, length = tokens.shape
        seg = mask.astype(jnp.int32)
        ones = jnp.ones((b, length), jnp.int32)
        base = dict(tokens=tokens, context_gather=None, bounds=None)
        if self.cfg.mask_vl_padding:
            positions = jnp.maximum(jnp.cumsum(seg, axis=1) - 1, 0)
            return dict(base, positions=positions, llm_q=seg, llm_kv=seg, causal=True, adapter=seg,
                        dit_q=jnp.ones((b,), jnp.int32), dit_kv=seg)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))  # HF: cache positions
        return dict(base, positions=positions, llm_q=ones, llm_kv=seg, causal=False, adapter=ones,
                    dit_q=jnp.ones((b,), jnp.int32), dit_kv=ones)

    def _packed_layout(self, obs, tokens):
        if not self.cfg.mask_vl_padding:
            raise ValueError("packed GR00T batches (segment_ids) need Gr00tConfig.mask_vl_padding=True")
        missing = [k for k in PACKED_KEYS if k not in obs]
        if missing:
            raise KeyError(f"packed GR00T batch lacks {missing} (needs all of {PACKED_KEYS})")
        seg = jnp.asarray(obs["segment_ids"], jnp.int32)
        present = jnp.asarray(obs["sample_mask"], bool)
        r, length = seg.shape
        m = present.shape[1]
        ids = jnp.arange(1, m + 1, dtype=jnp.int32)
        # Sample slot (row, m) cross-attends the window of its segment: it starts where segment m does.
        member = seg[:, None, :] == ids[None, :, None]  # [R, M, L]
        start = jnp.argmax(member, axis=-1).reshape(-1)
        window = min(length, self.cfg.max_token_len)
        index = jnp.minimum(start[:, None], length - window) + jnp.arange(window, dtype=jnp.int32)
        rows = jnp.repeat(jnp.arange(r, dtype=jnp.int32), m)
        dit_q = jnp.where(present, ids[None], 0).reshape(-1)
        bounds = SegmentBounds(max_segments=m, max_q_len=self.cfg.max_token_len, max_kv_len=self.cfg.max_token_len)
        return dict(tokens=tokens, positions=jnp.asarray(obs["positions"], jnp.int32), llm_q=seg, llm_kv=seg,
                    causal=True, adapter=seg, dit_q=dit_q, dit_kv=seg[rows[:, None], index],
                    context_gather=(rows, index), bounds=bounds)

    def _images(self, obs):
        """[R, k, H, W, 3]: a packed row's image slots, or an unpacked sample's cameras."""
        images = obs["images"]
        if not isinstance(images, dict):
            return jnp.asarray(images)
        missing = [c for c in self.cfg.cameras if c not in images]
        if missing:
            raise KeyError(f"observation['images'] lacks cameras {missing}; config cameras {self.cfg.cameras}")
        return jnp.stack([jnp.asarray(images[c]) for c in self.cfg.cameras], axis=1)

    def vl_features(self, obs, key=None):
        """Adapter output [R, S, D] and the per-sample attention layout for the DiT."""
        layout = self._vl_layout(obs)
        features = self.backbone(self._images(obs), layout["tokens"], layout["positions"], layout["llm_q"],
                                 layout["llm_kv"], causal_blocks=layout["causal"], bounds=layout["bounds"])
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
        beta = jax.random.beta(key, self.cfg.noise_beta_alpha, self.cfg.noise_beta_beta, (batch_size,))
        return (self.cfg.noise_s - beta) / self.cfg.noise_s

    def per_sample_losses(self, batch, rng, *, noise=None, time=None, dropout: bool = True):
        """(per-sample masked squared-error sums [N], per-sample mask counts [N]); N = R·M slots for
        packed rows (an empty slot counts 0), explicit ``noise`` [N, horizon, A] / ``time`` [N].

        ``dropout=False`` turns off the DiT/adapter dropout (deterministic evaluation). As upstream,
        a frozen DiT (``tune_diffusion_model=False``) runs without dropout (eval mode)."""
        samples, present = self.per_sample(batch)
        actions = samples["actions"].astype(jnp.float32)
        b = actions.shape[0]
        k_noise, k_time, k_adapter, k_dit = jax.random.split(rng, 4)
        train_dropout = dropout and (self.cfg.dit_dropout > 0 or self.cfg.vl_dropout > 0)
        noise = jax.random.normal(k_noise, actions.shape) if noise is None else jnp.asarray(noise, jnp.float32)
        t = self.sample_time(k_time, b) if time is None else jnp.asarray(time, jnp.float32).reshape(b)
        vl, layout = self.vl_features(batch, k_adapter if train_dropout else None)
        slots = samples["embodiment_id"].astype(jnp.int32)
        head = self.action_head
        state_features = head.encode_state(samples["state"].astype(jnp.float32), slots)
        x_t = (1.0 - t[:, None, None]) * noise + t[:, None, None] * actions
        buckets = jnp.floor(t * self.cfg.num_timestep_buckets).astype(jnp.int32)
        velocity = head.velocity(state_features, x_t, buckets, slots, vl, q_segment_ids=layout["dit_q"],
                                 kv_segment_ids=layout["dit_kv"], context_gather=layout["context_gather"],
                                 key=k_dit if train_dropout and self.cfg.tune_diffusion_model else None)
        mask = samples.get("action_mask", jnp.ones_like(actions)).astype(jnp.float32) * present[:, None, None]
        sq = jnp.square(velocity - (actions - noise)) * mask
        return sq.sum(axis=(1, 2)), mask.sum(axis=(1, 2))

    def velocity(self, observation, noisy_actions, time):
        """The DiT's velocity prediction [B, horizon, action_dim] at x_t = ``noisy_actions``, t = ``time`` [B]."""
        vl, layout = self.vl_features(observation)
        slots = jnp.asarray(observation["embodiment_id"], jnp.int32)
        head = self.action_head
        state_features = head.encode_state(jnp.asarray(observation["state"], jnp.float32), slots)
        buckets = jnp.floor(jnp.asarray(time, jnp.float32) * self.cfg.num_timestep_buckets).astype(jnp.int32)
        return head.velocity(state_features, jnp.asarray(noisy_actions, jnp.float32), buckets, slots, vl,
                             q_segment_ids=layout["dit_q"], kv_segment_ids=layout["dit_kv"],
                             context_gather=layout["context_gather"])

    def loss(self, batch, rng, *, noise=None, time=None):
        errors, counts = self.per_sample_losses(batch, rng, noise=noise, time=time)
        loss = errors.sum() / jnp.maximum(counts.sum(), 1.0)
        seg = batch["segment_ids"] if "segment_ids" in batch else batch["token_mask"]
        tokens = jnp.sum(jnp.asarray(seg) > 0)
        examples = (jnp.sum(jnp.asarray(batch["sample_mask"]), dtype=jnp.int32) if "sample_mask" in batch
                    else jnp.int32(errors.shape[0]))
        return loss, {"loss": loss, "tokens": tokens, "examples": examples}

    def sample_actions(self, observation, rng, *, num_steps=None, noise=None):
        cfg = self.cfg
        k = int(num_steps or cfg.num_inference_steps)
        b = jnp.asarray(observation["embodiment_id"]).shape[0]
        shape = (b, cfg.action_horizon, cfg.action_dim)
        x = jax.random.normal(rng, shape) if noise is None else jnp.asarray(noise, jnp.float32)
        vl, layout = self.vl_features(observation)
        slots = jnp.asarray(observation["embodiment_id"], jnp.int32)
        state_features = self.action_head.encode_state(jnp.asarray(observation["state"], jnp.float32), slots)
        # upstream: int(k / K * num_timestep_buckets) in Python floats
        buckets = jnp.asarray(np.array([int(i / k * cfg.num_timestep_buckets) for i in range(k)], np.int32))
        dt = jnp.float32(1.0 / k)
        graphdef, state = nnx.split(self.action_head)

        def step(i, carry):  # the head's state rides in the carry so NNX sees it at the loop's trace level
            x, head_state = carry
            head = nnx.merge(graphdef, head_state)
            v = head.velocity(state_features, x, jnp.full((b,), buckets[i]), slots, vl,
                              q_segment_ids=layout["dit_q"], kv_segment_ids=layout["dit_kv"],
                              context_gather=layout["context_gather"])
            return x + dt * v, head_state

        return jax.lax.fori_loop(0, k, step, (x, state))[0]
