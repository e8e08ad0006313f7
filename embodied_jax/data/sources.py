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
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from embodied_jax.config_registry import register
from embodied_jax.data.iterator import BatchIterator
from embodied_jax.data.packing import PackingConfig
from embodied_jax.data.pipeline import DataConfig, SourceConfig, make_data_iterator
from embodied_jax.data.sample_transform import ModelInputs, SampleTransform
from embodied_jax.data.stats import FeatureStats

if TYPE_CHECKING:  # the contract only: data/ builds no model
    from embodied_jax.policy import PolicyConfig


class DataSource(abc.ABC):
    """Base of ``ExperimentConfig.data`` (subclasses are frozen dataclasses)."""

    @abc.abstractmethod
    def make_iterator(
        self, *, model: PolicyConfig, process_index: int, process_count: int, batch_size: int, seed: int
    ) -> BatchIterator:
        """This process's batches; ``batch_size`` is global (all processes together)."""

    def serving_transform(self, model: PolicyConfig, stats: Mapping[str, FeatureStats] | None) -> SampleTransform:
        """The per-sample transform of a robot's raw observation (training's, without augmentation)."""
        raise TypeError(
            f"{type(self).__name__}: a policy bundle needs a run trained on a dataset "
            f"(ExperimentConfig.data = LeRobotData), not on {type(self).__name__}"
        )


@register
@dataclasses.dataclass(frozen=True)
class LeRobotData(DataSource):
    data: DataConfig = DataConfig(sources=())
    inputs: ModelInputs = ModelInputs()
    packing: PackingConfig = PackingConfig()
    root: str | None = None  # one dataset directory: shorthand for data.sources = (SourceConfig(root),)

    def __post_init__(self):
        if self.root is not None and self.data.sources:
            raise ValueError(
                f"LeRobotData: give either root={self.root!r} (--data.root) or data.sources "
                f"({len(self.data.sources)} sources), not both"
            )

    @property
    def sources(self) -> tuple[SourceConfig, ...]:
        """The datasets read: ``(SourceConfig(root),)`` or ``data.sources``."""
        return (SourceConfig(self.root),) if self.root is not None else self.data.sources

    def make_iterator(
        self, *, model: PolicyConfig, process_index: int, process_count: int, batch_size: int, seed: int
    ) -> BatchIterator:
        if batch_size % process_count:
            raise ValueError(f"train.batch_size={batch_size} is not divisible by {process_count} processes")
        packing = self.packing
        if packing.enabled:
            builder = model.input_builder(packed=True)
            packing = packing.resolved(builder.tokens_per_image)
        else:
            builder = model.input_builder()
        return make_data_iterator(
            dataclasses.replace(self.data, sources=self.sources),
            process_index=process_index,
            process_count=process_count,
            batch_size=batch_size // process_count,
            seed=seed,
            inputs=self.inputs,
            builder=builder,
            packing=packing,
        )

    def serving_transform(self, model: PolicyConfig, stats: Mapping[str, FeatureStats] | None) -> SampleTransform:
        return self.data.sample_transform(
            stats, self.inputs.camera_keys, inputs=self.inputs, builder=model.input_builder(), training=False
        )
