"""Shared helpers of the training-core tests."""

from __future__ import annotations

import dataclasses
import json
import pathlib

from embodied_jax.models.toy_flow import ToyFlowConfig
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train.config import (
    CheckpointConfig,
    ExperimentConfig,
    MetricsConfig,
    OptimizerConfig,
    TrainConfig,
)

TOY = ToyFlowConfig(state_dim=8, action_dim=4, horizon=8, width=64, hidden=128, depth=2)


def toy_config(
    workdir: pathlib.Path | str,
    *,
    steps: int = 3,
    mesh: MeshConfig = MeshConfig(),
    save_every: int = 1000,
    checkpoint: bool = False,
    **train_kw,
) -> ExperimentConfig:
    return ExperimentConfig(
        name="toy_test",
        model=TOY,
        train=TrainConfig(steps=steps, batch_size=16, log_every=1, **train_kw),
        optimizer=OptimizerConfig(lr=1e-2, schedule="warmup_cosine", warmup_steps=2, decay_steps=20),
        mesh=mesh,
        checkpoint=CheckpointConfig(enabled=checkpoint, save_every=save_every, keep_last=3),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
        workdir=str(workdir),
    )


def losses(history: list[dict]) -> dict[int, float]:
    return {int(h["step"]): h["loss"] for h in history if "loss" in h}


def read_metrics(workdir: pathlib.Path) -> dict[int, float]:
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return losses([json.loads(line) for line in lines])


def replace_train(config: ExperimentConfig, **kw) -> ExperimentConfig:
    return dataclasses.replace(config, train=dataclasses.replace(config.train, **kw))


# Command-line overrides equivalent to ``toy_config`` for subprocess runs of the launcher.
TOY_CLI = [
    "toy",
    "--model.width",
    "64",
    "--model.hidden",
    "128",
    "--model.depth",
    "2",
    "--train.batch-size",
    "16",
    "--train.log-every",
    "1",
    "--optimizer.lr",
    "1e-2",
    "--optimizer.warmup-steps",
    "2",
    "--optimizer.decay-steps",
    "20",
    "--metrics.no-progress-bar",
    "--metrics.no-tensorboard",
]
