"""Layouts: how a checkpoint's tensor names map onto the leaves of our parameter trees, the one
mapping engine of every importer (LeRobot's and NVIDIA's safetensors, openpi's Orbax params).

A checkpoint format is a ``Layout``: an ordered table of ``Rule``s, each taking one checkpoint
tensor (``source``, a name template) to one leaf of our parameter tree (``target``, a dotted path
template), plus an explicit ignore list of checkpoint names known to be unused (skipped with one
log line). A rule's transform of one layer: index ``take`` on the first axis, permute by
``transpose`` (``ours = theirs.transpose(perm)``), then merge runs of consecutive axes into the
leaf's shape (heads and head_dim into one axis); ``shape`` states the checkpoint tensor's shape
where the leaf's does not give it (merged axes, ``take``, a stacked tensor).

``{layer}`` stands for a layer number. A rule with it in both templates maps one checkpoint tensor
per layer (safetensors: ``…layers.3.…``); with it in ``target`` only, the checkpoint holds the
whole stack as one tensor with a leading layer axis (``stacked``, openpi). Our stacks exist in two
layouts and both are handled: unscanned (``llm.layers.3.….kernel``: one leaf per layer) and
scanned (``nn.stack`` with ``scan_layers``: one leaf ``llm.layers.….kernel`` with a leading
``layers`` axis). ``Rule.upstream_layer`` maps our stack index to the checkpoint's layer number
when they differ.

Several rules may target the same leaf (aliases, e.g. a tied embedding stored as ``lm_head`` by
one writer and ``embed_tokens`` by another): the first is canonical (written by export), any of
them satisfies import.

``assign`` gives each rule the ``Slot``s it fills in a tree with given leaf shapes and
``transform`` computes a slot's value from the checkpoint tensor; ``plan`` expands the same into
``Entry``s (one checkpoint tensor <-> one slot, with both shapes) and ``check_names`` names every
missing, unexpected and mis-shaped tensor of a checkpoint; ``flatten_params``/``unflatten_params``
convert between nested trees and dotted paths; ``concrete_sharding`` places a sharding recorded
over an abstract mesh. Reading and writing the files is the importers' (``safetensors_io``,
``models/pi05/openpi_weights.py``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from embodied_jax.errors import InputError

LAYER = "{layer}"
_MAX_LISTED = 25


class WeightMismatchError(InputError, ValueError):
    """The checkpoint's tensors do not match the model's leaves (names or shapes)."""


@dataclasses.dataclass(frozen=True)
class Rule:
    source: str
    target: str
    transpose: tuple[int, ...] | None = None
    upstream_layer: Callable[[int], int] | None = None
    take: int | None = None
    shape: tuple[int, ...] | None = None  # the checkpoint tensor's shape (a stack's layer axis included)

    def __post_init__(self):
        if LAYER in self.source and LAYER not in self.target:
            raise ValueError(f"Rule {self.source!r} -> {self.target!r}: {LAYER} in the source must be in the target")
        if self.shape is None and (self.stacked or self.take is not None):
            raise ValueError(f"Rule {self.source!r} -> {self.target!r}: a stacked or taken source needs its shape")

    @property
    def stacked(self) -> bool:
        """The checkpoint holds every layer in one tensor (a leading layer axis)."""
        return LAYER in self.target and LAYER not in self.source


@dataclasses.dataclass(frozen=True)
class Slot:
    """What one checkpoint tensor fills: a whole ``leaf``; with ``layer``, that layer of a scanned
    leaf; with ``source_layer``, from that layer of a stacked checkpoint tensor."""

    leaf: str
    layer: int | None = None
    source_layer: int | None = None


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = ()  # regexes (full match) of upstream names that are known-unused
    model_only: tuple[str, ...] = ()  # regexes (full match) of our leaves with no upstream tensor (e.g. LoRA)

    def is_ignored(self, upstream_name: str) -> bool:
        return any(re.fullmatch(p, upstream_name) for p in self.ignore)

    def is_model_only(self, leaf: str) -> bool:
        return any(re.fullmatch(p, leaf) for p in self.model_only)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint tensor <-> one slot: a leaf (``layer`` None) or one layer slice of a scanned leaf."""

    upstream: str
    leaf: str
    layer: int | None
    transpose: tuple[int, ...] | None
    upstream_shape: tuple[int, ...]
    canonical: bool
    rule: Rule
    slot: Slot
    shape: tuple[int, ...]  # the slot's shape

    @property
    def key(self) -> tuple[str, int | None]:
        return (self.leaf, self.layer)


# ----------------------------------------------------------------------------- trees


def flatten_params(tree: Any) -> tuple[dict[str, Any], dict[str, tuple]]:
    """Nested dict (or ``nnx.State``) -> ({dotted path: leaf}, {dotted path: original key tuple})."""
    from flax import nnx

    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    flat, keys = {}, {}

    def walk(node, path):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*path, k))
        else:
            dotted = ".".join(str(k) for k in path)
            flat[dotted] = node
            keys[dotted] = path

    walk(tree, ())
    return flat, keys


