"""What a compiled program communicates over the mesh, read from its HLO text: collective statistics.

``collective_stats(hlo_text, mesh)`` finds every all-gather, reduce-scatter, all-reduce,
all-to-all and collective-permute (their ``-start`` forms on GPU), multiplies each by how
many times it runs (the product of the ``known_trip_count`` of the while loops around it:
a layer scan's collectives count once per layer) and attributes it to the mesh axes its
replica groups span (sub-axes of a split axis count as that axis: ``fsdp_3`` -> ``fsdp``).

Bytes are what one device sends over the network per call, for ring algorithms over a
group of g devices and the array size S in the dtype the HLO moves: all-gather S_out·(g-1)/g,
reduce-scatter S_in·(g-1)/g, all-reduce 2·S·(g-1)/g, all-to-all S·(g-1)/g,
collective-permute S. An all-reduce whose result is only dynamic-sliced (XLA:CPU's form of
a reduce-scatter) is counted as a reduce-scatter. ``payload`` is S itself.

The HLO text is parsed by ``hlo``.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import numpy as np

from embodied_jax.parallel.hlo import ARRAY, CALLEES, OPERAND, loop_multipliers, parse_computations
from embodied_jax.parallel.mesh import config_axis

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s4": 0.5,
    "u4": 0.5,
}


@dataclasses.dataclass
class Collective:
    kind: str
    axes: tuple[str, ...]  # config axes the group spans
    group_size: int
    payload: float  # bytes of the array moved (the full, gathered / reduced side)
    wire: float  # bytes one device sends per call
    count: int  # executions per step


@dataclasses.dataclass
class CollectiveStats:
    ops: list[Collective]

    def by_kind(self) -> dict[str, dict[str, float]]:
        out = {k: {"count": 0, "bytes": 0.0, "payload_bytes": 0.0} for k in KINDS}
        for op in self.ops:
            row = out[op.kind]
            row["count"] += op.count
            row["bytes"] += op.wire * op.count
            row["payload_bytes"] += op.payload * op.count
        return out

    def by_axis(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "bytes": 0.0})
        for op in self.ops:
            row = out["+".join(op.axes) or "none"]
            row["count"] += op.count
            row["bytes"] += op.wire * op.count
        return dict(out)

    @property
    def total_bytes(self) -> float:
        return sum(op.wire * op.count for op in self.ops)


def _array_bytes(shape_text: str) -> list[float]:
    return [
        _DTYPE_BYTES.get(dt, 4) * float(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        for dt, dims in ARRAY.findall(shape_text)
    ]


def _iota_groups(text: str) -> np.ndarray | None:
    """``[G,S]<=[d0,d1,...]T(p...)`` -> device ids [G, S]."""
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
    if not m:
        return None
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape)


def _first_group(attrs: str, num_devices: int) -> list[int]:
    """Device ids of the first replica group of an instruction (all groups have its structure)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\([^)]*\)+)?\s*\{([^}]*)\}", attrs)
    if m:  # mesh form: a group varies over the named axes of a device mesh
        axes = re.findall(r"'?(\w+)'?=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        varying = {a.strip().strip("'") for a in m.group(2).split(",") if a.strip()}
        ids = np.arange(int(np.prod(sizes)))
        d = re.search(r"device_ids=\(?\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
        if d:
            ids = ids.reshape([int(x) for x in d.group(1).split(",")])
            if d.group(2):
                ids = ids.transpose([int(x) for x in d.group(2).split(",")])
        ids = ids.reshape(sizes)
        index = tuple(slice(None) if n in varying else 0 for n in names)
        return [int(i) for i in np.asarray(ids[index]).reshape(-1)]
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if m:
        return [int(i) for i in _iota_groups(m.group(1))[0]]
    m = re.search(r"replica_groups=\{\{([\d,\s]*)\}", attrs)
    if m and m.group(1).strip():
        return [int(i) for i in m.group(1).split(",")]
    m = re.search(r"source_target_pairs=\{\{(\d+),(\d+)\}", attrs)
    if m:
        return [int(m.group(1)), int(m.group(2))]
    return list(range(num_devices))  # no groups: every device


def _group_axes(group: list[int], mesh) -> tuple[str, ...]:
    shape = tuple(mesh.shape.values()) if hasattr(mesh, "shape") else ()
    if not shape or len(group) < 2:
        return ()
    coords = np.array(np.unravel_index(np.asarray(group), shape)).T
    varying = [name for i, name in enumerate(mesh.axis_names) if len(set(coords[:, i])) > 1]
    return tuple(dict.fromkeys(config_axis(name) for name in varying))


def _users(instructions) -> dict[str, list[tuple[str, str, str, str]]]:
    users: dict[str, list] = defaultdict(list)
    for ins in instructions:
        for operand in set(OPERAND.findall(ins[3].split("), ")[0])):
            users[operand].append(ins)
    return users


_PASS_THROUGH = {"get-tuple-element", "convert", "bitcast", "copy", "reshape", "bitcast-convert"}


def _only_dynamic_sliced(name: str, users, computations, depth: int = 0) -> bool:
    """Whether every use of ``name`` ends in a dynamic-slice, through converts and copies."""
    if not users.get(name) or depth > 8:
        return False
    for user, _, opcode, rest in users[name]:
        if opcode == "dynamic-slice":
            continue
        if opcode in _PASS_THROUGH:
            if not _only_dynamic_sliced(user, users, computations, depth + 1):
                return False
            continue
        if opcode != "fusion":
            return False
        body = {op for c in CALLEES.findall(rest) for _, _, op, _ in computations.get(c, [])}
        if "dynamic-slice" in body:
            continue
        if not body <= _PASS_THROUGH | {"parameter", "transpose"}:
            return False
        if not _only_dynamic_sliced(user, users, computations, depth + 1):
            return False
    return True


def _scattered_bytes(name: str, sizes: list[float], users, computations) -> float:
    """Bytes of an all-reduce's result that are only dynamic-sliced (per tuple element)."""
    if len(sizes) == 1:
        return sizes[0] if _only_dynamic_sliced(name, users, computations) else 0.0
    total = 0.0
    for user, _, opcode, rest in users.get(name, []):
        index = re.search(r"index=(\d+)", rest)
        if opcode == "get-tuple-element" and index and _only_dynamic_sliced(user, users, computations):
            total += sizes[int(index.group(1))]
    return total


def collective_stats(hlo_text: str, mesh) -> CollectiveStats:
    computations, entry = parse_computations(hlo_text)
    mult = loop_multipliers(computations, entry)
    num_devices = int(np.prod(list(mesh.shape.values())))
    ops = []
    for comp, instructions in computations.items():
        count = mult.get(comp, 0)
        if not count:
            continue
        users = None
        for name, result, opcode, rest in instructions:
            kind = opcode.removesuffix("-start")
            if kind not in KINDS or opcode.endswith("-done"):
                continue
            sizes = _array_bytes(result)
            if not sizes:
                continue
            group = _first_group(rest, num_devices)
            g = max(len(group), 1)
            if kind == "all-gather":
                payload = sizes[-1] if opcode.endswith("-start") else sum(sizes)
                wire = payload * (g - 1) / g
            elif kind == "reduce-scatter":
                payload = sum(sizes) * g
                wire = payload * (g - 1) / g
            elif kind == "all-reduce":
                users = _users(instructions) if users is None else users
                scattered = _scattered_bytes(name, sizes, users, computations)
                axes = _group_axes(group, mesh)
                if scattered:
                    ops.append(Collective("reduce-scatter", axes, g, scattered, scattered * (g - 1) / g, count))
                payload = sum(sizes) - scattered
                if not payload:
                    continue
                wire = 2 * payload * (g - 1) / g
            elif kind == "all-to-all":
                payload = sum(sizes)
                wire = payload * (g - 1) / g
            else:
                payload = sizes[0] if opcode.endswith("-start") else sum(sizes)
                wire = payload
            ops.append(Collective(kind, _group_axes(group, mesh), g, payload, wire, count))
    return CollectiveStats(ops)
