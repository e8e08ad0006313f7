"""A run's runtime, built from its config before any step: the checks of the config against the
devices and the outputs (``ConfigError``), the dataset fitted to the model (``prepare``), and the
mesh, sharding rules, model parts, optimizer and compiled step (``build``, ``Runtime``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any

import jax

from embodied_jax.assets import with_assets
from embodied_jax.data.sources import DataSource
from embodied_jax.errors import InputError
from embodied_jax.parallel.mesh import axis_size, make_mesh
from embodied_jax.parallel.rules import MESH_AXES, RulesError, ShardingRules
from embodied_jax.parallel.sharding import data_parallel_size, mesh_context
from embodied_jax.policy import PolicyConfig
from embodied_jax.train import pretrained
from embodied_jax.train.config import Evaluation, ExperimentConfig
from embodied_jax.train.optimizer import make_optimizer
from embodied_jax.train.state import (
    ModelParts,
    TrainState,
    init_seed,
    make_init_fn,
    model_parts,
    state_shardings,
)
from embodied_jax.train.step import jit_train_step, make_train_step

log = logging.getLogger(__name__)


class ConfigError(InputError, ValueError):
    """A config that cannot run; raised before anything is compiled or written."""


@dataclasses.dataclass
class Runtime:
    """Everything derived from the config before any array is allocated."""

    config: ExperimentConfig
    mesh: Any
    parts: ModelParts
    tx: Any
    schedule: Any
    init_fn: Any
    abstract_state: TrainState
    shardings: TrainState
    rules: ShardingRules = ShardingRules()

    def context(self):
        """The mesh and sharding rules that tracing and running the step need."""
        return mesh_context(self.mesh, self.rules)

    def step_function(self, batch: Any):
        """The jitted train step for batches shaped like ``batch`` (trace it under ``context()``)."""
        return jit_train_step(
            make_train_step(self.parts, self.tx, self.schedule, self.config.train, self.mesh, self.rules),
            self.shardings,
            batch,
            self.mesh,
            self.rules,
        )


def _check_writable(field: str, path: pathlib.Path) -> None:
    """The directory exists and is writable, or can be created under a writable directory."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{field}={str(path)!r}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{field}={str(path)!r}: {existing} is not writable")


def validate_outputs(config: ExperimentConfig) -> None:
    """Where a training run writes can be written (checked before anything is)."""
    _check_writable("workdir", pathlib.Path(config.workdir))
    if config.checkpoint.directory is not None:
        _check_writable("checkpoint.directory", pathlib.Path(config.checkpoint.directory))


def validate(config: ExperimentConfig, num_devices: int, process_count: int = 1) -> None:
    """Checks that need no compile; each error names the config field."""
    t = config.train
    if config.model is None:
        raise ConfigError("model: the experiment has no model config")
    for name, value, base in (
        ("model", config.model, PolicyConfig),
        ("data", config.data, DataSource),
        ("evaluation", config.evaluation, Evaluation),
    ):
        if value is not None and not isinstance(value, base):
            raise ConfigError(f"{name}: {type(value).__name__} does not subclass {base.__module__}.{base.__qualname__}")
    for name in ("steps", "batch_size", "grad_accum_steps", "log_every", "max_consecutive_skips"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 1")
    if t.ema_decay is not None and not 0.0 <= t.ema_decay < 1.0:
        raise ConfigError(f"train.ema_decay={t.ema_decay} must be in [0, 1)")
    ckpt = config.checkpoint
    if ckpt.save_every < 1:
        raise ConfigError(f"checkpoint.save_every={ckpt.save_every} must be >= 1")
    if ckpt.enabled and ckpt.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={ckpt.keep_last} must be >= 1 (or --checkpoint.no-enabled)")
    if ckpt.keep_every is not None and ckpt.keep_every < 1:
        raise ConfigError(f"checkpoint.keep_every={ckpt.keep_every} must be >= 1")
    if config.init_from is not None:
        pretrained.locate(config.init_from)  # one of the kinds it reads, named when it is not
    if config.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr={config.optimizer.lr} must be > 0")
    if t.batch_size % process_count:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by the {process_count} processes")
    if t.batch_size % t.grad_accum_steps:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.grad_accum_steps={t.grad_accum_steps}"
        )


def prepare(config: ExperimentConfig) -> ExperimentConfig:
    """The run's config fitted to its data, checked against it (``DataSource.fit``, ``check``):
    what a run trains and saves, and what ``--dry-run`` reports. Fills the model's unset files
    (the tokenizer) from ``--init-from`` weights first. Reads metadata and tables, no frames;
    compiles and writes nothing."""
    model = config.model
    if config.init_from is not None and isinstance(model, PolicyConfig):
        model = with_assets(model, pretrained.locate(config.init_from).assets, only_unset=True)
    data = config.data
    if isinstance(data, DataSource) and isinstance(model, PolicyConfig):
        data, model = data.fit(model)
        data.check(model)
    return dataclasses.replace(config, model=model, data=data)


def build(config: ExperimentConfig, devices: list | None = None) -> Runtime:
    """Everything derived from the config; ``devices`` restricts the mesh (default: all devices)."""
    from embodied_jax.parallel.mesh import MeshError

    try:
        mesh = make_mesh(config.mesh, devices)
        rules = ShardingRules.from_config(config.mesh.rules, config.mesh.min_shard_bytes)
    except (MeshError, RulesError) as e:
        raise ConfigError(str(e)) from e
    validate(config, mesh.devices.size, jax.process_count())
    for axis in MESH_AXES:
        if axis_size(mesh, axis) > 1 and not rules.uses(axis):
            log.warning(
                "mesh.%s=%d but no sharding rule uses %r: it only replicates (for tensor "
                "parallelism add --mesh.rules tensor_parallel)",
                axis,
                axis_size(mesh, axis),
                axis,
            )
    dp = data_parallel_size(mesh, rules)
    micro = config.train.batch_size // config.train.grad_accum_steps
    if micro % dp:
        raise ConfigError(
            f"train.batch_size={config.train.batch_size} / train.grad_accum_steps={config.train.grad_accum_steps} "
            f"= {micro} rows per micro-batch is not divisible by the {dp} data-parallel devices "
            f"(mesh.data × mesh.fsdp)"
        )
    # The model's own freezing switches (e.g. GR00T's tune_*) add to optimizer.freeze.
    parts = model_parts(config.model, tuple(config.optimizer.freeze) + tuple(config.model.freeze_regexes()))
    try:
        tx, schedule = make_optimizer(config.optimizer, config.train.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    init_fn = make_init_fn(config.model, parts, tx, config.optimizer, mesh, config.train.ema_decay is not None)
    abstract_state = jax.eval_shape(init_fn, init_seed(config.train.seed))
    shardings = state_shardings(abstract_state, parts, tx, mesh, rules)
    return Runtime(config, mesh, parts, tx, schedule, init_fn, abstract_state, shardings, rules)


def initial_state(rt: Runtime) -> TrainState:
    with rt.context():
        state = jax.jit(rt.init_fn, out_shardings=rt.shardings)(init_seed(rt.config.train.seed))
    if rt.config.init_from:
        state = pretrained.load_into(state, rt.config.init_from, rt.abstract_state, rt.shardings)
    return state