def unflatten_params(flat: Mapping[str, Any], keys: Mapping[str, tuple]) -> dict:
    out: dict = {}
    for dotted, value in flat.items():
        node = out
        path = keys[dotted]
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


# ----------------------------------------------------------------------------- planning


def _upstream_shape(leaf_shape: tuple[int, ...], perm: tuple[int, ...] | None) -> tuple[int, ...]:
    if perm is None:
        return tuple(leaf_shape)
    if sorted(perm) != list(range(len(leaf_shape))):
        raise ValueError(f"transpose {perm} does not fit a leaf of shape {leaf_shape}")
    shape = [0] * len(leaf_shape)
    for i, p in enumerate(perm):
        shape[p] = leaf_shape[i]
    return tuple(shape)


def _scanned(target: str) -> str:
    """A ``{layer}`` target's scanned leaf: the template without its layer component."""
    prefix, suffix = target.split(LAYER)
    return prefix.rstrip(".") + ("." if suffix.startswith(".") else "") + suffix.lstrip(".")


def _slots(rule: Rule, leaf_shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[Slot, str, tuple[int, ...]]]:
    """(slot, checkpoint name, slot shape) of every slot ``rule`` fills in a tree with these leaves;
    for a stacked rule whose leaves are missing, the unscanned slots it would fill."""
    if LAYER not in rule.target:
        shape = leaf_shapes.get(rule.target)
        return [] if shape is None else [(Slot(rule.target), rule.source, tuple(shape))]
    scanned = _scanned(rule.target)
    if rule.stacked:
        if scanned in leaf_shapes:
            return [(Slot(scanned), rule.source, tuple(leaf_shapes[scanned]))]
        slots = []
        for i in range(rule.shape[0]):
            leaf = rule.target.replace(LAYER, str(i))
            slots.append((Slot(leaf, source_layer=i), rule.source, tuple(leaf_shapes.get(leaf, ()))))
        return slots
    prefix, suffix = rule.target.split(LAYER)
    pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix))
    found = []
    for leaf, shape in leaf_shapes.items():
        m = pattern.fullmatch(leaf)
        if m:
            found.append((Slot(leaf), int(m.group(1)), tuple(shape)))
    if scanned in leaf_shapes:
        shape = tuple(leaf_shapes[scanned])
        found.extend((Slot(scanned, layer=i), i, shape[1:]) for i in range(shape[0]))
    out = []
    for slot, index, shape in found:
        number = rule.upstream_layer(index) if rule.upstream_layer else index
        out.append((slot, rule.source.replace(LAYER, str(number)), shape))
    return out


def transform(rule: Rule, x: Any, slot: Slot, shape: tuple[int, ...]) -> Any:
    """The checkpoint tensor ``x`` (its full shape) -> the value of ``slot`` (shape ``shape``)."""
    lead = 1 if rule.stacked and slot.source_layer is None else 0  # a scanned leaf keeps the layer axis
    if slot.source_layer is not None:
        x = x[slot.source_layer]
    if rule.take is not None:
        x = x[(slice(None),) * lead + (rule.take,)]
    if rule.transpose is not None:
        x = x.transpose(*range(lead), *(lead + p for p in rule.transpose))
    return _merge(x, shape)


def _merge(x, shape: tuple[int, ...]):
    """Reshape ``x`` to ``shape`` where that only merges runs of consecutive axes (never reorders)."""
    src, i = tuple(x.shape), 0
    for size in shape:
        if i == len(src):
            raise ValueError(f"{src} does not merge into {shape}")
        merged, i = src[i], i + 1
        while merged < size and i < len(src):
            merged *= src[i]
            i += 1
        if merged != size:
            raise ValueError(f"{src} does not merge into {shape}")
    if any(d != 1 for d in src[i:]):
        raise ValueError(f"{src} does not merge into {shape}")
    return x if tuple(src) == tuple(shape) else x.reshape(shape)


def _shape_problems(checks: list[tuple[Rule, Slot, tuple[int, ...]]]) -> list[str]:
    """Run the transforms of rules with a stated shape abstractly (one ``jax.eval_shape``, nothing
    allocated); the failures."""
    import jax
    import numpy as np

    problems = []

    def run(sources):
        for x, (rule, slot, shape) in zip(sources, checks, strict=True):
            try:
                transform(rule, x, slot, shape)
            except (ValueError, TypeError, IndexError) as exc:
                problems.append(f"{rule.source} {rule.shape} -> {slot.leaf} {shape}: {exc}")

    jax.eval_shape(run, [jax.ShapeDtypeStruct(rule.shape, np.float32) for rule, _, _ in checks])
    return problems


