"""π0.5: packed rows with segment-id attention vs upstream's padded layout (examples/s in one run).

``python -m experiments.benchmarks.pi05_packing [--batch 4] [--steps 3] [--row-tokens 320]``

Workload: the ``pi05_bench`` model trained (loss + gradients of every parameter + AdamW) on the
standard mix: task text log-normal (median 12, 95th percentile 40 tokens) plus the prompt
template and the discretised state as upstream tokenises it (32 padded state dims; Gemma's
tokenizer splits digits, so a bin costs one separator plus one token per digit), capped at 200;
2 of 3 camera slots filled.

- ``padded`` (upstream): one sample per row, 3 camera slots (the empty one still runs SigLIP and
  sits in the sequence as padding), prompt padded to 200 tokens.
- ``packed``: rows of up to 2 samples with 4 camera slots and ``--row-tokens`` prompt tokens,
  greedily filled (``pi05_inputs.pack_rows``); samples are separated by segment ids.

The measured examples/s ratio is printed beside the ideal ratio: padded token work / packed
token work per example (vision patches + prompt + action tokens, padding included). On a CPU the
xla attention backend computes dense masks, so padding inside a row still costs attention work
there; the fused GPU backends skip it.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np
import optax
from flax import nnx

from embodied_jax.models.pi05_inputs import pack_rows, stack_rows
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context
from experiments.pi05 import bench_model

MAX_PROMPT = 200
TEMPLATE_TOKENS = 10  # BOS + "Task: " + ", State: " + ";\nAction: " with PaliGemma's tokenizer


def task_lengths(rng, n: int) -> np.ndarray:
    """Log-normal task-text lengths: median 12, 95th percentile 40 tokens (at least 1)."""
    sigma = np.log(40 / 12) / 1.6449
    return np.maximum(1, np.round(np.exp(np.log(12) + sigma * rng.standard_normal(n)))).astype(int)


def state_tokens(rng, real_dims: int = 14, padded_dims: int = 32) -> int:
    """Tokens of the discretised state string: padded dims are bin 128 (zero state)."""
    bins = np.concatenate([rng.integers(0, 256, real_dims), np.full(padded_dims - real_dims, 128)])
    return int(sum(1 + len(str(b)) for b in bins))


def make_samples(config, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    size = config.vision.image_size
    samples = []
    for length in task_lengths(rng, n):
        real = min(MAX_PROMPT, TEMPLATE_TOKENS + int(length) + state_tokens(rng))
        tokens = np.zeros((MAX_PROMPT,), np.int32)
        tokens[:real] = rng.integers(1, config.vocab_size, real)
        samples.append({
            "images": {c: rng.uniform(-1, 1, (size, size, 3)).astype(np.float32) for c in ("base", "left", "right")},
            "image_masks": {"base": np.bool_(True), "left": np.bool_(True), "right": np.bool_(False)},
            "tokens": tokens,
            "token_mask": np.arange(MAX_PROMPT) < real,
            "actions": rng.standard_normal((config.action_horizon, config.max_action_dim)).astype(np.float32),
        })
    return samples


def make_step(model, lr=1e-4):
    optimizer = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch, rng):
        loss, grads = nnx.value_and_grad(lambda m: m.loss(batch, rng)[0])(model)
        optimizer.update(model, grads)
        return loss

    return optimizer, step


def time_layout(config, batches, examples_per_batch, steps, mesh) -> float:
    """Examples/s over ``steps`` timed steps (after one compile step)."""
    with mesh_context(mesh):
        model = nnx.jit(lambda: config.make(nnx.Rngs(0)))()
        optimizer, step = make_step(model)
        jax.block_until_ready(step(model, optimizer, batches[0], jax.random.key(0)))
        t0 = time.perf_counter()
        done = 0
        for i in range(steps):
            b = batches[(i + 1) % len(batches)]
            jax.block_until_ready(step(model, optimizer, b, jax.random.key(i + 1)))
            done += examples_per_batch[(i + 1) % len(batches)]
        return done / (time.perf_counter() - t0)


def tokens_per_row(config) -> int:
    return len(config.camera_names) * config.vision.num_patches + config.max_token_len \
        + config.samples_per_row * config.action_horizon


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="examples per padded batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--row-tokens", type=int, default=320)
    args = parser.parse_args(argv)

    base = bench_model()
    padded_cfg = dataclasses.replace(base, camera_names=("base", "left", "right"), max_token_len=MAX_PROMPT)
    packed_cfg = dataclasses.replace(base, camera_names=("s0", "s1", "s2", "s3"), max_token_len=args.row_tokens,
                                     samples_per_row=2)
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    n = args.batch * (args.steps + 1)
    samples = make_samples(base, n, seed=0)
    real_prompt = float(np.mean([s["token_mask"].sum() for s in samples]))

    padded_batches = [stack_rows(samples[i:i + args.batch]) for i in range(0, n, args.batch)]
    rows = pack_rows(samples, camera_slots=packed_cfg.camera_names, max_token_len=args.row_tokens, samples_per_row=2)
    rows_per_batch = max(1, args.batch // 2)
    groups = [rows[i:i + rows_per_batch] for i in range(0, len(rows) - rows_per_batch + 1, rows_per_batch)]
    packed_batches = [stack_rows(g) for g in groups]
    packed_examples = [int((b["token_segment_ids"].max(axis=1)).sum()) for b in packed_batches]

    padded_work = tokens_per_row(padded_cfg)
    packed_work = tokens_per_row(packed_cfg) * len(rows) / len(samples)
    real_work = 2 * base.vision.num_patches + real_prompt + base.action_horizon
    print(f"mix: {len(samples)} samples, mean prompt {real_prompt:.1f} tokens, {len(samples) / len(rows):.2f} "
          f"samples per packed row")
    print(f"tokens per example: padded {padded_work}, packed {packed_work:.1f}, real {real_work:.1f}")

    padded_eps = time_layout(padded_cfg, padded_batches, [args.batch] * len(padded_batches), args.steps, mesh)
    packed_eps = time_layout(packed_cfg, packed_batches, packed_examples, args.steps, mesh)
    print(f"padded: {padded_eps:.3f} examples/s   packed: {packed_eps:.3f} examples/s")
    print(f"packed/padded measured {packed_eps / padded_eps:.2f}x   ideal {padded_work / packed_work:.2f}x "
          f"(upper bound padded/real {padded_work / real_work:.2f}x)")


if __name__ == "__main__":
    main()
