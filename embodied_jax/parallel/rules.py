"""The one table mapping logical axis names to mesh axes, and its overrides.

Parameters and activations are annotated with logical names (``embed``, ``mlp``,
``heads``...). This table decides which mesh axis each one is split over, so a change
of parallelism is a change of mesh sizes or of these rules, never of model code. A name
may appear several times: the entries are tried in order (``parallel.partition`` falls
back to the next one when a mesh axis does not divide the dimension). A name mapped to
``None`` is replicated; a name absent from the table is an error at sharding time.

The defaults are data parallelism over ``data`` and FSDP over ``fsdp``: the batch is split
over both, parameters over ``fsdp`` along ``embed`` (and, where that does not divide, along
whatever dimension does). Tensor parallelism is a rules change (the ``tensor_parallel``
preset); ``MeshConfig.rules`` / ``--mesh.rules`` take entries ``LOGICAL=AXIS[,AXIS...]``
(``LOGICAL=`` replicates) or preset names, and replace the defaults of the names they set:

    --mesh.fsdp 4 --mesh.tensor 2 --mesh.rules tensor_parallel
    --mesh.rules vocab=fsdp mlp=tensor act_mlp=tensor
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from embodied_jax.errors import InputError

MESH_AXES = ("data", "fsdp", "tensor")
# Axes that shard parameters: laid out as one mesh axis per prime factor (``parallel.mesh``).
SPLIT_AXES = ("fsdp", "tensor")
# Parameters are spread over these axes along any dimension the rules leave free.
PARAMETER_FILL_AXES = ("fsdp",)

Target = str | tuple[str, ...] | None
Rules = tuple[tuple[str, Target], ...]

LOGICAL_AXIS_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_mlp", None),
    ("act_heads", None),
    ("act_kv_heads", None),
    ("act_head_dim", None),
    # parameters
    ("embed", "fsdp"),
    ("mlp", None),
    ("heads", None),
    ("kv_heads", None),
    ("head_dim", None),
    ("vocab", None),
    ("layers", None),
    ("norm", None),
    ("conv", None),
    ("channels", None),
    ("positions", None),
    ("embodiments", None),
    ("cond", None),
    ("lora", None),
    ("fp8_meta", None),
)

KNOWN_LOGICAL_AXES = frozenset(name for name, _ in LOGICAL_AXIS_RULES)

# Megatron-style tensor parallelism: attention heads and MLP hidden units (weights and the
# activations between the paired matmuls) split over ``tensor``; the vocabulary too.
PRESETS: dict[str, Rules] = {
    "tensor_parallel": (
        ("mlp", "tensor"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("vocab", "tensor"),
        ("act_mlp", "tensor"),
        ("act_heads", "tensor"),
        ("act_kv_heads", "tensor"),
    ),
}


class RulesError(InputError, ValueError):
    """A rules override that names an unknown logical axis, mesh axis or preset."""


def parse_rules(entries: Sequence[str]) -> Rules:
    """``("mlp=tensor", "batch=data,fsdp", "vocab=", "tensor_parallel")`` -> rules."""
    rules: list[tuple[str, Target]] = []
    for entry in entries:
        if "=" not in entry:
            if entry not in PRESETS:
                raise RulesError(
                    f"mesh.rules: {entry!r} is neither LOGICAL=AXIS nor a preset ({', '.join(sorted(PRESETS))})"
                )
            rules.extend(PRESETS[entry])
            continue
        name, _, value = entry.partition("=")
        name = name.strip()
        if name not in KNOWN_LOGICAL_AXES:
            raise RulesError(
                f"mesh.rules: unknown logical axis {name!r} in {entry!r}; known: "
                f"{', '.join(sorted(KNOWN_LOGICAL_AXES))}"
            )
        axes = tuple(a.strip() for a in value.split(",") if a.strip())
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise RulesError(
                f"mesh.rules: unknown mesh axis {unknown[0]!r} in {entry!r}; mesh axes: {', '.join(MESH_AXES)}"
            )
        rules.append((name, None if not axes else axes[0] if len(axes) == 1 else axes))
    return tuple(rules)


def with_overrides(overrides: Sequence[str] = (), base: Rules = LOGICAL_AXIS_RULES) -> Rules:
    """``base`` with every logical name that ``overrides`` sets replaced by the override's entries."""
    parsed = parse_rules(overrides)
    replaced = {name for name, _ in parsed}
    return parsed + tuple((name, target) for name, target in base if name not in replaced)


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """The rules in force: the table, plus a size below which parameters stay replicated
    (bytes; openpi replicates arrays under 4 MiB; 0 shards everything, which keeps the
    per-device state within 1% of total/fsdp up to 1024 devices)."""

    table: Rules = LOGICAL_AXIS_RULES
    min_shard_bytes: int = 0

    @classmethod
    def from_config(cls, overrides: Sequence[str] = (), min_shard_bytes: int = 0) -> ShardingRules:
        if min_shard_bytes < 0:
            raise RulesError(f"mesh.min_shard_bytes={min_shard_bytes} must be >= 0")
        return cls(with_overrides(overrides), int(min_shard_bytes))

    def uses(self, mesh_axis: str) -> bool:
        """Whether any rule maps a logical axis onto config axis ``mesh_axis``."""
        return any(t is not None and mesh_axis in ((t,) if isinstance(t, str) else t) for _, t in self.table)


def candidates(rules: Rules, name: str) -> list[Target]:
    """The mesh-axis choices for one logical name, in order of preference."""
    found = [target for n, target in rules if n == name]
    if not found:
        raise KeyError(
            f"logical axis {name!r} has no sharding rule (known: {', '.join(sorted({n for n, _ in rules}))})"
        )
    return found