def _expand(
    layout: Layout, leaf_shapes: Mapping[str, tuple[int, ...]]
) -> list[tuple[Rule, Slot, str, tuple[int, ...]]]:
    """(rule, slot, checkpoint name, slot shape) of every slot the layout fills in a tree with these
    leaves, in rule order; ``ValueError`` as ``assign`` says."""
    expanded, covered, problems, checks = [], set(), [], []
    for rule in layout.rules:
        for slot, name, shape in _slots(rule, leaf_shapes):
            if slot.leaf not in leaf_shapes:
                problems.append(f"{rule.source} -> {slot.leaf}: no such leaf")
                continue
            expanded.append((rule, slot, name, shape))
            covered.add(slot.leaf)
            if rule.shape is not None:
                checks.append((rule, slot, shape))
    if checks:
        problems += _shape_problems(checks)
    uncovered = sorted(k for k in set(leaf_shapes) - covered if not layout.is_model_only(k))
    if uncovered:
        problems.append(f"layout {layout.name!r} has no rule for leaves: {format_names(uncovered)}")
    if problems:
        raise ValueError(f"layout {layout.name!r} does not fit the model:\n  " + "\n  ".join(problems))
    return expanded


def assign(layout: Layout, leaf_shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[Rule, list[Slot]]]:
    """Each rule with the slots it fills in a tree with these leaves (leaves matching
    ``layout.model_only`` need none).

    Raises ``ValueError`` naming every leaf no rule reaches, every stacked rule that reaches a leaf
    the tree lacks, and every stated shape whose transform does not give its leaf's shape."""
    slots: dict[int, list[Slot]] = {id(rule): [] for rule in layout.rules}
    for rule, slot, _, _ in _expand(layout, leaf_shapes):
        slots[id(rule)].append(slot)
    return [(rule, slots[id(rule)]) for rule in layout.rules]


def plan(layout: Layout, leaf_shapes: Mapping[str, tuple[int, ...]]) -> list[Entry]:
    """Every (checkpoint name, slot) pair the layout defines for a tree with these leaves, with both
    shapes; the first rule of a slot is canonical. Raises as ``assign``."""
    entries: list[Entry] = []
    seen: set[tuple[str, int | None]] = set()
    for rule, slot, name, shape in _expand(layout, leaf_shapes):
        key = (slot.leaf, slot.layer)
        source_shape = rule.shape if rule.shape is not None else _upstream_shape(shape, rule.transpose)
        entries.append(
            Entry(name, slot.leaf, slot.layer, rule.transpose, tuple(source_shape), key not in seen, rule, slot, shape)
        )
        seen.add(key)
    return entries


def check_names(
    what: str, names: Mapping[str, tuple[int, ...]], entries: list[Entry], layout: Layout
) -> tuple[dict[tuple[str, int | None], Entry], list[str]]:
    """Match a checkpoint's tensors (name -> shape) to ``entries``: ({slot key: the entry read},
    names on the ignore list), or a ``WeightMismatchError`` naming every missing (canonical and no
    alias present), unexpected and mis-shaped tensor. ``what``: the checkpoint, for the message."""
    by_name: dict[str, Entry] = {}
    for e in entries:
        by_name.setdefault(e.upstream, e)
    unexpected, ignored, misshaped = [], [], []
    for name, got in names.items():
        entry = by_name.get(name)
        if entry is None:
            (ignored if layout.is_ignored(name) else unexpected).append(name)
        elif tuple(got) != entry.upstream_shape:
            expected = entry.upstream_shape
            misshaped.append(f"{name}: checkpoint {tuple(got)}, model expects {expected} (leaf {entry.leaf})")
    chosen: dict[tuple[str, int | None], Entry] = {}
    for e in entries:  # the first present rule wins per slot (canonical before aliases)
        if e.upstream in names and e.key not in chosen:
            chosen[e.key] = e
    missing = list(dict.fromkeys(e.upstream for e in entries if e.canonical and e.key not in chosen))
    if missing or unexpected or misshaped:
        lines = [f"{what} does not match the model:"]
        for label, listed in (("missing", missing), ("unexpected", sorted(unexpected)), ("mis-shaped", misshaped)):
            if listed:
                lines.append(f"  {label} ({len(listed)}): {format_names(listed)}")
        raise WeightMismatchError("\n".join(lines))
    return chosen, ignored


def concrete_sharding(sharding: Any, mesh: Any) -> Any:
    """A NamedSharding over an abstract mesh (what ``eval_shape`` records) made concrete on ``mesh``."""
    import jax

    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.AbstractMesh):
        if mesh is None:
            raise ValueError("weight import: the target shardings use an abstract mesh; pass mesh=")
        return jax.sharding.NamedSharding(mesh, sharding.spec)
    return sharding


def format_names(names: Iterable[str]) -> str:
    """The names comma-separated, the first 25 of them and a count of the rest (for error messages)."""
    names = list(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")
