"""Device meshes from a config of named axis sizes.

``MeshConfig(data=-1, fsdp=1, tensor=1)`` builds a mesh over all devices; one axis may
be -1 and absorbs what the others leave. For multi-node jobs the ``dcn_*`` sizes split
each axis into an outer part across slices/nodes (data-centre network) and an inner
part within a node (ICI/NVLink), through ``mesh_utils.create_hybrid_device_mesh``.

Parameter axes (``fsdp``, ``tensor``) of composite size are laid out as one mesh axis per
prime factor (``fsdp=8`` -> ``fsdp_0, fsdp_1, fsdp_2`` of size 2), in order, so that
the sharding rules can split an array dimension over the part of an axis that divides it
(SigLIP's width 1152 over 128 of 256 devices, the rest of the axis on another dimension).
Sharding a dimension over all parts is the same device layout as over the unsplit axis.
``axis_parts``/``axis_size`` translate config axis names to mesh axes; nothing else should
index ``mesh.shape`` by a config name.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, Mesh

from embodied_jax.config_registry import register
from embodied_jax.errors import InputError
from embodied_jax.parallel.rules import MESH_AXES, SPLIT_AXES


class MeshError(InputError, ValueError):
    """A mesh config that cannot be laid over the available devices."""


@register
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
    # Overrides of the logical-axis rules, "LOGICAL=AXIS[,AXIS...]" ("LOGICAL=" replicates)
    # or a preset name such as "tensor_parallel" (see ``parallel.rules``).
    rules: tuple[str, ...] = ()
    # Parameters smaller than this many bytes stay replicated (0: shard every one that divides).
    min_shard_bytes: int = 0

    def ici_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, a) for a in MESH_AXES)

    def dcn_sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, f"dcn_{a}") for a in MESH_AXES)


def resolve_axis_sizes(config: MeshConfig, num_devices: int) -> dict[str, int]:
    """Total size per axis (dcn × ici) with -1 filled; raises MeshError naming the field."""
    dcn = config.dcn_sizes()
    for name, size in zip(MESH_AXES, dcn, strict=True):
        if size < 1:
            raise MeshError(f"mesh.dcn_{name}={size}: DCN axis sizes must be >= 1")
    sizes = list(config.ici_sizes())
    fills = [a for a, s in zip(MESH_AXES, sizes, strict=True) if s == -1]
    if len(fills) > 1:
        raise MeshError(f"mesh: at most one axis may be -1, got {', '.join('mesh.' + a for a in fills)}")
    for name, size in zip(MESH_AXES, sizes, strict=True):
        if size == 0 or size < -1:
            raise MeshError(f"mesh.{name}={size}: axis sizes must be positive or -1")
    fixed = math.prod(s * d for s, d in zip(sizes, dcn, strict=True) if s != -1)
    if fills:
        i = MESH_AXES.index(fills[0])
        rest = fixed * dcn[i]
        if num_devices % rest:
            raise MeshError(
                f"mesh.{fills[0]}=-1: the other axes use {rest} devices, which does not divide "
                f"the {num_devices} available"
            )
        sizes[i] = num_devices // rest
    total = {a: s * d for a, s, d in zip(MESH_AXES, sizes, dcn, strict=True)}
    if math.prod(total.values()) != num_devices:
        desc = ", ".join(f"mesh.{a}={getattr(config, a)}" for a in MESH_AXES)
        hint = ""
        if num_devices < math.prod(total.values()) and jax.default_backend() == "cpu":
            hint = (
                f" (on a CPU, simulate them: --virtual-devices {math.prod(total.values())}, or "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={math.prod(total.values())})"
            )
        raise MeshError(f"{desc} need {math.prod(total.values())} devices but {num_devices} are available{hint}")
    return total


def prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def _mesh_axes(axis: str, size: int) -> list[tuple[str, int]]:
    """The mesh axes (name, size) that one config axis becomes."""
    factors = prime_factors(size)
    if axis not in SPLIT_AXES or len(factors) <= 1:
        return [(axis, size)]
    return [(f"{axis}_{i}", p) for i, p in enumerate(factors)]


def config_axis(mesh_axis: str) -> str:
    """The config axis a mesh axis belongs to (``fsdp_3`` -> ``fsdp``)."""
    base, _, index = mesh_axis.rpartition("_")
    return base if base and index.isdigit() else mesh_axis


def axis_parts(mesh: Mesh, axis: str) -> tuple[str, ...]:
    """The mesh axes making up config axis ``axis`` (itself, or its prime parts), in mesh order."""
    if axis in mesh.shape:
        return (axis,)
    parts = tuple(name for name in mesh.axis_names if config_axis(name) == axis)
    if not parts:
        raise MeshError(f"mesh has no axis {axis!r} (axes: {tuple(mesh.axis_names)})")
    return parts


def axis_size(mesh: Mesh, axis: str) -> int:
    return math.prod(mesh.shape[a] for a in axis_parts(mesh, axis))


def make_mesh(config: MeshConfig, devices: list | None = None) -> Mesh:
    """A ``jax.sharding.Mesh`` over ``("data", "fsdp", "tensor")``, composite parameter axes split."""
    devices = list(jax.devices() if devices is None else devices)
    total = resolve_axis_sizes(config, len(devices))
    dcn = config.dcn_sizes()
    if math.prod(dcn) > 1:
        ici = tuple(total[a] // d for a, d in zip(MESH_AXES, dcn, strict=True))
        # TPU pods group devices by slice; elsewhere (GPU/CPU nodes) a process is the granule.
        by_process = devices[0].platform != "tpu"
        try:
            device_array = mesh_utils.create_hybrid_device_mesh(
                ici, dcn, devices=devices, process_is_granule=by_process, allow_split_physical_axes=True
            )
        except ValueError as e:
            granules = "processes" if by_process else "slices"
            raise MeshError(
                f"mesh.dcn_*={dict(zip(MESH_AXES, dcn, strict=True))}: a hybrid mesh needs {math.prod(dcn)} {granules} "
                f"with equally many devices each ({e})"
            ) from e
    else:
        shape = tuple(total[a] for a in MESH_AXES)
        try:
            device_array = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        except ValueError:  # a shape the physical topology cannot tile: plain device order
            device_array = np.asarray(devices).reshape(shape)
    axes = mesh_axis_sizes(total)
    return Mesh(device_array.reshape(tuple(axes.values())), tuple(axes))


def mesh_axis_sizes(total: dict[str, int]) -> dict[str, int]:
    """Mesh axis name -> size, from the config axes' total sizes (composite ones split)."""
    return dict(part for a in MESH_AXES for part in _mesh_axes(a, total[a]))


def abstract_mesh(config: MeshConfig, num_devices: int) -> AbstractMesh:
    """The axes ``make_mesh`` would build over ``num_devices``, without any device (planning)."""
    axes = mesh_axis_sizes(resolve_axis_sizes(config, num_devices))
    return AbstractMesh(tuple(axes.values()), tuple(axes))


def describe_mesh(mesh: Mesh) -> str:
    axes = " × ".join(f"{name}={axis_size(mesh, name)}" for name in MESH_AXES)
    platforms = {d.platform for d in mesh.devices.flat}
    return f"{axes} over {mesh.devices.size} {'/'.join(sorted(platforms))} device(s)"
