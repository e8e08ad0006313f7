"""From logical axis names and shapes to ``PartitionSpec``s that always apply.

``place(shape, names, mesh, rules)`` walks each dimension's rule entries in order and
splits the dimension over the largest part of each entry's mesh axes that divides what is
left of it; an entry that does not divide falls back to the next one. Parameters then
spread the still unused parts of the ``fsdp`` axis (``rules.PARAMETER_FILL_AXES``) over
their other dimensions: the whole axis on one dimension that divides when there is one
(a [1536, 6144] kernel at 1024 devices goes along 6144), else split over the largest ones
(SigLIP's [1152, 4304] at 256: 128 x 2). A weight whose ``embed`` is 32 wide thus still
shards over 64 devices; arrays smaller than ``min_shard_bytes`` are replicated (openpi's
4 MiB rule; 0 here by default). Every placement that differs
from the rules' first choice carries a ``fallback`` note, which ``--dry-run`` lists.

``constrain(x, names)`` pins an activation to the placement of its logical names under
the active mesh (a no-op without one); the models use it on their residual streams and
attention inputs/outputs so that the partitioner gathers weights, never the batch.
``cast_parameter`` casts a weight to the compute dtype where it is stored (FSDP then
gathers bf16, and reduces gradients in f32). The rules in force come from ``use_rules``
(``sharding.mesh_context`` sets them).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from embodied_jax.parallel.mesh import axis_parts, config_axis
from embodied_jax.parallel.rules import LOGICAL_AXIS_RULES, PARAMETER_FILL_AXES, Rules, ShardingRules, candidates

_ACTIVE: contextvars.ContextVar[ShardingRules] = contextvars.ContextVar("sharding_rules", default=ShardingRules())


@contextlib.contextmanager
def use_rules(rules: ShardingRules) -> Iterator[None]:
    token = _ACTIVE.set(rules)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> ShardingRules:
    return _ACTIVE.get()


@dataclasses.dataclass(frozen=True)
class Placement:
    spec: PartitionSpec
    fallback: str | None = None  # why the placement differs from the rules' first choice


def _sizes(mesh) -> dict[str, int]:
    return dict(mesh.shape)


def _dividing(axes: Sequence[str], n: int, sizes: dict[str, int]) -> list[str]:
    """The axes (in order) whose product divides ``n``, taking each one that still fits."""
    taken, product = [], 1
    for axis in axes:
        if n % (product * sizes[axis]) == 0:
            taken.append(axis)
            product *= sizes[axis]
    return taken


def expand_axes(mesh, target) -> list[str]:
    names = (target,) if isinstance(target, str) else tuple(target)
    return [part for name in names for part in axis_parts(mesh, name)]


def place(
    shape: Sequence[int],
    names: Sequence[str | None],
    mesh,
    rules: Rules = LOGICAL_AXIS_RULES,
    *,
    fill: Sequence[str] = (),
    itemsize: int = 4,
    min_shard_bytes: int = 0,
    skip: frozenset[str] = frozenset(),
) -> Placement:
    """The placement of an array of ``shape`` whose dimensions have logical ``names``.

    ``fill``: config axes whose unused parts go to any dimension that divides (parameters);
    ``skip``: mesh axes not to use (manual axes inside ``shard_map``).
    """
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    sizes = _sizes(mesh)
    used: set[str] = set(skip)
    dims: list[list[str]] = [[] for _ in shape]
    notes: list[str] = []

    def left(i: int) -> int:
        return shape[i] // math.prod(sizes[a] for a in dims[i])

    fill_parts = {a for axis in fill for a in axis_parts(mesh, axis) if sizes[a] > 1}

    def whole_elsewhere(i: int, parts: list[str]) -> bool:
        """Another dimension could hold all of ``parts`` (a fill axis): split along one dimension."""
        whole = math.prod(sizes[a] for a in parts)
        return (
            bool(parts)
            and set(parts) <= fill_parts
            and any(j != i and not dims[j] and shape[j] % whole == 0 for j in range(len(shape)))
        )

    for i, name in enumerate(names):
        if name is None:
            continue
        for rank, target in enumerate(candidates(rules, name)):
            if target is None:
                break
            wanted = [a for a in expand_axes(mesh, target) if sizes[a] > 1 and a not in used]
            taken = _dividing(wanted, left(i), sizes)
            if taken != wanted and whole_elsewhere(i, wanted):
                taken = []  # the fill below puts the whole axis on a dimension that divides
            dims[i] += taken
            used.update(taken)
            if taken != wanted or rank:
                got = math.prod(sizes[a] for a in taken)
                notes.append(f"{name}[{shape[i]}] over {got} of {math.prod(sizes[a] for a in wanted)} ({target})")
            if taken == wanted:
                break
    for fill_axis in fill:
        spare = [a for a in axis_parts(mesh, fill_axis) if sizes[a] > 1 and a not in used]
        whole = math.prod(sizes[a] for a in spare)
        # One dimension for the whole spare axis when one divides (simpler collectives), else split.
        order = sorted(range(len(shape)), key=lambda d: (left(d) % whole != 0, -left(d)))
        for i in order:
            if not spare:
                break
            taken = _dividing(spare, left(i), sizes)
            if taken:
                dims[i] += taken
                used.update(taken)
                spare = [a for a in spare if a not in taken]
                notes.append(
                    f"{fill_axis} x{math.prod(sizes[a] for a in taken)} on dim {i} "
                    f"({names[i] or 'unnamed'}[{shape[i]}])"
                )
    if min_shard_bytes and math.prod(shape) * itemsize < min_shard_bytes and any(dims):
        return Placement(PartitionSpec(*([None] * len(shape))), f"replicated: below {min_shard_bytes} bytes")
    spec = PartitionSpec(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])
    return Placement(spec, "; ".join(notes) or None)


def describe_spec(spec: PartitionSpec, mesh) -> str:
    """A spec in config-axis terms: ``(None, fsdp)``, or ``(fsdp:128, fsdp:2)`` for parts of an axis."""
    sizes = _sizes(mesh)

    def entry(e) -> str:
        if e is None:
            return "None"
        names = [e] if isinstance(e, str) else list(e)
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(config_axis(name), []).append(name)
        parts = []
        for base, members in groups.items():
            whole = axis_parts(mesh, base)
            size = math.prod(sizes[m] for m in members)
            parts.append(base if len(members) == len(whole) else f"{base}:{size}")
        return "+".join(parts)

    return "(" + ", ".join(entry(e) for e in spec) + ")"


def logical_names(variable) -> tuple[str | None, ...]:
    """The logical axis names an NNX variable was annotated with (``()`` for scalars)."""
    names = variable.get_metadata().get("out_sharding") if hasattr(variable, "get_metadata") else None
    return tuple(names) if names is not None else (None,) * len(variable.shape)


def place_parameter(shape, names, dtype, mesh, rules: ShardingRules, skip: frozenset[str] = frozenset()) -> Placement:
    return place(
        shape,
        names,
        mesh,
        rules.table,
        fill=PARAMETER_FILL_AXES,
        itemsize=np.dtype(dtype).itemsize,
        min_shard_bytes=rules.min_shard_bytes,
        skip=skip,
    )


def parameter_placements(tree, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """``Placement`` per NNX variable of an abstract state (same tree structure)."""
    from flax import nnx

    def one(variable):
        return place_parameter(tuple(variable.shape), logical_names(variable), variable.dtype, mesh, rules)

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _manual_axes(mesh) -> frozenset[str]:
    return frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Manual)


def constrain(x, names: Sequence[str | None]):
    """``with_sharding_constraint`` of ``x`` to its logical ``names`` under the active mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = place(x.shape, names, mesh, active_rules().table, skip=_manual_axes(mesh)).spec
    return jax.lax.with_sharding_constraint(x, spec)


