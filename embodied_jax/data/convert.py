"""Convert a LeRobot dataset into a frame store: `python -m embodied_jax.data.convert SRC DST`.

Episodes are converted in parallel — a local process pool by default, a Ray cluster when
`--ray-address` is given (Ray is imported only then). Each episode is decoded through the
reader (the same timestamp lookup training uses), resized with the pipeline's resize, written,
read back and checksummed before its `done` marker is written, so an interrupted conversion
resumes where it stopped: episodes with a marker are skipped.

On Ray (`pip install ray`), the driver ships its own `embodied_jax` package to the workers
(runtime_env `py_modules`), so the nodes need only ray and the requirements.txt packages, and
SOURCE and DESTINATION must be paths every node sees (a shared filesystem). A task whose
worker dies is retried; episodes that still fail are named in the error, and a re-run
converts only them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Annotated

import numpy as np
import tyro

from embodied_jax.cli import INPUT_ERRORS, parse_flags, run_main
from embodied_jax.data import framestore as fs
from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.images import resize_with_pad


@dataclasses.dataclass
class ConversionReport:
    written: list[int]
    skipped: list[int]
    frames: int
    seconds: float


def _summary(dataset: LeRobotDataset, image_size: tuple[int, int] | None, source: pathlib.Path) -> dict:
    cameras = {}
    for key in dataset.camera_keys:
        h, w, c = dataset.image_shape(key)
        cameras[key] = [int(image_size[0]), int(image_size[1]), 3] if image_size else [h, w, c]
    modality = None
    if dataset.modality is not None:
        m = dataset.modality
        modality = {
            "state": {k: {"start": a, "end": b, "original_key": m.state_key} for k, (a, b) in m.state.items()},
            "action": {k: {"start": a, "end": b, "original_key": m.action_key} for k, (a, b) in m.action.items()},
            "video": {k: {"original_key": v} for k, v in m.video.items()},
            "annotation": {k: {"original_key": v} for k, v in m.annotation.items()},
        }
    return {
        "format": fs.FORMAT,
        "source": str(source.resolve()),
        "source_version": dataset.version,
        "fps": dataset.fps,
        "tasks": dataset.tasks,
        "cameras": cameras,
        "image_size": list(image_size) if image_size else None,
        "features": {k: v for k, v in dataset.features.items() if v.get("dtype") not in ("video", "image")},
        "array_keys": sorted(dataset.arrays),
        "episodes": [
            {"episode_index": int(e), "length": int(n)}
            for e, n in zip(dataset.episode_indices, dataset.episode_lengths, strict=True)
        ],
        "modality": modality,
    }


_WORKER_DATASETS: dict[str, LeRobotDataset] = {}
RAY_TASK_RETRIES = 3  # Ray re-runs an episode this often when its worker process or node dies


def convert_episode(
    source: str,
    destination: str,
    episode_index: int,
    image_size: tuple[int, int] | None,
    tolerance_s: float,
    zstd_level: int,
) -> tuple[int, int]:
    """Decodes, resizes, writes, reads back and checksums one episode; returns (episode, frames)."""
    dataset = _WORKER_DATASETS.get(source)
    if dataset is None:
        dataset = _WORKER_DATASETS[source] = LeRobotDataset(source, tolerance_s=tolerance_s)
    position = dataset.position_of(episode_index)
    length = int(dataset.episode_lengths[position])
    destination = pathlib.Path(destination)
    checksums = {}
    for key in dataset.camera_keys:
        frames = dataset.images(position, key, np.arange(length))
        if image_size is not None:
            frames = np.stack([resize_with_pad(f, *image_size) for f in frames])
        path = destination / "frames" / key / fs.episode_name(episode_index)
        fs.write_array(path, frames, frames=True, zstd_level=zstd_level)
        stored = fs.read_array(path)
        if len(stored) != length or fs.checksum(stored) != fs.checksum(frames):
            raise fs.FrameStoreError(
                f"{path}: episode {episode_index}, camera {key}: read-back differs from what was written"
            )
        checksums[key] = fs.checksum(stored)
    fs.atomic_write_json(
        destination / "done" / f"{fs.episode_name(episode_index)}.json",
        {"episode_index": int(episode_index), "length": length, "checksums": checksums},
    )
    return int(episode_index), length


def convert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    image_size: tuple[int, int] | None = None,
    workers: int | None = None,
    ray_address: str | None = None,
    episodes: Sequence[int] | None = None,
    tolerance_s: float = 1e-4,
    zstd_level: int = 0,
    log=print,
) -> ConversionReport:
    """Converts `source` (a LeRobot dataset) into a frame store at `destination`; resumable."""
    start = time.time()
    source, destination = pathlib.Path(source), pathlib.Path(destination)
    dataset = LeRobotDataset(source, tolerance_s=tolerance_s)
    summary = _summary(dataset, tuple(image_size) if image_size else None, source)
    summary_path = destination / fs.SUMMARY
    if summary_path.exists():
        existing = json.loads(summary_path.read_text())
        for field in ("source", "image_size", "episodes", "cameras"):
            if existing.get(field) != summary[field]:
                raise fs.FrameStoreError(
                    f"{summary_path}: existing store has a different {field!r} "
                    f"({existing.get(field)!r} vs {summary[field]!r}); use a new destination"
                )
    else:
        fs.atomic_write_json(summary_path, summary)
    arrays_done = destination / "arrays" / "done.json"
    if not arrays_done.exists():
        checksums = {}
        for key, values in dataset.arrays.items():
            values = np.ascontiguousarray(values)
            fs.write_array(destination / "arrays" / key, values, frames=False)
            checksums[key] = fs.checksum(fs.read_array(destination / "arrays" / key))
            if checksums[key] != fs.checksum(values):
                raise fs.FrameStoreError(f"{destination / 'arrays' / key}: read-back differs from what was written")
        fs.atomic_write_json(arrays_done, {"checksums": checksums})

    wanted = [int(e) for e in (episodes if episodes is not None else dataset.episode_indices)]
    done = [e for e in wanted if (destination / "done" / f"{fs.episode_name(e)}.json").exists()]
    todo = [e for e in wanted if e not in set(done)]
    log(f"convert {source} -> {destination}: {len(todo)} episodes to write, {len(done)} already done")
    args = [
        (str(source), str(destination), e, tuple(image_size) if image_size else None, tolerance_s, zstd_level)
        for e in todo
    ]
    frames = 0
    if ray_address and args:
        frames = _convert_on_ray(ray_address, args)
    elif (workers or 1) <= 1 or len(args) <= 1:
        for a in args:
            frames += convert_episode(*a)[1]
    else:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            for _episode, length in pool.map(convert_episode_star, args):
                frames += length
    report = ConversionReport(written=todo, skipped=done, frames=frames, seconds=time.time() - start)
    log(f"wrote {len(todo)} episodes ({frames} frames) in {report.seconds:.1f}s; skipped {len(done)}")
    return report


def convert_episode_star(args: tuple) -> tuple[int, int]:
    return convert_episode(*args)


def _convert_on_ray(address: str, args: list[tuple]) -> int:
    """Runs `convert_episode` for each of `args` as Ray tasks; returns the frames written."""
    import ray  # optional dependency, only for cluster conversion

    package = pathlib.Path(__file__).resolve().parents[1]  # embodied_jax/, shipped to the Ray workers
    connect = not ray.is_initialized()  # a caller's own connection (and runtime_env) is kept
    if connect:
        ray.init(address=address, runtime_env={"py_modules": [str(package)]})
    try:
        # errors raised by the conversion itself (a bad video) are not retried
        remote = ray.remote(max_retries=RAY_TASK_RETRIES)(convert_episode)
        tasks = [(a[2], remote.remote(*a)) for a in args]
        frames, failed = 0, {}
        for episode, task in tasks:  # every result, so that one failure does not stop the other episodes
            try:
                frames += ray.get(task)[1]
            except ray.exceptions.RayError as exc:
                failed[episode] = exc
    finally:
        if connect:
            ray.shutdown()
    if failed:
        first = min(failed)
        raise fs.FrameStoreError(
            f"episodes {sorted(failed)} failed on the Ray cluster at {address} (episode {first}: "
            f"{failed[first]}); finished episodes are kept: run the conversion again to "
            f"retry the others"
        ) from failed[first]
    return frames


PROG = "python -m embodied_jax.data.convert"


@dataclasses.dataclass(frozen=True)
class ConvertFlags:
    """``python -m embodied_jax.data.convert``'s command line."""

    source: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="SOURCE")]]
    """LeRobot dataset directory (v2.1 or v3.0)"""
    destination: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="DESTINATION")]]
    """frame store directory (created; resumed if it exists)"""
    image_size: Annotated[tuple[int, int] | None, tyro.conf.arg(metavar="HEIGHT WIDTH")] = None
    """resize-with-pad frames"""
    workers: int | None = None
    """local worker processes (default: the CPU count)"""
    ray_address: str | None = None
    """convert on this Ray cluster instead of local processes"""
    episodes: tuple[int, ...] | None = None
    """only these episode indices"""
    tolerance_s: float = 1e-4
    zstd_level: int = 0
    """compress frames with zstd at this level (0: uncompressed, fastest to read)"""
    verify: bool = False
    """re-read every episode and check its checksum after converting"""


def run(args: ConvertFlags) -> None:
    convert(
        args.source,
        args.destination,
        image_size=args.image_size,
        workers=args.workers or os.cpu_count(),
        ray_address=args.ray_address,
        episodes=None if args.episodes is None else list(args.episodes),
        tolerance_s=args.tolerance_s,
        zstd_level=args.zstd_level,
    )
    if args.verify:
        verified = fs.verify_store(args.destination)
        print(f"verified {len(verified)} episodes, {sum(verified.values())} frames")


def main(argv: Sequence[str] | None = None) -> int:
    def parse_and_run(args: list[str]) -> None:
        run(parse_flags(ConvertFlags, args=args, prog=PROG, description=__doc__.splitlines()[0]))

    return run_main(parse_and_run, argv, INPUT_ERRORS + (ValueError, KeyError))


if __name__ == "__main__":
    sys.exit(main())
