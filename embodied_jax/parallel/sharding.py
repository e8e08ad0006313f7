"""The mesh context, parameter and batch ``NamedSharding``s, per-process batches to global arrays."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import flax.core.spmd
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from embodied_jax.parallel.partition import expand_axes, parameter_placements, use_rules
from embodied_jax.parallel.rules import ShardingRules, candidates


def flax_rules(mesh: Mesh, rules: ShardingRules) -> tuple[tuple[str, Any], ...]:
    """First-choice rules in mesh-axis names, for Flax's own eager sharding of variables."""
    out = []
    for name in dict.fromkeys(n for n, _ in rules.table):
        target = candidates(rules.table, name)[0]
        parts = () if target is None else tuple(expand_axes(mesh, target))
        out.append((name, None if not parts else parts[0] if len(parts) == 1 else parts))
    return tuple(out)


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Iterator[None]:
    """Activate ``mesh`` and the logical-axis rules (for ``partition.constrain`` and for NNX
    variables created eagerly, which Flax shards at creation by the rules' first choices)."""
    with jax.set_mesh(mesh), use_rules(rules), flax.core.spmd.logical_axis_rules(flax_rules(mesh, rules)):
        yield


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> nnx.State:
    """``NamedSharding`` per leaf of an (abstract) NNX state, from its logical annotations."""
    return jax.tree.map(
        lambda p: NamedSharding(mesh, p.spec),
        parameter_placements(abstract_state, mesh, rules),
        is_leaf=lambda x: hasattr(x, "spec"),
    )


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_axes(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> tuple[str, ...]:
    """The mesh axes the batch is split over (the ``batch`` rule: data and fsdp by default)."""
    target = candidates(rules.table, "batch")[0]
    return () if target is None else tuple(expand_axes(mesh, target))


def batch_sharding(mesh: Mesh, ndim: int = 1, rules: ShardingRules = ShardingRules()) -> NamedSharding:
    """Leading (batch) dimension split over the data-parallel axes, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(batch_axes(mesh, rules) or None, *([None] * (ndim - 1))))


def batch_shardings(mesh: Mesh, batch: Any, rules: ShardingRules = ShardingRules()) -> Any:
    return jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x), rules), batch)


def data_parallel_size(mesh: Mesh, rules: ShardingRules = ShardingRules()) -> int:
    return int(np.prod([mesh.shape[a] for a in batch_axes(mesh, rules)]))


def global_batch(local_batch: Any, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> Any:
    """Assemble each process's rows into global arrays sharded over the batch axes.

    Every process passes its own slice (rows ``[p * n, (p + 1) * n)`` for process p);
    the global leading dimension is ``n * process_count``.
    """

    def to_global(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.ndim, rules)
        shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(to_global, local_batch)
