"""``python -m experiments.benchmarks.gpu_suite [--rehearse] [--record]``: every GPU check in one process.

Meant for a first run on one GPU (an H200): it measures, section by section, what has only ever
run on a CPU, and a failing section is reported and the next one still runs (exit status 1 if any
failed). ``--rehearse`` runs the very same code paths on a CPU with the tiny variants and one step
each, which is what CI does (``tests/test_benchmarks.py``), so that the GPU run measures rather
than debugs. Sections (``--sections``):

- ``gpu_tests``: the ``@pytest.mark.gpu`` tests (in a child pytest; on a CPU they skip);
- ``train_steps``: full-size π0.5 and GR00T-N1.5 train steps (``train_step``: step time,
  examples/s, MFU against the device's peak) at the largest per-device batch that fits
  (``batch_search``: XLA's memory analysis of the compiled step against the device's memory),
  ``--train-overrides`` passed on (a reduced depth; a ``--train.batch-size`` there skips the search);
- ``fp8``: π0.5 in float32, bfloat16, FP8 through Flax and through Transformer Engine
  (``pi05_fp8``; without TE the last falls back to Flax, logged);
- ``attention``: packed rows with the portable block-sparse attention against the Pallas kernel
  (``packing`` with ``--model.attention-impl``; where Pallas cannot run the dispatch falls back);
- ``serving``: request latency of both families' stand-in policies at their published sampling
  step counts (``serve_latency``; random weights, real shapes).

Prints each section's figures as it goes and one JSON line at the end (``--record`` appends it to
``results/gpu_suite.jsonl``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Literal

import jax

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness

SECTIONS = ("gpu_tests", "train_steps", "fp8", "attention", "serving")
Section = Literal["gpu_tests", "train_steps", "fp8", "attention", "serving"]
ROOT = pathlib.Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Flags:
    """gpu_suite's command line."""

    rehearse: bool = False
    """CPU, tiny variants, one step each: the same code paths, figures that mean nothing"""
    sections: tuple[Section, ...] = SECTIONS
    steps: int = 5
    """timed steps per train step and FP8 variant"""
    train_overrides: tuple[str, ...] = ()
    """launcher overrides for both full-size train steps (e.g. a reduced depth)"""
    max_batch: int | None = None
    """the largest per-device batch the search tries (default: 256 on a GPU, 4 with --rehearse)"""
    memory_gb: float | None = None
    """per-device memory the searched batch must fit (default: the device's own, the host's on a CPU)"""
    memory_fraction: float = 0.9
    """of that memory, what XLA's memory analysis of the step may take (the rest: workspaces, fragmentation)"""


def _gpu_tests(rehearse: bool) -> dict:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "-p", "no:cacheprovider", *files]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    if done.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):  # 5: nothing collected
        raise RuntimeError(f"gpu tests: {summary or done.stderr.strip()[-500:]}")
    return {"files": files, **counts}


