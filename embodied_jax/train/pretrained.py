"""Start a run from converted pretrained weights (``models.convert`` output).

The directory is an Orbax ``StandardCheckpointer`` checkpoint of the model's
parameters as one nested dict (trainable and frozen together, as the converter writes
them). Each leaf is read directly into the sharding of the run's train state.
"""
from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from embodied_jax.train.state import TrainState


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def _split_like(tree: dict, like: dict) -> dict:
    return {k: _split_like(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def load_into(state: TrainState, directory: str | pathlib.Path, abstract: TrainState, shardings: TrainState) -> TrainState:
    path = pathlib.Path(directory).absolute()
    if not path.exists():
        raise FileNotFoundError(f"init_from={directory}: no such directory")
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        _deep_merge(abstract.params, abstract.frozen),
        _deep_merge(shardings.params, shardings.frozen),
    )
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(path, target)
    trainable = _split_like(params, abstract.params)
    frozen = _split_like(params, abstract.frozen)
    ema = jax.tree.map(lambda x: x, trainable) if state.ema is not None else None
    return state.replace(params=trainable, frozen=frozen, ema=ema)
