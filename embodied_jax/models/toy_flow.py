"""A small flow-matching policy on synthetic data: the trainer's test model (``toy`` experiments).

The target action chunk is a fixed smooth function of the state, so the loss has
something to learn. Flow matching follows the π0.5 convention (noise at t = 1, data at
t = 0, velocity target ``noise - actions``). Its parameters carry logical axis names
so every mesh layout of the trainer is exercised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.config_registry import register
from embodied_jax.nn import flow
from embodied_jax.policy import PolicyConfig


def _dense(din: int, dout: int, axes: tuple, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        rngs=rngs,
        kernel_metadata={"out_sharding": axes},
        bias_metadata={"out_sharding": (axes[1],)},
    )


class ToyFlowPolicy(nnx.Module):
    def __init__(self, config: ToyFlowConfig, rngs: nnx.Rngs):
        self.config = config
        c = config
        self.time_dim = c.width
        self.inp = _dense(c.horizon * c.action_dim + c.state_dim, c.width, (None, "embed"), rngs)
        self.time_proj = _dense(c.width, c.width, ("embed", "mlp"), rngs)
        self.time_out = _dense(c.width, c.width, ("mlp", "embed"), rngs)
        self.blocks = nnx.List(
            [
                nnx.List(
                    [
                        _dense(c.width, c.hidden, ("embed", "mlp"), rngs),
                        _dense(c.hidden, c.width, ("mlp", "embed"), rngs),
                    ]
                )
                for _ in range(c.depth)
            ]
        )
        self.out = _dense(c.width, c.horizon * c.action_dim, ("embed", None), rngs)

    def velocity(self, state, x_t, t):
        c = self.config
        b = state.shape[0]
        freqs = jnp.exp(jnp.linspace(0.0, np.log(1000.0), self.time_dim // 2))
        temb = jnp.concatenate([jnp.sin(t[:, None] * freqs), jnp.cos(t[:, None] * freqs)], axis=-1)
        temb = self.time_out(jax.nn.silu(self.time_proj(temb)))
        h = self.inp(jnp.concatenate([x_t.reshape(b, -1), state], axis=-1)) + temb
        for up, down in self.blocks:
            h = h + down(jax.nn.gelu(up(h)))
        return self.out(h).reshape(b, c.horizon, c.action_dim)

    def example_losses(self, batch, rng, *, noise=None, time=None):
        """[B]: each example's flow-matching loss."""
        actions = batch["actions"]
        k_noise, k_time = jax.random.split(rng)
        if noise is None:
            noise = jax.random.normal(k_noise, actions.shape, actions.dtype)
        if time is None:
            time = 0.001 + 0.999 * jax.random.beta(k_time, 1.5, 1.0, (actions.shape[0],))
        x_t = time[:, None, None] * noise + (1.0 - time[:, None, None]) * actions
        v = self.velocity(batch["state"], x_t, time)
        return jnp.mean((v - (noise - actions)) ** 2, axis=(1, 2))

    def loss(self, batch, rng, *, noise=None, time=None):
        loss = self.example_losses(batch, rng, noise=noise, time=time).mean()
        return loss, {"examples": jnp.asarray(batch["actions"].shape[0], jnp.int32)}

    def _flow(self, observation, num_steps):
        c = self.config
        num_steps = int(num_steps or c.num_steps)
        state = jnp.asarray(observation["state"], jnp.float32)
        schedule = flow.FlowSchedule(
            times=1.0 - jnp.arange(num_steps, dtype=jnp.float32) / num_steps, dt=-1.0 / num_steps, clean_time=0.0
        )

        def velocity(policy, x, i):
            return policy.velocity(state, x, jnp.full((state.shape[0],), schedule.times[i]))

        return velocity, schedule, (state.shape[0], c.horizon, c.action_dim)

    def sample_actions(self, observation, rng, *, num_steps=None, noise=None, trace=False, sde=None):
        """Euler from the noise at t = 1 to the chunk at t = 0 (``nn/flow.py``; ``trace``, ``sde`` as there)."""
        velocity, schedule, shape = self._flow(observation, num_steps)
        k_sde = None
        if sde is not None:
            rng, k_sde = jax.random.split(rng)
        x = jax.random.normal(rng, shape) if noise is None else jnp.asarray(noise, jnp.float32)
        return flow.sample(self, velocity, x, schedule, trace=trace, sde=sde, rng=k_sde)

    def action_features(self, observation):
        """[B, horizon * action_dim]: the velocity at t = 1 from a zero chunk (a value head's input)."""
        velocity, _, shape = self._flow(observation, None)
        return velocity(self, jnp.zeros(shape, jnp.float32), 0).reshape(shape[0], -1)

    def chain_log_prob(self, observation, states, sde, *, num_steps=None):
        """log-probability [B] of a sampled chain ``states`` [num_steps + 1, B, horizon, action_dim] under ``sde``."""
        velocity, schedule, _ = self._flow(observation, num_steps)
        return flow.chunk_log_prob(flow.transition_log_density(self, velocity, jnp.asarray(states), schedule, sde))


@register
@dataclasses.dataclass(frozen=True)
class ToyFlowConfig(PolicyConfig):
    state_dim: int = 8
    action_dim: int = 4
    horizon: int = 8
    width: int = 64
    hidden: int = 128
    depth: int = 2
    num_steps: int = 10

    def make(self, rngs: nnx.Rngs) -> ToyFlowPolicy:
        return ToyFlowPolicy(self, rngs)

    def synthetic_batch(self, batch_size: int, seed: int = 0) -> dict:
        rng = np.random.default_rng(seed)
        state = rng.normal(size=(batch_size, self.state_dim)).astype(np.float32)
        mixing = np.random.default_rng(1234).normal(size=(self.state_dim, self.action_dim)).astype(np.float32)
        ramp = np.linspace(0.2, 1.0, self.horizon, dtype=np.float32)[None, :, None]
        actions = np.tanh(state @ mixing / np.sqrt(self.state_dim))[:, None, :] * ramp
        return {"state": state, "actions": actions.astype(np.float32)}
