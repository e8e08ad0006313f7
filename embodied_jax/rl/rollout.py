"""The RL rollout: a batch of episodes with the policy in the loop, as one jitted program.

Every ``execute_steps`` (k) control steps each environment takes a decision: the policy samples
a chunk through Flow-SDE (``agent.FlowAgent.sample``) from the observation of that moment and
the first k actions are executed (an inner ``lax.scan``); the critic values the decision's
state, from the robot state and, by default, the simulator's privileged state (object and
goal poses, latched facts: ``env.privileged_state``), which the policy never sees. Reset,
rendering, the policy's pre- and post-processing, sampling, physics and the bookkeeping run
on device for the whole batch with no host round trip.

Each environment's reset key and each decision's sampling key are derived from its global
index, and each row is sampled on its own (``vmap``), so a rollout sharded over the mesh's
``data`` axis (``shard_map``: each device simulates its share) is the single-device rollout.
With ``groups`` the environments share reset keys in ``groups`` groups (GRPO: environment ``b``
resets like ``b % groups``).

A decision's reward is 1 when the episode succeeds during its k steps, plus ``shaping`` times
the task's dense rewards of those steps. Decisions after an episode ended are inactive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from embodied_jax.rl.agent import FlowAgent


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Rollout:
    """Time-major [T, B, ...] decisions of one rollout, with per-episode outcomes [B]."""

    model_observation: Any  # the policy's inputs at each decision
    critic_input: jax.Array  # [T, B, C] robot state (and the privileged state)
    first_action: jax.Array  # [T, B, A] the first executed action of each decision (robot units)
    progress: jax.Array  # [T, B] decisions taken / decisions per episode
    chain: jax.Array  # [T, B, num_steps + 1, ...] the sampler's states
    log_prob: jax.Array  # [T, B] the chain's log-probability when sampled
    value: jax.Array  # [T, B]
    reward: jax.Array  # [T, B]
    terminal: jax.Array  # [T, B] the episode ended during the decision
    active: jax.Array  # [T, B] the episode was running when the decision was taken
    success: jax.Array  # [B]
    episode_return: jax.Array  # [B] undiscounted sum of rewards
    env_steps: jax.Array  # [B] control steps taken


EPISODE_FIELDS = ("success", "episode_return", "env_steps")  # [B]; the other fields are time-major [T, B, ...]


def concat_rollouts(rollouts: list[Rollout]) -> Rollout:
    """Several rollouts of one spec as one, their episodes side by side (B = the sum)."""
    if len(rollouts) == 1:
        return rollouts[0]
    fields = {}
    for field in dataclasses.fields(Rollout):
        axis = 0 if field.name in EPISODE_FIELDS else 1
        parts = [getattr(r, field.name) for r in rollouts]
        fields[field.name] = jax.tree.map(lambda *xs, axis=axis: jnp.concatenate(xs, axis=axis), *parts)
    return Rollout(**fields)


@dataclasses.dataclass(frozen=True)
class RolloutSpec:
    num_envs: int
    execute_steps: int
    decisions: int  # per episode: ceil(episode limit / execute_steps)
    shaping: float = 0.0
    groups: int | None = None
    privileged_critic: bool = True  # the critic also sees env.privileged_state
    expert_features: bool = False  # the critic also reads the agent's features of the observation


def critic_input(env: Any, states: Any, robot_state: jax.Array, privileged: bool) -> jax.Array:
    """The critic's input [B, C] of a batch of states: the robot state, then the privileged state."""
    if not privileged:
        return robot_state
    return jnp.concatenate([robot_state, env.privileged_state(states)], axis=-1)


def critic_width(env: Any, privileged: bool = True) -> int:
    """The width of the critic's input for ``env``."""

    def features(key):
        states = jax.vmap(env.reset)(key[None])
        return critic_input(env, states, env.robot_state(states), privileged)

    return int(jax.eval_shape(features, jax.random.key(0)).shape[-1])


def observation_example(env: Any) -> dict[str, Any]:
    """The abstract observation (``jax.ShapeDtypeStruct``s) of one world of ``env``."""
    return jax.eval_shape(lambda key: env.observe(jax.vmap(env.reset)(key[None])), jax.random.key(0))


def expert_width(agent: FlowAgent, params: Any, observation: dict[str, Any]) -> int:
    """The width of ``agent.features`` for an observation like ``observation`` (abstractly)."""
    return int(jax.eval_shape(lambda p, o: agent.features(p, agent.observe(o)), params, observation).shape[-1])