def largest_batch(need: Callable[[int], int | None], budget: float, limit: int) -> tuple[int, list[int]]:
    """(the largest b in 1..limit with ``need(b) <= budget``, 0 if none; the batches probed in order),
    ``need(b)`` being the bytes a device needs at a per-device batch of b (None: XLA refused it,
    resource exhausted), growing with b. Doubling from 1 until a batch does not fit (or the limit),
    then bisection; once two batches fit, the next probe is where their bytes, extrapolated
    (memory is affine in the batch), meet the budget, and the one after it checks the batch above
    that guess: a step whose memory is affine takes four probes (1, 2, the guess, one more)."""
    lo, hi = 0, limit + 1  # the largest batch known to fit (0: none), the smallest known not to
    fitting: dict[int, int] = {}
    probed: list[int] = []
    guesses = 2  # the extrapolated probe and its check; then doubling or bisection only
    b = 1
    while True:
        probed.append(b)
        bytes_ = need(b)
        if bytes_ is not None and bytes_ <= budget:
            lo, fitting[b] = b, bytes_
        else:
            hi = b
        if hi - lo <= 1:
            return lo, probed
        b = 2 * lo if hi > limit else (lo + hi) // 2
        if len(fitting) >= 2 and guesses:
            (b1, m1), (b2, m2) = sorted(fitting.items())[-2:]
            if m2 > m1:
                b = int(b2 + (budget - m2) // ((m2 - m1) / (b2 - b1)))
            guesses -= 1
        b = min(max(b, lo + 1), hi - 1)


def _resource_exhausted(error: Exception) -> bool:
    return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def memory_budget(memory_gb: float | None, fraction: float) -> float:
    """Bytes of one device's memory the step may take: ``fraction`` of ``memory_gb``, else of the
    device's limit, else (a CPU) of the host's memory shared by its local devices."""
    if memory_gb is None:
        stats = jax.local_devices()[0].memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit is None:
            limit = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / jax.local_device_count()
    else:
        limit = memory_gb * 1e9
    return fraction * limit


def batch_search(argv: list[str], *, limit: int, budget: float) -> dict:
    """The largest per-device batch at which the train step of the launcher command ``argv`` fits
    ``budget`` bytes per device (``largest_batch``), each probe a compile of the step for abstract
    batches of that size (nothing is allocated) read by XLA's memory analysis."""
    from embodied_jax.parallel.sharding import batch_shardings, data_parallel_size
    from embodied_jax.train.dry_run import abstract_batch, device_bytes, memory_analysis
    from embodied_jax.train.runtime import build
    from experiments.launch import parse

    config = parse(argv)
    rt = build(config)
    rows = data_parallel_size(rt.mesh, rt.rules) * config.train.grad_accum_steps  # global rows per per-device row
    placed = lambda tree, shardings: jax.tree.map(  # noqa: E731
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
    state = placed(rt.abstract_state, rt.shardings)
    probes: dict[int, int | None] = {}

    def need(per_device: int) -> int | None:
        batch = abstract_batch(config.model, per_device * rows)
        batch = placed(batch, batch_shardings(rt.mesh, batch, rt.rules))
        try:
            with rt.context():
                compiled = rt.step_function(batch).lower(state, batch).compile()
            probes[per_device] = device_bytes(memory_analysis(compiled))
        except Exception as e:
            if not _resource_exhausted(e):
                raise
            probes[per_device] = None
        return probes[per_device]

    found, _ = largest_batch(need, budget, limit)
    return {
        "per_device_batch": found,
        "batch_size": found * rows,
        "budget_bytes": int(budget),
        "limit": limit,
        "probes": probes,  # per-device batch -> XLA's bytes per device (None: resource exhausted), in order
    }


def _train_steps(flags: Flags) -> dict:
    from experiments.benchmarks import train_step

    names = ("pi05_tiny", "gr00t_tiny") if flags.rehearse else ("pi05", "gr00t_n15")
    steps = ["--steps", "1", "--warmup", "1"] if flags.rehearse else ["--steps", str(flags.steps), "--warmup", "2"]
    keep = ("median_step_s", "examples_per_s", "mfu", "compile_s", "peak_device_bytes", "batch_size")
    search = not any(o.startswith(("--train.batch-size", "--train.batch_size")) for o in flags.train_overrides)
    limit = flags.max_batch or (4 if flags.rehearse else 256)
    budget = memory_budget(flags.memory_gb, flags.memory_fraction)
    out = {}
    for name in names:
        argv, cap = [name, *flags.train_overrides], limit
        if not search:
            result = train_step.main([*argv, *steps])
            out[name] = {k: result.get(k) for k in keep}
            continue
        for attempt in range(3):  # a batch XLA's analysis admits may still run out of memory: search below it
            found = batch_search(argv, limit=cap, budget=budget)
            print(
                f"{name}: largest batch that fits: {found['per_device_batch']} per device, {found['batch_size']} "
                f"in all (bytes per device at each batch tried: {found['probes']}; budget {found['budget_bytes']})",
                flush=True,
            )
            if not found["per_device_batch"]:
                raise RuntimeError(f"{name}: one example per device does not fit ({found}); reduce its depth")
            try:
                result = train_step.main([*argv, "--train.batch-size", str(found["batch_size"]), *steps])
                break
            except Exception as e:
                if attempt == 2 or not _resource_exhausted(e) or found["per_device_batch"] == 1:
                    raise
                cap = found["per_device_batch"] - 1
        out[name] = {k: result.get(k) for k in keep}
        out[name].update(per_device_batch=found["per_device_batch"], batch_search=found)
    return out


def _fp8(flags: Flags) -> dict:
    from experiments.benchmarks import pi05_fp8

    experiment = "pi05_tiny" if flags.rehearse else "pi05_bench"
    results = pi05_fp8.main(["--experiment", experiment, "--steps", "2" if flags.rehearse else str(4 * flags.steps)])
    return {name: {"step_s": seconds, "loss": loss} for name, (seconds, loss, _) in results.items()}


def _packed_rows(rows: int, length: int, samples: int, heads: int, kv_heads: int, head_dim: int, dtype):
    """Causal packed rows of ``samples`` equal segments each, random q/k/v: (q, k, v, ids, blocks, bounds)."""
    import jax.numpy as jnp
    import numpy as np

    from embodied_jax.nn.block_sparse import SegmentBounds

    per = length // samples
    seg = np.repeat(np.arange(1, samples + 1, dtype=np.int32), per)[None].repeat(rows, 0)
    blk = np.tile(np.arange(per, dtype=np.int32), samples)[None].repeat(rows, 0)
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal((rows, seg.shape[1], n, head_dim)), dtype) for n in (heads, kv_heads, kv_heads)
    )
    return q, k, v, jnp.asarray(seg), jnp.asarray(blk), SegmentBounds(samples, per, per)


