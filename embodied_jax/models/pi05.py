"""π0.5 (openpi / LeRobot ``PI05Policy``) as a Flax NNX Policy, with prefix reuse and packing.

Architecture: SigLIP tower + linear projector embed each camera image (not scaled); Gemma token
embeddings of the prompt (which carries the discretised state, see ``pi05_inputs``) are scaled by
√width; together they form the prefix, attended bidirectionally (block 0). The action suffix
(``action_in_proj`` of the noisy actions, block 1) runs through the action expert, whose norms are
AdaRMS conditioned on ``silu(time_mlp_out(silu(time_mlp_in(sincos(t)))))``; the VLM and the expert
share one attention per layer (``gemma.MultiExpertGemma``). Positions count real tokens only.

Flow matching exactly as upstream: t = 0.001 + 0.999·Beta(1.5, 1); x_t = t·noise + (1-t)·actions;
target u = noise - actions; loss = mean of (v - u)² over real action dims (``action_dim_mask`` or
the first ``action_dim``), horizon and samples. ``sample_actions`` integrates from t=1 (noise) to
t=0 with ``num_steps`` Euler steps of dt = -1/num_steps: the prefix runs once into a per-layer KV
cache, each step runs the suffix only, inside ``lax.fori_loop``.

Beyond upstream:

- ``flow_samples_per_obs`` K: the prefix never attends the suffix, so training runs the prefix
  once and K (noise, time) draws per observation attend its cached keys/values (gradients reach
  the prefix from all K). ``joint_forward=True`` runs upstream's single joint pass (K must be 1);
  at K=1 both give the same loss.
- Packed rows (``data/packing.py``, the builder's ``packed=True`` form): ``tokens``,
  ``segment_ids``, ``positions`` [R, L] with image-token ids (``image_token_id``) where each
  sample's images go, ``images`` [R, I, H, W, 3] / ``image_segment_ids`` [R, I] (only the
  cameras samples have), per-sample ``actions`` [R, M, horizon, A], ``action_dim_mask``
  [R, M, A] and ``sample_mask`` [R, M]. Suffix tokens of sample m get segment m; attention
  is block-sparse over each sample's own tokens (``nn.block_sparse``), so samples never see
  each other and padding costs no attention work. Unpacked batches (the Observation
  contract) are the M = 1 case: ``token_mask``, ``image_masks``, ``actions`` [B, horizon, A].

Explicit ``noise``/``time`` may be given in the shapes [R, (K,) (M,) horizon, A] / [R, (K,) (M,)]
(K and M axes present only when > 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.assets import AssetError
from embodied_jax.config_registry import register
from embodied_jax.models.gemma import GemmaConfig, MultiExpertGemma, TokenLayout
from embodied_jax.models.siglip import SiglipConfig, SiglipVisionModel
from embodied_jax.nn import flow, rtc
from embodied_jax.nn.attention import mask_positions
from embodied_jax.nn.block_sparse import BlockSparseTiling, SegmentBounds
from embodied_jax.nn.dense import Dense
from embodied_jax.nn.embeddings import fill_image_tokens, sincos_embedding
from embodied_jax.nn.lora import LORA_FREEZE_REGEX, LoRAConfig
from embodied_jax.parallel.partition import shard_tokens
from embodied_jax.policy import DatasetFeatures, PolicyConfig

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
    flow_samples_per_obs: int = 1
    joint_forward: bool = False
    time_beta: tuple[float, float] = (1.5, 1.0)
    time_scale: float = 0.999
    time_offset: float = 0.001
    min_period: float = 4e-3
    max_period: float = 4.0
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
    asset_fields: ClassVar[tuple[str, ...]] = ("tokenizer_path",)
    ADDED_FIELDS = ("block_sparse_tiling",)  # runs saved before it read back with the platform's (config_registry)

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

    def make(self, rngs: nnx.Rngs) -> Pi05Policy:
        return Pi05Policy(self, rngs=rngs)

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
        return dataclasses.replace(self, action_dim=features.action_dim)

    def freeze_regexes(self) -> tuple[str, ...]:
        """Trainer freeze regexes: with LoRA (``lora_rank`` > 0) only ``lora_a``/``lora_b`` train."""
        return (LORA_FREEZE_REGEX,) if self.lora_rank else ()

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
        from embodied_jax.models.pi05_inputs import Pi05InputBuilder

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

    def training_flops(self, batch) -> dict[str, float]:
        """Analytic training FLOPs of one step on ``batch`` (NumPy; unpacked or packed rows):
        ``weights`` (every weight matmul of every token the batch carries, padding included)
        and ``attention`` (q·k and p·v: dense over an unpacked row's prefix, per sample in
        packed rows). Everything trains unless LoRA is on (then only activations flow back)."""
        from embodied_jax.nn import flops

        vlm, expert, patches = self.vlm, self.expert, self.vision.num_patches
        k, hzn = self.flow_samples_per_obs, self.action_horizon
        if "segment_ids" in batch:
            seg = np.asarray(batch["segment_ids"])
            rows, length = seg.shape
            slots = int(np.asarray(batch["sample_mask"]).size)
            images = rows * int(np.asarray(batch["images"]).shape[1])
            lengths = [np.bincount(r[r > 0], minlength=1)[1:] for r in seg]
            prefix_pairs = sum(flops.attention_pairs(row.tolist()) for row in lengths)
            keys = sum(int(n) + hzn for row in lengths for n in row)  # per present sample: its prefix + suffix
            prefix_tokens = rows * length
        else:
            rows, text = np.asarray(batch["tokens"]).shape
            length = len(self.camera_names) * patches + text
            slots, images, prefix_tokens = rows, rows * len(self.camera_names), rows * length
            prefix_pairs = rows * flops.attention_pairs((), dense_length=length)
            keys = rows * (length + hzn)
        suffix_tokens = slots * k * hzn
        suffix_pairs = k * hzn * keys
        common = dict(heads=vlm.num_heads, kv_heads=vlm.num_kv_heads, head_dim=vlm.head_dim, gated=True)
        weights, attention = flops.Tally(), flops.Tally()
        trains = not self.lora_rank
        weights.add(
            flops.siglip(self.vision, images) + 2 * images * patches * self.vision.width * vlm.width, trains=trains
        )
        per_layer = flops.transformer_layer(prefix_tokens, 0, width=vlm.width, mlp_dim=vlm.mlp_dim, **common)
        suffix_layer = flops.transformer_layer(suffix_tokens, 0, width=expert.width, mlp_dim=expert.mlp_dim, **common)
        head = 2 * suffix_tokens * self.max_action_dim * expert.width * 2 + 2 * slots * k * 2 * expert.width**2
        weights.add(vlm.depth * (per_layer + suffix_layer) + head, trains=trains)
        attention.add(
            vlm.depth * 4 * (prefix_pairs + suffix_pairs) * vlm.num_heads * vlm.head_dim,
            trains=trains,
            after_trainable=True,
        )
        # The prefix's last-layer output projection and MLP feed nothing (only its keys and
        # values are read); upstream computes them, XLA removes them from an unrolled stack.
        dead = flops.Tally(upstream_trains=True)
        dead.add(
            flops.transformer_layer(prefix_tokens, 0, width=vlm.width, mlp_dim=vlm.mlp_dim, **common)
            - 2 * prefix_tokens * vlm.width * (vlm.num_heads + 2 * vlm.num_kv_heads) * vlm.head_dim,
            trains=trains,
        )
        return {"weights": weights.total, "attention": attention.total, "unused": dead.total}

    def synthetic_batch(self, batch_size: int, seed: int = 0) -> dict[str, Any]:
        from embodied_jax.models.pi05_inputs import synthetic_pi05_batch

        return synthetic_pi05_batch(self, batch_size, seed)


@dataclasses.dataclass
class _Inputs:
    """A batch in the general (packed) form; M = 1 for unpacked batches."""

    prefix: Any  # callable(policy) -> (embeddings [R, S, D], segment ids [R, S], positions [R, S])
    present: jax.Array  # bool [R, M]: real samples
    bounds: SegmentBounds | None  # packed rows: block-sparse attention bounds of the prefix
    actions: jax.Array | None = None  # [R, M, horizon, A]
    dim_mask: jax.Array | None = None  # bool [R, M, A]

    @property
    def samples_per_row(self) -> int:
        return self.present.shape[1]


class Pi05Policy(nnx.Module):
    """π0.5 flow-matching policy (see module docstring)."""

    def __init__(self, config: Pi05Config, *, rngs: nnx.Rngs):
        self.config = config
        dtype, param_dtype = jnp.dtype(config.dtype), jnp.dtype(config.param_dtype)
        lora = LoRAConfig(config.lora_rank, config.lora_alpha) if config.lora_rank else None
        common = dict(dtype=dtype, param_dtype=param_dtype, fp8=config.fp8)
        self.vision_tower = SiglipVisionModel(
            config.vision,
            attention_impl=config.attention_impl,
            scan_layers=config.scan_layers,
            remat_policy=config.remat_policy,
            rngs=rngs,
            **common,
        )
        self.multi_modal_projector = Dense(
            config.vision.width, config.vlm.width, axes=("embed", "mlp"), rngs=rngs, **common
        )
        self.llm = MultiExpertGemma(
            (config.vlm, config.expert),
            vocab_size=config.vocab_size,
            attention_impl=config.attention_impl,
            scan_layers=config.scan_layers,
            remat_policy=config.remat_policy,
            lora=lora,
            rngs=rngs,
            **common,
        )
        width = config.expert.width
        self.action_in_proj = Dense(config.max_action_dim, width, axes=("channels", "embed"), rngs=rngs, **common)
        self.time_mlp_in = Dense(width, width, axes=("embed", "mlp"), rngs=rngs, **common)
        self.time_mlp_out = Dense(width, width, axes=("mlp", "embed"), rngs=rngs, **common)
        self.action_out_proj = Dense(
            width,
            config.max_action_dim,
            axes=("embed", "channels"),
            rngs=rngs,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            fp8=config.fp8,
        )

    # ------------------------------------------------------------------ inputs

    def _inputs(self, batch) -> _Inputs:
        config = self.config
        if "segment_ids" in batch:
            missing = [k for k in ("images", "image_segment_ids", "positions", "sample_mask") if k not in batch]
            if missing:
                raise KeyError(f"π0.5: packed batch lacks {missing}")
            present = jnp.asarray(batch["sample_mask"], bool)
            m = present.shape[1]
            longest = config.max_prefix_len
            bounds = SegmentBounds(m, longest, longest, tiling=config.block_sparse_tiling)
            prefix = lambda policy: policy.embed_packed_prefix(batch)  # noqa: E731
        else:
            missing = [c for c in config.camera_names if c not in batch["images"]]
            if missing:
                raise KeyError(
                    f"π0.5: batch['images'] lacks camera slots {missing} (config.camera_names {config.camera_names})"
                )
            rows = jnp.asarray(batch["tokens"]).shape[0]
            present = jnp.ones((rows, 1), bool)
            m, bounds = 1, None
            prefix = lambda policy: policy.embed_prefix(batch)  # noqa: E731
        inputs = _Inputs(prefix, present, bounds)
        if "actions" in batch:
            actions = jnp.asarray(batch["actions"], jnp.float32)
            rows = present.shape[0]
            inputs.actions = actions.reshape(rows, m, config.action_horizon, config.max_action_dim)
            if "action_dim_mask" in batch:
                mask = jnp.asarray(batch["action_dim_mask"], bool).reshape(rows, m, config.max_action_dim)
            else:
                mask = jnp.broadcast_to(
                    jnp.arange(config.max_action_dim) < config.action_dim, (rows, m, config.max_action_dim)
                )
            inputs.dim_mask = mask
        return inputs

    def embed_images(self, images):
        """images [R, C, H, W, 3] -> projected image tokens [R, C·P, D]."""
        r, c, h, w, ch = images.shape
        feats = self.multi_modal_projector(self.vision_tower(images.reshape(r * c, h, w, ch)))
        return feats.reshape(r, c * feats.shape[1], feats.shape[-1])

    def embed_prefix(self, batch):
        """Unpacked prefix: embeddings [B, S, D], segment ids [B, S] (1 real, 0 padding), positions.

        Tokens are gathered into [real images, real text, padding] order; attention is
        permutation-equivariant given segment ids and positions, so this changes no number
        but lets fused varlen kernels skip padding and absent cameras.
        """
        config = self.config
        images = jnp.stack([jnp.asarray(batch["images"][c]) for c in config.camera_names], axis=1)
        rows = images.shape[0]
        masks = batch.get("image_masks") or {}
        image_seg = jnp.stack(
            [jnp.asarray(masks.get(c, np.ones((rows,), bool))).astype(jnp.int32) for c in config.camera_names], axis=1
        )
        feats = self.embed_images(images)
        n = feats.shape[1] // len(config.camera_names)
        text = self.llm.embed(jnp.asarray(batch["tokens"], jnp.int32)).astype(feats.dtype)
        x = jnp.concatenate([feats, text], axis=1)
        segments = jnp.concatenate(
            [jnp.repeat(image_seg, n, axis=1), jnp.asarray(batch["token_mask"]).astype(jnp.int32)], axis=1
        )
        order = jnp.argsort(segments == 0, axis=1, stable=True)
        x = shard_tokens(jnp.take_along_axis(x, order[..., None], axis=1))
        segments = jnp.take_along_axis(segments, order, axis=1)
        positions = mask_positions(segments)
        return x, segments, positions

    def embed_packed_prefix(self, batch):
        """Packed prefix: the row's token embeddings with each image-token id replaced, in
        order, by the row's image tokens (``nn.embeddings.fill_image_tokens``)."""
        tokens = jnp.asarray(batch["tokens"], jnp.int32)
        is_image = tokens == self.config.image_token_id
        feats = self.embed_images(jnp.asarray(batch["images"]))
        text = self.llm.embed(jnp.where(is_image, 0, tokens)).astype(feats.dtype)
        x = shard_tokens(fill_image_tokens(text, is_image, feats))
        return x, jnp.asarray(batch["segment_ids"], jnp.int32), jnp.asarray(batch["positions"], jnp.int32)

    def embed_suffix(self, x_t, time):
        """x_t [B, M, horizon, A], time [B, M] -> suffix tokens [B, M*horizon, De], conditioning [B, M, De]."""
        width = self.config.expert.width
        suffix = self.action_in_proj(x_t)
        b, m, hzn, _ = suffix.shape
        t_emb = sincos_embedding(time, width, min_period=self.config.min_period, max_period=self.config.max_period)
        cond = shard_tokens(jax.nn.silu(self.time_mlp_out(jax.nn.silu(self.time_mlp_in(t_emb)))))
        return shard_tokens(suffix.reshape(b, m * hzn, width)), cond

    def _suffix_layout(self, prefix_lengths, bounds):
        """Suffix segment/block/positions for M samples of ``horizon`` tokens each."""
        hzn = self.config.action_horizon
        m = prefix_lengths.shape[1]
        ids = jnp.arange(1, m + 1, dtype=jnp.int32)
        present = prefix_lengths > 0  # [B, M]
        seg = jnp.repeat(jnp.where(present, ids[None], 0), hzn, axis=1)
        pos = (prefix_lengths[:, :, None] + jnp.arange(hzn, dtype=jnp.int32)).reshape(prefix_lengths.shape[0], -1)
        if bounds is not None:  # suffix queries see their prefix and their own suffix
            bounds = dataclasses.replace(bounds, max_q_len=hzn, max_kv_len=bounds.max_kv_len + hzn)
        return TokenLayout(seg, jnp.ones_like(seg), pos, bounds)

    # ------------------------------------------------------------------ forward passes

    def _velocity(self, v_out, shape):
        """Expert output [B, M*horizon, De] -> velocity float32 [B, M, horizon, A]."""
        return self.action_out_proj(v_out.astype(jnp.float32).reshape(*shape[:3], -1))

    def prefix_cache(self, inputs: _Inputs):
        """Run the prefix alone: per-layer (k, v), its ids and bounds, plus per-sample prefix lengths [R, M]."""
        x, seg, positions = inputs.prefix(self)
        layout = TokenLayout(seg, None, positions, inputs.bounds)
        _, kv = self.llm((x, None), layout, return_kv=True)
        return kv, (seg, jnp.zeros_like(seg)), self._lengths(seg, inputs.samples_per_row), inputs.bounds

    @staticmethod
    def _lengths(seg, m):
        return jnp.stack([(seg == i).sum(axis=1, dtype=jnp.int32) for i in range(1, m + 1)], axis=1)

    def suffix_velocity(self, cache, x_t, time):
        """Velocity [B', M, horizon, A] of x_t [B', M, horizon, A] at time [B', M] against a prefix cache.

        B' may be a multiple k·B of the cached batch: row i uses cached row i // k.
        """
        kv, ids, lengths, bounds = cache
        repeat = x_t.shape[0] // lengths.shape[0]
        if repeat > 1:
            kv = jax.tree.map(lambda a: jnp.repeat(a, repeat, axis=1), kv)
            ids = jax.tree.map(lambda a: jnp.repeat(a, repeat, axis=0), ids)
            lengths = jnp.repeat(lengths, repeat, axis=0)
        suffix, cond = self.embed_suffix(x_t, time)
        layout = self._suffix_layout(lengths, bounds)
        (_, out), _ = self.llm((None, suffix), layout, (None, cond), cache=(kv, ids))
        return self._velocity(out, x_t.shape)

    def joint_velocity(self, inputs: _Inputs, x_t, time):
        """Upstream's single pass over [prefix, suffix] (x_t [R, M, horizon, A], time [R, M])."""
        prefix, seg, positions = inputs.prefix(self)
        lengths = self._lengths(seg, inputs.samples_per_row)
        suffix, cond = self.embed_suffix(x_t, time)
        sl = self._suffix_layout(lengths, inputs.bounds)
        layout = TokenLayout(
            jnp.concatenate([seg, sl.segment_ids], axis=1),
            jnp.concatenate([jnp.zeros_like(seg), sl.block_ids], axis=1),
            jnp.concatenate([positions, sl.positions], axis=1),
            None if sl.bounds is None else dataclasses.replace(sl.bounds, max_q_len=sl.bounds.max_kv_len),
        )
        (_, out), _ = self.llm((prefix, suffix), layout, (None, cond))
        return self._velocity(out, x_t.shape)

    def velocity(self, observation, x_t, time, *, cached: bool = True):
        """Velocity for an unpacked observation, x_t [B, horizon, A], time [B] (parity checks)."""
        inputs = self._inputs(observation)
        b = x_t.shape[0]
        x_t = jnp.asarray(x_t, jnp.float32).reshape(b, 1, *x_t.shape[1:])
        time = jnp.asarray(time, jnp.float32).reshape(b, 1)
        if cached:
            v = self.suffix_velocity(self.prefix_cache(inputs), x_t, time)
        else:
            v = self.joint_velocity(inputs, x_t, time)
        return v[:, 0]

    # ------------------------------------------------------------------ Policy contract

    def loss_terms(self, batch, rng, *, noise=None, time=None):
        """(loss, per-sample loss [R, M] averaged over the K draws, sample presence [R, M], metrics)."""
        config = self.config
        inputs = self._inputs(batch)
        if inputs.actions is None:
            raise KeyError("π0.5 loss: batch has no 'actions'")
        r, m = inputs.actions.shape[:2]
        k = config.flow_samples_per_obs
        hzn, adim = config.action_horizon, config.max_action_dim
        noise_rng, time_rng = jax.random.split(rng)
        if noise is None:
            noise = jax.random.normal(noise_rng, (r, k, m, hzn, adim), jnp.float32)
        if time is None:
            alpha, beta = config.time_beta
            time = config.time_offset + config.time_scale * jax.random.beta(
                time_rng, alpha, beta, (r, k, m), jnp.float32
            )
        noise = jnp.asarray(noise, jnp.float32).reshape(r, k, m, hzn, adim)
        time = jnp.asarray(time, jnp.float32).reshape(r, k, m)
        actions = inputs.actions[:, None]
        t = time[..., None, None]
        x_t = t * noise + (1.0 - t) * actions
        target = noise - actions
        if config.joint_forward:
            v = self.joint_velocity(inputs, x_t[:, 0], time[:, 0])[:, None]
        else:
            cache = self.prefix_cache(inputs)
            v = self.suffix_velocity(cache, x_t.reshape(r * k, m, hzn, adim), time.reshape(r * k, m))
            v = v.reshape(r, k, m, hzn, adim)
        present = inputs.present
        mask = (inputs.dim_mask[:, None, :, None, :] & present[:, None, :, None, None]).astype(jnp.float32)
        mask = jnp.broadcast_to(mask, v.shape)
        sq = jnp.square(v - target) * mask
        loss = sq.sum() / jnp.maximum(mask.sum(), 1.0)
        per_sample = (sq.sum(axis=(3, 4)) / jnp.maximum(mask.sum(axis=(3, 4)), 1.0)).mean(axis=1)
        metrics = {
            "loss": loss,
            "tokens": self._real_tokens(batch) + present.sum() * k * hzn,
            "examples": present.sum(),
            "time_mean": time.mean(),
        }
        return loss, per_sample, present, metrics

    def _real_tokens(self, batch):
        if "segment_ids" in batch:
            return (jnp.asarray(batch["segment_ids"]) > 0).sum()
        masks = batch.get("image_masks") or {}
        images = sum(
            jnp.asarray(masks[c]).sum() if c in masks else jnp.asarray(batch["tokens"]).shape[0]
            for c in self.config.camera_names
        )
        return jnp.asarray(batch["token_mask"]).sum() + images * self.config.vision.num_patches

    def loss(self, batch, rng, *, noise=None, time=None):
        loss, _, _, metrics = self.loss_terms(batch, rng, noise=noise, time=time)
        return loss, metrics

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
        """Actions [B, horizon, action_dim] for an unpacked observation: Euler from t=1 to t=0 (``nn/flow.py``).

        Real-time chunking (``nn/rtc.py``): ``prefix_actions`` [B, horizon, A] (normalised, A <= max_action_dim,
        usually the previous chunk's ``action_dim`` actions shifted by the executed steps) guide the chunk
        towards them with ``prefix_weights`` [horizon] or [B, horizon] and maximum guidance weight
        ``max_guidance``, through the clean estimate x_t - t·v; dims from ``action_dim`` on are not guided,
        steps of weight 1 are returned as the prefix. None: plain sampling. ``trace``: a ``flow.FlowTrace``
        whose ``actions`` are these and whose states and velocities are [num_steps (+1), B, horizon,
        max_action_dim]."""
        config = self.config
        num_steps = int(num_steps or config.num_inference_steps)
        inputs = self._inputs({k: v for k, v in observation.items() if k != "actions"})
        b = inputs.present.shape[0]
        shape = (b, 1, config.action_horizon, config.max_action_dim)
        x = jax.random.normal(rng, shape, jnp.float32) if noise is None else jnp.asarray(noise, jnp.float32)
        x = x.reshape(shape)
        cache = self.prefix_cache(inputs)
        dt = -1.0 / num_steps
        # Step times as upstream computes them: in float64, then rounded once to float32.
        schedule = flow.FlowSchedule(
            times=jnp.asarray((1.0 + np.arange(num_steps) * dt).astype(np.float32)), dt=dt, clean_time=0.0
        )

        def velocity(policy, x, i):  # policy: this module, rebuilt inside the loop (nn/traced.py)
            return policy.suffix_velocity(cache, x, jnp.full((b, 1), schedule.times[i], jnp.float32))

        guidance = None
        if prefix_actions is None:
            rtc.check_unguided(prefix_weights)
        else:
            y, w = rtc.guidance_inputs(
                prefix_actions,
                prefix_weights,
                batch=b,
                horizon=config.action_horizon,
                width=config.max_action_dim,
                real_width=config.action_dim,
            )
            guidance = flow.Guidance(y.reshape(shape), w.reshape(shape), max_guidance)
        out = flow.sample(self, velocity, x, schedule, guidance=guidance, trace=trace)
        if trace:
            actions = out.actions[:, 0, :, : config.action_dim]
            return flow.FlowTrace(actions, out.states[:, :, 0], out.velocities[:, :, 0])
        return out[:, 0, :, : config.action_dim]