def cast_parameter(variable, dtype):
    """A parameter's value in the compute ``dtype``, cast where it is stored.

    Pinning the cast to the parameter's own placement makes the partitioner gather the
    compute dtype (bf16 FSDP all-gathers move half the bytes of f32), and the gradient is
    cast back before it leaves that placement, so gradient reductions run in the parameter's
    dtype (f32 sums across devices, as mixed-precision FSDP keeps them)."""
    value = variable[...]
    dtype = jnp.dtype(dtype or value.dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if dtype == value.dtype or mesh.empty:
        return value.astype(dtype)
    spec = place_parameter(
        value.shape, logical_names(variable), value.dtype, mesh, active_rules(), skip=_manual_axes(mesh)
    ).spec
    return _pinned_cast(value, dtype, spec, _widest_split(spec, mesh))


def gather_parameter(variable, dtype=None):
    """``cast_parameter`` then an explicit FSDP all-gather: the whole table on every device
    (tensor-parallel splits kept). For weights indexed per example (GR00T's per-embodiment
    matrices, position tables): gathering the table once is cheaper than letting the
    partitioner reshard the per-example copies, which it can only do by replicating them."""
    value = cast_parameter(variable, dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return value
    fsdp = frozenset(a for axis in PARAMETER_FILL_AXES for a in axis_parts(mesh, axis))
    spec = place(value.shape, logical_names(variable), mesh, active_rules().table, skip=fsdp | _manual_axes(mesh)).spec
    return jax.lax.with_sharding_constraint(value, spec)


def _widest_split(spec: PartitionSpec, mesh) -> PartitionSpec | None:
    """For a spec split over several dimensions: only its widest split, else None.

    A gradient reduced first to that one split and then to the full placement costs one
    reduce-scatter; reduced straight to a two-dimensional placement, XLA reduces the whole
    array once per dimension (a full all-reduce each)."""
    split = [i for i, e in enumerate(spec) if e is not None]
    if len(split) < 2:
        return None
    sizes = _sizes(mesh)
    widest = max(
        split, key=lambda i: math.prod(sizes[a] for a in ((spec[i],) if isinstance(spec[i], str) else spec[i]))
    )
    return PartitionSpec(*[e if i == widest else None for i, e in enumerate(spec)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _pinned_cast(x, dtype, spec, widest):
    return jax.lax.with_sharding_constraint(x.astype(dtype), spec)


def _pinned_cast_fwd(x, dtype, spec, widest):
    return _pinned_cast(x, dtype, spec, widest), jnp.zeros((), x.dtype)


def _pinned_cast_bwd(dtype, spec, widest, like, cotangent):
    cotangent = cotangent.astype(like.dtype)
    if widest is not None:
        cotangent = jax.lax.with_sharding_constraint(cotangent, widest)
    return (jax.lax.with_sharding_constraint(cotangent, spec),)


_pinned_cast.defvjp(_pinned_cast_fwd, _pinned_cast_bwd)


def shard_tokens(x, last: str = "act_embed"):
    """``constrain`` for a token tensor [batch, ..., last]: batch split, middle dims replicated."""
    if x.ndim < 2:
        return x
    return constrain(x, ("batch",) + ("act_length",) * (x.ndim - 2) + (last,))
