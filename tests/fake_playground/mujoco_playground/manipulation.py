"""One manipulation env: drive a box along a rail onto a target marker."""

import jax
import jax.numpy as jnp
import mujoco
from mujoco import mjx

from mujoco_playground import mjx_env

SUCCESS_DISTANCE = 0.02


class FakeSlideBox:
    """Action: the rail position the box's servo tracks. Obs: [box x, box velocity, target x]."""

    def __init__(self, config: mjx_env.Config):
        xml = mjx_env.MENAGERIE_PATH / "fake_slider" / "scene.xml"
        if not xml.exists():
            raise FileNotFoundError(f"{xml} is missing; the real Playground would clone mujoco_menagerie here")
        self._config = config
        self._mj_model = mujoco.MjModel.from_xml_path(str(xml))
        self._mj_model.opt.timestep = config.sim_dt
        self._mjx_model = mjx.put_model(self._mj_model, impl=config.impl)
        self._n_substeps = round(config.ctrl_dt / config.sim_dt)
        self._target_x = float(self._mj_model.geom("target").pos[0])

    mj_model = property(lambda self: self._mj_model)
    mjx_model = property(lambda self: self._mjx_model)
    action_size = property(lambda self: self._mj_model.nu)
    dt = property(lambda self: self._config.ctrl_dt)

    def reset(self, rng: jax.Array) -> mjx_env.State:
        rng, start_key = jax.random.split(rng)
        data = mjx.make_data(self._mjx_model)
        data = data.replace(qpos=jnp.full_like(data.qpos, jax.random.uniform(start_key, (), minval=-0.2, maxval=0.0)))
        data = mjx.kinematics(self._mjx_model, data)  # Playground runs mjx.forward; poses are all this needs
        return mjx_env.State(data, self._obs(data), jnp.zeros(()), jnp.zeros(()), self._metrics(data), {"rng": rng})

    def step(self, state: mjx_env.State, action: jax.Array) -> mjx_env.State:
        data = state.data.replace(ctrl=action)
        data = jax.lax.fori_loop(0, self._n_substeps, lambda _, d: mjx.step(self._mjx_model, d), data)
        done = jnp.isnan(data.qpos).any().astype(jnp.float32)
        reward = -jnp.abs(data.qpos[0] - self._target_x)
        return state.replace(data=data, obs=self._obs(data), reward=reward, done=done, metrics=self._metrics(data))

    def _obs(self, data: mjx.Data) -> jax.Array:
        return jnp.stack([data.qpos[0], data.qvel[0], jnp.asarray(self._target_x)])

    def _metrics(self, data: mjx.Data) -> dict[str, jax.Array]:
        return {"success": (jnp.abs(data.qpos[0] - self._target_x) < SUCCESS_DISTANCE).astype(jnp.float32)}


_ENVS = {"FakeSlideBox": FakeSlideBox}
ALL_ENVS = tuple(_ENVS)


def load(env_name: str, config: mjx_env.Config | None = None, config_overrides: dict | None = None):
    return _ENVS[env_name]((config or mjx_env.Config()).update(config_overrides or {}))
