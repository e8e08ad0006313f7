"""Data sources: what ``ExperimentConfig.data`` holds, and the LeRobot one.

A ``DataSource`` makes the run's ``BatchIterator`` (``make_iterator``) and, for real data,
the per-sample transform a policy bundle applies to a robot's observation
(``serving_transform``). ``LeRobotData`` joins the Grain pipeline over LeRobot datasets
(``DataConfig``) with the model's input builder: ``ModelInputs`` renames dataset keys into
the builder's layout, and the builder comes from the model config's ``input_builder``.
With ``packing.seq_len`` > 0 (``--data.packing.seq-len N``) the builder emits
variable-length samples and the pipeline packs them into rows of N tokens
(``data/packing.py``); ``train.batch_size`` then counts rows.

``--data.root DIR`` is the shorthand for a single dataset (``data.sources``).

Before a run, ``fit(model)`` resolves what the data determines and ``check(model)`` names the
first thing the model needs that the data lacks (``train.loop.prepare``; nothing is compiled or
written before). ``LeRobotData`` with no camera mapping (``ModelInputs(cameras=())``) maps the
dataset's cameras (``meta/modality.json``'s videos, else ``info.json``'s) onto the model's image
slots in order; its action horizon follows the model's; the model takes the dataset's state and
action widths (``PolicyConfig.fit_to_dataset``). Fitting reads the first dataset's metadata
only; the check opens every dataset's tables (no frames are decoded).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from embodied_jax.config_registry import register
from embodied_jax.data.iterator import BatchIterator
from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.data.lerobot_meta import DatasetError, DatasetMeta
from embodied_jax.data.packing import PackingConfig
from embodied_jax.data.pipeline import DataConfig, SourceConfig, make_data_iterator, open_source
from embodied_jax.data.sample_transform import ModelInputs, SampleTransform
from embodied_jax.data.samples import SampleLoader
from embodied_jax.data.stats import FeatureStats
from embodied_jax.errors import InputError
from embodied_jax.policy import DatasetFeatures

if TYPE_CHECKING:  # the contract only: data/ builds no model
    from embodied_jax.policy import PolicyConfig

log = logging.getLogger(__name__)

CAMERAS_FLAG = "--data.inputs.cameras KEY SLOT ..."


class DataConfigError(InputError, ValueError):
    """A data source config that does not fit its model (found before any data is read)."""


class DataSource(abc.ABC):
    """Base of ``ExperimentConfig.data`` (subclasses are frozen dataclasses)."""

    @abc.abstractmethod
    def make_iterator(
        self, *, model: PolicyConfig, process_index: int, process_count: int, batch_size: int, seed: int
    ) -> BatchIterator:
        """This process's batches; ``batch_size`` is global (all processes together)."""

    def fit(self, model: PolicyConfig) -> tuple[DataSource, PolicyConfig]:
        """This source and ``model`` with what the data determines resolved (once, before a run;
        the run saves the result). Default: both unchanged."""
        return self, model

    def check(self, model: PolicyConfig) -> None:
        """Raise an input error naming the first thing ``model`` needs that the data lacks (before
        anything is compiled or written). Default: nothing to check."""
        return None

    def serving_transform(self, model: PolicyConfig, stats: Mapping[str, FeatureStats] | None) -> SampleTransform:
        """The per-sample transform of a robot's raw observation (training's, without augmentation)."""
        raise TypeError(
            f"{type(self).__name__}: a policy bundle needs a run trained on a dataset "
            f"(ExperimentConfig.data = LeRobotData), not on {type(self).__name__}"
        )


# Command-line spellings of renamed fields, still accepted with a deprecation message (``cli.renamed_flags``).
FLAG_RENAMES = (("--data.data.", "--data.pipeline."),)


