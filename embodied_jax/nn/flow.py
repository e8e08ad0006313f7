"""The one flow-matching sampler: Euler steps of a model's velocity from noise to actions.

Both families integrate ``x <- x + dt * v(x, step)`` for a fixed number of steps and differ only
in the direction of time and how a step's time reaches the network, which the model gives as a
``FlowSchedule`` (π0.5: t from 1 at the noise to 0 at the data; GR00T: 0 to 1, the DiT seeing
discretised time buckets) and a velocity function ``velocity(module, x, step) -> v``. The module
(whatever holds the parameters, with any prefix KV cache closed over by ``velocity``) is rebuilt
inside the loop (``nn/traced.py``).

- ``sample(module, velocity, x, schedule)``: the chunk after the last step.
- ``guidance=Guidance(...)``: real-time chunking (``nn/rtc.py``): each velocity is guided towards
  a prefix through the clean estimate ``x + (clean_time - t) v``, and the frozen steps are
  returned as the prefix.
- ``trace=True``: also every step's state and velocity (``FlowTrace``), what a stochastic or
  likelihood-based use of the sampler (reinforcement learning) needs; the final chunk is the
  same as without it up to rounding (the scanned step is compiled apart from the looped one).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from embodied_jax.nn import rtc
from embodied_jax.nn.traced import module_fori_loop, module_scan

Velocity = Callable[[Any, jax.Array, jax.Array], jax.Array]  # (module, x, step index) -> v


class FlowSchedule(NamedTuple):
    """``times[i]``: the time of step ``i``'s velocity (float32 [num_steps]); ``dt``: the signed
    step; ``clean_time``: the time of the data (0 or 1)."""

    times: jax.Array
    dt: float | jax.Array
    clean_time: float

    @property
    def num_steps(self) -> int:
        return int(self.times.shape[0])


class Guidance(NamedTuple):
    """Real-time chunking inputs, shaped like the chunk (``rtc.guidance_inputs``)."""

    prefix: jax.Array
    weights: jax.Array
    max_guidance: float = 5.0


class FlowTrace(NamedTuple):
    """``actions``: the final chunk; ``states`` [num_steps + 1, ...]: the chunk before each step and
    after the last (``states[0]`` is the noise, ``states[-1]`` the actions before inpainting);
    ``velocities`` [num_steps, ...]: the (guided) velocity each step took."""

    actions: jax.Array
    states: jax.Array
    velocities: jax.Array


def sample(
    module: Any,
    velocity: Velocity,
    x: jax.Array,
    schedule: FlowSchedule,
    *,
    guidance: Guidance | None = None,
    trace: bool = False,
) -> jax.Array | FlowTrace:
    """Integrate from the noise ``x`` over ``schedule``; the chunk, or a ``FlowTrace`` with ``trace``."""

    def step_velocity(i, module, x):
        if guidance is None:
            return velocity(module, x, i)
        return rtc.guided_velocity(
            module,
            lambda module, x: velocity(module, x, i),
            x,
            schedule.times[i],
            guidance.prefix,
            guidance.weights,
            clean_time=schedule.clean_time,
            max_guidance=guidance.max_guidance,
        )

    def finish(x):
        return x if guidance is None else rtc.inpaint_frozen(x, guidance.prefix, guidance.weights)

    def euler(i, module, x):
        return x + schedule.dt * step_velocity(i, module, x)

    if not trace:
        return finish(module_fori_loop(module, schedule.num_steps, euler, x))

    def traced_euler(i, module, x):
        v = step_velocity(i, module, x)
        return x + schedule.dt * v, (x, v)

    last, (states, velocities) = module_scan(module, schedule.num_steps, traced_euler, x)
    states = jnp.concatenate([states, last[None]], axis=0)
    return FlowTrace(finish(last), states, velocities)
