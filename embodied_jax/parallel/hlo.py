"""Reading a compiled program's HLO text: its computations, instructions, matmuls and memory peak.

``parse_computations(hlo_text)`` splits the text into computations and their instructions;
``loop_multipliers`` says how many times each computation runs per execution (the product of
the ``known_trip_count`` of the while loops around it: a layer scan's body once per layer).
What the program communicates over the mesh is ``hlo_collectives``.

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

ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\).*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
CALLEES = re.compile(r"(?:calls|body|to_apply|true_computation|false_computation|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
OPERAND = re.compile(r"%([\w.\-]+)")


def parse_computations(hlo_text: str):
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
        dims = ARRAY.search(self.result)
        return int(np.prod([int(d) for d in dims.group(2).split(",") if d])) if dims else 0


def instructions(hlo_text: str) -> list[Instruction]:
    """Every instruction of every computation of ``hlo_text``."""
    computations, _ = parse_computations(hlo_text)
    found = []
    for listed in computations.values():
        for name, result, opcode, rest in listed:
            called = re.search(r"calls=%?([\w.\-]+)", rest) if opcode == "fusion" else None
            body = {inner for _, _, inner, _ in computations.get(called.group(1), [])} if called else {opcode}
            found.append(Instruction(name, result, opcode, rest, frozenset(body)))
    return found


def loop_multipliers(computations, entry) -> dict[str, int]:
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
            callees = CALLEES.findall(rest)
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
    found = ARRAY.search(type_text)
    return (found.group(1), tuple(int(d) for d in found.group(2).split(",") if d)) if found else None


def _dims(rest: str, key: str) -> tuple[int, ...]:
    found = re.search(key + r"=\{([\d,]*)\}", rest)
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def dots(hlo_text: str) -> list[Dot]:
    """Every distinct ``dot`` of the program with how many times one execution runs it (a loop
    whose trip count depends on the data, as block-sparse attention's inner loop, counts once)."""
    computations, entry = parse_computations(hlo_text)
    mult = loop_multipliers(computations, entry)
    counts: dict[tuple, int] = defaultdict(int)
    for comp, listed in computations.items():
        count = mult.get(comp, 0)
        if not count:
            continue
        types = {name: result for name, result, _, _ in listed}
        for _name, result, opcode, rest in listed:
            if opcode != "dot":
                continue
            operands = OPERAND.findall(rest.split(")")[0])
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
