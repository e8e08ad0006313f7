"""PPO over chunk-level decisions: the clipped surrogate of the chain's likelihood ratio, the value
loss, an optional KL term to the starting policy, and one update (epochs of minibatches) as one
jitted program.

``objective="weighted_flow"`` replaces the clipped surrogate by the model's own training loss
(flow matching) on each decision's sampled chunk, weighted by the positive part of its normalised
advantage: the policy regresses onto the decisions that did better than expected (advantage-weighted
regression with the weights clipped at zero), a loss as well conditioned as behaviour cloning's
whatever the sampler's noise level, where the likelihood ratio of a low-noise chain is not. The
ratio, its clip fraction and the KL are still computed and reported (and the KL term optimised
with ``kl_coef``). ``objective="self_imitation"`` takes the same flow-matching loss on the decisions
of the episodes that succeeded only, unweighted (success-filtered self-imitation, expert iteration
with the binary reward): no advantage, critic or ratio enters the policy's loss.

With demonstrations (``RLConfig.demo_batch``; ``rl/demos.py``) every minibatch also takes
behaviour cloning's own loss on a batch of the run's training data, times ``demo_coef``: the
policy is anchored to the demonstrations it was cloned from while it learns from its own episodes.

The ratio is ``exp(log π_θ(chain) - log π_old(chain))`` with the chain's Flow-SDE
log-probability (``nn/flow.py``); θ is the trainable part of the weights (``rl/scope.py``),
the rest enters the loss unchanged and gets no gradient. The KL to the start is the k3 estimator
``r - 1 - log r`` with ``r = π_start / π_θ`` on the chains sampled (its coefficient ``kl_coef``;
0: reported, not optimised). Advantages are normalised per minibatch over active decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from embodied_jax.config_registry import register
from embodied_jax.rl.agent import FlowAgent
from embodied_jax.rl.scope import Scope

OBJECTIVES = ("clip", "weighted_flow", "self_imitation")  # PPOSettings.objective
IMITATE = ("successes", "better_than_expected")  # PPOSettings.imitate


@register
@dataclasses.dataclass(frozen=True)
class PPOSettings:
    clip: float = 0.2
    value_coef: float = 0.5
    kl_coef: float = 0.0
    epochs: int = 2
    minibatches: int = 4
    normalize_advantages: bool = True
    # "clip": PPO's clipped ratio surrogate; "weighted_flow": the flow-matching loss on the decisions'
    # own chunks weighted by max(normalised advantage, 0); "self_imitation": that loss on the decisions of
    # successful episodes only (module docstring).
    objective: str = "clip"
    # self_imitation: the successful decisions an update trains on, drawn from the rollout's (with
    # replacement when it has fewer), so the update compiles once and spends nothing on failures.
    imitation_decisions: int = 1024
    # self_imitation: which successful decisions are imitated. "successes": all of them;
    # "better_than_expected": those whose advantage is positive as well. With GRPO's groups that keeps
    # the successes of initial states where not every episode succeeded (where what the policy chose,
    # not where the object lay, decided the outcome); with GAE, the successes the critic did not foresee.
    imitate: str = "successes"
    demo_coef: float = 1.0  # weight of behaviour cloning's loss on the demonstrations (RLConfig.demo_batch)

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"ppo.objective={self.objective!r}: one of {', '.join(OBJECTIVES)}")
        if self.imitate not in IMITATE:
            raise ValueError(f"ppo.imitate={self.imitate!r}: one of {', '.join(IMITATE)}")
        if self.imitation_decisions < self.minibatches:
            raise ValueError(
                f"ppo.imitation_decisions={self.imitation_decisions} must fill ppo.minibatches={self.minibatches}"
            )


def _masked_mean(x, mask):
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def ppo_loss(
    agent: FlowAgent,
    critic: Callable,
    settings: PPOSettings,
    params,
    critic_params,
    mb: dict[str, Any],
    fixed=None,
    key: jax.Array | None = None,
    demos: Any = None,
):
    """(loss, metrics) of one minibatch of flat decisions (``mb``: model_observation, chain, log_prob,
    start_log_prob, advantage, return, critic_input, progress, active, success); with ``fixed`` the
    policy's weights are ``Scope.combine(params, fixed)``; ``key``: the flow-matching draws of the
    flow objectives and of the demonstrations' loss; ``demos``: a training batch of the run's data
    (behaviour cloning's loss, times ``demo_coef``), or None."""
    mask = mb["active"].astype(jnp.float32)
    weights = params if fixed is None else Scope.combine(params, fixed)
    value = critic(critic_params, mb["critic_input"], mb["progress"])
    scale = critic_params["scale"] if isinstance(critic_params, dict) and "scale" in critic_params else 1.0
    value_loss = _masked_mean(jnp.square((value - mb["return"]) / scale), mask)  # in the returns' units
    loss = settings.value_coef * value_loss
    metrics = {"value_loss": value_loss}
    if settings.objective == "self_imitation":
        flow = agent.flow_loss(weights, mb["model_observation"], mb["chain"][:, -1], key)
        policy_loss = _masked_mean(flow, mask * mb["success"].astype(jnp.float32))
    # The chain's likelihood (a velocity per denoising step) only where a ratio or the KL term needs it.
    if settings.objective != "self_imitation" or settings.kl_coef > 0:
        log_prob = agent.log_prob(weights, mb["model_observation"], mb["chain"])
        # clamped: a ratio of e^20 is clipped all the same, and exp of more overflows to inf (NaN gradients)
        log_ratio = jnp.clip(jnp.where(mask > 0, log_prob - mb["log_prob"], 0.0), -20.0, 20.0)
        ratio = jnp.exp(log_ratio)
        adv = mb["advantage"]
        if settings.normalize_advantages:
            mean = _masked_mean(adv, mask)
            std = jnp.sqrt(_masked_mean(jnp.square(adv - mean), mask))
            adv = (adv - mean) / (std + 1e-8)
        if settings.objective == "weighted_flow":
            flow = agent.flow_loss(weights, mb["model_observation"], mb["chain"][:, -1], key)
            policy_loss = _masked_mean(jnp.maximum(adv, 0.0) * flow, mask)
        elif settings.objective == "clip":
            surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - settings.clip, 1.0 + settings.clip) * adv)
            policy_loss = -_masked_mean(surrogate, mask)
        log_r = jnp.clip(jnp.where(mask > 0, mb["start_log_prob"] - log_prob, 0.0), -20.0, 20.0)
        kl_start = _masked_mean(jnp.exp(log_r) - 1.0 - log_r, mask)
        loss = loss + settings.kl_coef * kl_start
        metrics.update(
            kl_to_start=kl_start,
            approx_kl=_masked_mean(ratio - 1.0 - log_ratio, mask),
            clip_fraction=_masked_mean((jnp.abs(ratio - 1.0) > settings.clip).astype(jnp.float32), mask),
            ratio_mean=_masked_mean(ratio, mask),
        )
    loss = loss + policy_loss
    metrics["policy_loss"] = policy_loss
    if demos is not None:
        demo_key = jax.random.fold_in(jax.random.key(0) if key is None else key, 1)
        demo_loss = agent.bc_loss(weights, demos, demo_key)
        loss = loss + settings.demo_coef * demo_loss
        metrics["demo_loss"] = demo_loss
    return loss, metrics


