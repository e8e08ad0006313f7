"""``python -m experiments.benchmarks.train_step NAME [--overrides]``: time a train step.

Builds the named experiment exactly as the launcher would, feeds synthetic batches of
its exact shapes, runs ``--warmup`` then ``--steps`` timed steps and prints one JSON
line: median step seconds, examples/s, tokens/s, compile seconds, peak host and
device memory, and on GPU the model FLOPs utilisation (from the model config's
``flops_per_example`` when it has one, else XLA's cost analysis of the step).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

# Peak dense bf16 FLOP/s per device, for MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_device_bytes() -> int | None:
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    bench, rest = parser.parse_known_args(argv)

    from embodied_jax.parallel import distributed
    from embodied_jax.parallel.sharding import global_batch
    from embodied_jax.train.dry_run import peak_host_bytes
    from embodied_jax.train.loop import build, initial_state
    from experiments.launch import parse

    config = parse(rest)
    distributed.initialize(config.distributed)
    rt = build(config)
    cfg = config.train
    batches = [config.model.synthetic_batch(cfg.batch_size, seed=i) for i in range(2)]
    tokens = float(np.sum(batches[0]["token_mask"])) if "token_mask" in batches[0] else 0.0
    with rt.context():
        state = initial_state(rt)
        device_batches = [global_batch(b, rt.mesh, rt.rules) for b in batches]
        step = rt.step_function(device_batches[0])
        t0 = time.perf_counter()
        compiled = step.lower(state, device_batches[0]).compile()
        compile_s = time.perf_counter() - t0
        for i in range(bench.warmup):
            state, metrics = compiled(state, device_batches[i % 2])
        jax.block_until_ready(metrics)
        times = []
        for i in range(bench.steps):
            t = time.perf_counter()
            state, metrics = compiled(state, device_batches[i % 2])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
    median = statistics.median(times)
    result = {
        "experiment": config.name,
        "backend": jax.default_backend(),
        "devices": jax.device_count(),
        "batch_size": cfg.batch_size,
        "median_step_s": median,
        "examples_per_s": cfg.batch_size / median,
        "tokens_per_s": tokens / median if tokens else None,
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "peak_host_bytes": peak_host_bytes(),
        "peak_device_bytes": peak_device_bytes() if jax.default_backend() != "cpu" else None,
    }
    if jax.default_backend() == "gpu":
        flops_fn = getattr(config.model, "flops_per_example", None)
        if flops_fn is not None:
            flops = 3.0 * flops_fn() * cfg.batch_size  # forward + backward
        else:
            analysis = compiled.cost_analysis()
            analysis = analysis[0] if isinstance(analysis, list) else analysis
            flops = float(analysis.get("flops", 0.0)) * jax.device_count()
        kind = jax.devices()[0].device_kind
        peak = next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
        result["mfu"] = flops / median / (peak * jax.device_count()) if peak else None
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
