"""Start a run from converted pretrained weights (``models.convert`` output).

The directory is an Orbax ``StandardCheckpointer`` checkpoint of the model's
parameters as one nested dict (trainable and frozen together, as the converter writes
them). Each leaf is read directly into the sharding of the run's train state.
Adapter leaves that a converted checkpoint cannot hold (LoRA ``lora_a``/``lora_b``, added
for finetuning) keep their initialised values; any other leaf missing from the
checkpoint is an error naming it.
"""

from __future__ import annotations

import pathlib
import re
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


# leaves created for finetuning (LoRA adapters: zero-effect at init), absent from converted weights
ADAPTER_LEAF_REGEX = r"(^|/)lora_[ab]$"


def _split_absent(target: dict, stored: Any, prefix: str = "") -> tuple[dict, list[str], list[str]]:
    """(target without the leaves absent from ``stored``, absent adapter paths, absent other paths)."""
    present, adapters, missing = {}, [], []
    for key, value in target.items():
        path = f"{prefix}{key}"
        found = None
        if isinstance(stored, dict):
            found = stored.get(key, stored.get(str(key)))
        if isinstance(value, dict):
            sub, a, m = _split_absent(value, found, path + "/")
            if sub:
                present[key] = sub
            adapters += a
            missing += m
        elif found is not None:
            present[key] = value
        elif re.search(ADAPTER_LEAF_REGEX, path):
            adapters.append(path)
        else:
            missing.append(path)
    return present, adapters, missing


def load_into(
    state: TrainState, directory: str | pathlib.Path, abstract: TrainState, shardings: TrainState
) -> TrainState:
    path = pathlib.Path(directory).absolute()
    if not path.exists():
        raise FileNotFoundError(f"init_from={directory}: no such directory")
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        _deep_merge(abstract.params, abstract.frozen),
        _deep_merge(shardings.params, shardings.frozen),
    )
    with ocp.StandardCheckpointer() as checkpointer:
        stored = checkpointer.metadata(path).item_metadata.tree
        target, adapters, missing = _split_absent(target, stored)
        if missing:
            raise ValueError(
                f"init_from={directory}: the checkpoint lacks {len(missing)} parameters of the model: "
                f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
            )
        params = checkpointer.restore(path, target)
    if adapters:  # keep the freshly initialised adapters
        params = _deep_merge(_deep_merge(state.params, state.frozen), params)
    trainable = _split_like(params, abstract.params)
    frozen = _split_like(params, abstract.frozen)
    ema = jax.tree.map(lambda x: x, trainable) if state.ema is not None else None
    return state.replace(params=trainable, frozen=frozen, ema=ema)