def decisions_per_episode(episode_limit: int, execute_steps: int) -> int:
    return -(-episode_limit // execute_steps)


def make_rollout(
    env: Any,
    agent: FlowAgent,
    critic: Callable[[Any, jax.Array, jax.Array], jax.Array],
    spec: RolloutSpec,
    *,
    mesh=None,
    data_axis: str = "data",
) -> Callable[[Any, Any, jax.Array], Rollout]:
    """A jitted ``rollout(params, critic_params, key) -> Rollout`` of ``spec.num_envs`` episodes.

    ``env``: ``reset(key)`` and ``step(state, action)`` of one world, ``observe(states)`` of a
    batch ({"state", "images"}), ``episode_limit``. ``critic(critic_params, state, progress)``."""
    k, decisions = spec.execute_steps, spec.decisions
    shards = 1 if mesh is None else mesh.shape[data_axis]
    if spec.num_envs % shards:
        raise ValueError(f"num_envs={spec.num_envs} must divide evenly over {shards} data shards")
    if spec.groups is not None and spec.num_envs % spec.groups:
        raise ValueError(f"num_envs={spec.num_envs} must be a multiple of groups={spec.groups}")
    local = spec.num_envs // shards

    def sample_row(params, observation, key):
        row = jax.tree.map(lambda x: x[None], observation)
        return jax.tree.map(lambda x: x[0], agent.sample(params, row, key))

    def run(params, critic_params, key, env_ids):
        k_reset, k_policy = jax.random.split(key)
        reset_ids = env_ids if spec.groups is None else env_ids % spec.groups
        states = jax.vmap(lambda i: env.reset(jax.random.fold_in(k_reset, i)))(reset_ids)

        def decide(carry, r):
            states, ret = carry
            obs = env.observe(states)
            obs["time_step"] = jnp.full((local,), r * k, jnp.int32)
            keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(k_policy, r), i))(env_ids)
            decision = jax.vmap(sample_row, in_axes=(None, 0, 0))(params, obs, keys)
            progress = jnp.full((local,), r / decisions, jnp.float32)
            features = critic_input(env, states, obs["state"], spec.privileged_critic)
            if spec.expert_features:
                features = jnp.concatenate([features, agent.features(params, decision.model_observation)], -1)
            value = critic(critic_params, features, progress)
            before = states

            def execute(states, j):
                nxt = jax.vmap(env.step)(states, decision.actions[:, j])
                return nxt, nxt.reward * (~states.done)

            states, dense = jax.lax.scan(execute, states, jnp.arange(k))
            gained = (states.success & ~before.success).astype(jnp.float32)
            reward = gained + spec.shaping * dense.sum(axis=0)
            record = dict(
                model_observation=decision.model_observation,
                critic_input=features,
                first_action=decision.actions[:, 0],
                progress=progress,
                chain=decision.chain,
                log_prob=decision.log_prob,
                value=value * ~before.done,
                reward=reward * ~before.done,
                terminal=states.done & ~before.done,
                active=~before.done,
            )
            return (states, ret + record["reward"]), record

        (final, ret), rec = jax.lax.scan(decide, (states, jnp.zeros((local,), jnp.float32)), jnp.arange(decisions))
        return Rollout(success=final.success, episode_return=ret, env_steps=final.step, **rec)

    if mesh is None:
        ids = jnp.arange(spec.num_envs)
        return jax.jit(lambda params, critic_params, key: run(params, critic_params, key, ids))

    # size-1 axes are manual too (as in sim/closed_loop.py): host callbacks need every axis manual
    manual = {data_axis} | {name for name, size in mesh.shape.items() if size == 1}

    def sharded(params, critic_params, key):
        def shard(params, critic_params, key):
            ids = jax.lax.axis_index(data_axis) * local + jnp.arange(local)
            return run(params, critic_params, key, ids)

        out_specs = Rollout(
            model_observation=P(None, data_axis),
            critic_input=P(None, data_axis),
            first_action=P(None, data_axis),
            progress=P(None, data_axis),
            chain=P(None, data_axis),
            log_prob=P(None, data_axis),
            value=P(None, data_axis),
            reward=P(None, data_axis),
            terminal=P(None, data_axis),
            active=P(None, data_axis),
            success=P(data_axis),
            episode_return=P(data_axis),
            env_steps=P(data_axis),
        )
        return jax.shard_map(
            shard, mesh=mesh, in_specs=(P(), P(), P()), out_specs=out_specs, axis_names=manual, check_vma=False
        )(params, critic_params, key)

    return jax.jit(sharded)
