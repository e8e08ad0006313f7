"""What a compiled program does, read from its HLO text: collectives, matmul FLOPs, peak buffers.

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

``dots(hlo_text)`` lists each distinct ``dot`` (operand shapes, dimension numbers) with how
many times it runs, by the same loop multipliers; ``dot_flops`` sums their 2·M·N·K (XLA's own
cost analysis counts a while body once, so a layer scan's matmuls once instead of per layer).

``instructions(hlo_text)`` lists every instruction with the opcodes of the computation a
fusion calls, for checks of what XLA fused or copied (which tests make of compiled steps).

``peak_buffers(live_range_text, hlo_text)`` lists the buffers live at the program's memory
peak, largest first, with the shape and the JAX operation that made each, from XLA's
``*-live-range.txt`` dump, which ``compile_with_dumps`` produces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import tempfile
from collections import defaultdict

import numpy as np

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
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\).*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_CALLEES = re.compile(r"(?:calls|body|to_apply|true_computation|false_computation|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_OPERAND = re.compile(r"%([\w.\-]+)")


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
        for dt, dims in _ARRAY.findall(shape_text)
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


def _parse(hlo_text: str):
    """computation name -> list of (name, result type, opcode, rest of line), plus the entry name."""
    computations: dict[str, list[tuple[str, str, str, str]]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if current is None:
            m = _COMPUTATION.match(stripped)
            if m and not stripped.startswith(("HloModule", "//")):
                current = m.group(1)
                computations[current] = []
                if stripped.startswith("ENTRY"):
                    entry = current
            continue
        if stripped == "}":
            current = None
            continue
        m = _INSTRUCTION.match(stripped)
        if m:
            computations[current].append((m.group(1), m.group(2), m.group(3), m.group(4)))
    return computations, entry


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a compiled module: its result type (``f32[4,8]{1,0}``), opcode, the
    rest of its line, and ``body``: the opcodes of the computation a fusion calls, else
    ``{opcode}``."""

    name: str
    result: str
    opcode: str
    rest: str
    body: frozenset[str]

    @property
    def elements(self) -> int:
        """Elements of its (first) array result."""
        dims = _ARRAY.search(self.result)
        return int(np.prod([int(d) for d in dims.group(2).split(",") if d])) if dims else 0


def instructions(hlo_text: str) -> list[Instruction]:
    """Every instruction of every computation of ``hlo_text``."""
    computations, _ = _parse(hlo_text)
    found = []
    for listed in computations.values():
        for name, result, opcode, rest in listed:
            called = re.search(r"calls=%?([\w.\-]+)", rest) if opcode == "fusion" else None
            body = {inner for _, _, inner, _ in computations.get(called.group(1), [])} if called else {opcode}
            found.append(Instruction(name, result, opcode, rest, frozenset(body)))
    return found


def _multipliers(computations, entry) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    mult: dict[str, int] = defaultdict(int)
    if entry is None:
        return {name: 1 for name in computations}
    mult[entry] = 1
    order = [entry]
    seen = {entry}
    while order:
        name = order.pop(0)
        for _, _, opcode, rest in computations.get(name, []):
            callees = _CALLEES.findall(rest)
            for branch in _BRANCHES.findall(rest):
                callees += [c.strip().lstrip("%") for c in branch.split(",") if c.strip()]
            trip = 1
            if opcode == "while":
                t = _TRIP.search(rest)
                trip = int(t.group(1)) if t else 1
            for callee in callees:
                if callee not in computations:
                    continue
                mult[callee] += mult[name] * trip
                if callee not in seen:
                    seen.add(callee)
                    order.append(callee)
    return dict(mult)


def _users(instructions) -> dict[str, list[tuple[str, str, str, str]]]:
    users: dict[str, list] = defaultdict(list)
    for ins in instructions:
        for operand in set(_OPERAND.findall(ins[3].split("), ")[0])):
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
        body = {op for c in _CALLEES.findall(rest) for _, _, op, _ in computations.get(c, [])}
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
    computations, entry = _parse(hlo_text)
    mult = _multipliers(computations, entry)
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


@dataclasses.dataclass(frozen=True)
class Dot:
    """One distinct matmul of a compiled program: operand types and shapes, the dimension
    numbers of ``jax.lax.dot_general`` and the result type, with ``count``, how many times
    the program runs it (loops counted per trip)."""

    lhs_dtype: str
    lhs_shape: tuple[int, ...]
    rhs_dtype: str
    rhs_shape: tuple[int, ...]
    dimension_numbers: tuple  # ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))
    result_dtype: str
    count: int

    @property
    def flops(self) -> float:
        """2·M·N·K of one execution."""
        (lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch) = self.dimension_numbers
        lhs_free = [d for i, d in enumerate(self.lhs_shape) if i not in lhs_contracting + lhs_batch]
        rhs_free = [d for i, d in enumerate(self.rhs_shape) if i not in rhs_contracting + rhs_batch]
        sizes = [self.lhs_shape[i] for i in lhs_batch + lhs_contracting] + lhs_free + rhs_free
        return 2.0 * float(np.prod(sizes or [1]))


