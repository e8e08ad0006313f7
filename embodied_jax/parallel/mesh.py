"""Device meshes from a config of named axis sizes.

``MeshConfig(data=-1, fsdp=1, tensor=1)`` builds a mesh over all devices; one axis may
be -1 and absorbs what the others leave. For multi-node jobs the ``dcn_*`` sizes split
each axis into an outer part across slices/nodes (data-centre network) and an inner
part within a node (ICI/NVLink), through ``mesh_utils.create_hybrid_device_mesh``.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from embodied_jax.parallel.rules import MESH_AXES


class MeshError(ValueError):
    """A mesh config that cannot be laid over the available devices."""


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the named mesh axes. -1 on one axis means "all remaining devices"."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # Outer (across-node) factors of each axis; 1 = the axis lives within a node.
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1

    def ici_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    def dcn_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, f"dcn_{a}") for a in MESH_AXES)


def resolve_axis_sizes(config: MeshConfig, num_devices: int) -> dict[str, int]:
    """Total size per axis (dcn × ici) with -1 filled; raises MeshError naming the field."""
    dcn = config.dcn_sizes()
    for name, size in zip(MESH_AXES, dcn):
        if size < 1:
            raise MeshError(f"mesh.dcn_{name}={size}: DCN axis sizes must be >= 1")
    sizes = list(config.ici_sizes())
    fills = [a for a, s in zip(MESH_AXES, sizes) if s == -1]
    if len(fills) > 1:
        raise MeshError(f"mesh: at most one axis may be -1, got {', '.join('mesh.' + a for a in fills)}")
    for name, size in zip(MESH_AXES, sizes):
        if size == 0 or size < -1:
            raise MeshError(f"mesh.{name}={size}: axis sizes must be positive or -1")
    fixed = math.prod(s * d for s, d in zip(sizes, dcn) if s != -1)
    if fills:
        i = MESH_AXES.index(fills[0])
        rest = fixed * dcn[i]
        if num_devices % rest:
            raise MeshError(
                f"mesh.{fills[0]}=-1: the other axes use {rest} devices, which does not divide "
                f"the {num_devices} available"
            )
        sizes[i] = num_devices // rest
    total = {a: s * d for a, s, d in zip(MESH_AXES, sizes, dcn)}
    if math.prod(total.values()) != num_devices:
        desc = ", ".join(f"mesh.{a}={getattr(config, a)}" for a in MESH_AXES)
        raise MeshError(f"{desc} need {math.prod(total.values())} devices but {num_devices} are available")
    return total


def make_mesh(config: MeshConfig, devices: list | None = None) -> Mesh:
    """A ``jax.sharding.Mesh`` with axes ``("data", "fsdp", "tensor")``."""
    devices = list(jax.devices() if devices is None else devices)
    total = resolve_axis_sizes(config, len(devices))
    dcn = config.dcn_sizes()
    if math.prod(dcn) > 1:
        ici = tuple(total[a] // d for a, d in zip(MESH_AXES, dcn))
        # TPU pods group devices by slice; elsewhere (GPU/CPU nodes) a process is the granule.
        by_process = devices[0].platform != "tpu"
        try:
            device_array = mesh_utils.create_hybrid_device_mesh(
                ici, dcn, devices=devices, process_is_granule=by_process, allow_split_physical_axes=True
            )
        except ValueError as e:
            granules = "processes" if by_process else "slices"
            raise MeshError(
                f"mesh.dcn_*={dict(zip(MESH_AXES, dcn))}: a hybrid mesh needs {math.prod(dcn)} {granules} "
                f"with equally many devices each ({e})"
            ) from e
    else:
        shape = tuple(total[a] for a in MESH_AXES)
        try:
            device_array = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        except ValueError:  # a shape the physical topology cannot tile: plain device order
            device_array = np.asarray(devices).reshape(shape)
    return Mesh(device_array, MESH_AXES)


def describe_mesh(mesh: Mesh) -> str:
    axes = " × ".join(f"{name}={size}" for name, size in mesh.shape.items())
    platforms = {d.platform for d in mesh.devices.flat}
    return f"{axes} over {mesh.devices.size} {'/'.join(sorted(platforms))} device(s)"
