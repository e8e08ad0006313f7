"""What explains an RL run beside its success rate.

- ``rollout_diagnostics``: per iteration, the critic's explained variance of the returns, the
  raw advantages' mean and std, and the spread of the executed actions.
- ``compare_samplers``: the RL sampler (Flow-SDE, ``FlowAgent.sample``) against the sampler as
  deployed (the model's deterministic Euler steps from fresh noise) on the same observations:
  the mean and spread of the executed actions over many draws per observation. An RL sampler
  whose actions sit elsewhere or spread wider than the deployed one's optimises a policy that is
  not the one evaluated.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from embodied_jax.rl.agent import FlowAgent


def rollout_diagnostics(r, adv, returns) -> dict[str, float]:
    """Over the active decisions of a ``Rollout``: ``explained_variance`` (1 - Var(return - value) /
    Var(return); absent when the returns do not vary), ``advantage_mean``/``advantage_std`` (before
    any normalisation) and ``action_spread`` (std over the running environments of each decision's
    first executed action, mean over dims and decisions)."""
    active = np.asarray(r.active, bool)
    values, rets, a = (np.asarray(x, np.float64)[active] for x in (r.value, returns, adv))
    out = {"advantage_mean": float(a.mean()), "advantage_std": float(a.std())}
    if rets.var() > 0:
        out["explained_variance"] = float(1.0 - np.var(rets - values) / rets.var())
    first = np.asarray(r.first_action, np.float64)
    spreads = [first[t][active[t]].std(axis=0).mean() for t in range(first.shape[0]) if active[t].sum() > 1]
    if spreads:
        out["action_spread"] = float(np.mean(spreads))
    return out


def executed_actions(
    agent: FlowAgent, params: Any, observation: dict[str, Any], keys: jax.Array, *, rl_sampler: bool
) -> jax.Array:
    """Robot actions [draws, B, H, A] of one chunk per key for a batch [B] of the simulator's
    observations: the RL sampler's (Flow-SDE) or, with ``rl_sampler`` False, the deployed one's."""

    def draw(rng):
        model = agent.merge(params)
        model_obs = agent.observe(observation)
        if rl_sampler:
            chunk = model.sample_actions(model_obs, rng, num_steps=agent.num_steps, trace=True, sde=agent.sde).actions
        else:
            chunk = model.sample_actions(model_obs, rng)
        return agent.act(chunk, observation["state"])

    return jax.lax.map(draw, keys)


def compare_samplers(agent: FlowAgent, params: Any, observation: dict[str, Any], draws: int, key: jax.Array) -> dict:
    """Executed actions of ``draws`` samples per observation (``observation``: a batch [B] of the
    simulator's observations) from the RL sampler and from the deployed one.

    Returns ``{"rl": {"mean", "std"}, "deployed": {...}}`` ([B, H, A] over draws) and the summary:
    ``mean_gap`` (mean |rl mean - deployed mean| over observations, steps and dims, in units of the
    deployed sampler's mean std) and ``spread_ratio`` (mean rl std / mean deployed std)."""

    out = {}
    for name, rl_sampler, k in zip(("rl", "deployed"), (True, False), jax.random.split(key), strict=True):
        fn = jax.jit(functools.partial(executed_actions, agent, rl_sampler=rl_sampler))
        samples = np.asarray(fn(params, observation, jax.random.split(k, draws)), np.float64)  # [draws, B, H, A]
        out[name] = {"mean": samples.mean(0), "std": samples.std(0)}
    scale = max(float(out["deployed"]["std"].mean()), 1e-12)
    out["mean_gap"] = float(np.mean(np.abs(out["rl"]["mean"] - out["deployed"]["mean"])) / scale)
    out["spread_ratio"] = float(out["rl"]["std"].mean() / scale)
    return out
