"""Adapter for MuJoCo Playground manipulation environments (optional, lazy import).

MuJoCo Playground (``pip install playground``; it pins ``mujoco`` 3.17.x) is not a
dependency of this project, and its manipulation environments load robot meshes from
``mujoco_menagerie``, which Playground clones from GitHub at first use. Offline, both
must already be on disk: this adapter checks that and explains what to provide
instead of letting Playground try to download.

:class:`PlaygroundEnv` exposes the same interface as :class:`~embodied_jax.sim.env.Env`
(``reset``/``step`` on one world, ``observe``/``render`` on a batch), so the batched
evaluator runs it unchanged. Physics uses MJX's Warp backend by default: these robots
are mesh-heavy, and the JAX backend compiles and steps them far too slowly on CPU.
Images come from the Warp batch renderer; the ray-caster
draws primitive geoms only.

What the policy is told, by default, is only what a robot knows of itself: its state is the
positions of the actuated joints (``proprio_state``), never Playground's whole observation,
which holds object and target poses (``privileged_state=True`` asks for it). Success is read per
environment from what that environment really computes (:data:`SUCCESS_READERS`, documented
there); an environment that reports nothing usable is refused with a clear error unless a
``success_fn`` is given, instead of scoring 0%. ``playground_scene.EmbodiedJaxReach`` is a scene
of the project's own registered with Playground, needing no downloaded asset (the tests use it).
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from embodied_jax.errors import InputError
from embodied_jax.sim import env as env_lib

MENAGERIE_REPO = "https://github.com/google-deepmind/mujoco_menagerie"
# Playground 0.2.0's manipulation envs: their robots come from mujoco_menagerie.
MENAGERIE_ENVS = frozenset(
    {
        "AlohaHandOver",
        "AlohaSinglePegInsertion",
        "PandaPickCube",
        "PandaPickCubeOrientation",
        "PandaPickCubeCartesian",
        "PandaOpenCabinet",
        "PandaRobotiqPushCube",
        "LeapCubeReorient",
        "LeapCubeRotateZAxis",
        "AeroCubeRotateZAxis",
    }
)


def _box_at_target(env, state) -> jax.Array:
    return jnp.linalg.norm(state.data.xpos[env._obj_body] - state.info["target_pos"]) < 0.05


# How success is read from each Playground env (what its source computes, playground 0.2.0):
# name -> (what is read, reader(playground_env, playground_state) -> bool). An env not listed is read
# from ``metrics["success"]`` when it reports one; otherwise it needs a ``success_fn``.
SUCCESS_READERS: dict[str, tuple[str, Callable[[Any, Any], jax.Array]]] = {
    "PandaRobotiqPushCube": ('metrics["success"] > 0 (set by the env)', lambda env, s: s.metrics["success"] > 0),
    "PandaPickCubeCartesian": (
        'metrics["reward/success"] > 0 (the env\'s box-to-target test, 5 cm)',
        lambda env, s: s.metrics["reward/success"] > 0,
    ),
    # These compute no success at all: the box within 5 cm of the target, PandaPickCubeCartesian's own test.
    "PandaPickCube": ("box within 5 cm of info['target_pos'] (the env reports none)", _box_at_target),
    "PandaPickCubeOrientation": ("box within 5 cm of info['target_pos'] (the env reports none)", _box_at_target),
}


class PlaygroundUnavailable(InputError, RuntimeError):
    """Playground or its robot assets are not on this machine."""


def _playground_root() -> pathlib.Path:
    spec = importlib.util.find_spec("mujoco_playground")  # does not import the package
    if spec is None or spec.origin is None:
        raise PlaygroundUnavailable(
            "MuJoCo Playground is not installed. Install it with `pip install playground` on a machine with "
            "network access (it keeps mujoco at 3.17.x), then provide its robot assets (see load_playground_env)."
        )
    return pathlib.Path(spec.origin).parent


def menagerie_path() -> pathlib.Path:
    """Where Playground expects ``mujoco_menagerie`` (inside its package directory)."""
    return _playground_root() / "external_deps" / "mujoco_menagerie"


def ensure_assets(menagerie_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Make Playground's menagerie path point at assets on disk, or explain how to provide them.

    ``menagerie_dir`` (or the ``MUJOCO_MENAGERIE_DIR`` environment variable): an existing
    checkout of mujoco_menagerie; it is linked into place when Playground has none.
    """
    target = menagerie_path()
    if target.exists():
        return target
    source = menagerie_dir or os.environ.get("MUJOCO_MENAGERIE_DIR")
    if source is None or not pathlib.Path(source).is_dir():
        raise PlaygroundUnavailable(
            f"MuJoCo Playground's robot assets are missing: {target} does not exist, and Playground would try to "
            f"download them. Provide them offline by cloning {MENAGERIE_REPO} on a machine with network access, "
            f"copying it here, and either placing it at {target} or passing its path as menagerie_dir= "
            "(or in the MUJOCO_MENAGERIE_DIR environment variable)."
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_symlink():  # dangling: it points at a checkout that has since moved
        target.unlink()
    target.symlink_to(pathlib.Path(source).resolve(), target_is_directory=True)
    return target


class PlaygroundEnv(env_lib.Cameras):
    """A Playground manipulation env behind :class:`~embodied_jax.sim.env.Env`'s interface.

    ``success_fn(playground_state) -> bool`` decides success (default: the env's entry in
    :data:`SUCCESS_READERS`, else its ``metrics["success"]``; an env with neither is refused).
    ``state_fn(playground_state)`` gives the policy's state (default: the actuated joints'
    positions; ``privileged_state=True``: Playground's whole observation, object and target poses
    included). As with ``Env``, a world that diverges ends as a failure at its last finite state,
    and ``step`` returns a done world unchanged.
    """

    def __init__(
        self,
        name: str,
        *,
        instruction: str | None = None,
        episode_limit: int | None = None,
        config: env_lib.EnvConfig = env_lib.EnvConfig(physics="warp", renderer="warp"),
        cameras: tuple[str, ...] | None = None,
        config_overrides: dict | None = None,
        success_fn: Callable[[Any], jax.Array] | None = None,
        state_fn: Callable[[Any], jax.Array] | None = None,
        privileged_state: bool = False,
        menagerie_dir=None,
    ):
        if name in MENAGERIE_ENVS:
            ensure_assets(menagerie_dir)
        elif importlib.util.find_spec("mujoco_playground") is None:
            _playground_root()  # the error that says how to install it
        from mujoco_playground import registry  # optional dependency

        manipulation = set(registry.manipulation.ALL_ENVS)
        if name not in manipulation:
            raise ValueError(f"{name!r} is not a Playground manipulation env; available: {sorted(manipulation)}")
        overrides = dict(config_overrides or {})
        overrides.setdefault("impl", config.physics)
        if overrides["impl"] != config.physics:
            raise ValueError(
                f"config_overrides impl={overrides['impl']!r} contradicts EnvConfig.physics="
                f"{config.physics!r}; set the backend through EnvConfig"
            )
        self._pg = _instantiate(registry, name, overrides)
        self.name = name
        self.instruction = instruction or name
        self.config = config
        self.mj_model = self._pg.mj_model
        self.model = self._pg.mjx_model
        self.episode_limit = episode_limit or int(getattr(self._pg._config, "episode_length", 250))
        self.cameras = cameras or tuple(self.mj_model.camera(i).name for i in range(self.mj_model.ncam))
        if not self.cameras:
            raise ValueError(f"Playground env {name!r} has no cameras; pass cameras= naming some")
        self.action_dim = int(self._pg.action_size)
        self.control_dt = float(self._pg.dt)
        if state_fn is not None and privileged_state:
            raise ValueError("state_fn and privileged_state=True both choose the state: pass one")
        self.success_source, self._success_fn = self._success_reader(success_fn)
        if state_fn is None:
            state_fn = _full_observation if privileged_state else proprio_state(self.mj_model)
        self._state_fn = state_fn
        self.renderers = env_lib.renderer_cache(self.mj_model, config)
        self.renderer()  # fail now on a model the chosen renderer cannot draw

    def _success_reader(self, success_fn) -> tuple[str, Callable[[Any], jax.Array]]:
        if success_fn is not None:
            return "success_fn", success_fn
        if self.name in SUCCESS_READERS:
            source, reader = SUCCESS_READERS[self.name]
            return source, lambda s: reader(self._pg, s)
        metrics = jax.eval_shape(self._pg.reset, jax.random.key(0)).metrics
        if "success" in metrics:
            return 'metrics["success"] > 0', lambda s: s.metrics["success"] > 0
        raise ValueError(
            f"Playground env {self.name!r} reports no success (its metrics: {sorted(metrics)}), and this adapter "
            f"knows no reading of it (SUCCESS_READERS): pass success_fn=(playground_state -> bool) saying what "
            f"success is, rather than scoring every episode a failure"
        )

    def reset(self, rng: jax.Array) -> env_lib.EnvState:
        pg = self._pg.reset(rng)
        return env_lib.EnvState(
            data=pg.data,
            info={"playground": pg},
            step=jnp.zeros((), jnp.int32),
            reward=jnp.zeros((), jnp.float32),
            success=self._succeeded(pg),
            done=jnp.zeros((), bool),
        )

    def step(self, state: env_lib.EnvState, action: jax.Array) -> env_lib.EnvState:
        action = jnp.asarray(action, jnp.float32)
        if action.shape != (self.action_dim,):
            raise ValueError(f"{self.name}: action must have shape ({self.action_dim},), got {action.shape}")
        old = state.info["playground"]
        pg = self._pg.step(old, action)
        # As in Env: a blown-up simulation ends the episode as a failure and keeps the last finite state.
        diverged = ~(jnp.isfinite(pg.data.qpos).all() & jnp.isfinite(pg.data.qvel).all())
        pg = env_lib.select_tree(diverged, old, pg)
        success = state.success | (self._succeeded(pg) & ~diverged)
        step = state.step + 1
        new = env_lib.EnvState(
            data=pg.data,
            info={"playground": pg},
            step=step,
            reward=jnp.where(diverged, 0.0, jnp.asarray(pg.reward, jnp.float32)),
            success=success,
            done=success | diverged | (pg.done > 0) | (step >= self.episode_limit),
        )
        return env_lib.select_tree(state.done, state, new)

    def _succeeded(self, pg) -> jax.Array:
        return jnp.asarray(self._success_fn(pg)).astype(bool)

    def robot_state(self, states: env_lib.EnvState) -> jax.Array:
        return jax.vmap(self._state_fn)(states.info["playground"]).astype(jnp.float32)


def _instantiate(registry, name: str, overrides: dict):
    """Playground's ``registry.load`` clones mujoco_menagerie from GitHub whenever it is absent, even
    for an env that uses none of it: envs outside ``MENAGERIE_ENVS`` (registered by a user, or the
    project's ``playground_scene``) are built from the manipulation registry's class and default config
    directly, so nothing is fetched."""
    if name in MENAGERIE_ENVS:
        return registry.load(name, config_overrides=overrides)
    manipulation = registry.manipulation
    classes = getattr(manipulation, "_envs", None)
    if not isinstance(classes, dict) or name not in classes:
        raise ValueError(
            f"cannot build {name!r} without Playground's loader (its registry changed): installed "
            f"playground differs from the 0.2.0 this adapter was written for"
        )
    return classes[name](config=manipulation.get_default_config(name), config_overrides=overrides)


def _full_observation(state) -> jax.Array:
    return state.obs["state"] if isinstance(state.obs, dict) else state.obs


def proprio_state(mj_model) -> Callable[[Any], jax.Array]:
    """``state -> float32 [J]``: the positions of the joints the actuators drive (what a robot knows
    of itself); refuses a model whose actuators drive no joint (pass a ``state_fn``)."""
    import mujoco

    joints = sorted(
        {int(mj_model.actuator_trnid[i, 0]) for i in range(mj_model.nu) if mj_model.actuator_trntype[i] == 0}
    )
    free = (mujoco.mjtJoint.mjJNT_FREE, mujoco.mjtJoint.mjJNT_BALL)
    joints = [j for j in joints if mj_model.jnt_type[j] not in free]
    if not joints:
        raise ValueError("the model's actuators drive no hinge or slide joint: pass state_fn to choose the state")
    addresses = jnp.asarray([int(mj_model.jnt_qposadr[j]) for j in joints])
    return lambda state: state.data.qpos[addresses]


def load_playground_env(name: str, **kwargs) -> PlaygroundEnv:
    """Load a Playground manipulation env (e.g. ``PandaPickCube``) if it and its assets are on disk."""
    return PlaygroundEnv(name, **kwargs)
