"""Layouts: how an upstream checkpoint's tensor names map onto the leaves of our parameter trees.

A checkpoint format is a ``Layout``: an ordered table of ``Rule``s, each renaming one upstream
tensor (name template) to one leaf of our parameter tree (dotted path template) with an optional
axis permutation (``ours = upstream.transpose(perm)``), plus an explicit ignore list of upstream
names that are known to be unused (skipped with one log line).

``{layer}`` in both templates stands for a layer number. Our stacks exist in two layouts and both
are handled: unscanned (``llm.layers.3.….kernel``: one leaf per layer) and scanned (``nn.stack``
with ``scan_layers``: one leaf ``llm.layers.….kernel`` with a leading ``layers`` axis, filled by
stacking the per-layer upstream tensors). ``Rule.upstream_layer`` maps our stack index to the
upstream layer number when they differ.

Several rules may target the same leaf (aliases, e.g. a tied embedding stored as ``lm_head`` by
one writer and ``embed_tokens`` by another): the first is canonical (written by export), any of
them satisfies import.

``plan`` expands a layout for a tree's leaf shapes into ``Entry``s (one upstream tensor <-> one
leaf or layer slice); ``flatten_params``/``unflatten_params`` convert between nested trees and
dotted paths. Reading and writing the files is ``safetensors_io``.
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
    upstream: str
    target: str
    transpose: tuple[int, ...] | None = None
    upstream_layer: Callable[[int], int] | None = None

    def __post_init__(self):
        if (LAYER in self.upstream) != (LAYER in self.target):
            raise ValueError(f"Rule {self.upstream!r} -> {self.target!r}: {LAYER} must be in both or neither")


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
    """One upstream tensor <-> one leaf (``layer`` None) or one layer slice of a scanned leaf."""

    upstream: str
    leaf: str
    layer: int | None
    transpose: tuple[int, ...] | None
    upstream_shape: tuple[int, ...]
    canonical: bool

    @property
    def slot(self) -> tuple[str, int | None]:
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


def plan(layout: Layout, leaf_shapes: Mapping[str, tuple[int, ...]]) -> list[Entry]:
    """Every (upstream name, leaf slot) pair the layout defines for a tree with these leaves.

    Raises ``ValueError`` if a leaf is reached by no rule (the layout is incomplete for this model).
    """
    entries: list[Entry] = []
    covered: set[str] = set()
    canonical_slots: set[tuple[str, int | None]] = set()
    for rule in layout.rules:
        if LAYER in rule.target:
            prefix, suffix = rule.target.split(LAYER)
            pattern = re.compile(re.escape(prefix) + r"(\d+)" + re.escape(suffix))
            scanned_leaf = prefix.rstrip(".") + ("." if suffix.startswith(".") else "") + suffix.lstrip(".")
            matches = []
            for leaf, shape in leaf_shapes.items():
                m = pattern.fullmatch(leaf)
                if m:
                    matches.append((leaf, int(m.group(1)), None, tuple(shape)))
            if scanned_leaf in leaf_shapes:
                shape = tuple(leaf_shapes[scanned_leaf])
                matches.extend((scanned_leaf, i, i, shape[1:]) for i in range(shape[0]))
            for leaf, index, layer, shape in matches:
                number = rule.upstream_layer(index) if rule.upstream_layer else index
                slot = (leaf, layer)
                canonical = slot not in canonical_slots
                canonical_slots.add(slot)
                entries.append(
                    Entry(
                        rule.upstream.replace(LAYER, str(number)),
                        leaf,
                        layer,
                        rule.transpose,
                        _upstream_shape(shape, rule.transpose),
                        canonical,
                    )
                )
                covered.add(leaf)
        elif rule.target in leaf_shapes:
            shape = tuple(leaf_shapes[rule.target])
            slot = (rule.target, None)
            canonical = slot not in canonical_slots
            canonical_slots.add(slot)
            entries.append(
                Entry(
                    rule.upstream, rule.target, None, rule.transpose, _upstream_shape(shape, rule.transpose), canonical
                )
            )
            covered.add(rule.target)
    uncovered = sorted(k for k in set(leaf_shapes) - covered if not layout.is_model_only(k))
    if uncovered:
        raise ValueError(f"layout {layout.name!r} has no rule for leaves: {format_names(uncovered)}")
    return entries


def format_names(names: Iterable[str]) -> str:
    """The names comma-separated, the first 25 of them and a count of the rest (for error messages)."""
    names = list(names)
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")