def _shape(type_text: str) -> tuple[str, tuple[int, ...]] | None:
    found = _ARRAY.search(type_text)
    return (found.group(1), tuple(int(d) for d in found.group(2).split(",") if d)) if found else None


def _dims(rest: str, key: str) -> tuple[int, ...]:
    found = re.search(key + r"=\{([\d,]*)\}", rest)
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def dots(hlo_text: str) -> list[Dot]:
    """Every distinct ``dot`` of the program with how many times one execution runs it (a loop
    whose trip count depends on the data, as block-sparse attention's inner loop, counts once)."""
    computations, entry = _parse(hlo_text)
    mult = _multipliers(computations, entry)
    counts: dict[tuple, int] = defaultdict(int)
    for comp, listed in computations.items():
        count = mult.get(comp, 0)
        if not count:
            continue
        types = {name: result for name, result, _, _ in listed}
        for _name, result, opcode, rest in listed:
            if opcode != "dot":
                continue
            operands = _OPERAND.findall(rest.split(")")[0])
            if len(operands) != 2 or not all(o in types for o in operands):
                continue
            lhs, rhs, out = _shape(types[operands[0]]), _shape(types[operands[1]]), _shape(result)
            if lhs is None or rhs is None or out is None:
                continue
            numbers = (
                (_dims(rest, "lhs_contracting_dims"), _dims(rest, "rhs_contracting_dims")),
                (_dims(rest, "lhs_batch_dims"), _dims(rest, "rhs_batch_dims")),
            )
            counts[(*lhs, *rhs, numbers, out[0])] += count
    return [Dot(*key, count=count) for key, count in counts.items()]


def dot_flops(hlo_text: str) -> float:
    """Matmul FLOPs of one execution of the program (per device), loops counted per trip."""
    return sum(d.flops * d.count for d in dots(hlo_text))


@dataclasses.dataclass
class LiveBuffer:
    name: str
    bytes: int
    shape: str
    op_name: str


def peak_buffers(live_range_text: str, hlo_text: str) -> list[LiveBuffer]:
    """The buffers live at the memory peak of the entry computation, largest first."""
    section = re.search(r"Live ranges at \d+ \(peak\):\n(.*?)(?:\n\s*Stack trace|\Z)", live_range_text, re.S)
    if section is None:
        return []
    info = {}
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line.strip())
        if m:
            op = re.search(r'op_name="([^"]*)"', m.group(4))
            info[m.group(1)] = (re.sub(r"\{[\d,]*\}", "", m.group(2)), op.group(1) if op else "")
    out = []
    for name, size in re.findall(r"^\s*([\w.\-]+)\{[\d,]*\}: (\d+) bytes", section.group(1), re.M):
        shape, op = info.get(name, ("", ""))
        out.append(LiveBuffer(name, int(size), shape, op))
    return sorted(out, key=lambda b: -b.bytes)


def compile_with_dumps(lowered, module: str = ""):
    """``(compiled, live-range dump text)`` of a real compile of ``lowered``.

    XLA writes its dumps only when it compiles, so the persistent compilation cache is
    bypassed for this one compile (its key ignores dump options: a cached program of the
    same HLO would come back without any), and the compile time is a real one."""
    from jax._src.config import enable_compilation_cache  # no public switch for one compile
    from jax.experimental.compilation_cache import compilation_cache

    with tempfile.TemporaryDirectory() as dump, _without_persistent_cache(compilation_cache, enable_compilation_cache):
        options = {"xla_dump_to": dump}
        if module:
            options["xla_dump_hlo_module_re"] = module
        compiled = lowered.compile(compiler_options=options)
        live = sorted(pathlib.Path(dump).glob(f"*{module + '*' if module else ''}after_optimizations-live-range.txt"))
        return compiled, live[-1].read_text() if live else ""


@contextlib.contextmanager
def _without_persistent_cache(compilation_cache, enable_compilation_cache):
    compilation_cache.reset_cache()  # JAX decides once per process whether the cache is on
    try:
        with enable_compilation_cache(False):
            yield
    finally:
        compilation_cache.reset_cache()
