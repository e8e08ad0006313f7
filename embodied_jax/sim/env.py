"""Functional MJX environments: ``reset(rng) -> state``, ``step(state, action) -> state``.

Both act on ONE world and are batched with ``jax.vmap``; ``observe(states)`` takes a
batch and returns what a real robot would see: joint state plus RGB images from the
fixed ``scene`` camera and the wrist camera(s), rendered in one batched call.

Which backend steps the physics when cameras are on
----------------------------------------------------
The JAX backend (``physics="jax"``, default), with its kinematic arrays handed to the
Warp batch renderer each time an observation is taken. Rendering needs the Warp
backend, but stepping does not, and measured on a 2-core CPU for the pick-and-place
scene with 64 worlds (see ``experiments/benchmarks/sim_throughput.py``):

* JAX backend: ~18k world-steps/s, ~25 s first compile;
* Warp backend: ~2-3k world-steps/s, ~50 s first kernel build (~5 s cached).

The JAX backend also composes with ``vmap``/``shard_map``/``jit`` on any number of
devices, while a Warp render context fixes its world count. Only ``geom_xpos``,
``geom_xmat``, ``cam_xpos`` and ``cam_xmat`` (a few KB per world) are copied into the
render call. ``physics="warp"`` is kept for mesh-heavy models (MuJoCo Playground),
where the JAX backend is unusable; then rendering reads the Warp data directly.
The physics is re-run to current kinematics before rendering, so images show the
state after the last substep.

Episode bookkeeping lives in :class:`EnvState`: the step counter, the latched success
flag and ``done`` (success, episode limit, or a diverged simulation, which counts as failure).
``step`` on a done state returns it unchanged, so fixed-length batched rollouts need no masking.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import mujoco
import numpy as np
from mujoco import mjx

from embodied_jax.sim import render as render_lib
from embodied_jax.sim import tasks as tasks_lib

PHYSICS_BACKENDS = ("jax", "warp")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EnvState:
    """State of one world (or a batch of worlds, leading axis, after ``vmap``)."""

    data: mjx.Data
    info: dict[str, jax.Array]  # task poses (target / goal / object_start) and latched facts (Task.track)
    step: jax.Array  # int32 control steps taken
    reward: jax.Array  # float32 reward of the last step
    success: jax.Array  # bool, latched
    done: jax.Array  # bool: success or episode limit


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """How to simulate and render. ``image_size`` is (height, width)."""

    image_size: tuple[int, int] = (64, 64)
    physics: str = "jax"
    renderer: str = "auto"  # "warp", "raycast" or "auto" (Warp when installed)
    shadows: bool = True  # hard shadows from the directional light (a depth cue)
    # Append the episode's phase (control steps taken / episode limit, in [0, 1]) to the robot
    # state: a policy then knows how far into the episode it is, as the time-scheduled experts do.
    phase_in_state: bool = False
    warp_max_worlds: int = 1024  # contact buffer size when physics="warp"

    def __post_init__(self):
        if self.physics not in PHYSICS_BACKENDS:
            raise ValueError(f"EnvConfig.physics must be one of {PHYSICS_BACKENDS}, got {self.physics!r}")
        if len(self.image_size) != 2 or min(self.image_size) < 8:
            raise ValueError(f"EnvConfig.image_size must be (height, width) >= 8, got {self.image_size!r}")


class Cameras:
    """Batched observations for an environment with ``config``, ``mj_model``, ``model``,
    ``cameras``, ``robot_state(states)`` and ``renderers`` (its ``render.RendererCache``, made
    with ``renderer_cache(mj_model, config)``)."""

    renderers: render_lib.RendererCache

    def renderer(self, cameras: tuple[str, ...] | None = None, kind: str | None = None):
        """The renderer of ``cameras`` (default: all) of ``kind`` (default: ``config.renderer``), built once."""
        return self.renderers.get(kind or self.config.renderer, tuple(cameras or self.cameras))

    def current_kinematics(self, data: mjx.Data) -> mjx.Data:
        """A batch of ``data`` with the poses cameras must show (see the module function)."""
        return current_kinematics(self.model, data, self.config.physics)

    def render(self, states: EnvState, cameras: tuple[str, ...] | None = None) -> dict[str, jax.Array]:
        """uint8 [B, H, W, 3] per camera for a batch of states."""
        return self.renderer(cameras)(self.current_kinematics(states.data))

    def observe(self, states: EnvState) -> dict[str, Any]:
        """``{"state": float32 [B, S], "images": {camera: uint8 [B, H, W, 3]}}``."""
        return {"state": self.robot_state(states), "images": self.render(states)}


class Env(Cameras):
    """A built-in task simulated in MJX. Construct with a task name or a bound Task."""

    def __init__(self, task: str | tasks_lib.Task, config: EnvConfig = EnvConfig()):
        self.task = tasks_lib.make_task(task) if isinstance(task, str) else task
        if self.task.model is None:
            self.task.build_model()
        self.config = config
        self.mj_model = self.task.model
        self.model = mjx.put_model(self.mj_model, impl=config.physics)
        self.renderers = renderer_cache(self.mj_model, config)
        self._warp_template = None
        if config.physics == "warp":
            self._make_data()
        # The per-world dynamics are traced once per Env: every program built on them
        # (rollouts, evaluations of any batch size, unbatched calls) reuses that trace, and
        # eager calls run compiled.
        self._reset = jax.jit(self._reset_world)
        self._step = jax.jit(self._step_world)

    # --- description ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.task.name

    @property
    def instruction(self) -> str:
        return self.task.instruction

    @property
    def episode_limit(self) -> int:
        return self.task.episode_limit

    @property
    def cameras(self) -> tuple[str, ...]:
        return self.task.cameras

    @property
    def action_dim(self) -> int:
        return self.task.action_dim

    @property
    def state_dim(self) -> int:
        return self.task.state_dim + int(self.config.phase_in_state)

    @property
    def control_dt(self) -> float:
        return tasks_lib.CONTROL_DT

    def action_bounds(self) -> tuple[jax.Array, jax.Array]:
        return self.task.action_bounds()

    # --- dynamics (one world) ------------------------------------------------------
    def _make_data(self) -> mjx.Data:
        if self.config.physics == "warp":
            # Warp's make_data allocates host-side buffers: build one concrete template, outside traces.
            if self._warp_template is None:
                with jax.ensure_compile_time_eval():
                    data = mjx.make_data(
                        self.mj_model, impl="warp", naconmax=16 * self.config.warp_max_worlds, njmax=64
                    )
                    self._warp_template = jax.tree.map(np.asarray, data)
            return jax.tree.map(jnp.asarray, self._warp_template)
        return mjx.make_data(self.model)

    def reset(self, rng: jax.Array) -> EnvState:
        """A new episode of ONE world, randomised from ``rng``."""
        return self._reset(rng)

    def step(self, state: EnvState, action: jax.Array) -> EnvState:
        """ONE world advanced by one control step (``SUBSTEPS`` physics steps); a done state is returned unchanged."""
        action = jnp.asarray(action, jnp.float32)
        if action.shape != (self.action_dim,):
            raise ValueError(f"{self.name}: action must have shape ({self.action_dim},), got {action.shape}")
        return self._step(state, action)

    def _reset_world(self, rng: jax.Array) -> EnvState:
        data, info = self.task.randomize(rng, self._make_data())
        # Poses only: every task reads qpos/mocap, and the first step runs the full forward
        # pass itself (same trajectory bit for bit; a forward pass here would double the
        # dynamics compiled into every program that resets).
        data = mjx.kinematics(self.model, data)
        return EnvState(
            data=data,
            info=info,
            step=jnp.zeros((), jnp.int32),
            reward=jnp.zeros((), jnp.float32),
            success=self.task.success(data, info),
            done=jnp.zeros((), bool),
        )

    def _step_world(self, state: EnvState, action: jax.Array) -> EnvState:
        data = self.task.apply_action(state.data, action)
        data = jax.lax.fori_loop(0, tasks_lib.SUBSTEPS, lambda _, d: mjx.step(self.model, d), data)
        # A simulation that blew up (e.g. an object flung by a wild policy) ends the episode as a
        # failure and keeps the last finite state, so NaNs never reach observations or metrics.
        diverged = ~(jnp.isfinite(data.qpos).all() & jnp.isfinite(data.qvel).all())
        data = select_tree(diverged, state.data, data)
        info = self.task.track(data, state.info)
        success = state.success | (self.task.success(data, info) & ~diverged)
        step = state.step + 1
        new = EnvState(
            data=data,
            info=info,
            step=step,
            reward=jnp.where(diverged, 0.0, self.task.reward(data, info)),
            success=success,
            done=success | diverged | (step >= self.episode_limit),
        )
        return select_tree(state.done, state, new)

    # --- observations (batched) ----------------------------------------------------
    def robot_state(self, states: EnvState) -> jax.Array:
        """float32 [B, state_dim]: joint positions, grip opening in [0, 1] (then the phase, with
        ``EnvConfig.phase_in_state``)."""
        robot = jax.vmap(self.task.robot_state)(states.data)
        if not self.config.phase_in_state:
            return robot
        phase = jnp.minimum(states.step, self.episode_limit).astype(jnp.float32) / self.episode_limit
        return jnp.concatenate([robot, phase[:, None]], axis=-1)

    def privileged_state(self, states: EnvState) -> jax.Array:
        """float32 [B, P]: what the simulator knows and the policy never sees (an RL critic's input):
        every joint's position and velocity (the objects' poses among them), the task's poses and
        latched facts (``info``), and the episode's phase."""
        info = [jnp.asarray(v, jnp.float32).reshape(v.shape[0], -1) for _, v in sorted(states.info.items())]
        phase = jnp.minimum(states.step, self.episode_limit).astype(jnp.float32) / self.episode_limit
        return jnp.concatenate([states.data.qpos, states.data.qvel, *info, phase[:, None]], axis=-1).astype(jnp.float32)

    def random_actions(self, rng: jax.Array, batch: int) -> jax.Array:
        """Uniform random joint targets within the action bounds, [batch, action_dim]."""
        low, high = self.action_bounds()
        return jax.random.uniform(rng, (batch, self.action_dim), minval=low, maxval=high)


