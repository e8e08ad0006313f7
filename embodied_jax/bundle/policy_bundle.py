"""``PolicyBundle``: a trained model as the policy a robot (or the simulator) runs (the package
docstring has the whole story); host pre/post-processing and the jitted per-row sampler."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.bundle.observation import (
    TIME_KEYS,
    ObservationError,
    RtcPrefix,
    check_finite_stats,
    check_raw_observation,
)
from embodied_jax.data.samples import to_absolute_actions
from embodied_jax.data.stats import FeatureStats, Normalizer
from embodied_jax.nn import rtc
from embodied_jax.nn.traced import merge_in_trace


@dataclasses.dataclass(frozen=True)
class PreparedRow:
    """One unbatched observation made ready for sampling on the host: the model's inputs (a
    batch of one), its raw state (delta actions are relative to it) and its real-time chunking
    guide (target [H, A], weights [H]; None: plain sampling)."""

    inputs: dict[str, Any]
    state: np.ndarray
    guide: tuple[np.ndarray, np.ndarray] | None


def _stack(samples: list[dict]) -> dict:
    first = samples[0]
    if isinstance(first, dict):
        return {k: _stack([s[k] for s in samples]) for k in first}
    return np.stack([np.asarray(s) for s in samples])


def row_keys(rng: jax.Array, rows: int) -> jax.Array:
    """The per-row keys of a call with ``rng``: ``predict`` and the server derive them alike."""
    return jax.random.split(rng, rows)


class PolicyBundle:
    """``config``: the run's ``ExperimentConfig``; ``model``: its built ``Policy``; ``norm_stats``:
    the statistics saved with the checkpoint (JSON); ``seed``: of the key ``predict`` advances
    when it is given none.

    What an observation must match: ``inputs.state_key`` and ``inputs.camera_keys`` (its keys),
    ``state_dim`` and ``image_size`` (None where the run does not fix them); ``action_dim``:
    the width of the actions it returns."""

    def __init__(
        self, config: Any, model: nnx.Module, norm_stats: Mapping[str, Any] | None, *, step: int, seed: int = 0
    ):
        self.config = config
        self.model = model
        self.step = step
        self.stats = {k: FeatureStats.from_json(v, key=k) for k, v in (norm_stats or {}).items()}
        self.transform = config.data.serving_transform(config.model, self.stats)
        self.inputs = self.transform.inputs
        data = config.data.pipeline
        modes = dict(data.norm_modes)
        check_finite_stats(self.stats, modes)
        self._unnormalizer = Normalizer(self.stats, modes) if modes else None
        self._delta_action_mask = data.spec.delta_action_mask
        action_stats = self.stats.get(self.inputs.action_key)
        self.action_dim = int(np.asarray(action_stats.mean).shape[-1]) if action_stats is not None else None
        state_stats = self.stats.get(self.inputs.state_key)
        self.state_dim = int(np.asarray(state_stats.mean).shape[-1]) if state_stats is not None else None
        # The size every camera's images are resized to for the model (None: the run takes them as they are).
        size = self.transform.images.size
        self.image_size = None if size is None else tuple(int(x) for x in size)
        self.params = nnx.state(model)
        # NNX modules may not cross a trace boundary: jitted code rebuilds the model from its state.
        self._graphdef = nnx.graphdef(model)
        self._sample_rows = jax.jit(self._rows_sampler)
        self._rng = jax.random.key(seed)

    def _rows_sampler(self, params, obs, keys, prefix=None, weights=None):
        """Each row sampled with its own key (``vmap`` of a batch of one): a row's actions do not
        depend on the rows it is batched with (the policy server batches unrelated requests).
        ``prefix``/``weights``: real-time chunking per row (``nn/rtc.py``; zero weights: plain)."""

        def one(row, key, *guide):  # the model is rebuilt inside vmap's trace (NNX modules may not cross it)
            model = self._merge(params)
            row = jax.tree.map(lambda x: x[None], row)
            if not guide:
                return model.sample_actions(row, key)[0]
            return model.sample_actions(row, key, prefix_actions=guide[0][None], prefix_weights=guide[1][None])[0]

        if prefix is None:
            return jax.vmap(one)(obs, keys)
        return jax.vmap(one)(obs, keys, prefix, weights)

    def _merge(self, params) -> nnx.Module:
        return merge_in_trace(self._graphdef, params)  # the evaluator calls act inside its scans

    # ------------------------------------------------------------------ host side
    def _check(
        self,
        raw: Mapping[str, Any],
        image_range: tuple[float, float] | None,
        resize: bool,
        batched: bool | None = None,
    ) -> tuple[dict[str, np.ndarray], list[str] | None]:
        return check_raw_observation(
            raw,
            state_key=self.inputs.state_key,
            cameras=self.inputs.camera_keys,
            state_dim=self.state_dim,
            image_size=self.image_size,
            image_range=image_range,
            resize=resize,
            batched=batched,
        )

    def preprocess(
        self, raw: Mapping[str, Any], *, image_range: tuple[float, float] | None = None, resize: bool = False
    ) -> dict[str, np.ndarray]:
        """Raw observation (one or a batch) -> the model's observation batch (NumPy; B = 1 for one).
        ``image_range``: the value range of float images (uint8 images need none); ``resize``:
        accept images of another size than ``image_size`` (resized with padding). The optional
        time keys (``frame_index``, ``timestamp``) reach the per-sample transform as they did in
        every training sample."""
        checked, tasks = self._check(raw, image_range, resize)
        single = tasks is None
        state = checked[self.inputs.state_key]
        samples = []
        for i, task in enumerate([raw["task"]] if single else tasks):
            sample = {self.inputs.state_key: state if single else state[i], "task": task}
            for key in (*self.inputs.camera_keys, *(k for k in TIME_KEYS if k in checked)):
                sample[key] = checked[key] if single else checked[key][i]
            samples.append(self._model_inputs(sample))
        return _stack(samples)

    def _model_inputs(self, sample: dict[str, Any]) -> dict[str, Any]:
        """The run's per-sample transform of one checked sample, without training targets."""
        out = self.transform(sample)
        out.pop("actions", None)
        out.pop("action_dim_mask", None)
        return out

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
        self,
        raw: Mapping[str, Any],
        *,
        rng: jax.Array | None = None,
        image_range: tuple[float, float] | None = None,
        resize: bool = False,
    ) -> np.ndarray:
        """Unnormalised absolute action chunks: [horizon, action_dim] for one observation (state
        [S], images [H, W, 3]), [B, horizon, action_dim] for a batch (docs/observations.md).

        Without ``rng`` each call draws fresh noise from the bundle's own key (split on every
        call, starting from ``seed``); the same explicit ``rng`` gives the same actions, and one
        observation gives the first row of the same observation as a batch of one. Images are
        uint8, or float with ``image_range=(lo, hi)``, of size ``image_size`` (any size with
        ``resize=True``); a bad observation is an ``ObservationError`` naming the key.
        """
        if rng is None:
            self._rng, rng = jax.random.split(self._rng)
        obs = self.preprocess(raw, image_range=image_range, resize=resize)
        rows = next(iter(jax.tree.leaves(obs))).shape[0]
        actions = np.asarray(self._sample_rows(self.params, jax.tree.map(jnp.asarray, obs), row_keys(rng, rows)))
        state = np.asarray(raw[self.inputs.state_key], np.float32)
        actions = self.postprocess(actions, state.reshape(actions.shape[0], -1))
        return actions[0] if state.ndim == 1 else actions

    # ------------------------------------------------------------------ serving
    @property
    def action_shape(self) -> tuple[int, int]:
        """(horizon, action_dim) of one observation's actions."""
        horizon = int(self.config.model.action_horizon)
        return horizon, int(self.action_dim if self.action_dim is not None else self.config.model.action_dim)

    def observation_spec(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """``{key: (shape, dtype)}`` of one unbatched observation (dtype "str" for the task)."""
        if self.state_dim is None or self.image_size is None:
            raise ObservationError("this run fixes no state width or image size: its observations cannot be described")
        spec = {self.inputs.state_key: ((self.state_dim,), "float32")}
        for key in self.inputs.camera_keys:
            spec[key] = ((*self.image_size, 3), "uint8")
        spec["task"] = ((), "str")
        return spec

    def check_observation(self, raw: Mapping[str, Any], *, batched: bool | None = None) -> None:
        """Raise an ``ObservationError`` naming what is wrong with ``raw`` (unknown keys included);
        ``batched``: require a batched (True) or an unbatched (False) observation."""
        self._check_keys(raw)
        self._check(raw, None, False, batched)

    def _check_keys(self, raw: Mapping[str, Any]) -> None:
        expected = {self.inputs.state_key, "task", *self.inputs.camera_keys, *TIME_KEYS}
        unknown = sorted(set(raw) - expected)
        if unknown:
            shown = ", ".join(repr(k[:40]) for k in unknown[:8]) + (", ..." if len(unknown) > 8 else "")
            raise ObservationError(f"unknown keys [{shown}]; a policy of this run takes {sorted(expected)}")

    def prepare_row(
        self, raw: Mapping[str, Any], prefix: RtcPrefix | None = None, *, guided: bool = False
    ) -> PreparedRow:
        """Everything one unbatched observation needs before sampling, done for it alone: checks
        (unknown keys included), the per-sample transform (tokenisation included) and its guide
        (``guided``: a guide even without ``prefix``, zero weights). A fault of the observation is
        an ``InputError`` (``ObservationError`` or the transform's own) naming the field."""
        self._check_keys(raw)
        checked, _ = self._check(raw, None, False, batched=False)
        inputs = self._model_inputs({**checked, "task": raw["task"]})
        state = checked[self.inputs.state_key]
        guide = self._guide(prefix, state) if guided or prefix is not None else None
        return PreparedRow(jax.tree.map(lambda x: np.asarray(x)[None], inputs), state, guide)

    def sample_prepared(self, rows: list[PreparedRow], keys: jax.Array, *, guided: bool = False) -> np.ndarray:
        """Actions [N, horizon, action_dim] of N prepared rows in one call, row i from ``keys[i]``;
        ``guided``: the real-time chunking sampler for every row (a row without a guide gets zero
        weights)."""
        obs = jax.tree.map(lambda *x: jnp.asarray(np.concatenate(x)), *[r.inputs for r in rows])
        if not guided:
            actions = self._sample_rows(self.params, obs, keys)
        else:
            guides = [r.guide if r.guide is not None else self._guide(None, r.state) for r in rows]
            prefix, weights = zip(*guides, strict=True)
            actions = self._sample_rows(self.params, obs, keys, jnp.stack(prefix), jnp.stack(weights))
        return self.postprocess(np.asarray(actions), np.stack([r.state for r in rows]))

    def predict_rows(
        self, observations: list[Mapping[str, Any]], keys: jax.Array, *, prefixes: list[RtcPrefix | None] | None = None
    ) -> np.ndarray:
        """Actions [N, horizon, action_dim] for N unbatched observations, row i from ``keys[i]``
        (``row_keys(key, 1)[0]`` gives what ``predict(observation, rng=key)`` gives).

        ``prefixes``: real-time chunking, one ``RtcPrefix`` (or None: plain sampling) per row;
        given at all, the guided sampler runs for every row (a None row gets zero weights)."""
        guided = prefixes is not None
        prefixes = prefixes if guided else [None] * len(observations)
        rows = [self.prepare_row(o, p, guided=guided) for o, p in zip(observations, prefixes, strict=True)]
        return self.sample_prepared(rows, keys, guided=guided)

    def _guide(self, prefix: RtcPrefix | None, state: Any) -> tuple[np.ndarray, np.ndarray]:
        """(target chunk in the model's normalised action space [H, A], weights [H]); ``state``: the
        request's raw state (a delta-action policy's chunk is relative to it)."""
        horizon, width = self.action_shape
        if prefix is None:
            return np.zeros((horizon, width), np.float32), np.zeros((horizon,), np.float32)
        actions = prefix.check(horizon, width)
        if self._delta_action_mask is not None:  # robot actions -> relative to this observation's state
            mask = np.asarray(self._delta_action_mask, bool)
            state = np.asarray(state, np.float32).reshape(-1)[: len(mask)]
            actions = actions.copy()
            actions[:, : len(mask)] -= np.where(mask, state, 0.0)
        if self._unnormalizer is not None:
            key = self.inputs.action_key
            actions = np.asarray(self._unnormalizer.normalize({key: actions})[key], np.float32)
        padded = np.concatenate([actions, np.repeat(actions[-1:], horizon - len(actions), axis=0)])
        weights = np.asarray(rtc.prefix_weights(horizon, prefix.delay, horizon - len(actions)))
        return padded, weights
