"""``load_policy``: a run's checkpoint or an exported policy -> the ``PolicyBundle`` a robot runs.

The saved config (``config_registry``: versioned, library classes only) is rebuilt without
importing the code that launched the run, its file fields point at the copies stored with the
weights (``embodied_jax.assets``: the tokenizer), the model is restored with its trained
parameters (the EMA when the run kept one) and wrapped with the statistics and the per-sample
transform of its data source. Nothing outside the directory is read, so a run directory or an
exported policy (``embodied_jax.export``) loads after being moved to another machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from embodied_jax.assets import with_assets
from embodied_jax.bundle import PolicyBundle
from embodied_jax.config_registry import from_dict
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.paths import resolve_inside
from embodied_jax.train import pretrained
from embodied_jax.train.checkpoint import Checkpointer
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig
from embodied_jax.train.runtime import Runtime, build
from embodied_jax.train.state import TrainState

MODEL_STATE = "model_state"  # an exported policy's non-parameter model state (FP8 scales, ...)


def serving_runtime(config: ExperimentConfig, devices: list | None) -> Runtime:
    """The runtime of a saved config for serving: data-parallel over ``devices`` (default: the
    first local device, which keeps the simulator's renderer, a custom call, out of SPMD
    partitioning), one example per device, no multi-process initialisation, no init weights."""
    devices = list(devices or jax.local_devices()[:1])
    config = dataclasses.replace(
        config,
        mesh=MeshConfig(data=-1),
        init_from=None,
        train=dataclasses.replace(config.train, grad_accum_steps=1, batch_size=len(devices)),
    )
    return build(config, devices)


def with_model_edits(config: ExperimentConfig, edits: dict[str, Any] | None, source: Any) -> ExperimentConfig:
    """``config`` with model fields replaced by ``edits`` (a field the model lacks: ``ValueError``
    naming ``source``); for settings that leave the weights' shapes alone."""
    if not edits:
        return config
    unknown = sorted(k for k in edits if not hasattr(config.model, k))
    if unknown:
        raise ValueError(f"{source}: the run's model config has no {unknown}")
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **edits))


def restore_run(
    ckpt_dir: str | os.PathLike,
    *,
    step: int | None = None,
    devices: list | None = None,
    model_edits: dict[str, Any] | None = None,
) -> tuple[ExperimentConfig, Runtime, TrainState, dict, int]:
    """A run's saved config (its asset fields pointing into the step), its serving runtime over
    ``devices``, the restored train state and statistics, and the step (default: the latest).
    ``model_edits``: model config fields replaced before the runtime is built, for settings that
    leave the weights' shapes alone (e.g. ``num_inference_steps``)."""
    path = pathlib.Path(ckpt_dir).absolute()
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        raise FileNotFoundError(f"{ckpt_dir}: no such checkpoint directory")
    ckpt = Checkpointer(path, CheckpointConfig(async_save=False), read_only=True)  # never touches a live run
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{path}: no checkpoint steps")
        config = from_dict(ckpt.read_json(step, "config"))
        config = dataclasses.replace(config, model=with_assets(config.model, ckpt.step_directory(step)))
        config = with_model_edits(config, model_edits, ckpt_dir)
        rt = serving_runtime(config, devices)
        state, norm_stats = ckpt.restore(rt.abstract_state, rt.shardings, step=step)
    finally:
        ckpt.close()
    return config, rt, state, norm_stats, step


def load_policy(
    ckpt_dir: str | os.PathLike,
    *,
    step: int | None = None,
    use_ema: bool = True,
    devices: list | None = None,
    model_edits: dict[str, Any] | None = None,
) -> PolicyBundle:
    """A trained policy from a run (``<workdir>``, ``<workdir>/checkpoints``) or an exported policy.

    ``step``: the checkpoint step (default: the latest). ``use_ema``: the EMA weights when the run
    kept them. The parameters are replicated over ``devices`` (default: the first local device).
    An exported policy holds one step and one set of weights: ``step`` and ``use_ema`` must be
    left at their defaults for it. ``model_edits``: model config fields replaced for sampling
    (``noise_scale``, ``num_inference_steps``), as ``restore_run`` takes them.
    """
    path = pathlib.Path(ckpt_dir).absolute()
    if (path / pretrained.POLICY_FILE).is_file():
        if step is not None or not use_ema:
            raise ValueError(f"{ckpt_dir}: an exported policy holds one step and one set of weights")
        return _load_exported(path, devices, model_edits)
    config, rt, state, norm_stats, step = restore_run(ckpt_dir, step=step, devices=devices, model_edits=model_edits)
    params = state.ema if (use_ema and state.ema is not None) else state.params
    with rt.context():
        model = rt.parts.merge(params, state.frozen, state.fp8, state.other)
    return PolicyBundle(config, model, norm_stats, step=step)


def _load_exported(path: pathlib.Path, devices: list | None, model_edits: dict[str, Any] | None) -> PolicyBundle:
    def inside(name: str, **kw) -> pathlib.Path:  # an export copied from elsewhere may hold links out of it
        return resolve_inside(path, name, what=f"exported policy {path}", **kw)

    info = json.loads(inside(pretrained.POLICY_FILE, regular_file=True).read_text())
    config = from_dict(json.loads(inside("config.json", regular_file=True).read_text()))
    config = dataclasses.replace(config, model=with_assets(config.model, path))
    config = with_model_edits(config, model_edits, path)
    norm_stats = json.loads(inside("norm_stats.json", regular_file=True).read_text())
    rt = serving_runtime(config, devices)
    abstract, shardings = rt.abstract_state, rt.shardings
    source = pretrained.WeightsSource("exported policy", inside("weights"), (), path)
    weights, adapters = pretrained.read_params(source, abstract, shardings)
    if adapters:
        raise pretrained.InitFromError(f"{path}: the exported weights lack {', '.join(adapters)}")
    params = pretrained.split_like(weights, abstract.params)
    frozen = pretrained.split_like(weights, abstract.frozen)
    fp8, other = abstract.fp8, abstract.other
    if jax.tree.leaves((fp8, other)):
        target = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            {"fp8": abstract.fp8, "other": abstract.other},
            {"fp8": shardings.fp8, "other": shardings.other},
        )
        with ocp.StandardCheckpointer() as reader:
            restored = reader.restore(inside(MODEL_STATE), target)
        fp8, other = restored["fp8"], restored["other"]
    with rt.context():
        model = rt.parts.merge(params, frozen, fp8, other)
    return PolicyBundle(config, model, norm_stats, step=int(info["step"]))
