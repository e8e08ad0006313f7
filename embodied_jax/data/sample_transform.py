"""The per-sample transform: a raw sample in dataset keys -> the model's inputs.

``SampleTransform`` is the one object that both the Grain pipeline (on every training
record) and a policy bundle (on a robot's observation) apply, so serving runs the
training preprocessing by construction:

1. normalise state/action with the run's statistics (``data/stats.py``);
2. resize-with-pad every camera to the configured size, augment when training, convert
   to float [-1, 1] (``data/transforms.py``);
3. rename dataset keys into the input builder's layout (``ModelInputs``): ``{"task",
   "state", "images": {slot: image}, "actions"}``;
4. the model's input builder (tokenise; unpadded samples when packing).

``data/`` knows no model: the builder is a plain callable handed in by the data source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from embodied_jax.config_registry import register
from embodied_jax.data.stats import FeatureStats, Normalizer
from embodied_jax.data.transforms import AugmentConfig, ImageTransform


@register
@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """Dataset keys -> the model input builder's sample layout.

    ``blind_state``: the model sees zeros in place of the (normalised) state, in training and when
    served alike; a policy then has to take where things are from its images (the state shortcut:
    from the hand's position alone a policy can guess how far along a scripted path it is, and keep
    going past the goal it never looked at).

    ``privileged_key``: a per-frame feature the policy never sees (Meta-World's
    ``observation.environment_state``), handed to the loss alone as ``privileged_state`` for a
    training-only head (``Pi05Config.privileged_weight``). Observations served to a policy lack it,
    so it is passed on only when the sample holds it; in training the sample spec loads it."""

    ADDED_FIELDS = ("blind_state", "privileged_key")  # runs saved before them read back with the defaults

    state_key: str = "observation.state"
    action_key: str = "action"
    cameras: tuple[tuple[str, str], ...] = ()  # (dataset camera key, model camera slot)
    blind_state: bool = False
    privileged_key: str | None = None

    @property
    def camera_keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.cameras)

    def rename(self, sample: dict[str, Any]) -> dict[str, Any]:
        missing = [k for k in (self.state_key, "task", *self.camera_keys) if k not in sample]
        if missing:
            raise KeyError(f"sample has no {missing} (keys: {sorted(sample)})")
        state = np.asarray(sample[self.state_key], np.float32)
        out = {
            "task": str(sample["task"]),
            "state": np.zeros_like(state) if self.blind_state else state,
            "images": {slot: sample[key] for key, slot in self.cameras},
        }
        if self.action_key in sample:
            out["actions"] = np.asarray(sample[self.action_key], np.float32)
        if self.privileged_key is not None and self.privileged_key in sample:
            out["privileged_state"] = np.asarray(sample[self.privileged_key], np.float32)
        return out


class SampleTransform:
    """normalise -> images -> rename -> builder, on one sample (a dict of dataset keys).

    ``inputs`` None: no renaming (a builder, if any, then sees the dataset keys).
    ``__call__(sample, rng)``: ``rng`` is Grain's per-record generator, needed only with
    augmentation.
    """

    def __init__(
        self,
        *,
        normalizer: Normalizer | None,
        images: ImageTransform,
        inputs: ModelInputs | None = None,
        builder: Callable[[dict], dict] | None = None,
    ):
        self.normalizer = normalizer
        self.images = images
        self.inputs = inputs
        self.builder = builder

    @classmethod
    def create(
        cls,
        *,
        stats: dict[str, FeatureStats] | None,
        norm_modes: Sequence[tuple[str, str]],
        cameras: Sequence[str],
        image_size: tuple[int, int] | None,
        augment: AugmentConfig | None = None,
        inputs: ModelInputs | None = None,
        builder: Callable[[dict], dict] | None = None,
    ) -> SampleTransform:
        modes = dict(norm_modes)
        missing = sorted(set(modes) - set(stats or {}))
        if missing:
            raise ValueError(f"no normalisation statistics for {missing}")
        normalizer = Normalizer(stats, modes) if modes else None
        images = ImageTransform(cameras=tuple(cameras), size=image_size, augment=augment)
        return cls(normalizer=normalizer, images=images, inputs=inputs, builder=builder)

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator | None = None) -> dict[str, Any]:
        if self.normalizer is not None:
            sample = self.normalizer.normalize(sample)
        sample = self.images(sample, rng)
        if self.inputs is not None:
            sample = self.inputs.rename(sample)
        if self.builder is not None:
            sample = self.builder(sample)
        return sample
