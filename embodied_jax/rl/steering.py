"""Noise-space steering (DSRL, Wagenmaker et al. 2025): a small actor chooses the initial noise the
behaviour-cloned flow policy denoises from; the policy itself stays frozen and is sampled as it is
deployed (the deterministic Euler ODE), so every chunk the robot executes is one the cloned policy
can produce, and RL only picks among them.

The actor reads what the policy reads, reduced to two small inputs: the robot state and the action
expert's velocity at the start of sampling (``Policy.action_features``: the chunk the policy
intends, a function of its images, prompt and state). The twin critics (soft actor-critic, off
policy, a replay buffer) read those, the simulator's privileged state (never deployed) and the
noise. Off-policy learning reuses every decision many times: the PPO runs of ``docs/rl.md`` saw
each decision in one update.

Pure functions of parameter pytrees: ``SteerNetworks.init`` -> ``SteerParams``; ``actor_sample``,
``steered_chunk`` and ``make_update`` (a jitted scan of ``updates`` SAC steps).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from embodied_jax.config_registry import register


@register
@dataclasses.dataclass(frozen=True)
class SteerSettings:
    # |noise| <= bound per dimension (tanh-squashed); the deployed sampler's noise is N(0, 1).
    noise_bound: float = 2.0
    width: int = 256  # hidden width of the actor and of each critic (two layers)
    actor_lr: float = 3e-4
    critic_lr: float = 3e-4
    batch_size: int = 256
    updates_per_decision: int = 8  # SAC steps per batched decision (num_envs transitions); push ran at 8
    warmup: int = 1000  # transitions in the buffer before the first update
    buffer: int = 200_000  # transitions kept
    tau: float = 0.005  # target critics' Polyak rate
    # SAC's entropy weight to start from (then tuned to the target): the noise of a chunk has 32 or more
    # dimensions and about 43 nats of entropy untrained, so at 0.1 the entropy bonus (4 a decision) would
    # outweigh the success reward of 1 many times over.
    init_temperature: float = 0.001
    # The entropy target per noise dimension (SAC's default: -1 per dimension).
    target_entropy_per_dim: float = -1.0
    # Weight of the KL divergence of the actor's (pre-squash) Gaussian from the one the untrained actor
    # starts as (the deployed sampler's noise): a noise far from it costs more than its value gains
    # unless the critics are sure. At 0 the actor's entropy fell from 42 to -38 nats within 1000 updates,
    # its noise drifted outwards (mean |noise| 0.86 -> 1.26) and push's rollouts fell from 30% to 0%.
    prior_weight: float = 0.01
    # What the critics regress on: "return_to_go", each decision's own episode's discounted return (the
    # value of the policies that collected the buffer; no bootstrap, nothing to overestimate), or
    # "bootstrap", SAC's target from the next decision's critics and actor. On Meta-World push the
    # bootstrapped critics rose to the value bound everywhere within 2000 updates (docs/rl.md).
    critic_target: str = "return_to_go"
    # The held-out evaluation samples the actor's mean (True, DSRL's deployment) or its distribution.
    deterministic_eval: bool = True

    def __post_init__(self):
        for name in ("noise_bound", "actor_lr", "critic_lr", "tau", "init_temperature"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SteerSettings.{name} must be > 0, got {getattr(self, name)}")
        for name in ("width", "batch_size", "updates_per_decision", "buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"SteerSettings.{name} must be >= 1, got {getattr(self, name)}")
        if self.prior_weight < 0:
            raise ValueError(f"SteerSettings.prior_weight must be >= 0, got {self.prior_weight}")
        if self.critic_target not in ("return_to_go", "bootstrap"):
            raise ValueError(
                f"SteerSettings.critic_target must be 'return_to_go' or 'bootstrap', got {self.critic_target!r}"
            )
        if self.warmup < 0 or self.warmup > self.buffer:
            raise ValueError(f"SteerSettings.warmup={self.warmup} must lie in [0, buffer={self.buffer}]")


class _MLP(nnx.Module):
    def __init__(self, din: int, width: int, dout: int, *, zero_out: bool, rngs: nnx.Rngs):
        self.hidden = nnx.List([nnx.Linear(din, width, rngs=rngs), nnx.Linear(width, width, rngs=rngs)])
        self.norms = nnx.List([nnx.LayerNorm(width, rngs=rngs), nnx.LayerNorm(width, rngs=rngs)])
        init = nnx.initializers.zeros if zero_out else nnx.initializers.lecun_normal()
        self.out = nnx.Linear(width, dout, kernel_init=init, rngs=rngs)

    def __call__(self, x):
        for layer, norm in zip(self.hidden, self.norms, strict=True):
            x = jax.nn.relu(norm(layer(x)))
        return self.out(x)


def _pre_tanh_std(bound: float) -> float:
    """The pre-squash std at which ``bound * tanh(N(0, s))`` has unit variance, as the deployed
    sampler's noise has: the untrained actor explores the noise the policy was trained to start from."""
    z = np.linspace(-6.0, 6.0, 4001)
    density = np.exp(-0.5 * z**2)
    density = density / density.sum()
    lo, hi = 1e-3, 5.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        var = float(np.sum(density * (bound * np.tanh(mid * z)) ** 2))
        lo, hi = (mid, hi) if var < 1.0 else (lo, mid)
    if var < 0.99:  # the bound is too small for unit variance: the widest the squash allows
        return hi
    return 0.5 * (lo + hi)


