"""The RL rollout with environments stepped on the host (Meta-World's, as its evaluation steps them):
the same ``Rollout`` as ``rollout.make_rollout``'s in-program one, from one jitted policy call per
decision for the whole batch.

A ``HostEnvs`` is a batch of environments behind five calls: ``reset(key, env_ids)``,
``observe()`` ({"state", "images"} as NumPy, the simulator's observation), ``privileged_state()``
(the critic's extra input), ``step(actions) -> reward`` (one control step of every environment
still running; a finished one gets reward 0 and stays as it is) and the arrays ``done``,
``success`` and ``steps``. ``JaxHostEnvs`` puts a JAX environment (the toy, an MJX task) behind
them; ``sim.metaworld.MetaWorldBatch`` Meta-World's.

Keys are derived as in the in-program rollout (each environment's from its index, each decision's
sampling key from the decision and the index), so a JAX environment stepped here gives the
in-program rollout's episodes (``tests/test_rl_core.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.rl.agent import FlowAgent
from embodied_jax.rl.rollout import Rollout, RolloutSpec


class HostEnvs(Protocol):
    num_envs: int
    episode_limit: int
    done: np.ndarray  # bool [B]
    success: np.ndarray  # bool [B], latched
    steps: np.ndarray  # int [B] control steps taken

    def reset(self, key: jax.Array, env_ids: np.ndarray) -> None: ...

    def observe(self) -> dict[str, Any]: ...

    def privileged_state(self) -> np.ndarray: ...

    def step(self, actions: np.ndarray) -> np.ndarray: ...


class JaxHostEnvs:
    """A JAX environment (``reset(key)``/``step(state, action)`` of one world, batched ``observe``,
    ``privileged_state``) stepped from the host, one jitted call per control step."""

    def __init__(self, env: Any, num_envs: int):
        self.env, self.num_envs, self.episode_limit = env, num_envs, env.episode_limit
        self._reset = jax.jit(lambda key, ids: jax.vmap(lambda i: env.reset(jax.random.fold_in(key, i)))(ids))
        self._step = jax.jit(jax.vmap(env.step))
        self._observe = jax.jit(env.observe)
        self._privileged = jax.jit(env.privileged_state)
        self.states = None

    def reset(self, key, env_ids):
        self.states = self._reset(key, jnp.asarray(env_ids))

    def observe(self):
        return jax.device_get(self._observe(self.states))

    def privileged_state(self):
        return np.asarray(self._privileged(self.states))

    def step(self, actions):
        before = np.asarray(self.states.done)
        self.states = self._step(self.states, jnp.asarray(actions, jnp.float32))
        return np.where(before, 0.0, np.asarray(self.states.reward)).astype(np.float32)

    @property
    def done(self):
        return np.asarray(self.states.done)

    @property
    def success(self):
        return np.asarray(self.states.success)

    @property
    def steps(self):
        return np.asarray(self.states.step)


def critic_width(envs: HostEnvs, privileged: bool = True) -> int:
    """The width of the critic's input for ``envs`` (resets them once to see it)."""
    envs.reset(jax.random.key(0), np.arange(envs.num_envs))
    width = np.asarray(envs.observe()["state"]).shape[-1]
    return width + (envs.privileged_state().shape[-1] if privileged else 0)


def make_host_rollout(
    envs: HostEnvs, agent: FlowAgent, critic: Callable[[Any, jax.Array, jax.Array], jax.Array], spec: RolloutSpec
) -> Callable[[Any, Any, jax.Array], Rollout]:
    """``rollout(params, critic_params, key) -> Rollout`` of ``spec.num_envs`` host-stepped episodes."""
    if envs.num_envs != spec.num_envs:
        raise ValueError(f"the host environments hold {envs.num_envs} worlds, the rollout wants {spec.num_envs}")
    if spec.groups is not None and spec.num_envs % spec.groups:
        raise ValueError(f"num_envs={spec.num_envs} must be a multiple of groups={spec.groups}")
    k, n = spec.execute_steps, spec.num_envs
    ids = np.arange(n)

    def sample_row(params, observation, key):
        row = jax.tree.map(lambda x: x[None], observation)
        return jax.tree.map(lambda x: x[0], agent.sample(params, row, key))

    @jax.jit
    def decide(params, critic_params, obs, features, progress, k_policy, r):
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(k_policy, r), i))(jnp.arange(n))
        decision = jax.vmap(sample_row, in_axes=(None, 0, 0))(params, obs, keys)
        if spec.expert_features:
            features = jnp.concatenate([features, agent.features(params, decision.model_observation)], -1)
        return decision, critic(critic_params, features, progress), features

    def rollout(params, critic_params, key):
        k_reset, k_policy = jax.random.split(key)
        envs.reset(k_reset, ids if spec.groups is None else ids % spec.groups)
        records, ret = [], np.zeros(n, np.float32)
        for r in range(spec.decisions):
            obs = envs.observe()
            obs["time_step"] = np.full((n,), r * k, np.int32)
            robot = np.asarray(obs["state"], np.float32)
            features = robot if not spec.privileged_critic else np.concatenate([robot, envs.privileged_state()], -1)
            progress = np.full((n,), r / spec.decisions, np.float32)
            decision, value, features = decide(params, critic_params, obs, features, progress, k_policy, r)
            was_done, had_success = envs.done.copy(), envs.success.copy()
            actions = np.asarray(decision.actions)
            dense = np.zeros(n, np.float32)
            for j in range(k):
                dense += envs.step(actions[:, j])
            running = ~was_done
            reward = ((envs.success & ~had_success).astype(np.float32) + spec.shaping * dense) * running
            ret += reward
            records.append(
                dict(
                    model_observation=decision.model_observation,
                    critic_input=features,
                    progress=progress,
                    chain=decision.chain,
                    log_prob=decision.log_prob,
                    value=np.asarray(value) * running,
                    reward=reward,
                    terminal=envs.done & running,
                    active=running,
                    first_action=actions[:, 0],
                )
            )
        stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *records)
        return Rollout(
            success=jnp.asarray(envs.success),
            episode_return=jnp.asarray(ret),
            env_steps=jnp.asarray(envs.steps),
            **stacked,
        )

    return rollout
