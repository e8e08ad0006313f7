"""Experiment-level data sources: what ``ExperimentConfig.data`` holds for real datasets.

``LeRobotData`` joins the data layer (Grain pipeline over LeRobot datasets) with the
model's input builder: ``ModelInputs`` renames a data-layer sample (dataset keys such as
``observation.state``, ``action``, ``observation.images.<camera>``) into the builder's
``{"task", "state", "images": {slot: image}, "actions"}`` and calls the builder that the
model config provides through ``input_builder(packed)``. With ``packing.seq_len`` > 0
(``--data.packing.seq-len N``) the builder emits variable-length samples and the pipeline
packs them into rows of N tokens (``data/packing.py``); ``train.batch_size`` then counts
rows. The trainer only calls ``make_iterator``; ``data/`` never imports a model. A policy bundle applies the same
``ModelInputs`` to a robot's raw observation, so serving sees what training saw.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from embodied_jax.data.packing import PackingConfig
from embodied_jax.data.pipeline import DataConfig, make_data_iterator


@dataclasses.dataclass(frozen=True)
class ModelInputs:
    """Dataset keys -> the model input builder's sample layout."""

    state_key: str = "observation.state"
    action_key: str = "action"
    cameras: tuple[tuple[str, str], ...] = ()  # (dataset camera key, model camera slot)

    def rename(self, sample: dict[str, Any]) -> dict[str, Any]:
        missing = [k for k in (self.state_key, "task", *(c for c, _ in self.cameras)) if k not in sample]
        if missing:
            raise KeyError(f"sample has no {missing} (keys: {sorted(sample)})")
        out = {
            "task": str(sample["task"]),
            "state": np.asarray(sample[self.state_key], np.float32),
            "images": {slot: sample[key] for key, slot in self.cameras},
        }
        if self.action_key in sample:
            out["actions"] = np.asarray(sample[self.action_key], np.float32)
        return out


@dataclasses.dataclass(frozen=True)
class _RenamedBuilder:
    inputs: ModelInputs
    builder: Callable[[dict], dict]

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        return self.builder(self.inputs.rename(sample))


@dataclasses.dataclass(frozen=True)
class LeRobotData:
    data: DataConfig
    inputs: ModelInputs = ModelInputs()
    packing: PackingConfig = PackingConfig()

    def make_iterator(self, *, model: Any, process_index: int, process_count: int, batch_size: int, seed: int):
        if batch_size % process_count:
            raise ValueError(f"train.batch_size={batch_size} is not divisible by {process_count} processes")
        packing = self.packing
        if packing.enabled:
            builder = model.input_builder(packed=True)
            packing = packing.resolved(builder.tokens_per_image)
        else:
            builder = model.input_builder()
        return make_data_iterator(self.data, process_index=process_index, process_count=process_count,
                                  batch_size=batch_size // process_count, seed=seed,
                                  builder=_RenamedBuilder(self.inputs, builder), packing=packing)
