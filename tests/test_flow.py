"""The one flow sampler (``nn/flow.py``) against a hand-written Euler loop, and its trace."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embodied_jax.nn import flow, rtc


class Toy(nnx.Module):
    def __init__(self, width: int):
        self.w = nnx.Param(jnp.asarray(np.random.default_rng(0).normal(size=(width, width)) / width, jnp.float32))


def _toy_velocity(module, x, i):
    return jnp.tanh(x @ module.w[...]) + 0.1 * i


def _reference(x, w, times, dt, steps):
    """Euler in NumPy float64: v = tanh(x W) + 0.1 i."""
    x = np.asarray(x, np.float64)
    for i in range(steps):
        x = x + dt * (np.tanh(x @ np.asarray(w, np.float64)) + 0.1 * i)
    return x


@pytest.mark.parametrize("direction", ["noise_at_1", "noise_at_0"])
def test_sample_is_euler_and_its_trace_holds_every_step(direction):
    steps = 5
    dt = -1.0 / steps if direction == "noise_at_1" else 1.0 / steps
    times = jnp.asarray((1.0 if dt < 0 else 0.0) + np.arange(steps) * dt, jnp.float32)
    schedule = flow.FlowSchedule(times, dt, clean_time=0.0 if dt < 0 else 1.0)
    model = Toy(3)
    x0 = jnp.asarray(np.random.default_rng(1).normal(size=(4, 6, 3)), jnp.float32)

    actions = flow.sample(model, _toy_velocity, x0, schedule)
    np.testing.assert_allclose(actions, _reference(x0, model.w[...], times, dt, steps), rtol=1e-5, atol=1e-5)

    traced = flow.sample(model, _toy_velocity, x0, schedule, trace=True)
    # The same chunk with or without the trace (up to rounding: XLA compiles the scanned step apart).
    np.testing.assert_allclose(traced.actions, actions, rtol=1e-6, atol=1e-6)
    assert traced.states.shape == (steps + 1, 4, 6, 3) and traced.velocities.shape == (steps, 4, 6, 3)
    np.testing.assert_array_equal(traced.states[0], x0)
    for i in range(steps):
        v = _toy_velocity(model, traced.states[i], i)
        np.testing.assert_allclose(traced.velocities[i], v, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(traced.states[i + 1], traced.states[i] + dt * v, rtol=1e-6, atol=1e-6)


def test_guided_sampling_returns_the_frozen_prefix_and_traces_the_guided_velocity():
    steps = 4
    schedule = flow.FlowSchedule(jnp.asarray(1.0 - np.arange(steps) / steps, jnp.float32), -1.0 / steps, 0.0)
    model = Toy(2)
    x0 = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5, 2)), jnp.float32)
    prefix = jnp.full((3, 5, 2), 0.5, jnp.float32)
    weights = jnp.broadcast_to(jnp.asarray([1.0, 1.0, 0.5, 0.0, 0.0])[None, :, None], (3, 5, 2))
    guidance = flow.Guidance(prefix, weights, 5.0)
    guided = flow.sample(model, _toy_velocity, x0, schedule, guidance=guidance)
    np.testing.assert_array_equal(guided[:, :2], prefix[:, :2])  # frozen steps: the prefix itself
    plain = flow.sample(model, _toy_velocity, x0, schedule)
    assert not np.allclose(guided[:, 2], plain[:, 2])  # partly weighted steps are pulled
    traced = flow.sample(model, _toy_velocity, x0, schedule, guidance=guidance, trace=True)
    np.testing.assert_allclose(traced.actions, guided, rtol=1e-6, atol=1e-6)
    v0 = rtc.guided_velocity(
        model, lambda m, x: _toy_velocity(m, x, 0), x0, schedule.times[0], prefix, weights, clean_time=0.0
    )
    np.testing.assert_allclose(traced.velocities[0], v0, rtol=1e-6)
