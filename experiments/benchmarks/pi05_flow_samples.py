"""π0.5 prefix reuse: ``flow_samples_per_obs`` K=1 vs K=4 (examples/s and loss after N steps).

``python -m experiments.benchmarks.pi05_flow_samples [--model bench|tiny] [--steps 5] [--batch 4]``

Both runs train the same model from the same initialisation on the same synthetic batches
(AdamW); with K=4 every observation's prefix (SigLIP + VLM) runs once and four (noise, time)
draws of the action suffix attend its cached keys/values. Printed: observations/s of each, their
ratio, and the loss after N steps on a held-out batch with fixed noise and time (K=1 evaluation),
so the extra draws' effect on sample efficiency is visible beside their cost.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Literal

import jax
import numpy as np
import optax
from flax import nnx

from embodied_jax.cli import parse_flags
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context
from experiments.benchmarks import harness
from experiments.pi05 import bench_model, tiny_model


def make_step(model, lr=1e-4):
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch, rng):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(batch, rng)[0])(model)
        optimizer.update(model, grads)
        return loss

    return optimizer, step


def held_out_loss(model, config, batch, noise, time_) -> float:
    """Loss of the trained parameters under a K=1 config with fixed noise and time."""
    _, state = nnx.split(model)
    evaluator = nnx.eval_shape(lambda: dataclasses.replace(config, flow_samples_per_obs=1).make(nnx.Rngs(0)))
    nnx.update(evaluator, state)
    return float(nnx.jit(lambda m: m.loss(batch, jax.random.key(0), noise=noise, time=time_)[0])(evaluator))


def run(config, batches, held_out, steps, mesh):
    with mesh_context(mesh):
        model = nnx.jit(lambda: config.make(nnx.Rngs(0)))()
        optimizer, step = make_step(model, lr=3e-4)
        jax.block_until_ready(step(model, optimizer, batches[0], jax.random.key(0)))  # compile
        t0 = time.perf_counter()
        for i in range(1, steps):
            jax.block_until_ready(step(model, optimizer, batches[i % len(batches)], jax.random.key(i)))
        seconds = time.perf_counter() - t0
        loss = held_out_loss(model, config, *held_out)
    examples = (steps - 1) * batches[0]["tokens"].shape[0]
    return examples / seconds, loss


@dataclasses.dataclass(frozen=True)
class Flags:
    """pi05_flow_samples's command line."""

    model: Literal["bench", "tiny"] = "bench"
    steps: int = 5
    """training steps (the first compiles, untimed)"""
    batch: int = 4
    draws: int = 4


def main(argv=None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.pi05_flow_samples", description=__doc__.split("\n")[0]
    )
    base = bench_model() if args.model == "bench" else tiny_model()
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    batches = [base.synthetic_batch(args.batch, seed=i) for i in range(4)]
    held = base.synthetic_batch(args.batch, seed=1000)
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((args.batch, base.action_horizon, base.max_action_dim)).astype(np.float32)
    time_ = rng.uniform(0.001, 1.0, (args.batch,)).astype(np.float32)
    results = {}
    for k in (1, args.draws):
        config = dataclasses.replace(base, flow_samples_per_obs=k)
        results[k] = run(config, batches, (held, noise, time_), args.steps, mesh)
        print(f"K={k}: {results[k][0]:.3f} observations/s, held-out loss after {args.steps} steps {results[k][1]:.4f}")
    (eps1, loss1), (epsk, lossk) = results[1], results[args.draws]
    print(
        f"K={args.draws} vs K=1: {epsk / eps1:.2f}x observations/s (without prefix reuse at most "
        f"{1 / args.draws:.2f}x), held-out loss {lossk:.4f} vs {loss1:.4f}"
    )
    return {f"K={k}": {"observations_per_s": r[0], "held_out_loss": r[1]} for k, r in results.items()}


if __name__ == "__main__":
    sys.exit(harness.run(main, "pi05_flow_samples"))  # --record: the result appended to results/pi05_flow_samples.jsonl
