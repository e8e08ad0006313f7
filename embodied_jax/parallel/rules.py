"""The one table mapping logical axis names to mesh axes.

Parameters and activations are annotated with logical names (``embed``, ``mlp``,
``heads``...). This table decides which mesh axis each one is split over, so a change
of parallelism is a change of mesh sizes, never of model code. A logical name mapped to
``None`` is replicated; a name absent from the table is an error at sharding time.
"""
from __future__ import annotations

MESH_AXES = ("data", "fsdp", "tensor")

# (logical name, mesh axis or tuple of mesh axes or None)
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    # parameters
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
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
