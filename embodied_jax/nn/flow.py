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
- ``sde=FlowSDE(...)`` (with ``trace``): Flow-SDE (πRL): the chosen steps become Gaussian
  transitions whose marginals are the ODE's, so a chunk has a likelihood, the sum of those
  steps' log-densities (``step_log_density``; ``transition_log_density`` recomputes it for a
  stored chain under other weights: the PPO ratio).
- ``sde=FlowSDE(action_noise=σ)``: every step stays the Euler step and Gaussian noise of std σ is
  added to the final chunk. Its mean is the whole deterministic chain from the stored initial
  noise, recomputed under the weights being evaluated, so the likelihood depends on every step's
  velocity (the deployed sampler with its noise held fixed, explored around in action space).

Flow-SDE, written in the noise level ``s`` = |t - clean_time| (s = 1 at the noise, 0 at the
data), the data's direction ``u = dx/ds`` (= v where the clean time is 0, -v where it is 1)
and ``x_s = (1 - s) x_0 + s ε``: the score is ``-(x + (1 - s) u) / s``, and with a diffusion
``σ_s = a·sqrt(s / (1 - s))`` (``a`` = ``noise_level``) the step from s to s - h is Gaussian
with mean ``x + dt·v - h·a²/(2(1 - s))·(x + (1 - s) u)`` and standard deviation
``σ_s·sqrt(h)``; ``1 - s`` is floored at ``h`` so the first step (s = 1) stays finite, its
standard deviation then being ``a``. Deterministic steps keep the Euler update.
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


class FlowSDE(NamedTuple):
    """Which Euler steps become stochastic and how much: ``noise_level`` is ``a`` of the module
    docstring; ``stochastic_steps``: step indices (None: every step). ``counted_positions``: how many
    leading positions of the chunk (the axis before the action dims) count in the log-density, e.g.
    the actions a robot executes of each chunk (None: all). Every position is still sampled with
    noise; the others' noise is treated as the sampler's own randomness, which drops from the
    likelihood ratio the terms of actions that never reach the robot (a lower-variance estimate
    that ignores their slight influence, through attention, on the counted positions' later steps).
    ``action_noise`` > 0: no step is stochastic; the final chunk gets Gaussian noise of this std
    around the deterministic chain (module docstring), and ``noise_level``/``stochastic_steps`` are
    unused."""

    noise_level: float = 0.5
    stochastic_steps: tuple[int, ...] | None = None
    counted_positions: int | None = None
    action_noise: float = 0.0

    def mask(self, num_steps: int) -> jax.Array:
        """float32 [num_steps]: 1 where the step is stochastic."""
        if self.action_noise > 0:
            return jnp.zeros((num_steps,), jnp.float32)
        if self.stochastic_steps is None:
            return jnp.ones((num_steps,), jnp.float32)
        bad = [i for i in self.stochastic_steps if not 0 <= i < num_steps]
        if bad:
            raise ValueError(f"FlowSDE.stochastic_steps {bad} outside 0..{num_steps - 1}")
        return jnp.zeros((num_steps,), jnp.float32).at[jnp.asarray(self.stochastic_steps, jnp.int32)].set(1.0)


class FlowTrace(NamedTuple):
    """``actions``: the final chunk; ``states`` [num_steps + 1, ...]: the chunk before each step and
    after the last (``states[0]`` is the noise, ``states[-1]`` the actions before inpainting);
    ``velocities`` [num_steps, ...]: the (guided) velocity each step took; ``log_density``
    [num_steps, ...] (with ``sde``): each element's Gaussian log-density of its step (0 where the
    step is deterministic)."""

    actions: jax.Array
    states: jax.Array
    velocities: jax.Array
    log_density: jax.Array | None = None


def _sde_step(schedule: FlowSchedule, sde: FlowSDE, i, x, v):
    """(mean, std) of step ``i`` from ``x`` with velocity ``v`` (std 0 where deterministic)."""
    h = jnp.abs(jnp.asarray(schedule.dt, jnp.float32))
    s = jnp.abs(schedule.times[i] - schedule.clean_time)
    u = v if schedule.clean_time == 0.0 else -v
    one_minus_s = jnp.maximum(1.0 - s, h)
    on = sde.mask(schedule.num_steps)[i]
    a2 = sde.noise_level**2 * on
    mean = x + schedule.dt * v - h * a2 / (2.0 * one_minus_s) * (x + (1.0 - s) * u)
    std = jnp.sqrt(a2 * s / one_minus_s * h)
    return mean, std


def step_log_density(schedule: FlowSchedule, sde: FlowSDE, states: jax.Array, velocities: jax.Array) -> jax.Array:
    """Elementwise Gaussian log-density [num_steps, ...] of ``states[i + 1]`` given ``states[i]`` and
    the velocity taken there (0 for deterministic steps)."""
    steps = jnp.arange(schedule.num_steps)
    return _log_density_at(schedule, sde, steps, states[:-1], velocities, states[1:])


