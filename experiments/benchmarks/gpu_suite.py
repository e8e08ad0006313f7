"""``python -m experiments.benchmarks.gpu_suite [--rehearse] [--record]``: every GPU check in one process.

Meant for a first run on one GPU (an H200): it measures, section by section, what has only ever
run on a CPU, and a failing section is reported and the next one still runs (exit status 1 if any
failed). ``--rehearse`` runs the very same code paths on a CPU with the tiny variants and one step
each, which is what CI does (``tests/test_benchmarks.py``), so that the GPU run measures rather
than debugs. Sections (``--sections``):

- ``gpu_tests``: the ``@pytest.mark.gpu`` tests (in a child pytest; on a CPU they skip);
- ``train_steps``: full-size π0.5 and GR00T-N1.5 train steps (``train_step``: step time,
  examples/s, MFU against the device's peak), ``--train-overrides`` passed on (depth or batch);
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
import pathlib
import re
import subprocess
import sys
import time
import traceback
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
    """launcher overrides for both full-size train steps (e.g. a smaller --train.batch-size)"""


def _gpu_tests(rehearse: bool) -> dict:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py") if "mark.gpu" in p.read_text())
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:randomly", "-p", "no:cacheprovider", *files]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error)", summary)}
    if done.returncode not in (0, 5) or counts.get("failed") or counts.get("error"):  # 5: nothing collected
        raise RuntimeError(f"gpu tests: {summary or done.stderr.strip()[-500:]}")
    return {"files": files, **counts}


def _train_steps(flags: Flags) -> dict:
    from experiments.benchmarks import train_step

    names = ("pi05_tiny", "gr00t_tiny") if flags.rehearse else ("pi05", "gr00t_n15")
    steps = ["--steps", "1", "--warmup", "1"] if flags.rehearse else ["--steps", str(flags.steps), "--warmup", "2"]
    keep = ("median_step_s", "examples_per_s", "mfu", "compile_s", "peak_device_bytes", "batch_size")
    out = {}
    for name in names:
        result = train_step.main([name, *steps, *flags.train_overrides])
        out[name] = {k: result.get(k) for k in keep}
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
