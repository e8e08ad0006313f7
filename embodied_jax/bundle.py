"""Policy bundles: a training checkpoint as the policy a robot (or the simulator) runs.

``load_policy(CKPT_DIR)`` rebuilds the experiment config saved in the checkpoint, the
model with its trained parameters (the EMA when the run kept one), the normalisation
statistics and the model's input builder. ``predict(raw)`` takes a robot's raw
observation in dataset keys::

    {"observation.state": float [B, S] (or [S]),
     "observation.images.<camera>": uint8 [B, H, W, 3],
     "task": str or a list of B strings}

and applies, on the host, exactly the per-sample code that fed training (normalise,
resize, the model's input builder), samples action chunks with one jitted call and
returns them unnormalised (delta actions turned back into absolute ones).

``act_fn(instruction)`` gives the simulator's evaluator a jittable
``act(observation, rng) -> [B, H, A]``; the host preprocessing runs inside the compiled
program through ``jax.pure_callback``, so evaluation exercises the same code as serving.
"""
from __future__ import annotations

import dataclasses
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.parallel.mesh import MeshConfig


def _stack(samples: list[dict]) -> dict:
    first = samples[0]
    if isinstance(first, dict):
        return {k: _stack([s[k] for s in samples]) for k in first}
    return np.stack([np.asarray(s) for s in samples])


class PolicyBundle:
    def __init__(self, config: Any, model: Any, norm_stats: dict | None, *, step: int):
        from embodied_jax.data.pipeline import DataConfig
        from embodied_jax.data.stats import FeatureStats, Normalizer
        from embodied_jax.data.transforms import ImageTransform

        self.config = config
        self.model = model
        self.step = step
        data = getattr(config.data, "data", None)
        if not isinstance(data, DataConfig):
            raise ValueError(f"{type(config.data).__name__}: a policy bundle needs a run trained on a LeRobot "
                             f"dataset (ExperimentConfig.data = LeRobotData)")
        self.inputs = config.data.inputs
        self.data_config = data
        modes = dict(data.norm_modes)
        self.stats = {k: FeatureStats.from_json(v, key=k) for k, v in (norm_stats or {}).items()}
        missing = set(modes) - set(self.stats)
        if missing:
            raise ValueError(f"checkpoint has no normalisation statistics for {sorted(missing)}")
        self.normalizer = Normalizer(self.stats, modes) if modes else None
        self.cameras = tuple(key for key, _ in self.inputs.cameras)
        self.images = ImageTransform(cameras=self.cameras, size=data.image_size, augment=None)
        self.builder = config.model.input_builder()
        action_stats = self.stats.get(self.inputs.action_key)
        self.action_dim = int(np.asarray(action_stats.mean).shape[-1]) if action_stats is not None else None
        # NNX modules may not cross a trace boundary: jitted code rebuilds the model from its state.
        self._graphdef, _ = nnx.split(model)
        self._sample = jax.jit(lambda state, obs, rng: self._merge(state).sample_actions(obs, rng))

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model):
        self._model = model
        self._state = nnx.state(model)

    def _merge(self, state):
        # Lift the weights into the current trace (e.g. a scan body): NNX refuses modules
        # whose variables belong to an enclosing trace.
        return nnx.merge(self._graphdef, jax.tree.map(jnp.copy, state))

    # ------------------------------------------------------------------ host side
    def preprocess(self, raw: dict[str, Any]) -> dict[str, np.ndarray]:
        """Raw batched observation -> the model's observation batch (NumPy)."""
        state = np.asarray(raw[self.inputs.state_key], np.float32)
        single = state.ndim == 1
        batch = 1 if single else state.shape[0]
        tasks = raw["task"]
        tasks = [tasks] * batch if isinstance(tasks, str) else list(tasks)
        samples = []
        for i in range(batch):
            sample = {self.inputs.state_key: state if single else state[i], "task": tasks[i]}
            for key in self.cameras:
                image = np.asarray(raw[key])
                sample[key] = image if single else image[i]
            if self.normalizer is not None:
                sample = self.normalizer.normalize(sample)
            sample = self.images(sample)
            out = self.builder(self.inputs.rename(sample))
            out.pop("actions", None)
            out.pop("action_dim_mask", None)
            samples.append(out)
        return _stack(samples)

    def postprocess(self, actions: np.ndarray, raw_state: np.ndarray) -> np.ndarray:
        """Normalised, padded model actions [B, H, A_pad] -> robot actions [B, H, A]."""
        actions = np.asarray(actions, np.float32)
        if self.action_dim is not None:
            actions = actions[..., : self.action_dim]
        if self.normalizer is not None:
            actions = self.normalizer.unnormalize({self.inputs.action_key: actions})[self.inputs.action_key]
        mask = self.data_config.spec.delta_action_mask
        if mask is not None:
            from embodied_jax.data.samples import to_absolute_actions

            raw_state = np.asarray(raw_state, np.float32).reshape(actions.shape[0], -1)
            actions = np.stack([to_absolute_actions(a, s, mask) for a, s in zip(actions, raw_state)])
        return actions

    def predict(self, raw: dict[str, Any], rng: jax.Array | None = None) -> np.ndarray:
        """Unnormalised action chunks [B, horizon, action_dim] for a raw observation."""
        rng = jax.random.key(0) if rng is None else rng
        obs = self.preprocess(raw)
        actions = np.asarray(self._sample(self._state, jax.tree.map(jnp.asarray, obs), rng))
        state = np.asarray(raw[self.inputs.state_key], np.float32)
        return self.postprocess(actions, state.reshape(actions.shape[0], -1))

    # ------------------------------------------------------------------ in-jit form
    def act_fn(self, instruction: str, camera_keys: dict[str, str] | None = None, *, with_params: bool = False):
        """A jittable ``act(observation, rng)`` for ``sim.Evaluator``.

        ``observation`` = {"state": [B, S], "images": {camera: uint8 [B, H, W, 3]}, ...};
        camera ``c`` is the dataset key ``observation.images.c`` unless ``camera_keys`` says otherwise.
        With ``with_params`` it returns ``(act(params, observation, rng), params)`` instead, so an
        evaluator compiled once can be called again with new weights (in-training evaluation).
        """
        camera_keys = camera_keys or {}

        def to_raw(state, images):
            raw = {self.inputs.state_key: np.asarray(state), "task": instruction}
            for cam, image in images.items():
                raw[camera_keys.get(cam, f"observation.images.{cam}")] = np.asarray(image)
            return raw

        def host_pre(state, images):
            return self.preprocess(to_raw(state, images))

        def host_post(actions, state):
            return self.postprocess(np.asarray(actions), np.asarray(state)).astype(np.float32)

        def act_with(model, observation, rng):
            state, images = observation["state"], observation["images"]
            example = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), (state, images))
            spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_pre(*example))
            obs = jax.pure_callback(host_pre, spec, state, images)
            actions = model.sample_actions(obs, rng)
            out_dim = self.action_dim or actions.shape[-1]
            out = jax.ShapeDtypeStruct((*actions.shape[:2], out_dim), jnp.float32)
            return jax.pure_callback(host_post, out, actions, state)

        def act(params, observation, rng):
            return act_with(self._merge(params), observation, rng)

        if not with_params:
            state = self._state
            return lambda observation, rng: act(state, observation, rng)
        return act, self._state


