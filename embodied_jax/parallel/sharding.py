"""From logical axis names to ``NamedSharding``s, and per-process batches to global arrays."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import flax.core.spmd
import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from embodied_jax.parallel.rules import LOGICAL_AXIS_RULES

BATCH_AXES = ("data", "fsdp")


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> Iterator[None]:
    """Activate ``mesh`` and the logical-axis rules: NNX variables are sharded at creation."""
    with jax.set_mesh(mesh), flax.core.spmd.logical_axis_rules(rules):
        yield


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules=LOGICAL_AXIS_RULES) -> nnx.State:
    """``NamedSharding`` per leaf of an (abstract) NNX state, from its logical annotations."""
    with mesh_context(mesh, rules):
        return nnx.get_named_sharding(abstract_state, mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading (batch) dimension split over the data-parallel axes, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def batch_shardings(mesh: Mesh, batch: Any) -> Any:
    return jax.tree.map(lambda x: batch_sharding(mesh, np.ndim(x)), batch)


def data_parallel_size(mesh: Mesh) -> int:
    return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def global_batch(local_batch: Any, mesh: Mesh) -> Any:
    """Assemble each process's rows into global arrays sharded over the batch axes.

    Every process passes its own slice (rows ``[p * n, (p + 1) * n)`` for process p);
    the global leading dimension is ``n * process_count``.
    """

    def to_global(x):
        x = np.asarray(x)
        sharding = batch_sharding(mesh, x.ndim)
        shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, shape)

    return jax.tree.map(to_global, local_batch)


def sharded_bytes_per_device(abstract_tree: Any, shardings: Any) -> int:
    """Bytes one device holds for a tree, from each leaf's sharded shape."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        shard = sharding.shard_shape(leaf.shape) if hasattr(sharding, "shard_shape") else leaf.shape
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
