"""Mesh construction, cluster detection and global batch assembly."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from embodied_jax.parallel import distributed
from embodied_jax.parallel.mesh import MeshConfig, MeshError, make_mesh, resolve_axis_sizes
from embodied_jax.parallel.rules import KNOWN_LOGICAL_AXES, LOGICAL_AXIS_RULES, MESH_AXES
from embodied_jax.parallel.sharding import global_batch


@pytest.mark.parametrize(
    "config, sizes",
    [
        (MeshConfig(), {"data": 8, "fsdp": 1, "tensor": 1}),
        (MeshConfig(data=2, fsdp=-1), {"data": 2, "fsdp": 4, "tensor": 1}),
        (MeshConfig(data=1, fsdp=-1, tensor=2), {"data": 1, "fsdp": 4, "tensor": 2}),
        (MeshConfig(data=-1, fsdp=2, dcn_data=2), {"data": 4, "fsdp": 2, "tensor": 1}),
    ],
)
def test_axis_sizes(config, sizes):
    assert resolve_axis_sizes(config, 8) == sizes


@pytest.mark.parametrize(
    "config, message",
    [
        (MeshConfig(data=3), "mesh.data=3"),
        (MeshConfig(data=-1, fsdp=3), "mesh.data=-1"),
        (MeshConfig(data=-1, fsdp=-1), "at most one axis"),
        (MeshConfig(data=0), "mesh.data=0"),
    ],
)
def test_impossible_meshes_name_the_field(config, message):
    with pytest.raises(MeshError, match=message):
        resolve_axis_sizes(config, 8)


def test_mesh_axes_and_rules_table():
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert mesh.axis_names == MESH_AXES and mesh.devices.shape == (2, 2, 2)
    for _, target in LOGICAL_AXIS_RULES:
        targets = target if isinstance(target, tuple) else (target,)
        assert all(t is None or t in MESH_AXES for t in targets)
    assert {"embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers", "batch"} <= KNOWN_LOGICAL_AXES


def test_global_batch_is_sharded_over_data_axes():
    mesh = make_mesh(MeshConfig(data=2, fsdp=4))
    local = {"x": np.arange(16 * 3, dtype=np.float32).reshape(16, 3)}
    arr = global_batch(local, mesh)["x"]
    assert arr.shape == (16, 3)
    assert arr.sharding.spec[0] == ("data", "fsdp_0", "fsdp_1")  # fsdp=4 as its prime parts
    assert arr.addressable_shards[0].data.shape == (2, 3)
    np.testing.assert_array_equal(np.asarray(arr), local["x"])


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16", "SLURM_PROCID": "5", "SLURM_STEP_NODELIST": "gpu[003-006,010]"},
            ("gpu003:6789", 16, 5, "SLURM"),
        ),
        (
            {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_JOB_NODELIST": "node1,node2"},
            ("node1:6789", 2, 1, "SLURM"),
        ),
        (
            {"JOB_COMPLETION_INDEX": "3", "JOBSET_NAME": "vla", "REPLICATED_JOB_NAME": "workers", "NUM_PROCESSES": "4"},
            ("vla-workers-0-0.vla:6789", 4, 3, "Kubernetes"),
        ),
        (
            {"JOB_COMPLETION_INDEX": "1", "NUM_PROCESSES": "2", "COORDINATOR_ADDRESS": "train-0.svc:1234"},
            ("train-0.svc:1234", 2, 1, "Kubernetes"),
        ),
        (
            {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "2", "MASTER_ADDR": "head"},
            ("head:6789", 8, 2, "Open MPI"),
        ),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),
        ({}, None),
    ],
)
def test_cluster_detection(env, expected):
    spec = distributed.detect_cluster(env)
    if expected is None:
        assert spec is None
    else:
        assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == expected


def test_explicit_flags_must_come_together():
    with pytest.raises(ValueError, match="--num-processes"):
        distributed.initialize(distributed.DistributedConfig(coordinator="127.0.0.1:1234", process_id=0), env={})
    with pytest.raises(ValueError, match="Open MPI"):
        distributed.detect_cluster({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"})
    assert distributed.initialize(distributed.DistributedConfig(), env={}) is None
    assert jax.process_count() == 1
