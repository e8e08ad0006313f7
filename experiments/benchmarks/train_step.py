"""``python -m experiments.benchmarks.train_step NAME [--overrides]``: time a train step.

Builds the named experiment exactly as the launcher would, feeds synthetic batches of
its exact shapes, runs ``--warmup`` then ``--steps`` timed steps and prints one JSON
line: median step seconds, examples/s, tokens/s, compile seconds, peak host and
device memory, and the arithmetic:

- ``analytic_flops``: the model's weight-matmul training FLOPs of the step
  (``config.training_flops``; the convention of LeRobot's counted 2.54e11 for
  ``pi05_bench``), ``analytic_attention_flops`` beside it;
- ``xla_flops``: matmul FLOPs of the compiled step counted from its HLO with every loop
  body times its trip count (XLA's own cost analysis counts a loop body once; its figure
  is ``xla_cost_analysis_flops``), and its ratio to the analytic count with attention
  (``xla_vs_analytic_needed``: without ``analytic_unused_flops``, work whose result nothing
  reads, which XLA removes when it sees it);
- ``matmul_flops_per_s``: median of 7 jitted 3464x512 @ 512x2048 float32 matmuls in this
  process (measured before and after the steps; the higher median counts), and
  ``limit_fraction`` = analytic_flops / median step / that rate;
- on GPU, the model FLOPs utilisation against the device's peak;
- with ``--matmul-floor``: ``matmul_floor_s``, the step's matmuls each compiled and timed
  alone, summed over their executions (``matmul_floor.py``), and ``step_over_matmul_floor``;
- ``host_malloc``: ``reuse`` when the step ran with ``embodied_jax.host_malloc``'s settings
  (the command restarts itself with them; ``EMBODIED_JAX_MALLOC=system`` keeps glibc's default).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np

from embodied_jax import host_malloc
from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness

# Peak dense bf16 FLOP/s per device, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_device_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def step_arithmetic(model_config, batch, compiled, median_s: float, rate: float) -> dict:
    """Analytic and XLA-counted FLOPs of a compiled step and the fraction of the matmul limit reached."""
    from embodied_jax.parallel.hlo import dot_flops

    analytic = model_config.training_flops(batch)
    xla = dot_flops(compiled.as_text()) * jax.device_count()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    total = analytic["weights"] + analytic["attention"]
    return {
        "analytic_flops": analytic["weights"],
        "analytic_attention_flops": analytic["attention"],
        "xla_flops": xla,
        "xla_cost_analysis_flops": float(analysis.get("flops", 0.0)) * jax.device_count(),
        "xla_vs_analytic_with_attention": xla / total if total else None,
        # work whose result nothing reads (π0.5: the prefix's last-layer o_proj and MLP)
        "analytic_unused_flops": analytic.get("unused", 0.0),
        "xla_vs_analytic_needed": xla / (total - analytic.get("unused", 0.0)) if total else None,
        "matmul_flops_per_s": rate,
        "limit_fraction": analytic["weights"] / median_s / rate,
    }


@dataclasses.dataclass
class CompiledStep:
    """An experiment's train step as the launcher builds it, compiled for synthetic batches."""

    runtime: Any
    step: Any  # the compiled step: (state, batch) -> (state, metrics)
    state: Any
    host_batches: list  # NumPy batches of the model's exact shapes (seeds 0, 1, ...)
    batches: list  # the same on the mesh
    compile_s: float


def compile_step(config, num_batches: int = 2) -> CompiledStep:
    """Build the run of ``config`` (an ``ExperimentConfig``) as the launcher does and compile
    its train step for ``num_batches`` synthetic batches of the step's shapes."""
    from embodied_jax.train.runtime import build, initial_state

    rt = build(config)
    host = [config.model.synthetic_batch(config.train.batch_size, seed=i) for i in range(num_batches)]
    with rt.context():
        state = initial_state(rt)
        compiled, batches, compile_s = harness.compile_train_step(rt, state, host)
    return CompiledStep(rt, compiled, state, host, batches, compile_s)


@dataclasses.dataclass(frozen=True)
class Flags:
    """train_step's own flags; the rest of the command line (NAME and overrides) goes to the launcher."""

    warmup: int = 2
    steps: int = 5
    profile: str | None = None
    """trace one step here and print the top ops"""
    matmul_floor: bool = False
    """also time each of the step's matmuls alone (matmul_floor.py)"""


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    # --help is the launcher's (NAME --help lists the experiment's overrides)
    bench, rest = parse_flags(Flags, args=argv, return_unknown_args=True, add_help=False)

    from embodied_jax.parallel import distributed
    from embodied_jax.train.dry_run import peak_host_bytes
    from experiments.launch import parse

    config = parse(rest)
    distributed.initialize(config.distributed)
    built = compile_step(config)
    rate_before = harness.matmul_flops_per_s()
    rt, compiled, state = built.runtime, built.step, built.state
    batches, device_batches, compile_s = built.host_batches, built.batches, built.compile_s
    train = config.train
    tokens = float(np.sum(batches[0]["token_mask"])) if "token_mask" in batches[0] else 0.0
    with rt.context():
        for i in range(bench.warmup):
            state, metrics = compiled(state, device_batches[i % 2])
        jax.block_until_ready(metrics)
        times = []
        for i in range(bench.steps):
            t = time.perf_counter()
            state, metrics = compiled(state, device_batches[i % 2])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        if bench.profile:
            from experiments.benchmarks.profile import report

            holder = {"state": state}

            def run():
                holder["state"], out = compiled(holder["state"], device_batches[0])
                return out

            report(config.name, run, compiled, bench.profile)
    median = statistics.median(times)
    result = {
        "experiment": config.name,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "host_malloc": host_malloc.mode(),  # "reuse": memory kept between steps (embodied_jax.host_malloc)
        "batch_size": train.batch_size,
        "median_step_s": median,
        "examples_per_s": train.batch_size / median,
        "tokens_per_s": tokens / median if tokens else None,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "peak_host_bytes": peak_host_bytes(),
        "peak_device_bytes": peak_device_bytes() if jax.default_backend() != "cpu" else None,
    }
    if config.model.training_flops(batches[0]) is not None:
        # the rate is measured before and after the steps; the higher one (the machine's best
        # demonstrated rate) makes the limit, so a noisy measurement never inflates the fraction
        rates = (rate_before, harness.matmul_flops_per_s())
        result.update(step_arithmetic(config.model, batches[0], compiled, median, max(rates)))
        result["matmul_flops_per_s_before_after"] = list(rates)
    if bench.matmul_floor:
        from experiments.benchmarks.matmul_floor import matmul_floor

        result.update(matmul_floor(compiled.as_text()))
        result["step_over_matmul_floor"] = median / result["matmul_floor_s"] if result["matmul_floor_s"] else None
    if jax.default_backend() == "gpu" and "analytic_flops" in result:
        kind = jax.devices()[0].device_kind
        peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
        flops = result["analytic_flops"] + result["analytic_attention_flops"]
        result["mfu"] = flops / median / (peak * jax.device_count()) if peak else None
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "train_step"))  # --record: the result appended to results/train_step.jsonl