class SteerParams(NamedTuple):
    actor: Any
    q1: Any
    q2: Any
    q1_target: Any
    q2_target: Any
    log_temperature: jax.Array


@dataclasses.dataclass(frozen=True)
class SteerNetworks:
    """The actor (observation features -> a squashed Gaussian over the noise) and twin critics
    (critic features and noise -> value), as graph definitions; parameters travel separately."""

    actor_graph: Any
    critic_graph: Any
    noise_shape: tuple[int, int]  # (horizon, the model's action width): the flow's initial state per row
    bound: float
    log_std0: float

    @property
    def noise_dim(self) -> int:
        return self.noise_shape[0] * self.noise_shape[1]

    @staticmethod
    def init(
        actor_dim: int, critic_dim: int, noise_shape: tuple[int, int], settings: SteerSettings, seed: int
    ) -> tuple[SteerNetworks, SteerParams]:
        noise_dim = noise_shape[0] * noise_shape[1]
        rngs = nnx.Rngs(seed)
        actor_graph, actor = nnx.split(_MLP(actor_dim, settings.width, 2 * noise_dim, zero_out=True, rngs=rngs))
        critic_graph, q1 = nnx.split(_MLP(critic_dim + noise_dim, settings.width, 1, zero_out=False, rngs=rngs))
        _, q2 = nnx.split(_MLP(critic_dim + noise_dim, settings.width, 1, zero_out=False, rngs=rngs))
        nets = SteerNetworks(
            actor_graph,
            critic_graph,
            tuple(noise_shape),
            settings.noise_bound,
            float(np.log(_pre_tanh_std(settings.noise_bound))),
        )
        temperature = jnp.log(jnp.asarray(settings.init_temperature, jnp.float32))
        return nets, SteerParams(actor, q1, q2, q1, q2, temperature)

    def actor_dist(self, actor, actor_in):
        out = nnx.merge(self.actor_graph, actor, copy=True)(actor_in)
        mean, log_std = jnp.split(out, 2, axis=-1)
        return mean, jnp.clip(log_std + self.log_std0, -5.0, 1.0)

    def actor_sample(self, actor, actor_in, key, deterministic: bool = False):
        """(noise [B, noise_dim] in [-bound, bound], its log-density [B])."""
        mean, log_std = self.actor_dist(actor, actor_in)
        if deterministic:
            u = mean
        else:
            u = mean + jnp.exp(log_std) * jax.random.normal(key, mean.shape, mean.dtype)
        gauss = -0.5 * (((u - mean) / jnp.exp(log_std)) ** 2 + 2 * log_std + jnp.log(2 * jnp.pi))
        # log|d(bound * tanh u)/du| = log bound + log(1 - tanh^2 u), written stably
        jac = jnp.log(self.bound) + 2.0 * (jnp.log(2.0) - u - jax.nn.softplus(-2.0 * u))
        return self.bound * jnp.tanh(u), jnp.sum(gauss - jac, axis=-1)

    def prior_kl(self, actor, actor_in):
        """[B]: KL of the actor's pre-squash Gaussian from the untrained actor's, N(0, exp(log_std0)^2)."""
        mean, log_std = self.actor_dist(actor, actor_in)
        ratio = jnp.exp(2 * (log_std - self.log_std0))
        return 0.5 * jnp.sum(ratio + mean**2 * jnp.exp(-2 * self.log_std0) - 1.0 - 2 * (log_std - self.log_std0), -1)

    def q(self, q_params, critic_in, noise):
        net = nnx.merge(self.critic_graph, q_params, copy=True)
        return net(jnp.concatenate([critic_in, noise], axis=-1))[:, 0]


def steered_chunk(
    model, nets: SteerNetworks, actor, model_obs, robot_state, key, deterministic: bool, *, num_steps: int | None = None
):
    """The frozen policy's chunk from the noise the actor picks for these observations: (normalised
    chunk [B, H, A], actor input [B, F], noise [B, noise_dim]). The actor input is the robot state and
    the action expert's velocity at the start of sampling, both functions of what the policy sees."""
    features = jax.lax.stop_gradient(model.action_features(model_obs))
    actor_in = jnp.concatenate([jnp.asarray(robot_state, jnp.float32), features], axis=-1)
    noise, _ = nets.actor_sample(actor, actor_in, key, deterministic)
    initial = noise.reshape(noise.shape[0], *nets.noise_shape)
    chunk = model.sample_actions(model_obs, key, num_steps=num_steps, noise=initial)
    return chunk, actor_in, noise


