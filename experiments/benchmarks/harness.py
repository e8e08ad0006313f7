"""What the benchmarks share: compiling a run's train step for given batches, timing variants in
alternation in one process, and recording results as data.

- ``compile_train_step(rt, state, batches)``: the batches placed on the run's mesh and its train
  step compiled for their shape (one real compile, timed).
- ``alternate(steps, rounds=, warmup=)``: each variant's ``step()`` in turn, round after round, so
  a change of the machine's load (single runs move by about ±20% on a shared 2-core CPU) hits
  every variant alike; the wall and process-CPU seconds of each timed call.
- ``run(main, benchmark)``: a benchmark's command line (``run_main``'s conventions); with
  ``--record`` its result (what ``main`` returns) is appended as one JSON line, with the commit,
  the date, the machine (CPU model, cores, backend, measured float32 matmul rate) and the command,
  to ``experiments/benchmarks/results/<benchmark>.jsonl``. Tests call ``main`` and never record.
  ``python -m experiments.benchmarks.report`` turns those files into ``docs/performance.md``'s
  recorded tables.
"""

from __future__ import annotations

import os
import pathlib
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from embodied_jax import records

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / records.RESULTS
_RECORD_ENV = "EMBODIED_JAX_BENCHMARK_RECORD"  # survives the command line's one re-exec (host_malloc)


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


def machine(matmul_rate: bool = True) -> dict[str, Any]:
    """The machine a result was measured on; ``matmul_rate``: also time this machine's float32 matmuls."""
    out = records.machine()
    if matmul_rate:
        out["matmul_gflops"] = round(matmul_flops_per_s() / 1e9, 1)
    return out


def matmul_flops_per_s(repeats: int = 7) -> float:
    """This machine's float32 matmul rate: median of ``repeats`` jitted 3464x512 @ 512x2048 matmuls."""
    from experiments.benchmarks.matmul_floor import plain_matmul, time_dot

    reference = plain_matmul(3464, 512, 2048)
    return reference.flops / time_dot(reference, repeats)


def _commit() -> str | None:
    return records.commit(ROOT, RESULTS)


def record(benchmark: str, result: Any, command: list[str], results: pathlib.Path = RESULTS) -> pathlib.Path:
    """Append ``result`` (JSON-serialisable) as one line of ``<results>/<benchmark>.jsonl``, with the
    commit (``-dirty`` and ``"clean": false`` when the tree had uncommitted changes)."""
    command = f"python -m experiments.benchmarks.{benchmark} {shlex.join(command)}".rstrip()
    row = records.row(benchmark, root=ROOT, command=command, result=result, extra={"machine": machine()})
    path = records.append(row, results)
    return path


def run(main: Callable[[list[str]], Any], benchmark: str, *, reexec: bool = True) -> int:
    """The benchmark's command line: ``main(argv)`` under ``cli.run_main``; ``--record`` appends its result.
    ``reexec=False``: no restart with the training malloc settings (a server keeps the serving ones)."""
    from embodied_jax.cli import run_main

    if "--record" in sys.argv:
        sys.argv.remove("--record")
        os.environ[_RECORD_ENV] = "1"
    command = list(sys.argv[1:])
    results = []
    status = run_main(lambda argv: results.append(main(argv)), None if reexec else command)
    if status == 0 and os.environ.get(_RECORD_ENV) == "1":
        if not results or results[-1] is None:
            print(f"error: {benchmark} returns no result to record", file=sys.stderr)
            return 2
        print(f"recorded: {record(benchmark, results[-1], [a for a in command if a != '--verbose'])}")
    return status
