"""Rotary position embeddings, rotate-half convention (HF Gemma / Qwen3 / Llama).

The head dimension is split into a first and a second half; frequency k (k < H/2) rotates
the pair (x[k], x[k + H/2]) by angle ``position * theta ** (-2k / H)``. Computed in
float32, returned in the input dtype.
"""

from __future__ import annotations

import jax.numpy as jnp


def rope_angles(positions, head_dim: int, theta: float = 10_000.0):
    """Angles float32 [B, T, head_dim // 2]."""
    if head_dim % 2:
        raise ValueError(f"apply_rope: head_dim must be even, got {head_dim}")
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return jnp.asarray(positions, jnp.float32)[..., None] * inv_freq


def apply_rope(x, positions, *, theta: float = 10_000.0):
    """Rotate x [B, T, N, H] by positions int [B, T]."""
    angles = rope_angles(positions, x.shape[-1], theta)[:, :, None, :]  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)
