"""Batched, fixed-length rollouts of a per-step policy in one ``jit``/``lax.scan``.

Used by the scripted-expert data collection, the tests and the benchmarks; the
closed-loop evaluator with action chunking lives in :mod:`embodied_jax.sim.closed_loop`.

A *step policy* here is ``policy(states, t, rng) -> actions [B, A]`` over a batch of
:class:`~embodied_jax.sim.env.EnvState` (it may read privileged state: experts do).
The trajectory records, per control step ``t``, the observation *before* the action
(LeRobot's convention: frame t = (observation_t, action_t)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.sim import env as env_lib
from embodied_jax.sim import experts

StepPolicy = Callable[[env_lib.EnvState, jax.Array, jax.Array], jax.Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Trajectory:
    """Time-major arrays [T, B, ...] of one batched rollout."""

    state: jax.Array  # robot state before the action
    action: jax.Array
    qpos: jax.Array  # full simulator qpos before the action (for tests and debugging)
    reward: jax.Array  # reward after the action
    success: jax.Array  # latched success after the action
    done: jax.Array  # done after the action
    active: jax.Array  # the episode was still running when the action was taken
    images: dict[str, jax.Array]  # camera -> uint8 [T, B, H, W, 3] (empty if not rendered)
    info: dict[str, jax.Array]  # task poses of each episode, [B, ...]


def expert_policy(env: env_lib.Env) -> StepPolicy:
    expert = experts.expert_for(env.task)
    return lambda states, t, rng: jax.vmap(expert)(states)


def random_policy(env: env_lib.Env) -> StepPolicy:
    return lambda states, t, rng: env.random_actions(rng, states.step.shape[0])


def mixed_policy(first: StepPolicy, second: StepPolicy, use_second: np.ndarray) -> StepPolicy:
    """World i follows ``second`` where ``use_second[i]`` else ``first`` (one compile for both)."""
    mask = jnp.asarray(use_second, bool)[:, None]
    return lambda states, t, rng: jnp.where(mask, second(states, t, rng), first(states, t, rng))


def make_rollout(
    env: env_lib.Env,
    policy: StepPolicy,
    batch: int,
    *,
    steps: int | None = None,
    render: bool = False,
    execution_noise: float = 0.0,
) -> Callable[[jax.Array], Trajectory]:
    """A jitted ``rollout(rng) -> Trajectory`` of ``batch`` episodes for ``steps`` control steps.

    ``execution_noise`` (metres, std): Gaussian noise added to the commanded hand positions
    before they are executed, while the trajectory records the policy's clean actions. With
    an expert policy this is DART-style data collection: the states drift off the expert's
    nominal path and the labels show how the expert recovers from there.
    """
    steps = env.episode_limit if steps is None else steps
    if execution_noise < 0:
        raise ValueError(f"execution_noise must be >= 0, got {execution_noise}")
    positions = jnp.asarray(env.task.position_action_mask())

    def run(rng):
        k_reset, k_policy = jax.random.split(rng)
        states = env_lib.batch_reset(env, k_reset, batch)

        def body(states, xs):
            t, key = xs
            obs_images = env.render(states) if render else {}
            if execution_noise:
                key, k_noise = jax.random.split(key)
                actions = policy(states, t, key)
                noise = execution_noise * jax.random.normal(k_noise, actions.shape)
                executed = actions + jnp.where(positions, noise, 0.0)
            else:
                actions = executed = policy(states, t, key)
            nxt = env_lib.batch_step(env, states, executed)
            record = dict(
                state=env.robot_state(states),
                action=actions,
                qpos=states.data.qpos,
                reward=nxt.reward,
                success=nxt.success,
                done=nxt.done,
                active=~states.done,
                images=obs_images,
            )
            return nxt, record

        keys = jax.random.split(k_policy, steps)
        final, rec = jax.lax.scan(body, states, (jnp.arange(steps), keys))
        return Trajectory(info=states.info, **rec), final

    jitted = jax.jit(run)
    return lambda rng: jitted(rng)[0]


def episode_lengths(traj: Trajectory) -> np.ndarray:
    """Number of recorded frames per episode: steps taken until (and including) done."""
    return np.asarray(traj.active).sum(0)
