"""Scaffolding shared by the model families' experiment files.

``experiment`` wraps a model config with the trainer's settings; ``full_size`` is a run of a
published-size model (FSDP over every device), on synthetic batches or on a dataset;
``lerobot_data`` is one LeRobot dataset fed to a model's input builder (fine-tuning).
"""

from __future__ import annotations

import dataclasses

from embodied_jax.data.pipeline import DataConfig
from embodied_jax.data.sample_transform import ModelInputs
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.sources import LeRobotData
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.policy import PolicyConfig
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, OptimizerConfig, TrainConfig

# The default dataset directory of the fine-tuning experiments; a run names its own with ``--data.root DIR``.
DATASET = "data/lerobot_dataset"
# CPU benchmark runs: LeRobot's anchor sizes, 4 examples per step, nothing written.
BENCH_TRAIN = TrainConfig(steps=50, batch_size=4, log_every=5)


def experiment(
    name: str,
    model: PolicyConfig,
    *,
    train: TrainConfig,
    optimizer: OptimizerConfig,
    mesh: MeshConfig = MeshConfig(data=-1),
    checkpoint: CheckpointConfig = CheckpointConfig(enabled=False),
    data=None,
) -> ExperimentConfig:
    """An experiment named ``name`` writing to ``runs/<name>`` (synthetic data unless ``data``)."""
    config = ExperimentConfig(
        name=name,
        model=model,
        train=train,
        optimizer=optimizer,
        mesh=mesh,
        checkpoint=checkpoint,
        workdir=f"runs/{name}",
    )
    return config if data is None else dataclasses.replace(config, data=data)


def lerobot_data(
    root: str | None,
    *,
    image_size: int,
    norm: str,
    cameras: tuple[tuple[str, str], ...] = (),
    action_horizon: int | None = None,
    use_modality: bool = False,
) -> LeRobotData:
    """One LeRobot dataset -> the model's input builder, state and actions normalised with ``norm``.

    ``cameras`` () and ``action_horizon`` None: taken from the dataset and the model when the run
    starts (``DataSource.fit``), so ``--data.root DIR`` is all a run on another dataset needs."""
    return LeRobotData(
        DataConfig(
            sources=(),
            spec=SampleSpec(action_horizon=action_horizon, use_modality=use_modality),
            image_size=(image_size, image_size),
            norm_modes=(("observation.state", norm), ("action", norm)),
        ),
        ModelInputs(cameras=cameras),
        root=root,
    )


def full_size(
    name: str, model: PolicyConfig, *, optimizer: OptimizerConfig, steps: int, data: LeRobotData | None = None
) -> ExperimentConfig:
    """32 examples per step, FSDP over every device, a checkpoint every 1k steps."""
    return experiment(
        name,
        model,
        data=data,
        optimizer=optimizer,
        train=TrainConfig(steps=steps, batch_size=32, log_every=10),
        mesh=MeshConfig(data=1, fsdp=-1),
        checkpoint=CheckpointConfig(save_every=1_000, keep_last=3),
    )
