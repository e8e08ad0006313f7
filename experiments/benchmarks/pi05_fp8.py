"""π0.5 with FP8 matmuls (``fp8=flax``) vs bfloat16 and float32: step time and loss after N steps.

``python -m experiments.benchmarks.pi05_fp8 [--experiment pi05_tiny|pi05_bench] [--steps 20]``

Every variant is the named experiment with only the model's ``dtype``/``fp8`` changed, built by
the trainer (``train.loop.build``: FP8 amax histories and scales are ``Fp8Meta`` state, kept
out of the optimizer and clipping) from the same seed and trained on the same synthetic batches
in one process. Printed per variant: median step seconds (after one compile step), the mean
training loss over the last quarter of the steps, and each ratio against bfloat16. On a CPU
FP8 is emulated (quantise/dequantise around float matmuls), so only the loss tracking means
anything there; the speed-up needs FP8 tensor cores (H100/H200).
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Literal

import jax
import numpy as np

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness

VARIANTS = {
    "float32": dict(dtype="float32", fp8="none"),
    "bfloat16": dict(dtype="bfloat16", fp8="none"),
    "fp8 (flax)": dict(dtype="bfloat16", fp8="flax"),
    # Transformer Engine's FP8 matmuls; without a GPU and TE the model falls back to fp8="flax"
    # (logged), so this row then measures Flax's FP8 again.
    "fp8 (te)": dict(dtype="bfloat16", fp8="te"),
}


def run(config, steps: int, num_batches: int = 4) -> tuple[float, list[float]]:
    """(median step seconds excluding the compile step, training losses)."""
    from embodied_jax.parallel.sharding import global_batch
    from embodied_jax.train.loop import build, initial_state

    rt = build(config)
    batches = [config.model.synthetic_batch(config.train.batch_size, seed=i) for i in range(num_batches)]
    losses, times = [], []
    with rt.context():
        state = initial_state(rt)
        device_batches = [global_batch(b, rt.mesh, rt.rules) for b in batches]
        step = rt.step_function(device_batches[0])
        for i in range(steps):
            t = time.perf_counter()
            state, metrics = step(state, device_batches[i % num_batches])
            losses.append(float(jax.device_get(metrics["loss"])))
            if i:
                times.append(time.perf_counter() - t)
    return statistics.median(times), losses


@dataclasses.dataclass(frozen=True)
class Flags:
    """pi05_fp8's command line."""

    experiment: Literal["pi05_tiny", "pi05_bench", "pi05"] = "pi05_tiny"
    steps: int = 20
    batch: int | None = None
    """default: the experiment's batch size"""


def main(argv=None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.pi05_fp8", description=__doc__.split("\n")[0]
    )

    from embodied_jax.parallel.mesh import MeshConfig
    from embodied_jax.train.config import CheckpointConfig, MetricsConfig
    from experiments.registry import get

    base = get(args.experiment)
    train = dataclasses.replace(base.train, steps=args.steps, batch_size=args.batch or base.train.batch_size)
    base = dataclasses.replace(
        base,
        train=train,
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(enabled=False),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
    )
    tail = max(1, args.steps // 4)
    results = {}
    for name, fields in VARIANTS.items():
        config = dataclasses.replace(base, model=dataclasses.replace(base.model, **fields))
        seconds, losses = run(config, args.steps)
        results[name] = (seconds, float(np.mean(losses[-tail:])), losses)
        print(
            f"{name:>10}: {seconds * 1e3:8.1f} ms/step, loss over the last {tail} of {args.steps} steps "
            f"{results[name][1]:.4f} (first {losses[0]:.4f})",
            flush=True,
        )
    ref_s, ref_loss, _ = results["bfloat16"]
    for name in ("fp8 (flax)", "fp8 (te)", "float32"):
        seconds, loss, _ = results[name]
        print(
            f"{name} vs bfloat16: step time x{seconds / ref_s:.2f}, loss x{loss / ref_loss:.3f} "
            f"({jax.default_backend()}, {args.experiment}, batch {train.batch_size})"
        )
    return results


if __name__ == "__main__":
    sys.exit(harness.run(main, "pi05_fp8"))  # --record: the result appended to results/pi05_fp8.jsonl
