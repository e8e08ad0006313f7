"""Frozen dataclass configs of a training run (overridable from the CLI with tyro).

``ExperimentConfig`` holds the run: a model (``policy.PolicyConfig``), a data source
(``data.sources.DataSource``), an optional in-training ``Evaluation`` and the trainer's
own settings. Configs are data: what runs them is ``experiments/registry.py`` (training, or
an experiment's steps around it). Every class here is a registered config
(``config_registry``): checkpoints save the run's config and ``load_policy`` rebuilds it.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from embodied_jax.config_registry import register
from embodied_jax.parallel.distributed import DistributedConfig
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train.synthetic import SyntheticData


@register
@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 1e-4
    schedule: str = "warmup_cosine"  # or "constant" (after warmup)
    warmup_steps: int = 100
    decay_steps: int | None = None  # None: the run's train.steps
    end_lr_factor: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 1e-4
    clip_norm: float | None = 1.0
    # Parameters matching any of these regexes (on "a/b/c" paths) or with ndim < 2 get no decay.
    no_decay: tuple[str, ...] = (r"(^|/)(bias|scale|embedding)$", r"norm")
    # Parameters matching any of these regexes are frozen: no gradient, no optimizer state.
    freeze: tuple[str, ...] = ()
    # Frozen parameters are cast to this dtype (e.g. "bfloat16"); None keeps them as created.
    frozen_dtype: str | None = None


@register
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 32  # global, all processes together
    grad_accum_steps: int = 1
    seed: int = 0
    ema_decay: float | None = None
    log_every: int = 10
    max_consecutive_skips: int = 5  # non-finite steps in a row before the run stops
    eval_every: int = 0  # 0: no in-training evaluation


@register
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    directory: str | None = None  # None: <workdir>/checkpoints
    save_every: int = 1000
    keep_last: int = 3
    keep_every: int | None = None  # additionally keep every K-th step forever
    async_save: bool = True


@register
@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    progress_bar: bool = True
    tensorboard: bool = True
    wandb: bool = False  # offline mode; needs the wandb package
    wandb_project: str = "embodied_jax"


# Scores the live model at a training step: ``run(model, step) -> {name: value}``.
EvaluationRun = Callable[[Any, int], Mapping[str, float]]


class Evaluation(abc.ABC):
    """Base of ``ExperimentConfig.evaluation``: in-training evaluation every ``train.eval_every`` steps."""

    @abc.abstractmethod
    def start(self, model: Any, *, config: ExperimentConfig, norm_stats: Mapping[str, Any] | None) -> EvaluationRun:
        """Prepare once per training run (build and compile what the evaluation needs, for
        ``model``'s structure); the trainer keeps the returned callable for the whole run."""


@register
@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    # A PolicyConfig, a DataSource and an Evaluation (``train.loop.validate`` checks them; the
    # annotations stay ``Any`` so that tyro expands whichever subclass an experiment sets).
    model: Any = None
    data: Any = SyntheticData()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    distributed: DistributedConfig = DistributedConfig()
    evaluation: Any = None  # e.g. ``embodied_jax.evaluation.in_training.SimEvaluation``
    workdir: str = "runs/experiment"
    init_from: str | None = None  # parameters from a converted checkpoint (models.convert)
    dry_run: bool = False  # eval_shape only: config, mesh, parameter counts, bytes per device
    compile: bool = False  # with --dry-run: also compile the train step ahead of time
    # With --dry-run --compile: plan for GPUs of this memory (GB): devices needed, largest batch.
    gpu_memory_gb: float | None = None
    # Simulate this many CPU devices (sets the host platform device count before JAX starts).
    virtual_devices: int | None = None
    verbose: bool = False  # errors of bad input print their traceback, not only their one line
