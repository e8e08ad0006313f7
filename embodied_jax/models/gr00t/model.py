"""The gr00t module: the network, its loss and its sampler (the package docstring has the details)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.models.eagle import EagleBackbone
from embodied_jax.models.gr00t.action_head import Gr00tActionHead
from embodied_jax.models.gr00t.config import Gr00tConfig
from embodied_jax.models.gr00t.layout import vl_layout
from embodied_jax.nn import flow, rtc
from embodied_jax.nn.lora import LoRAConfig
from embodied_jax.policy import implements, initial_noise

PER_SAMPLE_KEYS = ("state", "actions", "action_mask", "embodiment_id")


class Gr00tPolicy(nnx.Module):
    def __init__(self, config: Gr00tConfig, *, rngs: nnx.Rngs):
        self.config = config
        compute = config.compute  # what every module shares: precision, attention kernel, layer stacking
        self.backbone = EagleBackbone(config.eagle_config(), compute=compute, rngs=rngs)
        lora = LoRAConfig(config.lora_rank, config.lora_alpha) if config.lora_rank else None
        self.action_head = Gr00tActionHead(
            config.action_head,
            action_dim=config.action_dim,
            max_state_dim=config.max_state_dim,
            backbone_width=config.llm.width,
            compute=compute,
            lora=lora,
            rngs=rngs,
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
        dropout_key = k_dit if train_dropout and self.config.tune_diffusion_model else None
        velocity = _dit_velocity(head, state_features, x_t, buckets, slots, vl, layout, key=dropout_key)
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
        return _dit_velocity(head, state_features, jnp.asarray(noisy_actions, jnp.float32), buckets, slots, vl, layout)

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

    def example_losses(self, batch, rng):
        """[B]: each example's flow-matching loss (an unpacked batch with ``actions``)."""
        errors, counts = self.per_sample_losses(batch, rng)
        return errors / jnp.maximum(counts, 1.0)

    def _flow(self, observation, num_steps):
        """The flow problem of one observation: (velocity, schedule, chunk shape [B, horizon, action_dim])."""
        config = self.config
        k = int(num_steps or config.num_inference_steps)
        b = jnp.asarray(observation["embodiment_id"]).shape[0]
        vl, layout = self.vl_features(observation)
        slots = jnp.asarray(observation["embodiment_id"], jnp.int32)
        state_features = self.action_head.encode_state(jnp.asarray(observation["state"], jnp.float32), slots)
        # upstream: int(k / K * num_timestep_buckets) in Python floats
        buckets = jnp.asarray(np.array([int(i / k * config.num_timestep_buckets) for i in range(k)], np.int32))
        dt = jnp.float32(1.0 / k)
        schedule = flow.FlowSchedule(times=jnp.arange(k, dtype=jnp.float32) * dt, dt=dt, clean_time=1.0)

        def velocity(head, x, i):  # head: the action head, rebuilt inside the loop (nn/traced.py)
            return _dit_velocity(head, state_features, x, jnp.full((b,), buckets[i]), slots, vl, layout)

        return velocity, schedule, (b, config.action_horizon, config.action_dim)

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
        """Actions [B, horizon, action_dim]: Euler from t=0 (noise) to t=1 (actions) (``nn/flow.py``).

        Real-time chunking (``nn/rtc.py``): ``prefix_actions`` [B, horizon, action_dim] (normalised, usually the
        previous chunk shifted by the executed steps) guide the chunk towards them with ``prefix_weights``
        [horizon] or [B, horizon] and maximum guidance weight ``max_guidance``, through the clean estimate
        x_t + (1 - t)·v; steps of weight 1 are returned as the prefix. None: plain sampling. ``trace``: a
        ``flow.FlowTrace`` with every step's state and velocity. ``sde`` (``flow.FlowSDE``, with ``trace``):
        Flow-SDE sampling with each stochastic step's log-density (``chain_log_prob``)."""
        config = self.config
        velocity, schedule, shape = self._flow(observation, num_steps)
        k_sde = None
        if sde is not None:
            rng, k_sde = jax.random.split(rng)
        x = initial_noise(config, rng, shape) if noise is None else jnp.asarray(noise, jnp.float32)
        guidance = None
        if prefix_actions is None:
            rtc.check_unguided(prefix_weights)
        else:
            y, w = rtc.guidance_inputs(
                prefix_actions, prefix_weights, batch=shape[0], horizon=config.action_horizon, width=config.action_dim
            )
            guidance = flow.Guidance(y, w, max_guidance)
        return flow.sample(self.action_head, velocity, x, schedule, guidance=guidance, trace=trace, sde=sde, rng=k_sde)

    def action_features(self, observation):
        """[B, horizon * action_dim]: the action head's velocity at the start of sampling (t=0) from a
        zero chunk, a deterministic function of the observation (a value head's input)."""
        velocity, _, shape = self._flow(observation, None)
        return velocity(self.action_head, jnp.zeros(shape, jnp.float32), 0).reshape(shape[0], -1)

    def chain_log_prob(self, observation, states, sde, *, num_steps=None):
        """log-probability [B] under ``sde`` of a sampled chain ``states`` [num_steps + 1, B, horizon,
        action_dim] (a ``FlowTrace``'s): the sum of its stochastic steps' Gaussian densities."""
        velocity, schedule, _ = self._flow(observation, num_steps)
        states = jnp.asarray(states, jnp.float32)
        return flow.chunk_log_prob(flow.transition_log_density(self.action_head, velocity, states, schedule, sde))


def _dit_velocity(head, state_features, x, buckets, slots, vl, layout, key=None):
    """The action head's velocity at ``x`` with the VL features' segment layout (``layout.py``)."""
    return head.velocity(
        state_features,
        x,
        buckets,
        slots,
        vl,
        q_segment_ids=layout["dit_q"],
        kv_segment_ids=layout["dit_kv"],
        context_gather=layout["context_gather"],
        key=key,
    )


@implements(Gr00tConfig, "make")
def build(config: Gr00tConfig, rngs: nnx.Rngs) -> Gr00tPolicy:
    return Gr00tPolicy(config, rngs=rngs)
