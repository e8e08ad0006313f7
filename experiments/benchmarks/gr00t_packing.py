"""GR00T: packed segment-id VL attention vs padded baselines, and FP8 vs bf16 (examples/s in one run).

``python -m experiments.benchmarks.gr00t_packing [--batch 8] [--steps 3] [--fp8]``

Workload: the ``gr00t_bench`` model (all parameters trained: loss + gradients of every
parameter) on the standard prompt mix: task text log-normal with median 12 and 95th
percentile 40 tokens, plus the Eagle chat template (``TEMPLATE_TOKENS``) and the 258-token
image block. Three layouts of the same samples:

- ``padded_longest``: each batch padded to its longest prompt (LeRobot's processor); the
  length is rounded up to a multiple of 16 to bound recompiles (compiles are not timed);
- ``padded_512``: every prompt padded to 512 tokens;
- ``packed_<L>``: prompts laid end to end in rows of L tokens with segment ids (``--row-lens``;
  ``auto`` = one row per batch, the smallest multiple of 64 holding every batch).

Each line prints the measured speed-up over a baseline beside its ideal ratio (padded VL
token work / real VL token work). On a CPU the xla attention backend computes a packed
row's full dense score matrix, so long rows pay attention work across segments; on a GPU
the cuDNN varlen path skips it. ``--fp8`` adds FP8 (``fp8="flax"``) vs bf16 on the packed
layout; on a CPU FP8 is emulated (slower), the ratio matters on Hopper GPUs.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time

import jax
import numpy as np
from flax import nnx

from embodied_jax.models.gr00t_inputs import pack_batch
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context
from experiments.gr00t import BENCH_MODEL

TEMPLATE_TOKENS = 26  # Eagle system/user/assistant template + "<image 1>" with a Qwen3 tokenizer
MAX_LEN = 512


def standard_mix(rng, n: int) -> np.ndarray:
    """Task-text lengths: log-normal, median 12, 95th percentile 40 tokens (at least 1)."""
    sigma = (math.log(40) - math.log(12)) / 1.6449
    return np.maximum(1, np.round(rng.lognormal(math.log(12), sigma, n))).astype(int)


def make_batch(cfg, rng, batch: int, length: int) -> dict:
    """Samples of the standard mix, right-padded to ``length`` tokens (image block after the template head)."""
    base = cfg.synthetic_batch(batch, seed=int(rng.integers(1 << 30)))
    text = standard_mix(rng, batch)
    tokens = np.zeros((batch, length), np.int32)
    mask = np.zeros((batch, length), bool)
    for i, n in enumerate(text):
        head = TEMPLATE_TOKENS - 5
        row = np.concatenate([rng.integers(0, cfg.image_token_id, head), [1],
                              np.full(cfg.image_tokens, cfg.image_token_id), [2],
                              rng.integers(0, cfg.image_token_id, n + 5)])
        tokens[i, : len(row)] = row[:length]
        mask[i, : len(row)] = True
    base.update(tokens=tokens, token_mask=mask)
    return base


def _step_fn():
    @nnx.jit
    def step(model, batch):
        return nnx.value_and_grad(lambda m: m.loss(batch, jax.random.key(0))[0])(model)
    return step


def _time(step, model, batches) -> float:
    """Examples per second over ``batches`` (each shape compiled once, before timing)."""
    for b in batches:
        jax.block_until_ready(step(model, b))  # compile every distinct shape (cached afterwards)
    t0 = time.perf_counter()
    for b in batches:
        jax.block_until_ready(step(model, b))
    seconds = time.perf_counter() - t0
    return sum(len(b["embodiment_id"]) for b in batches) / seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--row-lens", default="1024,auto", help="comma-separated packed row lengths or 'auto'")
    parser.add_argument("--fp8", action="store_true")
    args = parser.parse_args(argv)

    cfg = dataclasses.replace(BENCH_MODEL, max_token_len=MAX_LEN, tune_visual=True, tune_llm=True,
                              dit_dropout=0.0, vl_dropout=0.0)
    rng = np.random.default_rng(0)
    samples = [make_batch(cfg, rng, args.batch, MAX_LEN) for _ in range(args.steps)]
    real = [int(b["token_mask"].sum()) for b in samples]
    longest = [int(math.ceil(b["token_mask"].sum(1).max() / 16) * 16) for b in samples]
    layouts = {
        "padded_512": samples,
        "padded_longest": [dict(b, tokens=b["tokens"][:, :n], token_mask=b["token_mask"][:, :n])
                           for b, n in zip(samples, longest)],
    }
    work = {"padded_512": args.batch * MAX_LEN, "padded_longest": args.batch * float(np.mean(longest))}
    for spec in args.row_lens.split(","):
        row_len = int(math.ceil(max(real) / 64) * 64) if spec == "auto" else int(spec)
        rows = max(len(set(pack_batch(b, row_len)["sample_row"].tolist())) for b in samples)
        name = f"packed_{row_len}"
        layouts[name] = [pack_batch(b, row_len, num_rows=rows) for b in samples]
        work[name] = rows * row_len
    mesh = make_mesh(MeshConfig(data=1), devices=jax.devices()[:1])
    with mesh_context(mesh):
        model = nnx.jit(lambda: cfg.make(nnx.Rngs(0)))()
        step = _step_fn()
        speed = {name: _time(step, model, batches) for name, batches in layouts.items()}
    real_work = float(np.mean(real))
    print(f"gr00t_bench packing: batch {args.batch}, {args.steps} timed steps, real VL tokens/sample "
          f"{real_work / args.batch:.1f}")
    for name, eps in speed.items():
        print(f"  {name:15s} {eps:8.2f} examples/s   VL token slots {work[name]:8.0f}")
    packed_names = [n for n in speed if n.startswith("packed")]
    for packed in packed_names:
        for base in ("padded_longest", "padded_512"):
            print(f"  {packed} / {base:15s} measured {speed[packed] / speed[base]:5.2f}x   "
                  f"ideal {work[base] / real_work:5.2f}x (padded work / real work)")

    if args.fp8:
        results = {}
        for mode, overrides in (("bf16", dict(compute_dtype="bfloat16")),
                                ("fp8", dict(compute_dtype="bfloat16", fp8="flax"))):
            mcfg = dataclasses.replace(cfg, **overrides)
            with mesh_context(mesh):
                m = nnx.jit(lambda mcfg=mcfg: mcfg.make(nnx.Rngs(0)))()
                results[mode] = _time(_step_fn(), m, layouts[packed_names[0]])
        print(f"  fp8 / bf16 measured {results['fp8'] / results['bf16']:5.2f}x on {jax.default_backend()} "
              f"(bf16 {results['bf16']:.2f}, fp8 {results['fp8']:.2f} examples/s)")


if __name__ == "__main__":
    main()
