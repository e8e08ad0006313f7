"""Real-time chunking (RTC; Black, Galliker & Levine 2025): inpainting an action chunk at sampling time.

A robot runs chunk k while chunk k+1 is sampled. Inference started after ``executed`` actions of
chunk k and takes ``delay`` control steps, so when chunk k+1 arrives its first ``delay`` actions are
already in the past (chunk k executed them) and the rest of the overlap, up to ``horizon -
executed``, should follow chunk k's plan closely enough that switching is smooth. RTC samples chunk
k+1 with ΠGDM guidance towards Y = chunk k shifted by ``executed`` (``shift_prefix``) under soft
weights W (``prefix_weights``): at each Euler step, with the model's velocity v at (x_t, t),

    x̂ = x_t + (t_clean - t) v                   the clean chunk one jump away
    g = (∂x̂/∂x_t)ᵀ [W ⊙ (Y - x̂)]                one vector-Jacobian product through the denoiser
    v' = v + sign(t_clean - t) min(β, (1-τ) / (τ r²)) g,   r² = (1-τ)² / (τ² + (1-τ)²)

with τ = 1 - |t_clean - t| the paper's time (0 noise, 1 data) and β the maximum guidance weight.
``t_clean`` names a model's time convention: π0.5 integrates from noise at t=1 to data at t=0
(``clean_time=0``, dt < 0: the sign turns the correction into a step along g), GR00T from noise
at t=0 to data at t=1 (``clean_time=1``). Zero weights leave v unchanged (g = 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from embodied_jax.nn.traced import module_vjp

SCHEDULES = ("exp", "linear", "ones", "zeros")


def prefix_weights(horizon: int, delay, executed, schedule: str = "exp") -> jax.Array:
    """Guidance weights float32 [horizon] over the new chunk's steps.

    1 on the first ``delay`` steps (frozen: they execute from the previous chunk while the new one
    is sampled), 0 from ``horizon - executed`` on (past the previous chunk's end); over the overlap
    in between, with c_i = (horizon - executed - i) / (horizon - executed - delay + 1):
    ``exp`` c_i (e^c_i - 1) / (e - 1) (the paper's), ``linear`` c_i, ``ones`` 1, ``zeros`` 0 (hard
    freezing only). ``delay`` and ``executed`` may be traced; ``delay`` is capped at the overlap.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"prefix_weights: schedule {schedule!r} is not one of {SCHEDULES}")
    i = jnp.arange(horizon, dtype=jnp.float32)
    end = jnp.float32(horizon) - jnp.asarray(executed, jnp.float32)
    delay = jnp.minimum(jnp.asarray(delay, jnp.float32), end)
    c = (end - i) / (end - delay + 1.0)
    overlap = {
        "exp": c * jnp.expm1(c) / (math.e - 1.0),
        "linear": c,
        "ones": jnp.ones_like(c),
        "zeros": jnp.zeros_like(c),
    }[schedule]
    return jnp.where(i < delay, 1.0, jnp.where(i < end, overlap, 0.0)).astype(jnp.float32)


def shift_prefix(previous, executed: int) -> jax.Array:
    """The previous chunk [B, H, A] as the new chunk's target: steps ``executed`` .. H-1 first, padded
    with its last action (weight 0 there under ``prefix_weights``)."""
    previous = jnp.asarray(previous, jnp.float32)
    rest = previous[:, executed:]
    pad = jnp.repeat(previous[:, -1:], previous.shape[1] - rest.shape[1], axis=1)
    return jnp.concatenate([rest, pad], axis=1)


def guidance_inputs(prefix_actions, weights, *, batch: int, horizon: int, width: int, real_width: int | None = None):
    """Checked targets [B, horizon, width] (zero-padded from the caller's width) and weights of the same
    shape (``weights`` [H] or [B, H], zero on padded dims and on dims from ``real_width`` on)."""
    if weights is None:
        raise ValueError("prefix_actions need prefix_weights ([horizon] or [batch, horizon]: nn.rtc.prefix_weights)")
    y = jnp.asarray(prefix_actions, jnp.float32)
    if y.ndim != 3 or y.shape[:2] != (batch, horizon) or y.shape[2] > width:
        raise ValueError(f"prefix_actions {y.shape}: expected [{batch}, {horizon}, A] with A <= {width}")
    w = jnp.asarray(weights, jnp.float32)
    if w.shape not in ((horizon,), (batch, horizon)):
        raise ValueError(f"prefix_weights {w.shape}: expected [{horizon}] or [{batch}, {horizon}]")
    given = y.shape[2]
    y = jnp.pad(y, ((0, 0), (0, 0), (0, width - given)))
    dims = (jnp.arange(width) < min(given, real_width or width)).astype(jnp.float32)
    w = jnp.broadcast_to(w, (batch, horizon))[..., None] * dims
    return y, w


def guidance_scale(tau, max_guidance: float) -> jax.Array:
    """min(β, (1-τ) / (τ r²)) = min(β, (τ² + (1-τ)²) / (τ (1-τ))); β at τ = 0 and τ = 1."""
    tau = jnp.asarray(tau, jnp.float32)
    return jnp.minimum(jnp.float32(max_guidance), (tau**2 + (1.0 - tau) ** 2) / (tau * (1.0 - tau)))


def guided_velocity(
    module: nnx.Module,
    velocity: Callable[[nnx.Module, jax.Array], jax.Array],
    x: jax.Array,
    t,
    prefix: jax.Array,
    weights: jax.Array,
    *,
    clean_time: float,
    max_guidance: float = 5.0,
) -> jax.Array:
    """The guided velocity v' at ``x`` (see the module docstring); ``velocity(module, x)`` is the
    model's at time ``t`` (a scalar), ``prefix`` and ``weights`` broadcast against ``x``. The vjp
    runs through ``module`` rebuilt in its own trace (``nn/traced.py``)."""
    remaining = jnp.float32(clean_time) - jnp.asarray(t, jnp.float32)

    def denoise(module, x):
        v = velocity(module, x)
        return x + remaining * v, v

    x_hat, pullback, v = module_vjp(module, denoise, x, has_aux=True)
    (g,) = pullback(weights * (prefix - x_hat))
    scale = jnp.sign(remaining) * guidance_scale(1.0 - jnp.abs(remaining), max_guidance)
    return v + scale * g


def inpaint_frozen(x: jax.Array, prefix: jax.Array, weights: jax.Array) -> jax.Array:
    """The sampled chunk with the prefix where the weight is 1 (the frozen steps): clipped guidance
    brings them within a few hundredths of the prefix in a few steps, not onto it."""
    return jnp.where(weights >= 1.0, prefix, x)


def check_unguided(weights) -> None:
    """Plain sampling: weights without prefix actions are a caller's mistake, not a no-op."""
    if weights is not None:
        raise ValueError("prefix_weights were given without prefix_actions")
