"""What one train step costs per device, counted from the parameter tree and the traced program.

These are the analytic figures ``--dry-run`` prints beside XLA's compiled ones and that
``experiments.benchmarks.scale_report`` projects to GPU clusters; nothing here reads HLO.

- ``state_bytes``: per-device and global bytes of parameters, optimizer state and EMA, from
  each leaf's placement (``parallel.partition``).
- ``analytic_collectives``: FSDP traffic per device per step from the placements alone: every
  parameter is all-gathered over the devices that hold its shards before the forward pass,
  again in the backward pass for parameters of rematerialised layer stacks (a ``layers``
  axis and a remat policy other than "none"), and trainable gradients are reduce-scattered
  to their shards (then all-reduced across the data replicas of a shard, if any). Bytes
  follow ``parallel.collectives``' ring convention. Exceptions, all read from the tree:
  tables with a ``vocab`` axis (token embeddings) are looked up where they are stored (only
  ids and rows move); a frozen
  parameter gets a backward pass only when its block holds trainable ones (LoRA), i.e.
  frozen modules are assumed upstream of every trainable one (true for upstream's freezing:
  the VLM backbone runs first; not for a trainable vision tower under a frozen LLM).
- ``activation_bytes``: the residuals autodiff keeps for the backward pass under the model's
  remat policy, read from the jaxpr of the loss (what the policy keeps, before XLA
  schedules anything), per example: the difference between batch sizes 2 and 1, which
  leaves out residuals that do not grow with the batch (forwarded weights).
- ``memory_plan``: devices needed and the largest per-device batch that fits a GPU, from
  XLA's per-device figures at two batch sizes (temp memory is affine in the batch).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any

import jax
import numpy as np
from flax import nnx, traverse_util

from embodied_jax.parallel.partition import logical_names
from embodied_jax.parallel.rules import ShardingRules
from embodied_jax.parallel.sharding import batch_axes
from embodied_jax.train.state import GROUPS

# Token tables: the partitioner looks rows up where they are stored and moves only ids and
# rows, never the table or its gradient.
LOOKUP_AXES = frozenset({"vocab"})


def _nbytes(shape, dtype) -> int:
    itemsize = getattr(dtype, "itemsize", None) or np.dtype(dtype).itemsize  # PRNG key dtypes have one too
    return int(np.prod(shape, dtype=np.int64)) * int(itemsize)


def state_bytes(abstract_state, shardings) -> dict[str, dict[str, int]]:
    """{"per_device"|"total": {"params", "frozen", "fp8", "opt_state", "ema"}} in bytes."""
    out: dict[str, dict[str, int]] = {"per_device": {}, "total": {}}
    for name in ("params", "frozen", "fp8", "opt_state", "ema"):
        tree, sh = getattr(abstract_state, name), getattr(shardings, name)
        leaves, shards = jax.tree.leaves(tree), jax.tree.leaves(sh)
        out["total"][name] = sum(_nbytes(x.shape, x.dtype) for x in leaves)
        out["per_device"][name] = sum(
            _nbytes(s.shard_shape(x.shape), x.dtype) for x, s in zip(leaves, shards, strict=True)
        )
    return out


def _spec_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass
class _Leaf:
    path: str
    names: tuple
    elements: int
    itemsize: int
    group: str
    spec: Any


def _leaves(parts, placements) -> list[_Leaf]:
    out = []
    for group, template, placement in zip(GROUPS, parts.templates, placements, strict=True):
        specs = traverse_util.flatten_dict(placement)
        for path, variable in nnx.to_flat_state(template):
            out.append(
                _Leaf(
                    "/".join(map(str, path)),
                    logical_names(variable),
                    int(np.prod(variable.shape)),
                    np.dtype(variable.dtype).itemsize,
                    group,
                    specs[tuple(path)].spec,
                )
            )
    return out


def _block_of(path: str) -> str:
    """The module two levels above a parameter (``.../mlp`` for ``.../mlp/gate_proj/kernel``)."""
    return "/".join(path.split("/")[:-2])


def analytic_collectives(
    parts,
    placements,
    mesh,
    *,
    remat: bool,
    gather_itemsize,
    reduce_itemsize: int,
    rules: ShardingRules = ShardingRules(),
) -> dict[str, float]:
    """Per-device bytes per step: ``all-gather`` (forward and rematerialised backward),
    ``reduce-scatter`` and ``all-reduce`` of gradients, with their sum in ``total``.

    ``gather_itemsize(own itemsize) -> bytes`` is what a gathered weight element costs: on a GPU
    the compute dtype, ``min(own, 2)`` for bf16 (``partition.cast_parameter``); XLA:CPU moves
    every float collective in f32 (``lambda _: 4``). Gradients are reduced at
    ``reduce_itemsize``."""
    batch = set(batch_axes(mesh, rules))
    dp = math.prod(mesh.shape[a] for a in batch)
    leaves = [leaf for leaf in _leaves(parts, placements) if leaf.group in ("params", "frozen")]
    trainable_blocks = {_block_of(leaf.path) for leaf in leaves if leaf.group == "params"}
    out = defaultdict(float)
    for leaf in leaves:
        if LOOKUP_AXES & set(leaf.names):
            continue
        axes = [a for entry in leaf.spec for a in _spec_axes(entry)]
        s_batch = math.prod(mesh.shape[a] for a in axes if a in batch)
        s_other = math.prod(mesh.shape[a] for a in axes if a not in batch)
        local = leaf.elements / s_other  # what one device holds after the gather
        gather = local * gather_itemsize(leaf.itemsize) * (s_batch - 1) / s_batch
        stacked = "layers" in leaf.names
        backward = leaf.group == "params" or _block_of(leaf.path) in trainable_blocks
        passes = 2 if (remat and stacked and backward) else 1
        out["all-gather"] += passes * gather
        if leaf.group == "params":
            out["reduce-scatter"] += local * reduce_itemsize * (s_batch - 1) / s_batch
            replicas = dp // s_batch
            out["all-reduce"] += 2 * (local / s_batch) * reduce_itemsize * (replicas - 1) / replicas
    out["total"] = sum(out.values())
    return dict(out)


def activation_bytes(parts, model_config) -> dict[str, int]:
    """Bytes per example of the residuals the backward pass keeps, by dtype (see module doc)."""
    from jax.extend import core as jcore

    templates = [nnx.State(t).to_pure_dict() for t in parts.templates]
    params, frozen, fp8, other = [jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), t) for t in templates]

    def residuals(batch_size: int) -> dict[str, int]:
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), model_config.synthetic_batch(batch_size)
        )

        def vjp_of_loss(trained, fixed):
            def loss(trained):
                model = parts.merge(trained[0], fixed[0], trained[1], fixed[1])
                return model.loss(fixed[2], jax.random.key(0))[0]

            return jax.vjp(loss, trained)[1]

        with nnx.use_eager_sharding(False):
            jaxpr = jax.make_jaxpr(vjp_of_loss)((params, fp8), (frozen, other, batch)).jaxpr
        inputs = set(jaxpr.invars)
        counts: dict[str, int] = defaultdict(int)
        for var in jaxpr.outvars:
            if isinstance(var, jcore.Var) and var not in inputs:
                counts[str(var.aval.dtype)] += _nbytes(var.aval.shape, var.aval.dtype)
        return counts

    one, two = residuals(1), residuals(2)
    return {dtype: max(two.get(dtype, 0) - one.get(dtype, 0), 0) for dtype in set(one) | set(two)}


def stored_on_cpu(by_dtype: dict[str, int]) -> int:
    """Bytes as XLA:CPU stores them: it computes bf16/f16 in f32 and keeps f32 copies."""
    return sum(n * (2 if dtype in ("bfloat16", "float16") else 1) for dtype, n in by_dtype.items())


def memory_plan(
    device_bytes_at: dict[int, float],
    *,
    state_total: int,
    state_per_device: int,
    gpu_bytes: float,
    global_examples: int,
) -> dict[str, Any]:
    """Plan from XLA's per-device bytes (arguments + temp + outputs - aliased) at two per-device
    batch sizes on one mesh: memory is affine in the per-device batch, and its batch-free part
    holds this mesh's shard of the state (``state_per_device`` of ``state_total``), which
    shrinks as 1/devices. Returns the largest per-device batch that fits ``gpu_bytes`` here,
    and the fewest devices that fit ``global_examples`` (the run's batch) on such GPUs."""
    (b1, m1), (b2, m2) = sorted(device_bytes_at.items())[:2]
    per_example = max((m2 - m1) / (b2 - b1), 0.0)
    fixed = m1 - per_example * b1
    other = fixed - state_per_device  # gathered weights, gradient buffers: do not shrink with devices
    if per_example == 0:  # memory did not grow with the batch: no per-example estimate
        return {
            "bytes_per_example": 0.0,
            "fixed_bytes": m1,
            "max_examples_per_device": None,
            "devices_needed": math.ceil(state_total / (gpu_bytes - (m1 - state_per_device)))
            if gpu_bytes > m1 - state_per_device
            else None,
        }
    max_batch = int((gpu_bytes - fixed) // per_example) if gpu_bytes > fixed else 0
    need = (state_total + per_example * global_examples) / (gpu_bytes - other) if gpu_bytes > other else math.inf
    return {
        "bytes_per_example": per_example,
        "fixed_bytes": fixed,
        "max_examples_per_device": max_batch,
        "devices_needed": math.ceil(need) if math.isfinite(need) else None,
    }