def make_update(
    nets: SteerNetworks, settings: SteerSettings, gamma: float
) -> tuple[Callable, Callable[[SteerParams], Any]]:
    """``(update, init_opt)``: ``update(params, opt_state, batches, key, value_range) -> (params,
    opt_state, metrics)`` runs one SAC step per leading row of ``batches`` (dict of [G, B, ...]:
    ``actor_in``, ``critic_in``, ``noise``, ``reward``, ``terminal``, ``next_actor_in``,
    ``next_critic_in``, ``return_to_go``; the critics regress on ``settings.critic_target``).
    ``value_range`` ([2]: low, high) bounds the critics' targets: the run passes the range of the
    episode returns it has seen (with rewards >= 0 no value lies outside [0, the largest return]),
    which keeps bootstrapped critics from extrapolating upwards where the actor leads them out of
    the data, SAC's overestimation on sparse rewards."""
    actor_opt = optax.adam(settings.actor_lr)
    critic_opt = optax.adam(settings.critic_lr)
    temp_opt = optax.adam(settings.actor_lr)
    target_entropy = settings.target_entropy_per_dim * nets.noise_dim

    def init_opt(params: SteerParams):
        return (
            actor_opt.init(params.actor),
            critic_opt.init((params.q1, params.q2)),
            temp_opt.init(params.log_temperature),
        )

    def step(carry, inputs):
        params, opt_state, value_range = carry
        batch, key = inputs
        k_next, k_pi = jax.random.split(key)
        alpha = jnp.exp(params.log_temperature)
        next_noise, next_logp = nets.actor_sample(params.actor, batch["next_actor_in"], k_next)
        next_q = jnp.minimum(
            nets.q(params.q1_target, batch["next_critic_in"], next_noise),
            nets.q(params.q2_target, batch["next_critic_in"], next_noise),
        )
        target = batch["reward"] + gamma * (1.0 - batch["terminal"]) * (next_q - alpha * next_logp)
        if settings.critic_target == "return_to_go":
            target = batch["return_to_go"]
        target = jax.lax.stop_gradient(jnp.clip(target, value_range[0], value_range[1]))

        def critic_loss(qs):
            q1 = nets.q(qs[0], batch["critic_in"], batch["noise"])
            q2 = nets.q(qs[1], batch["critic_in"], batch["noise"])
            return jnp.mean((q1 - target) ** 2 + (q2 - target) ** 2), q1

        (q_loss, q1), q_grads = jax.value_and_grad(critic_loss, has_aux=True)((params.q1, params.q2))
        c_updates, c_state = critic_opt.update(q_grads, opt_state[1], (params.q1, params.q2))
        q1_new, q2_new = optax.apply_updates((params.q1, params.q2), c_updates)

        def actor_loss(actor):
            noise, logp = nets.actor_sample(actor, batch["actor_in"], k_pi)
            q = jnp.minimum(nets.q(q1_new, batch["critic_in"], noise), nets.q(q2_new, batch["critic_in"], noise))
            return jnp.mean(alpha * logp - q + settings.prior_weight * nets.prior_kl(actor, batch["actor_in"])), logp

        (a_loss, logp), a_grads = jax.value_and_grad(actor_loss, has_aux=True)(params.actor)
        a_updates, a_state = actor_opt.update(a_grads, opt_state[0], params.actor)
        actor = optax.apply_updates(params.actor, a_updates)

        def temp_loss(log_t):
            return -jnp.mean(log_t * jax.lax.stop_gradient(logp + target_entropy))

        t_loss, t_grad = jax.value_and_grad(temp_loss)(params.log_temperature)
        t_updates, t_state = temp_opt.update(t_grad, opt_state[2], params.log_temperature)
        log_t = optax.apply_updates(params.log_temperature, t_updates)

        def polyak(target, online):
            return jax.tree.map(lambda t, o: (1 - settings.tau) * t + settings.tau * o, target, online)

        new = SteerParams(
            actor, q1_new, q2_new, polyak(params.q1_target, q1_new), polyak(params.q2_target, q2_new), log_t
        )
        metrics = {
            "critic_loss": q_loss,
            "actor_loss": a_loss,
            "temperature": jnp.exp(log_t),
            "entropy": -jnp.mean(logp),
            "q_mean": jnp.mean(q1),
            "target_mean": jnp.mean(target),
        }
        return (new, (a_state, c_state, t_state), value_range), metrics

    @jax.jit
    def update(params, opt_state, batches, key, value_range):
        g = batches["reward"].shape[0]
        carry = (params, opt_state, jnp.asarray(value_range, jnp.float32))
        (params, opt_state, _), metrics = jax.lax.scan(step, carry, (batches, jax.random.split(key, g)))
        return params, opt_state, jax.tree.map(jnp.mean, metrics)

    return update, init_opt