def renderer_cache(mj_model: mujoco.MjModel, config: EnvConfig) -> render_lib.RendererCache:
    """The renderers of an environment of ``mj_model`` rendered as ``config`` says (bounded)."""
    height, width = config.image_size
    return render_lib.RendererCache(mj_model, height, width, shadows=config.shadows)


def current_kinematics(model, data: mjx.Data, physics: str) -> mjx.Data:
    """A batch of ``data`` with poses recomputed from ``qpos``: a step leaves the kinematics of
    the state before its last substep's integration, and cameras must show the state after it."""
    if physics == "warp":
        return jax.vmap(mjx.kinematics, in_axes=(None, 0))(model, data)
    return jax.vmap(lambda d: mjx.camlight(model, mjx.kinematics(model, d)))(data)


def select_tree(pred: jax.Array, old, new):
    """``old`` where ``pred`` else ``new``, leaf by leaf. Backend-private ``mjx.Data._impl``
    buffers (contacts, solver scratch; Warp's in/out FFI buffers) always come from ``new``."""

    def pick(o, n):
        if isinstance(o, mjx.Data):
            public = jax.tree.map(lambda a, b: jnp.where(pred, a, b), o.replace(_impl=None), n.replace(_impl=None))
            return public.replace(_impl=n._impl)
        return jnp.where(pred, o, n)

    return jax.tree.map(pick, old, new, is_leaf=lambda x: isinstance(x, mjx.Data))


def batch_reset(env: Env, rng: jax.Array, batch: int) -> EnvState:
    """``batch`` independent episodes from one key (world i uses ``split(rng, batch)[i]``)."""
    return jax.vmap(env.reset)(jax.random.split(rng, batch))


def batch_step(env: Env, states: EnvState, actions: jax.Array) -> EnvState:
    return jax.vmap(env.step)(states, actions)


def model_fingerprint(model: mujoco.MjModel) -> str:
    """Digest of a compiled model (its MJB bytes): equal for models built from the same MJCF."""
    buffer = np.empty(mujoco.mj_sizeModel(model), np.uint8)
    mujoco.mj_saveModel(model, None, buffer)
    return hashlib.sha256(buffer).hexdigest()


def to_numpy(tree):
    return jax.tree.map(np.asarray, tree)
