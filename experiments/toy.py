"""Experiments with the toy flow-matching policy on synthetic data (the trainer's tests, dry-run checks)."""

from __future__ import annotations

import dataclasses

from embodied_jax.models.toy_flow import ToyFlowConfig
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, OptimizerConfig, TrainConfig
from experiments.registry import register


@register("toy", "toy flow-matching policy on synthetic data (fast; the trainer's test model)")
def toy() -> ExperimentConfig:
    return ExperimentConfig(
        name="toy",
        model=ToyFlowConfig(),
        train=TrainConfig(steps=200, batch_size=32, log_every=20),
        optimizer=OptimizerConfig(lr=3e-3, warmup_steps=20, weight_decay=1e-4),
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(save_every=100, keep_last=2),
        workdir="runs/toy",
    )


@register("toy_large", "toy policy with ~1.1B parameters (for --dry-run memory checks)")
def toy_large() -> ExperimentConfig:
    base = toy()
    return dataclasses.replace(
        base,
        name="toy_large",
        model=ToyFlowConfig(width=4096, hidden=16384, depth=8),
        mesh=MeshConfig(data=1, fsdp=-1),
        workdir="runs/toy_large",
    )
