"""Built-in manipulation tasks: scene, instruction, randomisation, reward, success, limit.

A task is a plain Python object that knows its MJCF (from :mod:`scenes`) and, once
bound to the compiled ``MjModel`` (:meth:`Task.bind`), the qpos/ctrl addresses it needs.
Its traced methods take and return ``mjx.Data`` for ONE world; batching is ``vmap``.

Actions are absolute joint-position targets, per arm ``[x, y, z, grip]`` with the
prismatic joints in metres and ``grip`` in [0, 1] (1 = open). The proprioceptive state
has the same layout (``grip`` = measured finger opening / full opening). Object, target
and goal poses are never in the state: a policy sees them only in the images.

Reward per step is in [0, 1]: 1 on success, otherwise a shaped distance term.
Success is latched by the environment; an episode ends on success or at its limit.
Success may depend on the episode so far: ``Task.track`` latches facts in ``info`` after each
step (pick_place: the cube was held and lifted 2 cm, so a cube pushed onto the pad fails;
handover: the bar was off the table in the right gripper alone).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import mujoco
import numpy as np

from embodied_jax.sim import scenes

CONTROL_DT = 0.1  # seconds per environment step (10 Hz control)
SUBSTEPS = round(CONTROL_DT / scenes.TIMESTEP)


@dataclasses.dataclass(frozen=True)
class ArmLayout:
    """qpos/ctrl addresses of one gantry arm in a compiled model."""

    qpos: tuple[int, int, int, int, int]  # x, y, z, finger_a, finger_b
    ctrl: tuple[int, int, int, int, int]
    low: tuple[float, float, float]
    high: tuple[float, float, float]


class Task(abc.ABC):
    """Base class: subclasses define the scene, initial-state distribution and goal."""

    name: str = ""
    instruction: str = ""
    episode_limit: int = 0
    collect_steps: int = 0  # control steps simulated per expert demonstration (0: episode_limit)
    # DART noise (metres, std on executed hand positions) for demonstrations: the largest of
    # sim.collect.NOISE_LEVELS at which the expert still succeeds >= 90% (measured; see sim.collect).
    dart_noise: float = 0.0
    arms: tuple[scenes.ArmSpec, ...] = ()
    wrist_cameras: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._layouts: tuple[ArmLayout, ...] | None = None
        self.model: mujoco.MjModel | None = None

    # --- static description -------------------------------------------------------------
    @property
    def cameras(self) -> tuple[str, ...]:
        return ("scene",) + self.wrist_cameras

    @property
    def action_dim(self) -> int:
        return 4 * len(self.arms)

    @property
    def state_dim(self) -> int:
        return 4 * len(self.arms)

    @abc.abstractmethod
    def objects_xml(self) -> str:
        """MJCF bodies of the task's objects, targets and markers."""

    def xml(self) -> str:
        return scenes.scene_xml(self.arms, self.objects_xml(), wrist_names=self.wrist_cameras)

    def build_model(self) -> mujoco.MjModel:
        """Compile the MJCF and bind the task to the resulting model."""
        model = mujoco.MjModel.from_xml_string(self.xml())
        self.bind(model)
        return model

    def bind(self, model: mujoco.MjModel) -> None:
        layouts = []
        for arm in self.arms:
            names = [arm.prefix + j for j in ("x", "y", "z", "finger_a", "finger_b")]
            qpos = tuple(int(model.joint(n).qposadr[0]) for n in names)
            ctrl = tuple(int(model.actuator(n).id) for n in names)
            low = (arm.x_range[0], arm.y_range[0], arm.z_range[0])
            high = (arm.x_range[1], arm.y_range[1], arm.z_range[1])
            layouts.append(ArmLayout(qpos, ctrl, low, high))
        self._layouts = tuple(layouts)
        self.model = model
        self._bind_objects(model)

    def _bind_objects(self, model: mujoco.MjModel) -> None:
        """Subclasses look up their object addresses here (a task without objects has none)."""
        return None

    @property
    def layouts(self) -> tuple[ArmLayout, ...]:
        if self._layouts is None:
            raise RuntimeError(f"task {self.name!r} is not bound to a model; call build_model() first")
        return self._layouts

    # --- robot I/O (traced) -------------------------------------------------------------
    def action_bounds(self) -> tuple[jax.Array, jax.Array]:
        low = jnp.concatenate([jnp.array([*lay.low, 0.0]) for lay in self.layouts])
        high = jnp.concatenate([jnp.array([*lay.high, 1.0]) for lay in self.layouts])
        return low, high

    @classmethod
    def position_mask(cls) -> tuple[bool, ...]:
        """Which action entries are hand positions (the rest are grips), without building the model."""
        return (True, True, True, False) * len(cls.arms)

    def position_action_mask(self) -> np.ndarray:
        """bool [action_dim]: which action entries are hand positions (the rest are grips)."""
        return np.asarray(self.position_mask())

    def apply_action(self, data, action: jax.Array):
        """Write an action (clipped to the joint ranges) into ``data.ctrl``."""
        low, high = self.action_bounds()
        action = jnp.clip(action, low, high)
        ctrl = data.ctrl
        for i, lay in enumerate(self.layouts):
            a = action[4 * i : 4 * i + 4]
            opening = a[3] * scenes.FINGER_OPEN
            ctrl = ctrl.at[jnp.array(lay.ctrl)].set(jnp.stack([a[0], a[1], a[2], opening, opening]))
        return data.replace(ctrl=ctrl)

    def robot_state(self, data) -> jax.Array:
        parts = []
        for lay in self.layouts:
            q = data.qpos[jnp.array(lay.qpos)]
            grip = 0.5 * (q[3] + q[4]) / scenes.FINGER_OPEN
            parts.append(jnp.stack([q[0], q[1], q[2], grip]))
        return jnp.concatenate(parts).astype(jnp.float32)

    def pinch(self, data, arm: int = 0) -> jax.Array:
        lay = self.layouts[arm]
        return data.qpos[jnp.array(lay.qpos[:3])]

    def _home(self, rng: jax.Array, data, arm: int, home: tuple[float, float, float]):
        """Place an arm at ``home`` plus a small random offset, gripper open, ctrl matching."""
        lay = self.layouts[arm]
        offset = jax.random.uniform(rng, (3,), minval=-0.03, maxval=0.03)
        pos = jnp.clip(jnp.asarray(home) + offset, jnp.asarray(lay.low), jnp.asarray(lay.high))
        q = jnp.concatenate([pos, jnp.full((2,), scenes.FINGER_OPEN)])
        data = data.replace(qpos=data.qpos.at[jnp.array(lay.qpos)].set(q))
        return data.replace(ctrl=data.ctrl.at[jnp.array(lay.ctrl)].set(q))

    # --- episode logic (traced, one world) ---------------------------------------------
    @abc.abstractmethod
    def randomize(self, rng: jax.Array, data) -> tuple[object, dict[str, jax.Array]]:
        """Sample the initial state of one episode; returns (data, info) with the task's poses."""

    def track(self, data, info: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """``info`` after a control step: latched facts of the episode so far that success needs
        (pick_place: the cube was lifted; handover: the right hand alone held the bar). Default: none."""
        return dict(info)

    def holding(self, data, arm: int, obj: jax.Array, radius: float) -> jax.Array:
        """Whether ``arm``'s gripper is closed (below ``RELEASED``) with its pinch point within
        ``radius`` of the object's centre (bool scalar)."""
        near = jnp.linalg.norm(self.pinch(data, arm) - obj) < radius
        return near & (self.robot_state(data)[4 * arm + 3] < RELEASED)

    @abc.abstractmethod
    def success(self, data, info: Mapping[str, jax.Array]) -> jax.Array:
        """Whether the task is solved in this state (bool scalar); ``info`` is the tracked one."""

    @abc.abstractmethod
    def shaped_reward(self, data, info: Mapping[str, jax.Array]) -> jax.Array:
        """Dense progress term in [0, 1] used when not yet successful."""

    def reward(self, data, info: Mapping[str, jax.Array]) -> jax.Array:
        return jnp.where(self.success(data, info), 1.0, self.shaped_reward(data, info)).astype(jnp.float32)


def _closeness(distance: jax.Array) -> jax.Array:
    return 1.0 - jnp.tanh(10.0 * distance)


def _set_free_body(data, qpos_adr: int, pos: jax.Array):
    q = data.qpos.at[qpos_adr : qpos_adr + 3].set(pos).at[qpos_adr + 3 : qpos_adr + 7].set(jnp.array([1.0, 0, 0, 0]))
    return data.replace(qpos=q)


def _set_mocap(data, mocap_id: int, pos: jax.Array):
    return data.replace(mocap_pos=data.mocap_pos.at[mocap_id].set(pos))


def _mocap_id(model: mujoco.MjModel, body: str) -> int:
    return int(model.body_mocapid[model.body(body).id])


def _separated_pair(rng, low, high, min_distance: float, candidates: int = 16):
    """Two xy points uniform in a box, the second at least ``min_distance`` from the first."""
    k1, k2 = jax.random.split(rng)
    first = jax.random.uniform(k1, (2,), minval=low, maxval=high)
    options = jax.random.uniform(k2, (candidates, 2), minval=low, maxval=high)
    far = jnp.linalg.norm(options - first, axis=-1) >= min_distance
    second = options[jnp.argmax(far)]
    # If no candidate is far enough (rare), mirror the first point through the centre.
    second = jnp.where(far.any(), second, -first)
    return first, second


SINGLE_ARM = scenes.ArmSpec("", x_range=(-0.25, 0.25))
HOME = (0.0, -0.05, 0.18)


class Reach(Task):
    name = "reach"
    instruction = "move the gripper to the red ball"
    episode_limit = 30
    # The expert arrives within 10 steps (17 with 2 cm execution noise): simulating and
    # rendering all 30 steps of every demonstration would mostly record finished episodes.
    collect_steps = 20
    # The expert succeeds in 128 of 128 episodes at every level up to 2 cm; the demo's figures were measured at 1.5.
    dart_noise = 0.015
    arms = (SINGLE_ARM,)
    wrist_cameras = ("wrist",)
    tolerance = 0.03

    def objects_xml(self) -> str:
        return scenes.target_xml("target")

    def _bind_objects(self, model):
        self._target = _mocap_id(model, "target")

    def randomize(self, rng, data):
        k_arm, k_target = jax.random.split(rng)
        data = self._home(k_arm, data, 0, HOME)
        target = jax.random.uniform(
            k_target, (3,), minval=jnp.array([-0.2, -0.2, 0.05]), maxval=jnp.array([0.2, 0.2, 0.22])
        )
        return _set_mocap(data, self._target, target), {"target": target}

    def success(self, data, info):
        return jnp.linalg.norm(self.pinch(data) - info["target"]) < self.tolerance

    def shaped_reward(self, data, info):
        return _closeness(jnp.linalg.norm(self.pinch(data) - info["target"]))


CUBE_HALF = 0.02
RELEASED = 0.8  # grip opening above which an object counts as let go
LIFTED = 0.02  # metres above its resting height that an object held in a gripper must reach


class PickPlace(Task):
    name = "pick_place"
    instruction = "pick up the blue cube and place it on the green square"
    episode_limit = 60
    # Expert success with the lift required (128 episodes, calibration seed): 100% without noise,
    # 99.2% at 0.25 cm, 96.9% at 0.5 cm, 83.6% at 0.75 cm.
    dart_noise = 0.005
    arms = (SINGLE_ARM,)
    wrist_cameras = ("wrist",)
    tolerance = 0.03

    def objects_xml(self) -> str:
        return scenes.goal_pad_xml("goal") + scenes.block_xml("cube", (CUBE_HALF,) * 3)

    def _bind_objects(self, model):
        self._goal = _mocap_id(model, "goal")
        self._cube = int(model.joint("cube").qposadr[0])

    def object_pos(self, data):
        return data.qpos[self._cube : self._cube + 3]

    def randomize(self, rng, data):
        k_arm, k_xy = jax.random.split(rng)
        data = self._home(k_arm, data, 0, HOME)
        cube_xy, goal_xy = _separated_pair(k_xy, -0.17, 0.17, 0.12)
        cube = jnp.concatenate([cube_xy, jnp.array([CUBE_HALF])])
        goal = jnp.concatenate([goal_xy, jnp.array([0.001])])
        data = _set_free_body(data, self._cube, cube)
        data = _set_mocap(data, self._goal, goal)
        return data, {"goal": goal, "object_start": cube, "lifted": jnp.zeros((), bool)}

    def track(self, data, info):
        # A cube pushed onto the pad is not picked: success needs it held and lifted first.
        obj = self.object_pos(data)
        lifted_now = self.holding(data, 0, obj, CUBE_HALF) & (obj[2] > CUBE_HALF + LIFTED)
        return {**info, "lifted": info["lifted"] | lifted_now}

    def success(self, data, info):
        obj = self.object_pos(data)
        on_goal = jnp.linalg.norm(obj[:2] - info["goal"][:2]) < self.tolerance
        released = self.robot_state(data)[3] > RELEASED
        return info["lifted"] & on_goal & (obj[2] < CUBE_HALF + 0.01) & released

    def shaped_reward(self, data, info):
        obj = self.object_pos(data)
        grasp = _closeness(jnp.linalg.norm(self.pinch(data) - obj))
        place = _closeness(jnp.linalg.norm(obj[:2] - info["goal"][:2]))
        # Half the placing term until the cube has been lifted: pushing it to the pad pays less.
        return 0.3 * grasp + 0.7 * place * jnp.where(info["lifted"], 1.0, 0.5)


BAR_HALF = (0.06, 0.02, 0.02)
HANDOVER_GRIP_OFFSET = 0.028  # each hand grips the bar this far from its centre
LEFT_ARM = scenes.ArmSpec("left_", x_range=(-0.25, 0.03), color="0.45 0.5 0.65 1", column_y=0.0)
RIGHT_ARM = scenes.ArmSpec(
    "right_", x_range=(-0.03, 0.25), color="0.65 0.48 0.45 1", finger_color="0.9 0.85 0.2 1", column_y=0.0
)


class Handover(Task):
    name = "handover"
    instruction = "hand the blue bar from the left arm to the right arm and put it on the green square"
    episode_limit = 90
    # Expert success with the hand-over required (128 episodes, calibration seed): 100% without
    # noise, 97.7% at 0.25 cm, 77.3% at 0.5 cm.
    dart_noise = 0.0025
    arms = (LEFT_ARM, RIGHT_ARM)
    wrist_cameras = ("wrist_left", "wrist_right")
    tolerance = 0.03

    def objects_xml(self) -> str:
        return scenes.goal_pad_xml("goal") + scenes.block_xml("bar", BAR_HALF, mass=0.02)

    def _bind_objects(self, model):
        self._goal = _mocap_id(model, "goal")
        self._bar = int(model.joint("bar").qposadr[0])

    def object_pos(self, data):
        return data.qpos[self._bar : self._bar + 3]

    def randomize(self, rng, data):
        k_left, k_right, k_bar, k_goal = jax.random.split(rng, 4)
        data = self._home(k_left, data, 0, (-0.15, -0.05, 0.18))
        data = self._home(k_right, data, 1, (0.15, -0.05, 0.18))
        bar_xy = jax.random.uniform(k_bar, (2,), minval=jnp.array([-0.2, -0.12]), maxval=jnp.array([-0.12, 0.12]))
        goal_xy = jax.random.uniform(k_goal, (2,), minval=jnp.array([0.12, -0.12]), maxval=jnp.array([0.2, 0.12]))
        bar = jnp.concatenate([bar_xy, jnp.array([BAR_HALF[2]])])
        goal = jnp.concatenate([goal_xy, jnp.array([0.001])])
        data = _set_free_body(data, self._bar, bar)
        data = _set_mocap(data, self._goal, goal)
        return data, {"goal": goal, "object_start": bar, "handed_over": jnp.zeros((), bool)}

    def track(self, data, info):
        # Handed over: the bar off the table in the right gripper while the left has let it go.
        obj = self.object_pos(data)
        left, right = (self.holding(data, arm, obj, BAR_HALF[0]) for arm in (0, 1))
        now = right & ~left & (obj[2] > BAR_HALF[2] + LIFTED)
        return {**info, "handed_over": info["handed_over"] | now}

    def success(self, data, info):
        obj = self.object_pos(data)
        on_goal = jnp.linalg.norm(obj[:2] - info["goal"][:2]) < self.tolerance
        released = self.robot_state(data)[7] > RELEASED
        return info["handed_over"] & on_goal & (obj[2] < BAR_HALF[2] + 0.01) & released

    def shaped_reward(self, data, info):
        obj = self.object_pos(data)
        progress = jnp.clip((obj[0] - info["object_start"][0]) / (info["goal"][0] - info["object_start"][0]), 0.0, 1.0)
        place = _closeness(jnp.linalg.norm(obj[:2] - info["goal"][:2]))
        return 0.5 * progress + 0.5 * place


TASKS: dict[str, type[Task]] = {cls.name: cls for cls in (Reach, PickPlace, Handover)}


def make_task(name: str) -> Task:
    """A fresh, model-bound task by name (``reach``, ``pick_place``, ``handover``)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks are {sorted(TASKS)}")
    task = TASKS[name]()
    task.build_model()
    return task