def _gaussian_log_density(sde: FlowSDE, y, mean, std):
    """Elementwise log N(y; mean, std²), 0 where std is 0 and outside the counted positions."""
    safe = jnp.where(std > 0, std, 1.0)
    logp = -0.5 * jnp.square((y - mean) / safe) - jnp.log(safe) - 0.5 * jnp.log(2.0 * jnp.pi)
    logp = jnp.where(std > 0, logp, 0.0)
    if sde.counted_positions is not None:
        logp = logp * (jnp.arange(y.shape[-2]) < sde.counted_positions)[:, None].astype(logp.dtype)
    return logp


def _log_density_at(schedule, sde, steps, before, velocities, after):
    def one(i, x, v, y):
        mean, std = _sde_step(schedule, sde, i, x, v)
        return _gaussian_log_density(sde, y, mean, std)

    return jax.vmap(one)(steps, before, velocities, after)


def _final_noise_density(sde: FlowSDE, num_steps: int, mean: jax.Array, noisy: jax.Array) -> jax.Array:
    """[num_steps, ...]: the action noise's log-density of ``noisy`` around ``mean`` in the last step's row."""
    density = _gaussian_log_density(sde, noisy, mean, jnp.asarray(sde.action_noise, jnp.float32))
    return jnp.zeros((num_steps, *noisy.shape), density.dtype).at[-1].set(density)


def chunk_log_prob(log_density: jax.Array) -> jax.Array:
    """A chunk's log-probability [B]: ``log_density`` [num_steps, B, ...] summed over all but the batch."""
    return log_density.reshape(log_density.shape[0], log_density.shape[1], -1).sum(axis=(0, 2))


def transition_log_density(
    module: Any, velocity: Velocity, states: jax.Array, schedule: FlowSchedule, sde: FlowSDE
) -> jax.Array:
    """``step_log_density`` of a stored chain ``states`` [num_steps + 1, ...] with the velocities this
    ``module`` gives at its states (the likelihood of another policy's sample under this one). Only
    the stochastic steps are evaluated (the others' densities are 0); with ``sde.action_noise`` the
    whole chain from ``states[0]``."""
    if sde.action_noise > 0:

        def euler(i, module, x):
            return x + schedule.dt * velocity(module, x, i), None

        mean, _ = module_scan(module, schedule.num_steps, euler, states[0])
        return _final_noise_density(sde, schedule.num_steps, mean, states[-1])
    if sde.stochastic_steps is None:
        steps = tuple(range(schedule.num_steps))
    else:
        sde.mask(schedule.num_steps)  # checks the indices
        steps = tuple(sorted(set(sde.stochastic_steps)))
    index = jnp.asarray(steps, jnp.int32)

    def at(j, module, carry):
        i = index[j]
        return carry, velocity(module, states[i], i)

    _, velocities = module_scan(module, len(steps), at, jnp.zeros((), jnp.float32))
    density = _log_density_at(schedule, sde, index, states[index], velocities, states[index + 1])
    return jnp.zeros((schedule.num_steps, *states.shape[1:]), density.dtype).at[index].set(density)


def sample(
    module: Any,
    velocity: Velocity,
    x: jax.Array,
    schedule: FlowSchedule,
    *,
    guidance: Guidance | None = None,
    trace: bool = False,
    sde: FlowSDE | None = None,
    rng: jax.Array | None = None,
) -> jax.Array | FlowTrace:
    """Integrate from the noise ``x`` over ``schedule``; the chunk, or a ``FlowTrace`` with ``trace``.
    ``sde`` (with ``trace`` and the key ``rng`` of its noise): stochastic steps (module docstring)."""
    if sde is not None and (not trace or rng is None or guidance is not None):
        raise ValueError("flow.sample: sde needs trace=True and an rng, and does not take guidance")

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
        if sde is None or sde.action_noise > 0:
            return x + schedule.dt * v, (x, v)
        mean, std = _sde_step(schedule, sde, i, x, v)
        return mean + std * jax.random.normal(jax.random.fold_in(rng, i), x.shape, x.dtype), (x, v)

    last, (states, velocities) = module_scan(module, schedule.num_steps, traced_euler, x)
    if sde is not None and sde.action_noise > 0:
        noise = jax.random.normal(jax.random.fold_in(rng, schedule.num_steps), last.shape, last.dtype)
        mean, last = last, last + sde.action_noise * noise
        states = jnp.concatenate([states, last[None]], axis=0)
        return FlowTrace(finish(last), states, velocities, _final_noise_density(sde, schedule.num_steps, mean, last))
    states = jnp.concatenate([states, last[None]], axis=0)
    log_density = None if sde is None else step_log_density(schedule, sde, states, velocities)
    return FlowTrace(finish(last), states, velocities, log_density)
