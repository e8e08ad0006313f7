"""The pi05 module: the network, its loss and its sampler (the package docstring has the details)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.models.gemma import MultiExpertGemma, TokenLayout
from embodied_jax.models.pi05.config import Pi05Config
from embodied_jax.models.siglip import SiglipVisionModel
from embodied_jax.nn import flow, rtc
from embodied_jax.nn.attention import mask_positions
from embodied_jax.nn.block_sparse import SegmentBounds
from embodied_jax.nn.dense import Dense
from embodied_jax.nn.embeddings import fill_image_tokens, sincos_embedding
from embodied_jax.nn.lora import LoRAConfig
from embodied_jax.parallel.partition import shard_tokens
from embodied_jax.policy import implements, initial_noise


@dataclasses.dataclass
class _Inputs:
    """A batch in the general (packed) form; M = 1 for unpacked batches."""

    prefix: Any  # callable(policy) -> (embeddings [R, S, D], segment ids [R, S], positions [R, S])
    present: jax.Array  # bool [R, M]: real samples
    bounds: SegmentBounds | None  # packed rows: block-sparse attention bounds of the prefix
    actions: jax.Array | None = None  # [R, M, horizon, A]
    dim_mask: jax.Array | None = None  # bool [R, M, A]
    # what the prefix leaves for the loss while it runs: "image_tokens" [R, C·P, D] and
    # "image_present" [R, C] of an unpacked batch (the privileged head's input)
    taps: dict = dataclasses.field(default_factory=dict)

    @property
    def samples_per_row(self) -> int:
        return self.present.shape[1]


PRIVILEGED_CHANNELS = 8  # per image token, into the privileged head


class Pi05Policy(nnx.Module):
    """π0.5 flow-matching policy (see module docstring)."""

    def __init__(self, config: Pi05Config, *, rngs: nnx.Rngs):
        self.config = config
        compute = config.compute
        lora = LoRAConfig(config.lora_rank, config.lora_alpha) if config.lora_rank else None
        common = compute.dense
        self.vision_tower = SiglipVisionModel(config.vision, compute=compute, rngs=rngs)
        self.multi_modal_projector = Dense(
            config.vision.width, config.vlm.width, axes=("embed", "mlp"), rngs=rngs, **common
        )
        self.llm = MultiExpertGemma(
            (config.vlm, config.expert), vocab_size=config.vocab_size, compute=compute, lora=lora, rngs=rngs
        )
        width = config.expert.width
        self.action_in_proj = Dense(config.max_action_dim, width, axes=("channels", "embed"), rngs=rngs, **common)
        self.time_mlp_in = Dense(width, width, axes=("embed", "mlp"), rngs=rngs, **common)
        self.time_mlp_out = Dense(width, width, axes=("mlp", "embed"), rngs=rngs, **common)
        self.action_out_proj = Dense(  # the velocity in float32, whatever the compute dtype
            width, config.max_action_dim, axes=("embed", "channels"), rngs=rngs, **dict(common, dtype=jnp.float32)
        )
        if config.privileged_weight:
            if not config.privileged_state_dim:
                raise ValueError(
                    "π0.5: privileged_weight > 0 needs privileged_state_dim (set from the dataset's "
                    "--data.inputs.privileged-key feature)"
                )
            # Training only: a few channels per image token, read out by position (where things are).
            tokens = len(config.camera_names) * config.vision.num_patches
            self.privileged_token_proj = Dense(
                config.vlm.width, PRIVILEGED_CHANNELS, axes=("embed", None), rngs=rngs, dtype=jnp.float32
            )
            self.privileged_head = Dense(
                tokens * PRIVILEGED_CHANNELS,
                config.privileged_state_dim,
                axes=(None, None),
                rngs=rngs,
                dtype=jnp.float32,
            )

    # ------------------------------------------------------------------ inputs

    def _inputs(self, batch) -> _Inputs:
        config = self.config
        taps = {}
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
            prefix = lambda policy: policy.embed_prefix(batch, taps)  # noqa: E731
        inputs = _Inputs(prefix, present, bounds, taps=taps)
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

    def embed_prefix(self, batch, taps: dict | None = None):
        """Unpacked prefix: embeddings [B, S, D], segment ids [B, S] (1 real, 0 padding), positions;
        ``taps`` (a dict) receives the image tokens and which cameras are present.

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
        if taps is not None:
            taps.update(image_tokens=feats, image_present=image_seg)
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
        if config.privileged_weight:
            privileged = self.privileged_loss(batch, inputs)
            metrics["flow_loss"], metrics["privileged_loss"] = loss, privileged
            loss = loss + config.privileged_weight * privileged
            metrics["loss"] = loss
        return loss, per_sample, present, metrics

    def privileged_loss(self, batch, inputs: _Inputs):
        """Mean squared error of the training-only head's reading of the image tokens against the
        batch's (normalised) ``privileged_state`` [B, F]; absent cameras' tokens are zeroed."""
        if "privileged_state" not in batch:
            raise KeyError(
                "π0.5 loss: privileged_weight > 0 and the batch has no 'privileged_state' "
                "(--data.inputs.privileged-key KEY loads it)"
            )
        if "image_tokens" not in inputs.taps:
            raise ValueError("π0.5: the privileged head trains on unpacked batches (drop --data.packing.seq-len)")
        tokens, present = inputs.taps["image_tokens"], inputs.taps["image_present"]
        per_camera = tokens.shape[1] // present.shape[1]
        keep = jnp.repeat(present, per_camera, axis=1)[..., None].astype(jnp.float32)
        channels = self.privileged_token_proj(tokens.astype(jnp.float32)) * keep
        guess = self.privileged_head(channels.reshape(channels.shape[0], -1))
        target = jnp.asarray(batch["privileged_state"], jnp.float32)
        return jnp.mean(jnp.square(guess - target))

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

    def example_losses(self, batch, rng):
        """[B]: each example's flow-matching loss (an unpacked batch with ``actions``)."""
        return self.loss_terms(batch, rng)[1].reshape(-1)

    def _flow(self, observation, num_steps):
        """The flow problem of one observation: (velocity, schedule, chunk shape [B, 1, horizon, max_action_dim])."""
        config = self.config
        num_steps = int(num_steps or config.num_inference_steps)
        inputs = self._inputs({k: v for k, v in observation.items() if k != "actions"})
        b = inputs.present.shape[0]
        shape = (b, 1, config.action_horizon, config.max_action_dim)
        cache = self.prefix_cache(inputs)
        dt = -1.0 / num_steps
        # Step times as upstream computes them: in float64, then rounded once to float32.
        schedule = flow.FlowSchedule(
            times=jnp.asarray((1.0 + np.arange(num_steps) * dt).astype(np.float32)), dt=dt, clean_time=0.0
        )

        def velocity(policy, x, i):  # policy: this module, rebuilt inside the loop (nn/traced.py)
            return policy.suffix_velocity(cache, x, jnp.full((b, 1), schedule.times[i], jnp.float32))

        return velocity, schedule, shape

    def _real_dims(self, x):
        return (jnp.arange(x.shape[-1]) < self.config.action_dim).astype(x.dtype)

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
        sde=None,
    ):
        """Actions [B, horizon, action_dim] for an unpacked observation: Euler from t=1 to t=0 (``nn/flow.py``).

        Real-time chunking (``nn/rtc.py``): ``prefix_actions`` [B, horizon, A] (normalised, A <= max_action_dim,
        usually the previous chunk's ``action_dim`` actions shifted by the executed steps) guide the chunk
        towards them with ``prefix_weights`` [horizon] or [B, horizon] and maximum guidance weight
        ``max_guidance``, through the clean estimate x_t - t·v; dims from ``action_dim`` on are not guided,
        steps of weight 1 are returned as the prefix. None: plain sampling. ``trace``: a ``flow.FlowTrace``
        whose ``actions`` are these and whose states and velocities are [num_steps (+1), B, horizon,
        max_action_dim]. ``sde`` (``flow.FlowSDE``, with ``trace``): Flow-SDE sampling; the trace's
        ``log_density`` counts the ``action_dim`` real dims only (``chain_log_prob``)."""
        config = self.config
        velocity, schedule, shape = self._flow(observation, num_steps)
        b = shape[0]
        k_sde = None
        if sde is not None:
            rng, k_sde = jax.random.split(rng)
        x = initial_noise(config, rng, shape) if noise is None else jnp.asarray(noise, jnp.float32)
        x = x.reshape(shape)
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
        out = flow.sample(self, velocity, x, schedule, guidance=guidance, trace=trace, sde=sde, rng=k_sde)
        if trace:
            actions = out.actions[:, 0, :, : config.action_dim]
            density = None if out.log_density is None else out.log_density[:, :, 0] * self._real_dims(x)
            return flow.FlowTrace(actions, out.states[:, :, 0], out.velocities[:, :, 0], density)
        return out[:, 0, :, : config.action_dim]

    def action_features(self, observation):
        """[B, horizon * max_action_dim]: the action expert's velocity at the start of sampling (t=1)
        from a zero chunk, a deterministic function of the observation (a value head's input)."""
        velocity, _, shape = self._flow(observation, None)
        return velocity(self, jnp.zeros(shape, jnp.float32), 0).reshape(shape[0], -1)

    def chain_log_prob(self, observation, states, sde, *, num_steps=None):
        """log-probability [B] under ``sde`` of a sampled chain ``states`` [num_steps + 1, B, horizon,
        max_action_dim] (a ``FlowTrace``'s): its stochastic steps' densities over the real dims."""
        velocity, schedule, shape = self._flow(observation, num_steps)
        states = jnp.asarray(states, jnp.float32).reshape(states.shape[0], *shape)
        density = flow.transition_log_density(self, velocity, states, schedule, sde)[:, :, 0]
        return flow.chunk_log_prob(density * self._real_dims(density))


@implements(Pi05Config, "make")
def build(config: Pi05Config, rngs: nnx.Rngs) -> Pi05Policy:
    return Pi05Policy(config, rngs=rngs)