def flat_decisions(rollout, advantages, returns, start_log_prob) -> dict[str, Any]:
    """The rollout's [T, B] decisions as one flat batch [T * B] for minibatching."""

    def flat(x):
        return x.reshape(-1, *x.shape[2:])

    return {
        "model_observation": jax.tree.map(flat, rollout.model_observation),
        "chain": flat(rollout.chain),
        "log_prob": flat(rollout.log_prob),
        "start_log_prob": flat(start_log_prob),
        "advantage": flat(advantages),
        "return": flat(returns),
        "critic_input": flat(rollout.critic_input),
        "progress": flat(rollout.progress),
        "active": flat(rollout.active),
        "success": flat(jnp.broadcast_to(rollout.success[None], rollout.active.shape)),  # the episode's
    }


def imitation_pool(batch: dict[str, Any], imitate: str = "successes") -> np.ndarray:
    """Indices of the flat ``batch``'s decisions self-imitation may draw: the active decisions of its
    successful episodes (``imitate="better_than_expected"``: those of them with a positive advantage)."""
    if imitate not in IMITATE:
        raise ValueError(f"imitate={imitate!r}: one of {', '.join(IMITATE)}")
    keep = np.asarray(batch["active"], bool) & np.asarray(batch["success"], bool)
    if imitate == "better_than_expected":
        keep &= np.asarray(batch["advantage"]) > 0
    return np.flatnonzero(keep)


