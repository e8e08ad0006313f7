"""π0.5 experiments: full size, the CPU benchmark model (LeRobot's anchor sizes) and a tiny one for tests.

``pi05_model()``, ``bench_model()`` and ``tiny_model()`` return the model configs alone
(benchmarks and tests use them); the registered experiments wrap them with training settings.
Optimiser defaults follow LeRobot's π0.5 finetune: AdamW lr 2.5e-5, betas (0.9, 0.95),
eps 1e-8, weight decay 0.01, clip norm 1, 1k warmup then cosine to 2.5e-6 over 30k steps.
"""

from __future__ import annotations

import dataclasses

from embodied_jax.data.sources import LeRobotData
from embodied_jax.models.pi05 import variants
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, OptimizerConfig, TrainConfig
from experiments.common import BENCH_TRAIN, DATASET, experiment, full_size, lerobot_data
from experiments.registry import register

_UPSTREAM_OPT = dict(
    lr=2.5e-5, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01, clip_norm=1.0, schedule="warmup_cosine", end_lr_factor=0.1
)


pi05_model, bench_model, tiny_model = variants.full, variants.bench, variants.tiny  # the sizes: models/pi05/variants.py


@register("pi05", "π0.5 at full size (3.35B, bf16 compute, FSDP); start from weights with --init-from")
def pi05() -> ExperimentConfig:
    steps = 30_000
    optimizer = OptimizerConfig(**_UPSTREAM_OPT, warmup_steps=1_000, decay_steps=steps)
    return full_size("pi05", pi05_model(), optimizer=optimizer, steps=steps)


@register(
    "pi05_bench", "small π0.5 for CPU benchmarks (LeRobot's anchor sizes: 2 cameras at 224², horizon 50, batch 4)"
)
def pi05_bench() -> ExperimentConfig:
    return experiment(
        "pi05_bench",
        bench_model(),
        train=BENCH_TRAIN,
        optimizer=OptimizerConfig(**dict(_UPSTREAM_OPT, lr=1e-4), warmup_steps=5),
    )


@register("pi05_tiny", "tiny π0.5 on synthetic data (tests)")
def pi05_tiny() -> ExperimentConfig:
    return experiment(
        "pi05_tiny",
        tiny_model(),
        train=TrainConfig(steps=100, batch_size=8, log_every=10),
        optimizer=OptimizerConfig(**dict(_UPSTREAM_OPT, lr=1e-3), warmup_steps=10),
        checkpoint=CheckpointConfig(save_every=50, keep_last=1),
    )


def finetune_data(root: str | None, *, image_size: int) -> LeRobotData:
    """One LeRobot dataset → the π0.5 input builder, state and actions quantile-normalised (upstream);
    cameras, widths and the action horizon come from the dataset and the model at the start of a run."""
    return lerobot_data(root, image_size=image_size, norm="quantile")


@register(
    "pi05_finetune",
    "π0.5 on a LeRobot dataset: --data.root DIR --init-from WEIGHTS (cameras and sizes from the dataset)",
)
def pi05_finetune() -> ExperimentConfig:
    """Finetune π0.5 on one LeRobot dataset (quantile statistics saved in every checkpoint).

        python -m experiments.launch pi05_finetune --data.root DATASET_DIR --init-from WEIGHTS \\
            [--workdir RUN_DIR] [--model.lora-rank 16] [--dry-run]

    ``WEIGHTS`` is ``python -m embodied_jax.models.convert --arch pi05`` output (or a run, a step or
    an exported policy); it also supplies the tokenizer unless ``--model.tokenizer-path`` names one.
    The dataset's cameras (``meta/info.json`` order) fill the image slots in order (the mapping is
    logged; ``--data.inputs.cameras DATASET_KEY SLOT ...`` overrides it) and only those are decoded;
    ``action_dim`` is the dataset's action width; the action horizon is ``--model.action-horizon``.
    ``--dry-run`` checks all of it against the dataset. With ``--model.lora-rank`` > 0 only the LoRA
    adapters train (``Pi05Config.freeze_regexes``); frozen weights are then stored in bfloat16.
    """
    steps = 30_000
    model = pi05_model()
    data = finetune_data(DATASET, image_size=model.vision.image_size)
    optimizer = OptimizerConfig(**_UPSTREAM_OPT, warmup_steps=1_000, decay_steps=steps, frozen_dtype=model.dtype)
    return full_size("pi05_finetune", model, optimizer=optimizer, steps=steps, data=data)


@register(
    "pi05_finetune_tiny",
    "pi05_finetune with the demo's small π0.5 (20 steps on a laptop): --data.root DIR --init-from WEIGHTS",
)
def pi05_finetune_tiny() -> ExperimentConfig:
    """``pi05_finetune`` at the demo's size (``models/pi05/variants.py:demo``: 32² images, 4-dim
    actions, horizon 8), so a demo run's checkpoint is its ``WEIGHTS`` (tokenizer included)::

        python -m embodied_jax.sim.collect reach --episodes 20 --out DATASET_DIR
        python -m experiments.launch pi05_finetune_tiny --data.root DATASET_DIR --init-from runs/demo/reach
    """
    model = variants.demo()
    return experiment(
        "pi05_finetune_tiny",
        model,
        data=finetune_data(DATASET, image_size=model.vision.image_size),
        train=TrainConfig(steps=20, batch_size=8, log_every=5),
        optimizer=OptimizerConfig(**dict(_UPSTREAM_OPT, lr=1e-4), warmup_steps=2),
        checkpoint=CheckpointConfig(save_every=20, keep_last=1),
    )


def with_model(config: ExperimentConfig, **model_overrides) -> ExperimentConfig:
    """The experiment with some model fields replaced (benchmark variants)."""
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **model_overrides))