@register
@dataclasses.dataclass(frozen=True)
class LeRobotData(DataSource):
    # How the datasets are read into samples (sources, sample spec, image size, normalisation, workers):
    # ``--data.pipeline.*``; saved configs and command lines of the old name ``data`` still read.
    pipeline: DataConfig = DataConfig(sources=())
    inputs: ModelInputs = ModelInputs()
    packing: PackingConfig = PackingConfig()
    root: str | None = None  # one dataset directory: shorthand for pipeline.sources = (SourceConfig(root),)

    RENAMED_FIELDS: ClassVar[dict[str, str]] = {"data": "pipeline"}  # runs saved before the rename

    def __post_init__(self):
        if self.root is not None and self.pipeline.sources:
            raise ValueError(
                f"LeRobotData: give either root={self.root!r} (--data.root) or pipeline.sources "
                f"({len(self.pipeline.sources)} sources), not both"
            )

    @property
    def sources(self) -> tuple[SourceConfig, ...]:
        """The datasets read: ``(SourceConfig(root),)`` or ``pipeline.sources``."""
        return (SourceConfig(self.root),) if self.root is not None else self.pipeline.sources

    def fit(self, model: PolicyConfig) -> tuple[LeRobotData, PolicyConfig]:
        if not self.sources:
            return self, model
        data = self._following_spec_keys()
        root = self.sources[0].root
        meta = DatasetMeta.read(root)
        for what, key, flag in (
            ("state", data.inputs.state_key, "--data.pipeline.spec.state-keys"),
            ("action", data.inputs.action_key, "--data.pipeline.spec.action-keys"),
        ):
            if key not in meta.features:
                raise DatasetError(
                    f"{root}: no {what} feature {key!r}; the dataset has {list(meta.vector_keys)} "
                    f"(name its {what} with {flag} KEY)"
                )
        data, privileged_dim = data._with_privileged(meta, root)
        keys = data._camera_keys(meta)
        names = data._camera_names(meta, keys)
        features = DatasetFeatures(
            camera_keys=keys,
            camera_names=names,
            state_dim=meta.width(data.inputs.state_key),
            action_dim=meta.width(data.inputs.action_key),
            fps=meta.fps,
            modality=data.pipeline.spec.use_modality and meta.modality is not None,
            privileged_dim=privileged_dim,
        )
        fitted = _fit_model(model, features, root)
        if privileged_dim and not fitted.trains_privileged_head:
            raise DataConfigError(
                f"--data.inputs.privileged-key {data.inputs.privileged_key}: {type(fitted).__name__} trains no "
                "head on it (π0.5: --model.privileged-weight W > 0)"
            )
        cameras = data.inputs.cameras
        if not cameras:
            if len(keys) > len(fitted.camera_names):
                raise DatasetError(
                    f"{root}: the dataset has {len(keys)} cameras ({', '.join(keys)}) and the model "
                    f"{len(fitted.camera_names)} image slots ({', '.join(fitted.camera_names)}): choose the "
                    f"cameras with {CAMERAS_FLAG}"
                )
            cameras = tuple(zip(keys, fitted.camera_names[: len(keys)], strict=True))
            mapping = ", ".join(f"{key} -> {slot}" for key, slot in cameras)
            log.info("cameras: %s (override with %s)", mapping or "none", CAMERAS_FLAG)
        spec = data.pipeline.spec
        spec = dataclasses.replace(
            spec,
            action_horizon=data._horizon(fitted),
            camera_keys=spec.camera_keys if spec.camera_keys is not None else tuple(k for k, _ in cameras),
        )
        fitted_data = dataclasses.replace(
            data,
            pipeline=dataclasses.replace(data.pipeline, spec=spec),
            inputs=dataclasses.replace(data.inputs, cameras=cameras),
        )
        return fitted_data, fitted

    def _with_privileged(self, meta: DatasetMeta, root: str) -> tuple[LeRobotData, int]:
        """With ``inputs.privileged_key`` set: that feature loaded at the current frame and
        normalised by mean and std (unless ``norm_modes`` names it), and its width."""
        key = self.inputs.privileged_key
        if key is None:
            return self, 0
        if key not in meta.features:
            raise DatasetError(
                f"{root}: no feature {key!r} for --data.inputs.privileged-key; the dataset has {list(meta.vector_keys)}"
            )
        spec, pipeline = self.pipeline.spec, self.pipeline
        loaded = spec.state_keys + spec.action_keys + spec.extra_keys
        if key not in loaded:
            spec = dataclasses.replace(spec, extra_keys=(*spec.extra_keys, key))
        norm_modes = pipeline.norm_modes
        if key not in dict(norm_modes):
            norm_modes = (*norm_modes, (key, "mean_std"))
        pipeline = dataclasses.replace(pipeline, spec=spec, norm_modes=norm_modes)
        return dataclasses.replace(self, pipeline=pipeline), meta.width(key)

    def _following_spec_keys(self) -> LeRobotData:
        """A single ``--data.pipeline.spec.state-keys`` / ``action-keys`` key also becomes the key the
        model reads and the key normalised."""
        spec, inputs = self.pipeline.spec, self.inputs
        renamed = {}
        if len(spec.state_keys) == 1 and spec.state_keys[0] != inputs.state_key:
            renamed[inputs.state_key] = spec.state_keys[0]
        if len(spec.action_keys) == 1 and spec.action_keys[0] != inputs.action_key:
            renamed[inputs.action_key] = spec.action_keys[0]
        if not renamed:
            return self
        inputs = dataclasses.replace(
            inputs,
            state_key=renamed.get(inputs.state_key, inputs.state_key),
            action_key=renamed.get(inputs.action_key, inputs.action_key),
        )
        norm_modes = tuple((renamed.get(key, key), mode) for key, mode in self.pipeline.norm_modes)
        return dataclasses.replace(
            self, pipeline=dataclasses.replace(self.pipeline, norm_modes=norm_modes), inputs=inputs
        )

    def _camera_keys(self, meta: DatasetMeta) -> tuple[str, ...]:
        """The cameras read: the mapping's, ``spec.camera_keys``, modality.json's videos (when read)
        or every camera of info.json, in that order of precedence."""
        spec = self.pipeline.spec
        if self.inputs.cameras:
            return self.inputs.camera_keys
        if spec.camera_keys is not None:
            return tuple(spec.camera_keys)
        if spec.use_modality and meta.modality is not None and meta.modality.video:
            return tuple(meta.modality.video.values())
        return meta.camera_keys

    def _camera_names(self, meta: DatasetMeta, keys: tuple[str, ...]) -> tuple[str, ...] | None:
        if self.inputs.cameras:
            return tuple(slot for _, slot in self.inputs.cameras)
        if not (self.pipeline.spec.use_modality and meta.modality is not None):
            return None
        by_key = {key: name for name, key in meta.modality.video.items()}
        return tuple(by_key[k] for k in keys) if all(k in by_key for k in keys) else None

    def _horizon(self, model: PolicyConfig) -> int:
        """The action horizon of the samples: the model's (one flag, ``--model.action-horizon``)."""
        ours, models = self.pipeline.spec.action_horizon, model.action_horizon
        if ours is None:
            if not models:
                raise DataConfigError(
                    f"{type(model).__name__} names no action horizon: set --data.pipeline.spec.action-horizon N"
                )
            return models
        if models and ours != models:
            raise DataConfigError(
                f"--data.pipeline.spec.action-horizon {ours} differs from --model.action-horizon {models}: "
                "set only --model.action-horizon (the data follows the model)"
            )
        return ours

    def check(self, model: PolicyConfig) -> None:
        spec, inputs = self.pipeline.spec, self.inputs
        slots = [slot for _, slot in inputs.cameras]
        for key, slot in inputs.cameras:
            if slot not in model.camera_names:
                raise DataConfigError(
                    f"--data.inputs.cameras {key} {slot}: the model has no image slot {slot!r}; "
                    f"its slots: {list(model.camera_names)}"
                )
        if len(set(slots)) < len(slots):
            raise DataConfigError(f"--data.inputs.cameras: an image slot takes one camera, got {list(inputs.cameras)}")
        loaded = spec.state_keys + spec.action_keys + spec.extra_keys
        for flag, key in (("state-key", inputs.state_key), ("action-key", inputs.action_key)):
            if key not in loaded:
                raise DataConfigError(
                    f"--data.inputs.{flag} {key!r} is not among the features the samples hold {list(loaded)} "
                    "(--data.pipeline.spec.state-keys / --data.pipeline.spec.action-keys)"
                )
        for source in self.sources:
            where = source.frame_store or source.root
            frames = open_source(source, self.pipeline)  # tables and metadata; no video is decoded
            for key, slot in inputs.cameras:
                if key not in frames.camera_keys:
                    raise DatasetError(
                        f"{where}: no camera {key!r} (mapped to {slot!r}); the dataset has {list(frames.camera_keys)} "
                        f"(choose with {CAMERAS_FLAG})"
                    )
                if isinstance(frames, LeRobotDataset):
                    frames.image_shape(key)
            try:
                loader = SampleLoader(frames, spec)
            except (KeyError, ValueError) as exc:
                raise DatasetError(f"{where}: {exc.args[0]}") from exc
            undecoded = [key for key in inputs.camera_keys if key not in loader.cameras]
            if undecoded:
                raise DataConfigError(
                    f"cameras {undecoded} are mapped (--data.inputs.cameras) but not decoded "
                    f"(--data.pipeline.spec.camera-keys {list(loader.cameras)})"
                )
            privileged = inputs.privileged_key
            if privileged is not None and privileged not in frames.arrays:
                raise DatasetError(f"{where}: no feature {privileged!r} (--data.inputs.privileged-key)")
            features = DatasetFeatures(
                camera_keys=inputs.camera_keys,
                camera_names=tuple(slots),
                state_dim=int(np.prod(frames.arrays[inputs.state_key].shape[1:])),
                action_dim=int(np.prod(frames.arrays[inputs.action_key].shape[1:])),
                fps=frames.fps,
                modality=spec.use_modality and frames.modality is not None,
                privileged_dim=int(np.prod(frames.arrays[privileged].shape[1:])) if privileged else 0,
            )
            _fit_model(model, features, where)  # the model's own limits, for every source
        if self.sources:
            model.input_builder(packed=self.packing.enabled)  # its tokenizer, as the pipeline will load it

    def make_iterator(
        self, *, model: PolicyConfig, process_index: int, process_count: int, batch_size: int, seed: int
    ) -> BatchIterator:
        if self.pipeline.spec.action_horizon is None:
            raise DataConfigError(
                "data.pipeline.spec.action_horizon is unset: fit the data to its model first (LeRobotData.fit; "
                "a training run does, train.loop.prepare)"
            )
        if batch_size % process_count:
            raise ValueError(f"train.batch_size={batch_size} is not divisible by {process_count} processes")
        packing = self.packing
        if packing.enabled:
            builder = model.input_builder(packed=True)
            packing = packing.resolved(builder.tokens_per_image)
        else:
            builder = model.input_builder()
        return make_data_iterator(
            dataclasses.replace(self.pipeline, sources=self.sources),
            process_index=process_index,
            process_count=process_count,
            batch_size=batch_size // process_count,
            seed=seed,
            inputs=self.inputs,
            builder=builder,
            packing=packing,
        )

    def serving_transform(self, model: PolicyConfig, stats: Mapping[str, FeatureStats] | None) -> SampleTransform:
        return self.pipeline.sample_transform(
            stats, self.inputs.camera_keys, inputs=self.inputs, builder=model.input_builder(), training=False
        )


def _fit_model(model: PolicyConfig, features: DatasetFeatures, where: str) -> PolicyConfig:
    try:
        return model.fit_to_dataset(features)
    except ValueError as exc:  # the model's account of what does not fit
        raise DatasetError(f"{where}: {exc}") from exc
