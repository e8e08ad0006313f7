"""Policy bundles: a trained model as the policy a robot (or the simulator) runs.

A ``PolicyBundle`` holds the run's config, the model, the normalisation statistics and
the run's per-sample transform (``DataSource.serving_transform``: the very
``SampleTransform`` the Grain pipeline applied to every training sample, without
augmentation). ``predict(raw)`` takes a robot's raw observation in dataset keys::

    {"observation.state": float [B, S] (or [S]),
     "observation.images.<camera>": uint8 [B, H, W, 3],
     "task": str or a list of B strings}

applies that transform on the host, samples action chunks with one jitted call and
returns them unnormalised (delta actions turned back into absolute ones).

``act_fn(instruction)`` gives the simulator's evaluator a jittable ``act(params,
observation, rng) -> [B, H, A]`` and the parameters to call it with; the host
preprocessing runs inside the compiled program through ``jax.pure_callback``, so
evaluation exercises the same code as serving. ``embodied_jax.load_policy`` makes a
bundle from a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.data.samples import to_absolute_actions
from embodied_jax.data.stats import FeatureStats, Normalizer
from embodied_jax.errors import InputError
from embodied_jax.nn.traced import merge_in_trace

ActFn = Callable[[Any, dict[str, Any], jax.Array], jax.Array]


class ObservationError(InputError, ValueError):
    """A robot observation the policy cannot take (missing key, shape, dtype, non-finite state)."""


def _stack(samples: list[dict]) -> dict:
    first = samples[0]
    if isinstance(first, dict):
        return {k: _stack([s[k] for s in samples]) for k in first}
    return np.stack([np.asarray(s) for s in samples])


class PolicyBundle:
    """``config``: the run's ``ExperimentConfig``; ``model``: its built ``Policy``; ``norm_stats``:
    the statistics saved with the checkpoint (JSON); ``seed``: of the key ``predict`` advances
    when it is given none."""

    def __init__(
        self, config: Any, model: nnx.Module, norm_stats: Mapping[str, Any] | None, *, step: int, seed: int = 0
    ):
        self.config = config
        self.model = model
        self.step = step
        self.stats = {k: FeatureStats.from_json(v, key=k) for k, v in (norm_stats or {}).items()}
        self.transform = config.data.serving_transform(config.model, self.stats)
        self.inputs = self.transform.inputs
        data = config.data.data
        modes = dict(data.norm_modes)
        self._unnormalizer = Normalizer(self.stats, modes) if modes else None
        self._delta_action_mask = data.spec.delta_action_mask
        action_stats = self.stats.get(self.inputs.action_key)
        self.action_dim = int(np.asarray(action_stats.mean).shape[-1]) if action_stats is not None else None
        self.params = nnx.state(model)
        # NNX modules may not cross a trace boundary: jitted code rebuilds the model from its state.
        self._graphdef = nnx.graphdef(model)
        self._sample = jax.jit(lambda params, obs, rng: self._merge(params).sample_actions(obs, rng))
        self._rng = jax.random.key(seed)

    def _merge(self, params) -> nnx.Module:
        return merge_in_trace(self._graphdef, params)  # the evaluator calls act inside its scans

    # ------------------------------------------------------------------ host side
    def _check(self, raw: Mapping[str, Any], image_range: tuple[float, float] | None) -> dict[str, np.ndarray]:
        """The observation's state and images as validated arrays (images uint8), each problem named."""
        keys = (self.inputs.state_key, "task", *self.inputs.camera_keys)
        missing = [k for k in keys if k not in raw]
        if missing:
            raise ObservationError(f"observation lacks {missing}; a policy of this run needs {list(keys)}")
        state = np.asarray(raw[self.inputs.state_key])
        if state.ndim not in (1, 2) or not np.issubdtype(state.dtype, np.number):
            raise ObservationError(
                f"{self.inputs.state_key}: expected numbers [S] or [B, S], got {state.dtype} {state.shape}"
            )
        state = state.astype(np.float32)
        if not np.isfinite(state).all():
            raise ObservationError(f"{self.inputs.state_key} holds non-finite values: {state.tolist()}")
        batch = None if state.ndim == 1 else state.shape[0]
        out = {self.inputs.state_key: state}
        for key in self.inputs.camera_keys:
            image = np.asarray(raw[key])
            want_ndim = 3 if batch is None else 4
            if image.ndim != want_ndim or image.shape[-1] != 3 or (batch is not None and image.shape[0] != batch):
                layout = "[H, W, 3]" if batch is None else f"[{batch}, H, W, 3] (one per state)"
                raise ObservationError(f"{key}: expected an RGB image {layout}, got shape {image.shape}")
            if image.dtype == np.uint8:
                out[key] = image
            elif np.issubdtype(image.dtype, np.floating) and image_range is not None:
                lo, hi = image_range
                if not np.isfinite(image).all() or image.min() < lo or image.max() > hi:
                    raise ObservationError(f"{key}: values outside image_range={image_range} (or not finite)")
                out[key] = np.round((image - lo) / (hi - lo) * 255.0).astype(np.uint8)
            elif np.issubdtype(image.dtype, np.floating):
                raise ObservationError(
                    f"{key}: a {image.dtype} image needs predict(..., image_range=(lo, hi)) "
                    f"naming its range; uint8 images are taken as they are"
                )
            else:
                raise ObservationError(f"{key}: images must be uint8 (or float with image_range), got {image.dtype}")
        return out

    def preprocess(
        self, raw: Mapping[str, Any], *, image_range: tuple[float, float] | None = None
    ) -> dict[str, np.ndarray]:
        """Raw batched observation -> the model's observation batch (NumPy). ``image_range``: the
        value range of float images (uint8 images need none)."""
        checked = self._check(raw, image_range)
        state = checked[self.inputs.state_key]
        single = state.ndim == 1
        batch = 1 if single else state.shape[0]
        tasks = raw["task"]
        tasks = [tasks] * batch if isinstance(tasks, str) else list(tasks)
        if len(tasks) != batch:
            raise ObservationError(f"observation has {batch} states but {len(tasks)} tasks")
        samples = []
        for i in range(batch):
            sample = {self.inputs.state_key: state if single else state[i], "task": tasks[i]}
            for key in self.inputs.camera_keys:
                sample[key] = checked[key] if single else checked[key][i]
            out = self.transform(sample)
            out.pop("actions", None)
            out.pop("action_dim_mask", None)
            samples.append(out)
        return _stack(samples)

    def postprocess(self, actions: np.ndarray, raw_state: np.ndarray) -> np.ndarray:
        """Normalised, padded model actions [B, H, A_pad] -> robot actions [B, H, A]."""
        actions = np.asarray(actions, np.float32)
        if self.action_dim is not None:
            actions = actions[..., : self.action_dim]
        if self._unnormalizer is not None:
            key = self.inputs.action_key
            actions = self._unnormalizer.unnormalize({key: actions})[key]
        if self._delta_action_mask is not None:
            raw_state = np.asarray(raw_state, np.float32).reshape(actions.shape[0], -1)
            actions = np.stack(
                [to_absolute_actions(a, s, self._delta_action_mask) for a, s in zip(actions, raw_state, strict=True)]
            )
        return actions

    def predict(
        self, raw: Mapping[str, Any], *, rng: jax.Array | None = None, image_range: tuple[float, float] | None = None
    ) -> np.ndarray:
        """Unnormalised action chunks [B, horizon, action_dim] for a raw observation.

        Without ``rng`` each call draws fresh noise from the bundle's own key (split on every
        call, starting from ``seed``); the same explicit ``rng`` gives the same actions. Images
        are uint8, or float with ``image_range=(lo, hi)``; a bad observation is an
        ``ObservationError`` naming the key.
        """
        if rng is None:
            self._rng, rng = jax.random.split(self._rng)
        obs = self.preprocess(raw, image_range=image_range)
        actions = np.asarray(self._sample(self.params, jax.tree.map(jnp.asarray, obs), rng))
        state = np.asarray(raw[self.inputs.state_key], np.float32)
        return self.postprocess(actions, state.reshape(actions.shape[0], -1))

    # ------------------------------------------------------------------ in-jit form
    def act_fn(self, instruction: str, camera_keys: Mapping[str, str] | None = None) -> tuple[ActFn, Any]:
        """``(act, params)`` for ``sim.Evaluator``: ``act(params, observation, rng)`` is jittable.

        ``observation`` = {"state": [B, S], "images": {camera: uint8 [B, H, W, 3]}, ...};
        camera ``c`` is the dataset key ``observation.images.c`` unless ``camera_keys`` says
        otherwise. ``params`` are this bundle's weights; an evaluator compiled once can be called
        again with other weights of the same model (in-training evaluation).
        """
        camera_keys = dict(camera_keys or {})

        def to_raw(state, images):
            raw = {self.inputs.state_key: np.asarray(state), "task": instruction}
            for cam, image in images.items():
                raw[camera_keys.get(cam, f"observation.images.{cam}")] = np.asarray(image)
            return raw

        def host_pre(state, images):
            return self.preprocess(to_raw(state, images))

        def host_post(actions, state):
            return self.postprocess(np.asarray(actions), np.asarray(state)).astype(np.float32)

        def act(params, observation, rng):
            state, images = observation["state"], observation["images"]
            example = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), (state, images))
            spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host_pre(*example))
            obs = jax.pure_callback(host_pre, spec, state, images)
            actions = self._merge(params).sample_actions(obs, rng)
            out_dim = self.action_dim or actions.shape[-1]
            out = jax.ShapeDtypeStruct((*actions.shape[:2], out_dim), jnp.float32)
            return jax.pure_callback(host_post, out, actions, state)

        return act, self.params
