"""Time / position embeddings and token embeddings.

- ``sincos_embedding``: openpi / π0(.5) ``posemb_sincos`` convention (π0.5's flow-matching
  time), computed so that its result is float32-accurate although the angles reach ~1.6e3 rad.
- ``timestep_embedding``: diffusers ``get_timestep_embedding`` (used by GR00T-N1.5's DiT
  timestep encoder with ``flip_sin_to_cos=True, downscale_freq_shift=1``):
  exponent = -log(max_period) * arange(half) / (half - shift),
  emb = t * exp(exponent) (times ``scale``), concat[sin, cos] (or [cos, sin] if flipped),
  zero-padded by one column when ``dim`` is odd.
- ``LearnedPositions`` (param ``embedding`` [num, dim]) and ``Embed`` (token table with
  axes ("vocab", "embed"), ``attend`` for a tied output projection).
- ``fill_image_tokens``: image features into the image-token positions of each row.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from embodied_jax.parallel.partition import gather_parameter


def fill_image_tokens(embeddings, is_image, image_rows):
    """Row r's k-th image-token id (``is_image`` [R, L]) gets token k of ``image_rows`` [R, N, D].

    Row by row, so a batch-sharded step keeps the fill local; a row with more image-token ids
    than image tokens repeats the last one (callers keep the counts equal)."""
    index = jnp.clip(jnp.cumsum(is_image.astype(jnp.int32), axis=1) - 1, 0, image_rows.shape[1] - 1)
    gathered = jnp.take_along_axis(image_rows, index[..., None], axis=1).astype(embeddings.dtype)
    return jnp.where(is_image[..., None], gathered, embeddings)


def _split_f32(x: np.ndarray):
    """float64 constants -> (hi, lo) float32 with hi + lo ≈ x to ~1e-14 relative."""
    hi = x.astype(np.float32)
    return hi, (x - hi.astype(np.float64)).astype(np.float32)


def sincos_embedding(t, dim: int, *, min_period: float = 4e-3, max_period: float = 4.0):
    """t [...] -> float32 [..., dim]: concat[sin, cos](2π t / period), ``dim // 2`` periods log-spaced
    from ``min_period`` to ``max_period`` (openpi's ``posemb_sincos``), accurate to float32 rounding
    of its *result*.

    Upstream (LeRobot/openpi PyTorch) computes ``t · 2π / period`` in float64; with
    ``min_period = 4e-3`` the angle reaches ~1.6e3 rad, where a float32 product is off by ~1e-4.
    Here the angle is reduced modulo one turn before the trigonometry: the frequency
    ``1 / period`` is a float64 constant split into two float32 parts and the product ``t · f_hi``
    is made exact with Dekker's two-product, so ``frac(t · f)`` keeps full float32 precision.
    """
    if dim % 2:
        raise ValueError(f"sincos_embedding: dim must be even, got {dim}")
    fraction = np.linspace(0.0, 1.0, dim // 2)
    freq_hi, freq_lo = _split_f32(1.0 / (min_period * (max_period / min_period) ** fraction))
    t = jnp.asarray(t, jnp.float32)[..., None]
    prod = t * freq_hi
    splitter = jnp.float32(4097.0)  # Veltkamp split of float32 operands into 12-bit halves

    def split(a):
        c = splitter * a
        high = c - (c - a)
        return high, a - high

    t_hi, t_lo = split(t)
    f_hi, f_lo = split(jnp.asarray(freq_hi))
    err = ((t_hi * f_hi - prod) + t_hi * f_lo + t_lo * f_hi) + t_lo * f_lo
    turns = (prod - jnp.round(prod)) + (err + t * freq_lo)
    angle = (2.0 * np.pi) * turns
    return jnp.concatenate([jnp.sin(angle), jnp.cos(angle)], axis=-1)


def timestep_embedding(
    t,
    dim: int,
    *,
    flip_sin_to_cos: bool = True,
    downscale_freq_shift: float = 1.0,
    max_period: float = 10000.0,
    scale: float = 1.0,
):
    """diffusers ``get_timestep_embedding``: t [...] -> float32 [..., dim]."""
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - downscale_freq_shift)
    angle = jnp.asarray(t, jnp.float32)[..., None] * jnp.exp(exponent) * scale
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, [(0, 0)] * (emb.ndim - 1) + [(0, 1)])
    return emb


class LearnedPositions(nnx.Module):
    """Learned position table, param ``embedding`` [num, dim]; call with int positions."""

    def __init__(self, num: int, dim: int, *, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.embedding = nnx.Param(init(rngs.params(), (num, dim), param_dtype), out_sharding=("positions", "embed"))

    def __call__(self, positions=None):
        table = gather_parameter(self.embedding)
        return table if positions is None else jnp.take(table, positions, axis=0)


class Embed(nnx.Module):
    """Token embedding, param ``embedding`` [vocab, embed]."""

    def __init__(self, num: int, dim: int, *, dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.num = num
        self.dtype = dtype
        init = nnx.initializers.normal(1.0 / math.sqrt(dim))
        self.embedding = nnx.Param(init(rngs.params(), (num, dim), param_dtype), out_sharding=("vocab", "embed"))

    def __call__(self, tokens):
        table = self.embedding[...]
        return jnp.take(table, tokens, axis=0).astype(self.dtype or table.dtype)

    def attend(self, x):
        """Logits against the table (tied output projection): x [..., dim] -> [..., vocab]."""
        dtype = self.dtype or self.embedding.dtype
        return jnp.einsum("...d,vd->...v", x.astype(dtype), self.embedding[...].astype(dtype))
