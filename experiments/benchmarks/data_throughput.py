"""Data loading throughput: raw AV1 video decode vs the TensorStore frame store.

    python -m experiments.benchmarks.data_throughput [--workdir DIR] [--batches N]

Generates a LeRobot v3.0 dataset (10 episodes x 200 frames, 2 cameras at 224x224, AV1),
converts it to a frame store, then measures samples/s of the pi0.5 input pipeline
(normalise state/actions, resize-with-pad to 224, uint8 -> float [-1, 1], no augmentation;
batch 8, 50-step action chunks) with 0 and 2 Grain worker processes on both paths, and
prints the figures and the frame-store / raw ratio. Reference figures for LeRobot's own
loader on a 2-core machine on such data: about 110 samples/s with 0 workers, 165 with 2.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import tempfile
import time

import numpy as np

from embodied_jax.cli import parse_flags
from embodied_jax.data.convert import convert
from embodied_jax.data.pipeline import DataConfig, SourceConfig, make_data_iterator
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.writer import write_lerobot_dataset
from experiments.benchmarks import harness

EPISODES, FRAMES, SIZE = 10, 200, 224


def camera_frames(episode: int, camera: int, rng: np.random.Generator) -> np.ndarray:
    """Smoothly moving textured scenes with mild sensor noise (compress like real camera footage)."""
    y, x = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32) / SIZE
    frames = np.empty((FRAMES, SIZE, SIZE, 3), np.uint8)
    phase = rng.uniform(0, 2 * np.pi, size=3)
    for t in range(FRAMES):
        s = t / FRAMES
        image = np.stack(
            [
                0.5 + 0.35 * np.sin(2 * np.pi * (3 * x + s) + phase[0]) * np.cos(2 * np.pi * (2 * y - s)),
                0.5 + 0.35 * np.sin(2 * np.pi * (2 * x * y + 2 * s) + phase[1] + camera),
                0.5 + 0.35 * np.cos(2 * np.pi * (4 * y + s) + phase[2] + episode),
            ],
            axis=-1,
        )
        cx, cy = 0.5 + 0.3 * np.cos(2 * np.pi * s), 0.5 + 0.3 * np.sin(2 * np.pi * s)
        image[((x - cx) ** 2 + (y - cy) ** 2) < 0.01] = (0.9, 0.2, 0.1)
        image += rng.normal(0, 0.02, size=image.shape)
        frames[t] = np.clip(image * 255, 0, 255).astype(np.uint8)
    return frames


def generate(root: pathlib.Path) -> pathlib.Path:
    if (root / "meta/info.json").exists():
        return root
    rng = np.random.default_rng(0)
    episodes = []
    for e in range(EPISODES):
        episodes.append(
            {
                "task": f"pick up the object {e % 3}",
                "observation.state": rng.normal(size=(FRAMES, 14)).astype(np.float32),
                "action": rng.normal(size=(FRAMES, 14)).astype(np.float32),
                "observation.images.top": camera_frames(e, 0, rng),
                "observation.images.wrist": camera_frames(e, 1, rng),
            }
        )
    start = time.time()
    write_lerobot_dataset(root, episodes, fps=30, version="v3.0", codec="av1", episodes_per_file=EPISODES)
    print(f"generated {EPISODES} x {FRAMES} frames, 2 AV1 cameras at {SIZE}x{SIZE}, in {time.time() - start:.1f}s")
    return root


def measure(config: DataConfig, batches: int, warmup: int = 3) -> tuple[float, float]:
    """(samples/s wall clock, CPU ms per sample of this process and its threads)."""
    with make_data_iterator(config, process_index=0, process_count=1, batch_size=8, seed=0) as iterator:
        for _ in range(warmup):
            next(iterator)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            next(iterator)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        return batches * 8 / wall, 1000 * cpu / (batches * 8)


@dataclasses.dataclass(frozen=True)
class Flags:
    """data_throughput's command line."""

    workdir: str | None = None
    """where to keep the generated dataset and store (default: a temp dir)"""
    batches: int = 40
    """timed batches per configuration"""


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.data_throughput", description=__doc__.splitlines()[0]
    )
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="data_throughput_"))
    raw = generate(workdir / "lerobot")
    store = workdir / "framestore"
    start = time.time()
    report = convert(raw, store, image_size=(SIZE, SIZE), workers=2, log=lambda *_: None)
    if report.written:
        print(f"converted {len(report.written)} episodes ({report.frames} frames) in {time.time() - start:.1f}s")
    spec = SampleSpec(action_horizon=50)
    results = {}
    for path, source in (
        ("raw video", SourceConfig(str(raw))),
        ("frame store", SourceConfig(str(raw), frame_store=str(store))),
    ):
        for workers in (0, 2):
            config = DataConfig(sources=(source,), spec=spec, image_size=(SIZE, SIZE), num_workers=workers)
            results[path, workers], cpu_ms = measure(config, args.batches)
            # With 0 workers all work is in this process, so its CPU time per sample is the cost of a
            # sample independent of other load on the machine (2 / cost = what 2 free cores could do).
            cost = (
                f"; {cpu_ms:5.2f} CPU ms/sample (~{2000 / cpu_ms:6.0f} samples/s on 2 free cores)"
                if workers == 0
                else ""
            )
            print(f"{path:12s} workers={workers}: {results[path, workers]:8.1f} samples/s{cost}")
    for workers in (0, 2):
        ratio = results["frame store", workers] / results["raw video", workers]
        print(f"frame store / raw video, workers={workers}: {ratio:.2f}x")
    print("reference (LeRobot loader, 2-core machine): ~110 samples/s with 0 workers, ~165 with 2")
    return {f"{path}, workers={workers}": rate for (path, workers), rate in results.items()}


if __name__ == "__main__":
    sys.exit(harness.run(main, "data_throughput"))  # --record: the result appended to results/data_throughput.jsonl