def imitation_batch(
    batch: dict[str, Any], size: int, key: jax.Array, imitate: str = "successes", pool: np.ndarray | None = None
) -> dict[str, Any] | None:
    """``size`` decisions of the flat ``batch`` drawn from its :func:`imitation_pool` (``pool``, when the
    caller has it already), without replacement when there are enough, with it when not; None when the
    pool is empty."""
    chosen = imitation_pool(batch, imitate) if pool is None else pool
    if chosen.size == 0:
        return None
    idx = jax.random.choice(key, chosen, (size,), replace=chosen.size < size)
    return jax.tree.map(lambda x: x[idx], batch)


def make_update(
    agent: FlowAgent,
    critic: Callable,
    settings: PPOSettings,
    policy_opt: optax.GradientTransformation,
    critic_opt: optax.GradientTransformation,
):
    """A jitted ``update(params, fixed, critic_params, opt_states, batch, key, demos=None) -> (params,
    critic_params, opt_states, metrics)``: ``settings.epochs`` passes over ``settings.minibatches``
    shuffled minibatches of the flat ``batch``, moving the trainable ``params`` (``fixed``: the
    weights that stay, or None); ``demos``: one training batch per minibatch, stacked [epochs x
    minibatches, ...], or None. Metrics are the means over minibatches, and ``first_ratio`` the
    first minibatch's mean ratio (1 up to rounding: nothing has changed yet)."""
    grad_fn = jax.value_and_grad(
        lambda p, c, mb, fixed, key, demos: ppo_loss(agent, critic, settings, p, c, mb, fixed, key, demos),
        argnums=(0, 1),
        has_aux=True,
    )

    def update(params, fixed, critic_params, opt_states, batch, key, demos=None):
        n = batch["log_prob"].shape[0]
        size = n // settings.minibatches  # each epoch leaves out the remainder (< minibatches), at random
        if size == 0:
            raise ValueError(f"{n} decisions do not fill {settings.minibatches} minibatches")

        def minibatch(carry, xs):
            idx, mb_key, demo = xs
            params, critic_params, (p_state, c_state) = carry
            mb = jax.tree.map(lambda x: x[idx], batch)
            (_, metrics), (g_p, g_c) = grad_fn(params, critic_params, mb, fixed, mb_key, demo)
            up, p_state = policy_opt.update(g_p, p_state, params)
            params = optax.apply_updates(params, up)
            up, c_state = critic_opt.update(g_c, c_state, critic_params)
            critic_params = optax.apply_updates(critic_params, up)
            metrics["grad_norm"] = optax.global_norm(g_p)
            return (params, critic_params, (p_state, c_state)), metrics

        perms = jax.vmap(lambda k: jax.random.permutation(k, n))(jax.random.split(key, settings.epochs))
        idx = perms[:, : settings.minibatches * size].reshape(settings.epochs * settings.minibatches, size)
        keys = jax.random.split(jax.random.fold_in(key, 1), settings.epochs * settings.minibatches)
        (params, critic_params, opt_states), metrics = jax.lax.scan(
            minibatch, (params, critic_params, opt_states), (idx, keys, demos)
        )
        out = jax.tree.map(jnp.mean, metrics)
        if "ratio_mean" in metrics:
            out["first_ratio"] = metrics["ratio_mean"][0]
        return params, critic_params, opt_states, out

    return jax.jit(update)  # no donation: a non-finite update is dropped and the weights before it kept
