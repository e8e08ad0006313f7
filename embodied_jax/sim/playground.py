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

    ``success_fn(playground_state) -> bool`` decides success (default: a ``success``
    metric when the env reports one, else never). ``state_fn`` picks the robot state
    from Playground's observation (default: the flat observation, or its ``state`` entry).
    As with ``Env``, a world that diverges ends as a failure at its last finite state, and
    ``step`` returns a done world unchanged.
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
        menagerie_dir=None,
    ):
        ensure_assets(menagerie_dir)
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
        self._pg = registry.load(name, config_overrides=overrides)
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
        self._success_fn = success_fn or (lambda s: s.metrics.get("success", jnp.zeros(())) > 0)
        self._state_fn = state_fn or (lambda s: s.obs["state"] if isinstance(s.obs, dict) else s.obs)
        self.renderers = env_lib.renderer_cache(self.mj_model, config)
        self.renderer()  # fail now on a model the chosen renderer cannot draw

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


def load_playground_env(name: str, **kwargs) -> PlaygroundEnv:
    """Load a Playground manipulation env (e.g. ``PandaPickCube``) if it and its assets are on disk."""
    return PlaygroundEnv(name, **kwargs)
