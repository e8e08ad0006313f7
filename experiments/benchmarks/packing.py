"""``python -m experiments.benchmarks.packing MODEL [--batch 8] [--steps 3] [--rounds 2] [--seq-len N] [overrides]``

Padded batches vs packed rows on a realistic multi-embodiment mixture, same samples per step,
timed in one process. MODEL is ``pi05_bench`` or ``gr00t_bench`` (any experiment of either
family; ``--overrides`` as for the launcher). The models get three camera slots.

The mixture (fixed ``--seed``): three embodiments drawn uniformly with 1, 2 or 3 cameras
(state of 8, 14 or 32 dims); instructions of 8-60 words (1.3 tokens per word); π0.5's
prompt carries the discretised state as text (one token per digit plus a separator per
dimension, as PaliGemma's tokenizer splits numbers). Token ids and pixels are random: the
cost of a step depends only on the shapes.

- padded (today's batching): ``--steps`` steps of ``--batch`` samples, prompts right-padded
  to ``max_token_len``, every camera slot filled; absent cameras masked (π0.5) or given a
  blank image (GR00T has no camera mask);
- packed: the same samples in the same order, as the training pipeline packs them: the
  builders' variable-length form (only the cameras a sample has, no prompt padding) packed
  first-fit by ``data/packing.py`` into rows of ``--seq-len`` tokens and a number of image
  slots (default: the multiple of 128 and the slot count whose steps cost the fewest
  analytic FLOPs), then cut into as many steps of equally many rows: the same samples per
  step on average (each step's count is printed), samples per row fixed to the most any row
  holds (static shapes).

The two layouts' steps alternate (``--rounds`` timed passes after ``--warmup``), so a change
of the machine's load hits both alike; each figure is the median step.

Prints the mixture's statistics, the timings and one JSON line with ``model``,
``padded_examples_per_s``, ``packed_examples_per_s``, ``speedup`` (packed / padded) and
``ideal_speedup`` = analytic FLOPs of the padded batches / analytic FLOPs of the same
samples unpadded (``training_flops``: weight matmuls plus attention's quadratic term).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys

import numpy as np

from embodied_jax import host_malloc
from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness
from experiments.benchmarks.harness import alternate, compile_train_step

CAMERAS = {
    "pi05": ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"),
    "gr00t": ("ego_view", "left_wrist", "right_wrist"),
}
EMBODIMENTS = ((1, 8), (2, 14), (3, 32))  # (cameras, state dims)
PI05_TEMPLATE = 8  # BOS, "Task:", ", State:", ";\nAction: " pieces
GR00T_TEMPLATE = 24  # chat template around the user turn
GR00T_IMAGE_TAGS = 6  # "<image k>" text, <img>, </img>


@dataclasses.dataclass
class Sample:
    cameras: int
    state_dims: int
    words: int
    text_tokens: int  # prompt tokens beyond the image tokens


def draw_mixture(rng, count: int, family: str) -> list[Sample]:
    out = []
    for _ in range(count):
        cams, dims = EMBODIMENTS[int(rng.integers(len(EMBODIMENTS)))]
        words = int(rng.integers(8, 61))
        instruction = int(round(1.3 * words))
        if family == "pi05":
            bins = rng.integers(0, 256, dims)
            state = int(sum(len(str(b)) + 1 for b in bins))
            text = PI05_TEMPLATE + instruction + state
        else:
            text = GR00T_TEMPLATE + instruction + cams * GR00T_IMAGE_TAGS
        out.append(Sample(cams, dims, words, text))
    return out


def model_for(config, family: str, mixture: list[Sample]):
    cams = CAMERAS[family]
    longest_text = max(s.text_tokens for s in mixture)
    if family == "pi05":
        return dataclasses.replace(
            config, camera_names=cams, max_token_len=max(config.max_token_len, 200, longest_text)
        )
    patches = config.vision.num_patches
    # the padded prompt holds every camera's block: its text is the sample's plus the absent cameras' tags
    text = max(s.text_tokens + (len(cams) - s.cameras) * GR00T_IMAGE_TAGS for s in mixture)
    return dataclasses.replace(config, camera_names=cams, max_token_len=len(cams) * patches + text)


def pi05_samples(model, mixture, rng):
    from embodied_jax.models.pi05.inputs import packed_sample

    size = model.vision.image_size
    padded, packed = [], []
    for s in mixture:
        n = min(s.text_tokens, model.max_token_len)
        tokens = np.zeros(model.max_token_len, np.int32)
        tokens[:n] = rng.integers(1, model.vocab_size, n)
        images = {
            c: rng.uniform(-1, 1, (size, size, 3)).astype(np.float32)
            if j < s.cameras
            else np.full((size, size, 3), -1.0, np.float32)
            for j, c in enumerate(model.camera_names)
        }
        sample = {
            "images": images,
            "image_masks": {c: np.bool_(j < s.cameras) for j, c in enumerate(model.camera_names)},
            "state": rng.uniform(-1, 1, model.max_state_dim).astype(np.float32),
            "tokens": tokens,
            "token_mask": np.arange(model.max_token_len) < n,
            "actions": rng.normal(size=(model.action_horizon, model.max_action_dim)).astype(np.float32),
            "action_dim_mask": np.arange(model.max_action_dim) < model.action_dim,
        }
        padded.append(sample)
        packed.append(packed_sample(sample, model.camera_names, model.vision.num_patches, model.image_token_id))
    return padded, packed


def gr00t_samples(model, mixture, rng):
    patches = model.vision.num_patches
    size = model.vision.image_size
    text_vocab = min(model.llm.vocab_size, model.image_token_id)
    padded, packed = [], []

    def prompt(text_tokens, cams):
        pieces = [rng.integers(0, text_vocab, GR00T_TEMPLATE // 2)]
        for _ in range(cams):
            pieces += [
                rng.integers(0, text_vocab, GR00T_IMAGE_TAGS - 1),
                np.full(patches, model.image_token_id),
                rng.integers(0, text_vocab, 1),
            ]
        rest = text_tokens - GR00T_TEMPLATE // 2 - cams * GR00T_IMAGE_TAGS
        pieces.append(rng.integers(0, text_vocab, max(rest, 1)))
        return np.concatenate(pieces).astype(np.int32)

    for s in mixture:
        common = {
            "state": np.pad(rng.normal(size=s.state_dims), (0, model.max_state_dim - s.state_dims)).astype(np.float32),
            "embodiment_id": np.int32(s.cameras),
            "actions": rng.normal(size=(model.action_horizon, model.action_dim)).astype(np.float32),
            "action_mask": np.ones((model.action_horizon, model.action_dim), bool),
        }
        images = [rng.uniform(-1, 1, (size, size, 3)).astype(np.float32) for _ in range(s.cameras)]
        cameras = model.camera_names
        full = prompt(s.text_tokens + (len(cameras) - s.cameras) * GR00T_IMAGE_TAGS, len(cameras))
        tokens = np.zeros(model.max_token_len, np.int32)
        tokens[: len(full)] = full
        blank = np.full((size, size, 3), -1.0, np.float32)
        padded.append(
            dict(
                common,
                tokens=tokens,
                token_mask=np.arange(model.max_token_len) < len(full),
                images={c: images[j] if j < s.cameras else blank for j, c in enumerate(cameras)},
                image_masks={c: np.bool_(True) for c in cameras},
            )
        )
        packed.append(dict(common, tokens=prompt(s.text_tokens, s.cameras), images=np.stack(images)))
    return padded, packed


def time_interleaved(state, layouts: dict, warmup: int, rounds: int):
    """Median seconds per step of each layout, their steps alternating (``rounds`` passes over
    every layout's batches: ``harness.alternate``). The step donates its state: each call
    continues from the state the previous one returned."""
    holder, loss = {"state": state}, {}

    def step(name, compiled, batch):
        def run():
            holder["state"], metrics = compiled(holder["state"], batch)
            loss[name] = metrics["loss"]
            return metrics

        return run

    steps = {
        (name, i): step(name, compiled, batch)
        for name, (compiled, device) in layouts.items()
        for i, batch in enumerate(device)
    }
    times = alternate(steps, rounds=rounds, warmup=warmup)
    medians = {
        name: statistics.median(t for (n, _), v in times.items() if n == name for t in v["wall"]) for name in layouts
    }
    return medians, {name: float(v) for name, v in loss.items()}, holder["state"]


@dataclasses.dataclass(frozen=True)
class Flags:
    """packing's own flags; the rest of the command line (MODEL and overrides) goes to the launcher."""

    batch: int = 8
    """samples per padded step (packed: the same on average)"""
    steps: int = 3
    """steps of each layout (the same samples)"""
    rounds: int = 2
    """timed passes over every layout's steps"""
    warmup: int = 1
    """untimed passes first"""
    seq_len: int = 0
    """packed row length (0: the cheapest multiple of 128)"""
    seed: int = 0
    profile: str | None = None
    """trace one step of each layout here, print the top ops"""


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    # --help is the launcher's (MODEL --help lists the experiment's overrides)
    bench, rest = parse_flags(Flags, args=argv, return_unknown_args=True, add_help=False)

    from embodied_jax.data.packing import PackingConfig, pack_samples
    from embodied_jax.models.gr00t import Gr00tConfig
    from embodied_jax.models.pi05.inputs import stack_rows
    from embodied_jax.train.runtime import build, initial_state
    from experiments.launch import parse

    config = parse(rest)
    family = "gr00t" if isinstance(config.model, Gr00tConfig) else "pi05"
    rng = np.random.default_rng(bench.seed)
    mixture = [draw_mixture(rng, bench.batch, family) for _ in range(bench.steps)]
    model = model_for(config.model, family, [s for step in mixture for s in step])
    config = dataclasses.replace(config, model=model, train=dataclasses.replace(config.train, batch_size=bench.batch))
    make = pi05_samples if family == "pi05" else gr00t_samples
    per_step = [make(model, step, rng) for step in mixture]
    stream = [p for _, packed in per_step for p in packed]  # the samples in the order the loader yields them
    lengths = [len(p["tokens"]) for p in stream]
    tokens_per_image = model.vision.num_patches

    def analytic(batch):
        f = model.training_flops(batch)
        return f["weights"] + f["attention"]

    # Packing decisions depend on image counts, not pixels: search with 1x1 stand-ins.
    light = [dict(p, images=np.zeros((len(p["images"]), 1, 1, 3), np.float32)) for p in stream]

    def layout(seq_len, images, samples=light):
        """The stream packed as the training pipeline packs it (first fit over the loader's bins)
        into ``steps`` steps of equally many rows; None when a sample does not fit."""
        if images * tokens_per_image > seq_len + tokens_per_image or images < max(len(p["images"]) for p in stream):
            return None
        packing = PackingConfig(seq_len=seq_len, max_samples_per_row=len(stream), max_images_per_row=images)
        rows = pack_samples(samples, packing)
        packing = dataclasses.replace(packing, max_samples_per_row=int(rows["sample_mask"].sum(1).max()))
        rows_per_step = -(-len(rows["tokens"]) // bench.steps)
        rows = pack_samples(samples, packing, num_rows=rows_per_step * bench.steps)
        batches = [
            {k: v[i * rows_per_step : (i + 1) * rows_per_step] for k, v in rows.items()} for i in range(bench.steps)
        ]
        return sum(analytic(b) for b in batches) / bench.steps, packing, rows_per_step, batches

    # The row length and image slots a user would pick for this mixture: those whose packed
    # steps cost least (multiples of 128 tokens).
    unit = 128
    if bench.seq_len:
        candidates = [bench.seq_len]
    else:
        candidates = range(-(-max(lengths) // unit) * unit, 8 * max(lengths), unit)
    images_needed = sum(len(p["images"]) for p in stream) / sum(lengths)  # images per token
    options = []
    for seq_len in candidates:
        typical = images_needed * seq_len
        for images in sorted({max(1, int(typical * f)) for f in (0.9, 1.0, 1.1, 1.2, 1.35, 1.5)}):
            option = layout(seq_len, images)
            if option is not None:
                options.append(option)
    if not options:
        raise ValueError(f"packing: no row of {list(candidates)} tokens holds every sample")
    best = min(options, key=lambda x: x[0])[1]
    packed_flops, packing, rows, packed_batches = layout(best.seq_len, best.max_images_per_row, stream)
    seq_len, per_row = packing.seq_len, packing.max_samples_per_row
    padded_batches = [stack_rows(padded) for padded, _ in per_step]

    flat = [s for step in mixture for s in step]
    cams = np.bincount([s.cameras for s in flat], minlength=4)[1:]
    texts = [s.text_tokens for s in flat]
    real = sum(int((b["segment_ids"] > 0).sum()) for b in packed_batches)
    slots = sum(int((b["image_segment_ids"] > 0).sum()) for b in packed_batches)
    samples_per_step = [int(b["sample_mask"].sum()) for b in packed_batches]
    print(
        f"mixture: {len(flat)} samples (seed {bench.seed}); cameras 1/2/3: {cams.tolist()}; instruction words "
        f"{min(s.words for s in flat)}-{max(s.words for s in flat)} (mean {np.mean([s.words for s in flat]):.1f}); "
        f"prompt tokens {min(texts)}-{max(texts)} (mean {np.mean(texts):.1f}); sample tokens (images included) "
        f"{min(lengths)}-{max(lengths)} (mean {np.mean(lengths):.1f})"
    )
    print(
        f"padded: {bench.steps} steps of {bench.batch} samples x {padded_batches[0]['tokens'].shape[1]} prompt "
        f"tokens, {len(CAMERAS[family])} camera slots each"
    )
    print(
        f"packed: the same {len(flat)} samples in {bench.steps} steps of {rows} rows x {seq_len} tokens "
        f"(samples per step {samples_per_step}), <= {per_row} samples and {packing.max_images_per_row} image "
        f"slots per row; tokens real {real / (rows * seq_len * len(packed_batches)):.1%}, image slots used "
        f"{slots / (rows * packing.max_images_per_row * len(packed_batches)):.1%}"
    )

    padded_flops = np.mean([analytic(b) for b in padded_batches])
    one = dataclasses.replace(packing, max_samples_per_row=1)
    unpadded_flops = (
        sum(
            analytic(
                pack_samples(
                    [p], dataclasses.replace(one, seq_len=len(p["tokens"]), max_images_per_row=max(1, len(p["images"])))
                )
            )
            for p in stream
        )
        / bench.steps
    )

    rt = build(config)
    with rt.context():
        state = initial_state(rt)
        padded_step, padded_device, padded_compile = compile_train_step(rt, state, padded_batches)
        packed_step, packed_device, packed_compile = compile_train_step(rt, state, packed_batches)
        medians, loss, state = time_interleaved(
            state,
            {"padded": (padded_step, padded_device), "packed": (packed_step, packed_device)},
            bench.warmup,
            bench.rounds,
        )
        if bench.profile:
            from experiments.benchmarks.profile import report

            for label, compiled, device in (
                ("padded", padded_step, padded_device),
                ("packed", packed_step, packed_device),
            ):
                holder = {"state": state}

                def run(compiled=compiled, batch=device[0], holder=holder):
                    holder["state"], m = compiled(holder["state"], batch)
                    return m

                report(label, run, compiled, f"{bench.profile}/{label}")
                state = holder["state"]
    padded_s, packed_s = medians["padded"], medians["packed"]
    result = {
        "model": config.name,
        "host_malloc": host_malloc.mode(),
        "samples_per_step": bench.batch,
        "padded_step_s": padded_s,
        "packed_step_s": packed_s,
        "padded_examples_per_s": bench.batch / padded_s,
        "packed_examples_per_s": bench.batch / packed_s,
        "speedup": padded_s / packed_s,
        "ideal_speedup": float(padded_flops / unpadded_flops),
        "packed_layout_speedup": float(padded_flops / packed_flops),
        "fraction_of_ideal": float((padded_s / packed_s) / (padded_flops / unpadded_flops)),
        "padded_analytic_flops": float(padded_flops),
        "packed_analytic_flops": float(packed_flops),
        "unpadded_analytic_flops": float(unpadded_flops),
        "rows": rows,
        "seq_len": seq_len,
        "samples_per_row": per_row,
        "image_slots_per_row": packing.max_images_per_row,
        "packed_samples_per_step": samples_per_step,
        "compile_s": {"padded": padded_compile, "packed": packed_compile},
        "loss": loss,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "packing"))  # --record: the result appended to results/packing.jsonl