def _attention(flags: Flags) -> dict:
    """Forward + backward of attention over packed causal rows: the portable block-sparse form, the
    Pallas kernel (GPU) and the dense-mask reference; an implementation that cannot run here is
    reported with its reason (the dispatch's own check), not timed."""
    import jax.numpy as jnp
    import numpy as np

    from embodied_jax.nn import attention as attn
    from embodied_jax.nn import pallas_attention

    shape = (1, 256, 4, 2, 2, 16, jnp.float32) if flags.rehearse else (8, 4096, 8, 8, 1, 128, jnp.bfloat16)
    q, k, v, seg, blk, bounds = _packed_rows(*shape)
    out, reference = {"rows x tokens": f"{shape[0]} x {shape[1]}"}, None
    for impl in ("xla", "blocksparse", "pallas"):
        reason = pallas_attention.unavailable_reason(q) if impl == "pallas" else None
        if reason:
            out[impl] = {"unavailable": reason}
            continue

        def loss(q, k, v, impl=impl):
            o = attn.attention(
                q,
                k,
                v,
                q_segment_ids=seg,
                kv_segment_ids=seg,
                q_block_ids=blk,
                kv_block_ids=blk,
                impl=impl,
                bounds=bounds,
            )
            return jnp.sum(o.astype(jnp.float32) ** 2)

        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        value, _ = jax.block_until_ready(step(q, k, v))  # compile
        times = harness.alternate({impl: lambda step=step: step(q, k, v)}, rounds=1 if flags.rehearse else 10, warmup=1)
        reference = float(value) if reference is None else reference
        out[impl] = {
            "fwd_bwd_ms": 1e3 * float(np.median(times[impl]["wall"])),
            "loss_vs_xla": float(value) / reference,  # 1 up to rounding: the same attention
        }
    return out


def _serving(flags: Flags) -> dict:
    from experiments.benchmarks import serve_latency

    models = ("pi05_tiny", "gr00t_tiny") if flags.rehearse else ("pi05", "gr00t_n15")
    load = ["--clients", "1", "--max-batch", "1", "--requests", "2"] if flags.rehearse else ["--clients", "1", "4"]
    rows = serve_latency.main(["--models", *models, *load])
    return {
        f"{r['policy']} b{r['max_batch']} c{r['clients']}": {k: r.get(k) for k in ("p50_ms", "p99_ms")} for r in rows
    }


RUNNERS = {
    "gpu_tests": lambda flags: _gpu_tests(flags.rehearse),
    "train_steps": _train_steps,
    "fp8": _fp8,
    "attention": _attention,
    "serving": _serving,
}


def main(argv: list[str] | None = None) -> dict:
    flags = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.gpu_suite", description=__doc__.splitlines()[0]
    )
    devices = jax.devices()
    result = {"backend": jax.default_backend(), "device_kind": devices[0].device_kind, "rehearse": flags.rehearse}
    failed = []
    for section in flags.sections:
        print(f"=== {section}", flush=True)
        t0 = time.perf_counter()
        try:
            result[section] = RUNNERS[section](flags)
        except Exception as e:  # one section's failure is reported; the next still runs
            traceback.print_exc()
            result[section] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            failed.append(section)
        result[section]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"=== {section}: {result[section]}", flush=True)
    result["failed"] = failed
    print(
        f"gpu_suite on {result['backend']} ({result['device_kind']}): {len(flags.sections) - len(failed)} of "
        f"{len(flags.sections)} sections ran" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    print(json.dumps(result, default=str))
    if failed:
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "gpu_suite"))  # --record: appended to results/gpu_suite.jsonl
