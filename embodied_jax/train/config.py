"""Frozen dataclass configs of a training run (overridable from the CLI with tyro)."""
from __future__ import annotations

import dataclasses
from typing import Any

from embodied_jax.parallel.distributed import DistributedConfig
from embodied_jax.parallel.mesh import MeshConfig


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


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    directory: str | None = None  # None: <workdir>/checkpoints
    save_every: int = 1000
    keep_last: int = 3
    keep_every: int | None = None  # additionally keep every K-th step forever
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    progress_bar: bool = True
    tensorboard: bool = True
    wandb: bool = False  # offline mode; needs the wandb package
    wandb_project: str = "embodied_jax"


@dataclasses.dataclass(frozen=True)
class SyntheticData:
    """Batches from the model config's ``synthetic_batch``: a deterministic function of the step."""

    def make_iterator(self, *, model: Any, process_index: int, process_count: int, batch_size: int, seed: int):
        from embodied_jax.train.synthetic import SyntheticIterator

        return SyntheticIterator(model, process_index, process_count, batch_size, seed)


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    name: str = "experiment"
    model: Any = None
    data: Any = SyntheticData()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    mesh: MeshConfig = MeshConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()
    distributed: DistributedConfig = DistributedConfig()
    # In-training evaluation: ``evaluate(model, step, *, config, norm_stats) -> {name: value}``,
    # called every ``train.eval_every`` steps (e.g. ``experiments.sim_eval.SimEvaluation``).
    evaluation: Any = None
    workdir: str = "runs/experiment"
    init_from: str | None = None  # parameters from a converted checkpoint (models.convert)
    dry_run: bool = False  # eval_shape only: config, mesh, parameter counts, bytes per device
    compile: bool = False  # with --dry-run: also compile the train step ahead of time
    # With --dry-run --compile: plan for GPUs of this memory (GB): devices needed, largest batch.
    gpu_memory_gb: float | None = None
    # Simulate this many CPU devices (sets the host platform device count before JAX starts).
    virtual_devices: int | None = None


def to_dict(config: Any) -> Any:
    """A JSON view of a (nested) config; each dataclass records ``module:qualname`` so that
    ``from_dict`` rebuilds the same objects (a checkpoint knows how to remake its model)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        out = {"__class__": f"{type(config).__module__}:{type(config).__qualname__}"}
        for f in dataclasses.fields(config):
            out[f.name] = to_dict(getattr(config, f.name))
        return out
    if isinstance(config, (list, tuple)):
        return [to_dict(x) for x in config]
    if isinstance(config, dict):
        return {str(k): to_dict(v) for k, v in config.items()}
    if isinstance(config, (str, int, float, bool)) or config is None:
        return config
    return repr(config)


def from_dict(payload: Any) -> Any:
    """Inverse of ``to_dict``: dataclasses are re-created, JSON lists become tuples."""
    import importlib

    if isinstance(payload, dict) and "__class__" in payload:
        module, _, qualname = payload["__class__"].partition(":")
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: from_dict(v) for k, v in payload.items() if k != "__class__" and k in fields}
        return cls(**kwargs)
    if isinstance(payload, list):
        return tuple(from_dict(x) for x in payload)
    if isinstance(payload, dict):
        return {k: from_dict(v) for k, v in payload.items()}
    return payload
