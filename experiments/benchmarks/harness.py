"""What the benchmarks share: compiling a run's train step for given batches, and timing variants
in alternation in one process.

- ``compile_train_step(rt, state, batches)``: the batches placed on the run's mesh and its train
  step compiled for their shape (one real compile, timed).
- ``alternate(steps, rounds=, warmup=)``: each variant's ``step()`` in turn, round after round, so
  a change of the machine's load (single runs move by about ±20% on a shared 2-core CPU) hits
  every variant alike; the wall and process-CPU seconds of each timed call.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def compile_train_step(rt: Any, state: Any, batches: list) -> tuple[Any, list, float]:
    """(compiled step, the batches on the mesh, seconds to compile) for batches of one shape."""
    from embodied_jax.parallel.sharding import global_batch

    device = [global_batch(b, rt.mesh, rt.rules) for b in batches]
    t0 = time.perf_counter()
    compiled = rt.step_function(device[0]).lower(state, device[0]).compile()
    return compiled, device, time.perf_counter() - t0


def alternate(steps: dict[str, Callable[[], Any]], *, rounds: int, warmup: int = 1) -> dict[str, dict[str, list]]:
    """``{name: {"wall": [s, ...], "cpu": [s, ...]}}``: every ``step()`` (which returns what to wait
    for) called once per round, in order, ``warmup`` untimed rounds first."""
    times = {name: {"wall": [], "cpu": []} for name in steps}
    for round_ in range(warmup + rounds):
        for name, step in steps.items():
            wall, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(step())
            if round_ >= warmup:
                times[name]["wall"].append(time.perf_counter() - wall)
                times[name]["cpu"].append(time.process_time() - cpu)
    return times
