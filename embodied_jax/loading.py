"""``load_policy``: a run's checkpoint -> the ``PolicyBundle`` a robot or the simulator runs.

The checkpoint's saved config (``config_registry``: versioned, library classes only) is
rebuilt without importing the code that launched the run, the model is restored with its
trained parameters (the EMA when the run kept one) and wrapped with the statistics and
the per-sample transform of its data source.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import jax

from embodied_jax.bundle import PolicyBundle
from embodied_jax.config_registry import from_dict
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train.checkpoint import Checkpointer
from embodied_jax.train.config import CheckpointConfig
from embodied_jax.train.loop import build


def load_policy(
    ckpt_dir: str | os.PathLike, *, step: int | None = None, use_ema: bool = True, devices: list | None = None
) -> PolicyBundle:
    """A trained policy from a run's checkpoint directory (``<workdir>/checkpoints`` or the workdir).

    ``step``: the checkpoint step (default: the latest). ``use_ema``: the EMA weights when the run
    kept them. The parameters are replicated over ``devices`` (default: the first local device,
    which keeps the simulator's renderer, a custom call, out of SPMD partitioning).
    """
    path = pathlib.Path(ckpt_dir)
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
        # Serving: data-parallel over the chosen local devices; no multi-process initialisation.
        devices = list(devices or jax.local_devices()[:1])
        config = dataclasses.replace(
            config,
            mesh=MeshConfig(data=-1),
            init_from=None,
            train=dataclasses.replace(config.train, grad_accum_steps=1, batch_size=len(devices)),
        )
        rt = build(config, devices)
        state, norm_stats = ckpt.restore(rt.abstract_state, rt.shardings, step=step)
    finally:
        ckpt.close()
    params = state.ema if (use_ema and state.ema is not None) else state.params
    with rt.context():
        model = rt.parts.merge(params, state.frozen, state.fp8, state.other)
    return PolicyBundle(config, model, norm_stats, step=step)
