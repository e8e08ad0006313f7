"""Low-rank adapters (LoRA) on Dense / Einsum kernels.

``Dense(..., lora=LoRAConfig(rank, alpha))`` and ``Einsum(..., lora=...)`` add two params
next to ``kernel``: ``lora_a`` (the kernel's contracted dims + [rank], normal init, std
``init_std``) and ``lora_b`` ([rank] + the kernel's output dims, zero init), so the
layer starts equal to the base. Output = base(x) + (alpha / rank) * (x · lora_a) · lora_b,
computed in the layer's compute dtype without FP8. For Dense: ``lora_a`` [in, r],
``lora_b`` [r, out].

Freezing the base: train only parameters whose path (names joined by "/") matches
``LORA_TRAINABLE_REGEX`` (``lora_a``/``lora_b`` leaves); every other ``nnx.Param`` is frozen.
Equivalently, the trainer's freeze regex is ``LORA_FREEZE_REGEX`` (any path whose last name is
not ``lora_a``/``lora_b``). ``is_lora_path`` applies the rule to a path tuple.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from flax import nnx

from embodied_jax.config_registry import register

LORA_TRAINABLE_REGEX = r"(^|/)lora_[ab]$"
LORA_FREEZE_REGEX = r"^(?!(.*/)?lora_[ab]$).*$"


@register
@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int
    alpha: float = 1.0
    init_std: float = 0.01

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRAConfig.rank must be >= 1, got {self.rank}")


def is_lora_path(path: Sequence[Any]) -> bool:
    """True for a parameter path (tuple of keys) that LoRA training updates."""
    return re.search(LORA_TRAINABLE_REGEX, "/".join(str(p) for p in path)) is not None


def _parse(spec: str):
    lhs, out_spec = spec.replace(" ", "").split("->")
    x_spec, k_spec = lhs.split(",")
    contracted = "".join(c for c in k_spec if c in x_spec and c not in out_spec)
    produced = "".join(c for c in k_spec if c not in x_spec)
    if len(contracted) + len(produced) != len(k_spec) or "." in k_spec:
        raise ValueError(f"LoRA: einsum {spec!r} has kernel dims that are neither contracted nor output-only")
    free = [c for c in string.ascii_letters if c not in spec]
    return x_spec, k_spec, out_spec, contracted, produced, free[0]


def make_lora_params(spec: str, kernel_shape, axes, config: LoRAConfig, param_dtype, rngs: nnx.Rngs):
    """(lora_a, lora_b) nnx.Params for a kernel of ``kernel_shape`` used as ``einsum(spec, x, kernel)``."""
    _, k_spec, _, contracted, produced, _ = _parse(spec)
    dim = dict(zip(k_spec, kernel_shape, strict=True))
    axis = dict(zip(k_spec, axes, strict=True))
    a_shape = tuple(dim[c] for c in contracted) + (config.rank,)
    b_shape = (config.rank,) + tuple(dim[c] for c in produced)
    a = nnx.initializers.normal(config.init_std)(rngs.params(), a_shape, param_dtype)
    lora_a = nnx.Param(a, out_sharding=tuple(axis[c] for c in contracted) + ("lora",))
    lora_b = nnx.Param(jnp.zeros(b_shape, param_dtype), out_sharding=("lora",) + tuple(axis[c] for c in produced))
    return lora_a, lora_b


def lora_delta(spec: str, x, lora_a, lora_b, config: LoRAConfig):
    """(alpha / rank) * einsum through the two low-rank factors."""
    x_spec, _, out_spec, contracted, produced, r = _parse(spec)
    x_rest = "".join(c for c in x_spec if c not in contracted)
    hidden = jnp.einsum(f"{x_spec},{contracted}{r}->{x_rest}{r}", x, lora_a.astype(x.dtype))
    delta = jnp.einsum(f"{x_rest}{r},{r}{produced}->{out_spec}", hidden, lora_b.astype(x.dtype))
    return delta * jnp.asarray(config.alpha / config.rank, x.dtype)
