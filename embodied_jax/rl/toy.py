"""A pure-JAX reaching task for the toy flow policy: the RL stack's tests and its smallest demo.

A point starts at a random place in the unit square and must come within ``radius`` of a
random goal. The robot state is (position, goal, zeros to ``state_dim``); an action's first two
dims are a velocity command, clipped to [-1, 1] and scaled by ``speed``. Reward and success are
the simulator's conventions (``sim/env.py``): reward 1 once successful, otherwise a dense closeness
term in [0, 0.5]; success latched, done at success or the episode limit, a done world unchanged
by further steps. No images.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ToyState:
    position: jax.Array
    goal: jax.Array
    step: jax.Array
    reward: jax.Array
    success: jax.Array
    done: jax.Array


@dataclasses.dataclass(frozen=True)
class ToyReach:
    state_dim: int = 8
    action_dim: int = 4
    episode_limit: int = 16
    radius: float = 0.15
    speed: float = 0.25
    name: str = "toy_reach"
    instruction: str = "move the point to the goal"
    cameras: tuple[str, ...] = ()

    def reset(self, rng: jax.Array) -> ToyState:
        k_pos, k_goal = jax.random.split(rng)
        position = jax.random.uniform(k_pos, (2,), minval=-1.0, maxval=1.0)
        goal = jax.random.uniform(k_goal, (2,), minval=-1.0, maxval=1.0)
        success = jnp.linalg.norm(position - goal) < self.radius
        zero = jnp.zeros((), jnp.float32)
        return ToyState(position, goal, jnp.zeros((), jnp.int32), zero, success, jnp.zeros((), bool))

    def step(self, state: ToyState, action: jax.Array) -> ToyState:
        position = state.position + self.speed * jnp.clip(action[:2], -1.0, 1.0)
        step = state.step + 1
        success = state.success | (jnp.linalg.norm(position - state.goal) < self.radius)
        closeness = 1.0 - jnp.tanh(jnp.linalg.norm(position - state.goal))
        reward = jnp.where(success, 1.0, 0.5 * closeness).astype(jnp.float32)
        new = ToyState(position, state.goal, step, reward, success, success | (step >= self.episode_limit))
        return jax.tree.map(lambda old, n: jnp.where(state.done, old, n), state, new)

    def robot_state(self, states: ToyState) -> jax.Array:
        b = states.position.shape[0]
        pad = jnp.zeros((b, self.state_dim - 4), jnp.float32)
        return jnp.concatenate([states.position, states.goal, pad], axis=-1)

    def privileged_state(self, states: ToyState) -> jax.Array:
        """[B, 5]: position, goal and phase (the critic's input; the toy's state already shows the goal)."""
        phase = states.step.astype(jnp.float32) / self.episode_limit
        return jnp.concatenate([states.position, states.goal, phase[:, None]], axis=-1)

    def render(self, states: ToyState) -> dict[str, jax.Array]:
        return {}

    def observe(self, states: ToyState) -> dict[str, jax.Array]:
        return {"state": self.robot_state(states), "images": {}}
