"""The jitted train step: gradient accumulation, non-finite skipping, FP8 state, EMA.

A step whose loss or gradient is not finite leaves parameters, optimizer, FP8 and EMA
state untouched and increments the skip counters; the decision is a ``lax.cond`` inside
the compiled step (the update runs only when finite), so the host never waits on it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from embodied_jax.parallel.rules import ShardingRules
from embodied_jax.parallel.sharding import batch_shardings, replicated
from embodied_jax.train.config import TrainConfig
from embodied_jax.train.state import ModelParts, TrainState


def _micro_batches(batch: Any, accum: int, mesh: Mesh) -> Any:
    """[B, ...] -> [accum, B/accum, ...], micro-batch i = rows i, i+accum, ... so that
    every device keeps an equal share of every micro-batch."""

    def split(x):
        if x.shape[0] % accum:
            raise ValueError(f"batch of {x.shape[0]} rows is not divisible by train.grad_accum_steps={accum}")
        x = x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return x

    micro = jax.tree.map(split, batch)
    return micro


def make_train_step(
    parts: ModelParts,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    config: TrainConfig,
    mesh: Mesh,
    rules: ShardingRules = ShardingRules(),
):
    accum = config.grad_accum_steps

    def loss_fn(params, fp8, frozen, other, batch, rng):
        model = parts.merge(params, frozen, fp8, other)
        loss, metrics = model.loss(batch, rng)
        new_other = parts.split(model)[3]
        return loss, (metrics, new_other)

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)

    def train_step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if accum == 1:
            (loss, (metrics, other)), (grads, fp8) = grad_fn(
                state.params, state.fp8, state.frozen, state.other, batch, rng
            )
        else:
            micro = _micro_batches(batch, accum, mesh)

            def body(carry, xs):
                grads_sum, fp8, other = carry
                mb, i = xs
                mb = jax.lax.with_sharding_constraint(mb, batch_shardings(mesh, mb, rules))
                (loss, (metrics, other)), (grads, fp8) = grad_fn(
                    state.params, fp8, state.frozen, other, mb, jax.random.fold_in(rng, i)
                )
                grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
                return (grads_sum, fp8, other), (loss, metrics)

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (grads, fp8, other), (losses, metrics) = jax.lax.scan(
                body, (zeros, state.fp8, state.other), (micro, jnp.arange(accum))
            )
            grads = jax.tree.map(lambda g: g / accum, grads)
            loss = losses.mean()
            metrics = jax.tree.map(lambda m: m.sum(0) if _is_count(m) else m.mean(0), metrics)

        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def apply_update():
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            ema = state.ema
            if ema is not None:
                decay = config.ema_decay
                ema = jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)
            return params, opt_state, fp8, other, ema

        def keep_state():
            return state.params, state.opt_state, state.fp8, state.other, state.ema

        # a branch, not a select per leaf: a select keeps the old optimizer moments alive next
        # to the new ones, so XLA copies every moment before updating it in place
        params, opt_state, fp8, other, ema = jax.lax.cond(finite, apply_update, keep_state)
        skips = jnp.where(finite, 0, state.skips + 1)
        new_state = state.replace(
            step=state.step + 1,
            params=params,
            fp8=fp8,
            other=other,
            opt_state=opt_state,
            ema=ema,
            skips=skips,
            total_skips=state.total_skips + (~finite).astype(jnp.int32),
        )
        out = {k: v for k, v in metrics.items()}
        out.update(
            loss=loss,
            grad_norm=grad_norm,
            lr=schedule(state.step),
            skipped=(~finite).astype(jnp.int32),
            consecutive_skips=skips,
        )
        return new_state, out

    return train_step


def _is_count(m: jax.Array) -> bool:
    return jnp.issubdtype(m.dtype, jnp.integer)


def jit_train_step(train_step, shardings: TrainState, batch: Any, mesh: Mesh, rules: ShardingRules = ShardingRules()):
    """Compile once with explicit in/out shardings; the state argument is donated.

    Trace and compile it under ``mesh_context(mesh, rules)``: the models' activation
    constraints read the rules and the mesh from there."""
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch_shardings(mesh, batch, rules)),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=(0,),
    )
