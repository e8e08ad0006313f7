"""A scene of the project's own registered as a MuJoCo Playground environment: ``EmbodiedJaxReach``.

Playground's manipulation robots come from mujoco_menagerie, which cannot be had offline; this
small scene (the built-in ``reach`` task's gantry arm, wrist camera and target, :mod:`tasks`)
needs no asset, so the Playground adapter (:mod:`playground`) can be exercised against the real
``playground`` package: ``register()`` adds it to Playground's manipulation registry, after
which ``mujoco_playground.registry.load("EmbodiedJaxReach")`` builds it like any of Playground's
own environments (``MjxEnv``: ``reset``/``step`` on Playground ``State``s).

What it reports, like Playground's own envs: ``obs`` is Playground's flat vector (the arm's
joint positions, then the target's position: privileged), ``metrics["success"]`` 1.0 once the
pinch point is within the task's tolerance of the target, ``reward`` the task's shaped reward.
Actions are the task's absolute ``[x, y, z, grip]`` targets.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from mujoco import mjx

from embodied_jax.sim import tasks as tasks_lib

NAME = "EmbodiedJaxReach"


def default_config():
    from ml_collections import config_dict

    return config_dict.create(
        ctrl_dt=tasks_lib.CONTROL_DT,
        sim_dt=tasks_lib.CONTROL_DT / tasks_lib.SUBSTEPS,
        episode_length=tasks_lib.Reach.episode_limit,
        impl="jax",
    )


@functools.cache
def environment_class():
    """The ``MjxEnv`` subclass (built on first use: Playground is an optional dependency)."""
    from mujoco_playground import MjxEnv, State

    class EmbodiedJaxReach(MjxEnv):
        def __init__(self, config=None, config_overrides=None):
            super().__init__(config or default_config(), config_overrides)
            self._task = tasks_lib.make_task("reach")
            self._mj_model = self._task.model
            self._mjx_model = mjx.put_model(self._mj_model, impl=self._config.impl)

        def reset(self, rng: jax.Array) -> State:
            data, info = self._task.randomize(rng, mjx.make_data(self._mjx_model))
            data = mjx.forward(self._mjx_model, data)
            success = self._task.success(data, info).astype(jnp.float32)
            return State(data, self._obs(data, info), jnp.zeros(()), jnp.zeros(()), {"success": success}, info)

        def step(self, state: State, action: jax.Array) -> State:
            data = self._task.apply_action(state.data, action)
            data = jax.lax.fori_loop(0, self.n_substeps, lambda _, d: mjx.step(self._mjx_model, d), data)
            success = self._task.success(data, state.info).astype(jnp.float32)
            reward = self._task.reward(data, state.info)
            metrics = {**state.metrics, "success": success}
            return State(data, self._obs(data, state.info), reward, jnp.zeros(()), metrics, state.info)

        def _obs(self, data, info) -> jax.Array:
            return jnp.concatenate([data.qpos[jnp.array(self._task.layouts[0].qpos)], info["target"]])

        @property
        def xml_path(self) -> str:
            return "<embodied_jax.sim.tasks.Reach>"

        @property
        def action_size(self) -> int:
            return self._task.action_dim

        @property
        def mj_model(self):
            return self._mj_model

        @property
        def mjx_model(self):
            return self._mjx_model

    return EmbodiedJaxReach


def register() -> str:
    """Add ``EmbodiedJaxReach`` to Playground's manipulation registry (idempotent); returns its name."""
    from mujoco_playground import manipulation

    manipulation.register_environment(NAME, environment_class(), default_config)
    return NAME