def load_policy(ckpt_dir: str | pathlib.Path, *, step: int | None = None, use_ema: bool = True,
                devices: list | None = None) -> PolicyBundle:
    """A trained policy from a run's checkpoint directory (``<workdir>/checkpoints`` or the workdir).

    The parameters are replicated over ``devices`` (default: the first local device, which
    keeps the simulator's renderer, a custom call, out of SPMD partitioning).
    """
    from embodied_jax.train.checkpoint import Checkpointer
    from embodied_jax.train.config import CheckpointConfig, from_dict
    from embodied_jax.train.loop import build

    path = pathlib.Path(ckpt_dir)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
    ckpt = Checkpointer(path, CheckpointConfig(async_save=False))
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{path}: no checkpoint steps")
        config = from_dict(ckpt.read_json(step, "config"))
        # Serving: data-parallel over the chosen local devices; no multi-process initialisation.
        devices = list(devices or jax.local_devices()[:1])
        config = dataclasses.replace(config, mesh=MeshConfig(data=-1), init_from=None,
                                     train=dataclasses.replace(config.train, grad_accum_steps=1,
                                                               batch_size=len(devices)))
        rt = build(config, devices)
        state, norm_stats = ckpt.restore(rt.abstract_state, rt.shardings, step=step)
    finally:
        ckpt.close()
    params = state.ema if (use_ema and state.ema is not None) else state.params
    with rt.context():
        model = rt.parts.merge(params, state.frozen, state.fp8, state.other)
    return PolicyBundle(config, model, norm_stats, step=step)
