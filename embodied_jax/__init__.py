"""embodied_jax: train and evaluate vision-language-action robot policies in JAX/Flax.

The public entry points: ``load_policy(ckpt_dir, *, step=None, use_ema=True, devices=None)``
-> ``PolicyBundle`` (``predict(raw_observation, *, rng=None)``). Submodules load lazily,
so ``import embodied_jax`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["PolicyBundle", "__version__", "load_policy"]

_EXPORTS = {"load_policy": "embodied_jax.loading", "PolicyBundle": "embodied_jax.bundle"}

if TYPE_CHECKING:
    from embodied_jax.bundle import PolicyBundle
    from embodied_jax.loading import load_policy


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'embodied_jax' has no attribute {name!r}")
