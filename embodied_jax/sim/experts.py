"""Scripted experts: waypoint schedules with rate-limited Cartesian moves.

On the gantry arms joint space is the pinch point's position, so inverse kinematics
is the identity and an expert is a waypoint schedule: the episode step selects a
phase (approach, descend, close, lift, carry, lower, release, retreat), the phase
gives a pinch-point goal from the privileged task poses (current object pose, goal,
target), and the commanded joint target moves from the measured pose towards that
goal by at most ``MAX_STEP`` per control step (smooth, learnable demonstrations).

An expert is a pure function ``expert(env, state) -> action`` of ONE world's
:class:`~embodied_jax.sim.env.EnvState`; vmap it for a batch. It reads privileged
poses from the simulator, which a learned policy never gets.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from embodied_jax.sim import tasks as tasks_lib

MAX_STEP = 0.035  # metres per control step (0.35 m/s at 10 Hz)
OPEN, CLOSED = 1.0, 0.0
CARRY_Z = 0.12
APPROACH_Z = 0.10


def _toward(current: jax.Array, goal: jax.Array, max_step: float = MAX_STEP) -> jax.Array:
    delta = goal - current
    norm = jnp.linalg.norm(delta)
    return current + delta * jnp.minimum(1.0, max_step / jnp.maximum(norm, 1e-9))


def _schedule(step: jax.Array, ends: tuple[int, ...], options: list[jax.Array]) -> jax.Array:
    """``options[i]`` while ``step < ends[i]`` (first match); the last option afterwards."""
    index = jnp.searchsorted(jnp.asarray(ends), step, side="right")
    return jnp.stack(options)[jnp.minimum(index, len(options) - 1)]


def _arm_command(task, data, arm: int, goal_xyz: jax.Array, grip: jax.Array) -> jax.Array:
    return jnp.concatenate([_toward(task.pinch(data, arm), goal_xyz), grip[None]])


def reach_expert(task: tasks_lib.Reach, state) -> jax.Array:
    return _arm_command(task, state.data, 0, state.info["target"], jnp.asarray(OPEN))


def _pick_and_carry_phases(obj_xy, dest_xy, grasp_z, lower_z):
    """Pinch goals and grips for: approach, descend, close, lift, carry, lower, release, retreat."""

    def at(xy, z):
        return jnp.concatenate([xy, jnp.array([z])])

    goals = [
        at(obj_xy, APPROACH_Z),
        at(obj_xy, grasp_z),
        at(obj_xy, grasp_z),
        at(obj_xy, CARRY_Z),
        at(dest_xy, CARRY_Z),
        at(dest_xy, lower_z),
        at(dest_xy, lower_z),
        at(dest_xy, CARRY_Z),
    ]
    grips = [OPEN, OPEN, CLOSED, CLOSED, CLOSED, CLOSED, OPEN, OPEN]
    return goals, [jnp.asarray(g) for g in grips]


PICK_PLACE_ENDS = (14, 20, 24, 29, 42, 47, 50)


def pick_place_expert(task: tasks_lib.PickPlace, state) -> jax.Array:
    data, info = state.data, state.info
    obj = task.object_pos(data)
    # Track the object until it is grasped, then carry towards the goal.
    goals, grips = _pick_and_carry_phases(obj[:2], info["goal"][:2], tasks_lib.CUBE_HALF, tasks_lib.CUBE_HALF + 0.005)
    goal = _schedule(state.step, PICK_PLACE_ENDS, goals)
    grip = _schedule(state.step, PICK_PLACE_ENDS, grips)
    return _arm_command(task, data, 0, goal, grip)


# Left arm: approach, descend, close, lift, carry to the hand-over pose, hold, open, retreat.
HANDOVER_LEFT_ENDS = (14, 20, 24, 29, 42, 51, 54)
# Right arm: wait, above hand-over, descend onto the bar, close, hold, lift, carry, lower, open, retreat.
HANDOVER_RIGHT_ENDS = (29, 42, 47, 51, 54, 57, 70, 75, 78)


def handover_expert(task: tasks_lib.Handover, state) -> jax.Array:
    data, info = state.data, state.info
    bar = task.object_pos(data)
    off = jnp.array([tasks_lib.HANDOVER_GRIP_OFFSET, 0.0])
    half_z = tasks_lib.BAR_HALF[2]

    def at(xy, z):
        return jnp.concatenate([xy, jnp.array([z])])

    exchange_xy = jnp.zeros(2)  # bar centre during the exchange
    left_home = jnp.array([-0.15, -0.05, 0.2])
    left_goals = [
        at(bar[:2] - off, APPROACH_Z),
        at(bar[:2] - off, half_z),
        at(bar[:2] - off, half_z),
        at(bar[:2] - off, CARRY_Z),
        at(exchange_xy - off, CARRY_Z),
        at(exchange_xy - off, CARRY_Z),
        at(exchange_xy - off, CARRY_Z),
        left_home,
    ]
    left_grips = [OPEN, OPEN, CLOSED, CLOSED, CLOSED, CLOSED, OPEN, OPEN]

    right_home = jnp.array([0.15, -0.05, 0.18])
    right_goals = [
        right_home,
        at(exchange_xy + off, 0.18),
        at(bar[:2] + off, bar[2]),
        at(bar[:2] + off, bar[2]),
        at(bar[:2] + off, bar[2]),
        at(bar[:2] + off, CARRY_Z + 0.02),
        at(info["goal"][:2] + off, CARRY_Z + 0.02),
        at(info["goal"][:2] + off, half_z + 0.005),
        at(info["goal"][:2] + off, half_z + 0.005),
        at(info["goal"][:2] + off, CARRY_Z),
    ]
    right_grips = [OPEN, OPEN, OPEN, CLOSED, CLOSED, CLOSED, CLOSED, CLOSED, OPEN, OPEN]

    left = _arm_command(
        task,
        data,
        0,
        _schedule(state.step, HANDOVER_LEFT_ENDS, left_goals),
        _schedule(state.step, HANDOVER_LEFT_ENDS, [jnp.asarray(g) for g in left_grips]),
    )
    right = _arm_command(
        task,
        data,
        1,
        _schedule(state.step, HANDOVER_RIGHT_ENDS, right_goals),
        _schedule(state.step, HANDOVER_RIGHT_ENDS, [jnp.asarray(g) for g in right_grips]),
    )
    return jnp.concatenate([left, right])


EXPERTS: dict[str, Callable] = {
    "reach": reach_expert,
    "pick_place": pick_place_expert,
    "handover": handover_expert,
}


def expert_for(task: tasks_lib.Task) -> Callable:
    """``expert(state) -> action`` for one world of a built-in task."""
    if task.name not in EXPERTS:
        raise ValueError(f"no scripted expert for task {task.name!r}; experts exist for {sorted(EXPERTS)}")
    fn = EXPERTS[task.name]
    return lambda state: fn(task, state)
