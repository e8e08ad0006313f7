"""Inspect a LeRobot dataset or frame store: `python -m embodied_jax.data.inspect DIR`.

Prints the summary (format version, episodes, frames, fps, features with shapes, cameras
with codec and resolution, tasks). With `--episode E --frame F --save OUT.npz` it writes that
frame's raw arrays as the reader returns them, before any transform: every state/action
feature under its dataset key, each camera as uint8 HWC under its key, `timestamp`,
`episode_index`, `frame_index` and `task` (a string).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from collections.abc import Sequence
from typing import Annotated

import numpy as np
import tyro

from embodied_jax.cli import INPUT_ERRORS, parse_flags, run_main
from embodied_jax.data import framestore as fs
from embodied_jax.data import video
from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.errors import InputError


def open_source(path: str | pathlib.Path):
    """A LeRobotDataset, or a FrameStore when `path` holds a frame store."""
    path = pathlib.Path(path)
    if (path / fs.SUMMARY).exists():
        return fs.FrameStore(path)
    return LeRobotDataset(path)


def summary_lines(source) -> list[str]:
    is_store = isinstance(source, fs.FrameStore)
    lines = [
        f"dataset: {source.root}",
        f"format: {'frame store (from LeRobot ' + source.version + ')' if is_store else 'LeRobot ' + source.version}",
        f"episodes: {source.num_episodes}",
        f"frames: {source.num_frames}",
        f"fps: {source.fps:g}",
        "features:",
    ]
    for key, feature in source.features.items():
        if feature.get("dtype") in ("video", "image"):
            continue
        lines.append(f"  {key}: {feature.get('dtype')} {list(feature.get('shape', []))}")
    lines.append("cameras:")
    for key in source.camera_keys:
        if is_store:
            h, w, _ = source.summary["cameras"][key]
            lines.append(f"  {key}: frame store uint8 {w}x{h}")
        elif key in source.video_keys:
            info = video.probe_video(source.episodes[0].videos[key].path)
            lines.append(f"  {key}: video {info['codec']} {info['width']}x{info['height']} {info['pix_fmt']}")
        else:
            h, w, _ = source.image_shape(key)
            lines.append(f"  {key}: png-in-parquet {w}x{h}")
    lines.append(f"tasks ({len(source.tasks)}):")
    lines.extend(f"  [{i}] {task}" for i, task in enumerate(source.tasks))
    if getattr(source, "skipped", None):
        lines.append(f"skipped episodes: {len(source.skipped)}")
    return lines


def frame_arrays(source, episode_index: int, frame_index: int) -> dict[str, np.ndarray]:
    position = source.position_of(episode_index)
    raw = source.frame(position, frame_index)
    out = {key: np.asarray(value) for key, value in raw.items() if key != "task"}
    out["task"] = np.asarray(raw["task"], dtype=str)
    return out


PROG = "python -m embodied_jax.data.inspect"


@dataclasses.dataclass(frozen=True)
class InspectFlags:
    """``python -m embodied_jax.data.inspect``'s command line."""

    dataset: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="DIR")]]
    """LeRobot dataset or frame store directory"""
    episode: int | None = None
    """episode index (with --frame)"""
    frame: int | None = None
    """frame index inside the episode"""
    save: str | None = None
    """write that frame's raw arrays to this .npz"""


def inspect(args: InspectFlags) -> None:
    if (args.episode is None) != (args.frame is None) or (args.save and args.episode is None):
        raise InputError("--episode and --frame go together, and --save needs both")
    source = open_source(args.dataset)
    print("\n".join(summary_lines(source)))
    if args.episode is not None:
        arrays = frame_arrays(source, args.episode, args.frame)
        for key, value in arrays.items():
            print(f"  {key}: {value.dtype} {list(value.shape)}" + (f" = {value}" if value.size <= 8 else ""))
        if args.save:
            np.savez(args.save, **arrays)
            print(f"saved {args.save}")


def main(argv: Sequence[str] | None = None) -> int:
    def run(args: list[str]) -> None:
        inspect(parse_flags(InspectFlags, args=args, prog=PROG, description=__doc__.splitlines()[0]))

    return run_main(run, argv, INPUT_ERRORS + (KeyError, IndexError))


if __name__ == "__main__":
    sys.exit(main())
