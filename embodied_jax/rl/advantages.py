"""Advantages of chunk-level decisions: GAE over a rollout, and GRPO's group-normalised success.

Arrays are time-major, [T, B]: decision ``t`` of environment ``b``. ``active`` marks decisions
taken while the episode ran; ``terminal`` that the episode ended (success or failure, not a
time limit) during decision ``t``, so nothing after it is bootstrapped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gae(
    rewards: jax.Array,
    values: jax.Array,
    terminal: jax.Array,
    active: jax.Array,
    last_value: jax.Array,
    *,
    gamma: float,
    lam: float,
) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns) [T, B] by generalised advantage estimation.

    ``values`` [T, B] are the critic's at each decision, ``last_value`` [B] its value after the
    last one (bootstrapped where the episode was cut by the rollout's length). Inactive decisions
    get zero advantage and a return equal to their value."""
    active = active.astype(jnp.float32)
    cont = 1.0 - terminal.astype(jnp.float32)
    next_values = jnp.concatenate([values[1:], last_value[None]], axis=0)
    # an episode that ended at t has no decision t + 1: its next value only counts when it continues
    next_active = jnp.concatenate([active[1:], jnp.ones_like(last_value)[None]], axis=0)
    deltas = rewards + gamma * cont * next_values * next_active - values

    def back(carry, xs):
        delta, c, a, na = xs
        adv = delta + gamma * lam * c * na * carry
        adv = adv * a
        return adv, adv

    _, adv = jax.lax.scan(back, jnp.zeros_like(last_value), (deltas, cont, active, next_active), reverse=True)
    return adv, adv + values * active


def group_advantages(success: jax.Array, groups: int, eps: float = 1e-6) -> jax.Array:
    """GRPO: each episode's success [B] minus its group's mean, over the group's std (B = groups x
    members; episode ``b`` belongs to group ``b % groups``, so groups share reset keys); a group whose
    members all agree gives zero."""
    success = success.astype(jnp.float32)
    if success.shape[0] % groups:
        raise ValueError(f"{success.shape[0]} episodes do not split into {groups} groups")
    by_group = success.reshape(-1, groups)
    mean, std = by_group.mean(axis=0), by_group.std(axis=0)
    return ((by_group - mean) / (std + eps)).reshape(-1)
