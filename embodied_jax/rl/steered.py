"""The steered policy (``rl/steering.py``'s actor in front of the frozen flow policy) and its held-out
evaluations: ``Steerer.decide`` for the simulator's observations, ``Steerer.predict`` for raw batches,
and episodes on the evaluation seed for Meta-World (its own evaluation, LeRobot's protocol) or a
JAX environment (host-stepped), with or without the actor."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.rl import host_rollout
from embodied_jax.rl.held_out import MetaWorldHeldOut
from embodied_jax.rl.start import Start
from embodied_jax.rl.steering import SteerNetworks, steered_chunk


class Steerer:
    """The frozen policy with the actor in front: ``decide`` for the simulator's observations
    (the rollout), ``predict`` for the evaluation's raw batches (Meta-World)."""

    def __init__(self, st: Start, nets: SteerNetworks):
        self.st, self.nets = st, nets
        agent = st.agent

        def decide(policy_params, actor, obs, key, deterministic):
            model = agent.merge(policy_params)
            model_obs = agent.observe(obs)
            chunk, actor_in, noise = steered_chunk(
                model, nets, actor, model_obs, obs["state"], key, deterministic, num_steps=agent.num_steps
            )
            return agent.act(chunk, obs["state"]), actor_in, noise

        def base(policy_params, obs, key):  # the policy as deployed: the run's initial noise (noise_scale)
            model = agent.merge(policy_params)
            chunk = model.sample_actions(agent.observe(obs), key, num_steps=agent.num_steps)
            return agent.act(chunk, obs["state"])

        def chunk_for(policy_params, actor, model_obs, state, key):
            model = agent.merge(policy_params)
            return steered_chunk(model, nets, actor, model_obs, state, key, True, num_steps=agent.num_steps)[0]

        self.decide = jax.jit(decide, static_argnums=4)
        self.base = jax.jit(base)
        self._chunk_for = jax.jit(chunk_for)

    def predict(self, policy_params, actor, raw: dict[str, Any], key) -> np.ndarray:
        """Robot actions [B, H, A] for a raw observation batch (the bundle's pre- and postprocessing)."""
        bundle = self.st.bundle
        obs = jax.tree.map(jnp.asarray, bundle.preprocess(raw))
        state = np.asarray(raw[bundle.inputs.state_key], np.float32)
        chunk = self._chunk_for(policy_params, actor, obs, jnp.asarray(state), key)
        return bundle.postprocess(np.asarray(chunk), state)


def host_episodes(env, act, key, decisions: int, k: int) -> tuple[np.ndarray, int]:
    """One batch of host-stepped episodes with ``act(obs, decision) -> actions [B, H, A]``: (success
    [B], env steps)."""
    n = env.num_envs
    env.reset(key, np.arange(n))
    for r in range(decisions):
        if env.done.all():
            break
        obs = env.observe()
        obs["time_step"] = np.full((n,), r * k, np.int32)
        actions = np.asarray(act(obs, r))
        for j in range(k):
            env.step(actions[:, j])
    return env.success.copy(), int(np.sum(env.steps))


class HostHeldOut:
    """A JAX environment's held-out episodes, host-stepped from the evaluation seed's reset keys:
    the base policy (random noise) and the steered one on the same initial states."""

    def __init__(self, st: Start, steerer: Steerer, episodes: int, seed: int, decisions: int, k: int):
        self.env = host_rollout.JaxHostEnvs(st.env, episodes)
        self.steerer, self.seed, self.decisions, self.k = steerer, seed, decisions, k

    def __call__(self, policy_params, actor=None, deterministic=True) -> dict[str, Any]:
        key = jax.random.key(self.seed)
        k_reset, k_policy = jax.random.split(key)

        def act(obs, r):
            kr = jax.random.fold_in(k_policy, r)
            if actor is None:
                return self.steerer.base(policy_params, obs, kr)
            return self.steerer.decide(policy_params, actor, obs, kr, deterministic)[0]

        success, _ = host_episodes(self.env, act, k_reset, self.decisions, self.k)
        return {"success_rate": float(success.mean()), "episodes": len(success)}


class MetaWorldSteeredHeldOut:
    """Meta-World's held-out evaluation (``rl.held_out.MetaWorldHeldOut``'s settings): the policy as
    deployed without an actor, the steered policy with one."""

    def __init__(self, st: Start, steerer: Steerer, config, k: int):
        self.plain = MetaWorldHeldOut(st, config, k)
        self.steerer = steerer

    def __call__(self, policy_params, actor=None, deterministic=True) -> dict[str, Any]:
        if actor is None:
            return self.plain(policy_params)

        def policy(batch, call_seed):
            return self.steerer.predict(policy_params, actor, batch, jax.random.key(call_seed))

        return self.plain.evaluate(policy, self.plain.tasks, self.plain.settings)
