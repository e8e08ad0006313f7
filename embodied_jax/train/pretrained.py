"""Start a run from existing weights (``--init-from``): what the path holds, and reading it.

``--init-from`` accepts three kinds of directory (``locate`` tells them apart and the trainer
logs which it found and what it reads):

- **converted weights** (``models.convert`` output): an Orbax checkpoint of the model's
  parameters as one nested dict (trainable and frozen together);
- an **exported policy** (``python -m embodied_jax.export``): its ``weights/`` folder, the same
  format;
- a **training checkpoint** of this project: a run directory, its ``checkpoints/`` directory or
  one step directory (a run: its newest step). It reads the EMA weights when the run kept them,
  else its parameters, together with its frozen parameters; never the optimizer state or the
  step, so the new run starts its own schedule.

Each leaf is read directly into the sharding of the run's train state (a partial restore:
nothing else of the checkpoint is read). Adapter leaves that a checkpoint cannot hold (LoRA
``lora_a``/``lora_b``, added for fine-tuning) keep their initialised values; any other leaf
missing from the checkpoint is an error naming it. Every kind also carries the files the model
config names (``assets/``: the tokenizer), which a run that names none takes
(``embodied_jax.assets``).
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import re
from typing import Any

import jax
import orbax.checkpoint as ocp

from embodied_jax.errors import InputError
from embodied_jax.train.state import TrainState

log = logging.getLogger(__name__)

POLICY_FILE = "policy.json"  # marks an exported policy directory (embodied_jax.export)


class InitFromError(InputError, ValueError):
    """``--init-from`` names something that holds no usable weights for this model."""


@dataclasses.dataclass(frozen=True)
class WeightsSource:
    """Where ``--init-from`` weights live: ``checkpoint`` is the Orbax tree to read; ``groups``
    the top-level entries of that tree that together form the parameter dict (empty: the
    whole tree is the parameter dict); ``assets``: the directory holding ``assets/``."""

    kind: str
    checkpoint: pathlib.Path
    groups: tuple[str, ...]
    assets: pathlib.Path

    def describe(self) -> str:
        what = " + ".join(self.groups) if self.groups else "parameters"
        return f"{self.kind} at {self.checkpoint} (reading {what})"


def _is_step_dir(path: pathlib.Path) -> bool:
    return path.name.isdigit() and (path / "state" / "_METADATA").is_file()


def _newest_step_dir(checkpoints: pathlib.Path) -> pathlib.Path | None:
    steps = sorted((p for p in checkpoints.iterdir() if _is_step_dir(p)), key=lambda p: int(p.name))
    return steps[-1] if steps else None


def _stored_tree(checkpoint: pathlib.Path) -> dict:
    with ocp.PyTreeCheckpointer() as reader:  # Orbax finds no metadata under a relative path
        return reader.metadata(pathlib.Path(checkpoint).absolute()).item_metadata.tree


def locate(init_from: str | pathlib.Path) -> WeightsSource:
    """What ``init_from`` holds; an ``InitFromError`` naming the path when it is none of the kinds."""
    path = pathlib.Path(init_from).absolute()
    if not path.exists():
        raise InitFromError(f"init_from={str(init_from)!r}: no such file or directory")
    if (path / POLICY_FILE).is_file():
        return WeightsSource("exported policy", path / "weights", (), path)
    step_dir = None
    if _is_step_dir(path):
        step_dir = path
    elif path.is_dir():
        checkpoints = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        step_dir = _newest_step_dir(checkpoints)
    if step_dir is not None:
        stored = _stored_tree(step_dir / "state")
        weights = "ema" if isinstance(stored.get("ema"), dict) and stored["ema"] else "params"
        groups = (weights, "frozen") if stored.get("frozen") else (weights,)
        return WeightsSource(f"training checkpoint, step {step_dir.name}", step_dir / "state", groups, step_dir)
    if (path / "_METADATA").is_file() or (path / "_CHECKPOINT_METADATA").is_file():
        return WeightsSource("converted weights", path, (), path)
    raise InitFromError(
        f"init_from={str(init_from)!r}: holds neither converted weights (models.convert), an exported policy "
        f"(embodied_jax.export: {POLICY_FILE}) nor a training checkpoint (a run dir, its checkpoints/ or a step dir)"
    )


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if k in out and isinstance(v, dict) else v
    return out


def split_like(tree: dict, like: dict) -> dict:
    return {k: split_like(tree[k], v) if isinstance(v, dict) else tree[k] for k, v in like.items()}


def _child(stored: Any, key: Any) -> Any:
    if isinstance(stored, dict):
        return stored.get(key, stored.get(str(key)))
    return None


# leaves created for finetuning (LoRA adapters: zero-effect at init), absent from converted weights
ADAPTER_LEAF_REGEX = r"(^|/)lora_[ab]$"


def _place(target: dict, stored: dict, groups: tuple[str, ...], prefix: str = ""):
    """Each target leaf under the stored group that holds it: (restore target in the stored
    tree's nesting, absent adapter paths, absent other paths)."""
    placed: dict = {}
    adapters, missing = [], []

    def walk(node: dict, views: list[tuple[tuple, Any]], prefix: str, keys: tuple) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            children = [(g, _child(v, key)) for g, v in views]
            children = [(g, c) for g, c in children if c is not None]
            if isinstance(value, dict):
                walk(value, children, path + "/", keys + (key,))
            elif children:
                group = children[0][0]
                branch = placed
                for k in group + keys:
                    branch = branch.setdefault(k, {})
                branch[key] = value
            elif re.search(ADAPTER_LEAF_REGEX, path):
                adapters.append(path)
            else:
                missing.append(path)

    views = [((g,), stored.get(g)) for g in groups] if groups else [((), stored)]
    walk(target, views, prefix, ())
    return placed, adapters, missing


def _merge_groups(restored: dict, groups: tuple[str, ...]) -> dict:
    if not groups:
        return restored
    merged: dict = {}
    for group in groups:
        merged = _deep_merge(merged, restored.get(group, {}))
    return merged


def read_params(source: WeightsSource, abstract: TrainState, shardings: TrainState) -> tuple[dict, list[str]]:
    """(the run's trainable + frozen parameters as one nested dict, adapter paths left out)."""
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        _deep_merge(abstract.params, abstract.frozen),
        _deep_merge(shardings.params, shardings.frozen),
    )
    stored = _stored_tree(source.checkpoint)
    placed, adapters, missing = _place(target, stored, source.groups)
    if missing:
        raise InitFromError(
            f"init_from: the {source.kind} at {source.checkpoint} lacks {len(missing)} parameters of the model: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}"
        )
    with ocp.PyTreeCheckpointer() as reader:
        restored = reader.restore(
            source.checkpoint.absolute(),
            args=ocp.args.PyTreeRestore(
                item=placed, restore_args=ocp.checkpoint_utils.construct_restore_args(placed), partial_restore=True
            ),
        )
    return _merge_groups(restored, source.groups), adapters


def load_into(
    state: TrainState, directory: str | pathlib.Path, abstract: TrainState, shardings: TrainState
) -> TrainState:
    source = locate(directory)
    log.info("init_from: %s", source.describe())
    params, adapters = read_params(source, abstract, shardings)
    if adapters:  # keep the freshly initialised adapters
        params = _deep_merge(_deep_merge(state.params, state.frozen), params)
    trainable = split_like(params, abstract.params)
    frozen = split_like(params, abstract.frozen)
    ema = jax.tree.map(lambda x: x, trainable) if state.ema is not None else None
    return state.replace(params=trainable, frozen=frozen, ema=ema)
