"""Frame store: a LeRobot dataset as TensorStore zarr v3 arrays of pre-resized uint8 frames.

Layout under the store root::

    framestore.json                 summary: source, fps, tasks, cameras, features, episodes
    arrays/<key>                    every per-frame numeric column, [num_frames, ...] (all episodes)
    frames/<camera>/episode_NNNNNN  uint8 [T, H, W, 3]; one shard per episode, one inner chunk per frame
                                    (crc32c per chunk, so a corrupted chunk fails to read; zstd optional)
    done/episode_NNNNNN.json        written last, after a read-back check: frame count and sha256 per camera

An episode without its `done` marker is (re)written by the next conversion; `verify_store`
re-reads every episode and compares with the recorded checksums. `FrameStore` offers the
same frame-source interface as `LeRobotDataset`, so the pipeline yields identical samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data.modality import Modality
from embodied_jax.errors import InputError

SUMMARY = "framestore.json"
FORMAT = "embodied_jax.framestore/1"


class FrameStoreError(InputError, ValueError):
    """A missing, incomplete or corrupted frame store; the message names the episode and camera."""


def episode_name(episode_index: int) -> str:
    return f"episode_{int(episode_index):06d}"


def _kvstore(path: pathlib.Path) -> dict:
    return {"driver": "file", "path": str(path)}


def array_spec(path: pathlib.Path, shape: Sequence[int], dtype: str, *, frames: bool, zstd_level: int = 0) -> dict:
    """zarr3 spec: frame arrays are one shard of per-frame chunks; others one plain chunk per 4096 rows."""
    shape = [int(s) for s in shape]
    if frames:
        inner = (
            [{"name": "bytes"}]
            + ([{"name": "zstd", "configuration": {"level": zstd_level}}] if zstd_level else [])
            + [{"name": "crc32c"}]
        )
        codecs = [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [1] + shape[1:],
                    "codecs": inner,
                    "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                },
            }
        ]
        chunk = [max(1, shape[0])] + shape[1:]
    else:
        codecs = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
        chunk = [max(1, min(shape[0], 4096))] + shape[1:]
    return {
        "driver": "zarr3",
        "kvstore": _kvstore(path),
        "metadata": {
            "shape": shape,
            "data_type": dtype,
            "codecs": codecs,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
        },
    }


def write_array(path: pathlib.Path, values: np.ndarray, *, frames: bool, zstd_level: int = 0) -> None:
    spec = array_spec(path, values.shape, values.dtype.name, frames=frames, zstd_level=zstd_level)
    store = ts.open(spec, create=True, delete_existing=True).result()
    store.write(values).result()


def read_array(path: pathlib.Path) -> np.ndarray:
    return ts.open({"driver": "zarr3", "kvstore": _kvstore(path)}, open=True).result().read().result()


def checksum(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def atomic_write_json(path: pathlib.Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


class FrameStore:
    """Reads a converted store with the frame-source interface of `LeRobotDataset`.

    Args:
      root: the store directory.
      require_complete: raise if an episode lacks its `done` marker (an unfinished conversion).
    """

    def __init__(self, root: str | pathlib.Path, *, require_complete: bool = True):
        self.root = pathlib.Path(root)
        summary_path = self.root / SUMMARY
        try:
            self.summary = json.loads(summary_path.read_text())
        except FileNotFoundError as exc:
            raise FrameStoreError(f"{summary_path}: missing file (not a frame store)") from exc
        if self.summary.get("format") != FORMAT:
            raise FrameStoreError(f"{summary_path}: format {self.summary.get('format')!r} is not {FORMAT!r}")
        self.fps = float(self.summary["fps"])
        self.tasks = list(self.summary["tasks"])
        self.camera_keys = tuple(self.summary["cameras"])
        self.image_size = self.summary["image_size"]
        self.features = self.summary["features"]
        self.version = self.summary["source_version"]
        episodes = self.summary["episodes"]
        self.episode_indices = np.array([e["episode_index"] for e in episodes], np.int64)
        self.episode_lengths = np.array([e["length"] for e in episodes], np.int64)
        self.episode_starts = np.concatenate([[0], np.cumsum(self.episode_lengths)]).astype(np.int64)
        self.modality = Modality.from_json(self.summary["modality"]) if self.summary.get("modality") else None
        if not (self.root / "arrays" / "done.json").exists():
            raise FrameStoreError(f"{self.root}: per-frame arrays were not written (unfinished conversion)")
        if require_complete:
            missing = [
                int(e) for e in self.episode_indices if not (self.root / "done" / f"{episode_name(e)}.json").exists()
            ]
            if missing:
                raise FrameStoreError(
                    f"{self.root}: episodes {missing[:10]}{'...' if len(missing) > 10 else ''} "
                    f"were not converted (run the conversion again to resume)"
                )
        try:
            self.arrays = {key: read_array(self.root / "arrays" / key) for key in self.summary["array_keys"]}
        except ValueError as exc:
            raise FrameStoreError(f"{self.root / 'arrays'}: unreadable ({exc})") from exc
        self._position = {int(e): i for i, e in enumerate(self.episode_indices)}
        self._stores: dict[tuple[str, int], Any] = {}

    @property
    def num_episodes(self) -> int:
        return len(self.episode_indices)

    @property
    def num_frames(self) -> int:
        return int(self.episode_starts[-1])

    def position_of(self, episode_index: int) -> int:
        return self._position[int(episode_index)]

    def episode_array(self, position: int, key: str) -> np.ndarray:
        return self.arrays[key][self.episode_starts[position] : self.episode_starts[position + 1]]

    def task(self, position: int, frame_index: int) -> str:
        return self.tasks[int(self.arrays[fmt.TASK_INDEX][self.episode_starts[position] + frame_index])]

    def frame_path(self, key: str, episode_index: int) -> pathlib.Path:
        return self.root / "frames" / key / episode_name(episode_index)

    def images(self, position: int, key: str, frame_indices: Sequence[int]) -> np.ndarray:
        if key not in self.camera_keys:
            raise KeyError(f"{key!r} is not a camera of {self.root}; cameras: {self.camera_keys}")
        cache_key = (key, position)
        store = self._stores.get(cache_key)
        episode = int(self.episode_indices[position])
        if store is None:
            try:
                store = ts.open(
                    {"driver": "zarr3", "kvstore": _kvstore(self.frame_path(key, episode))}, open=True
                ).result()
            except ValueError as exc:
                raise FrameStoreError(
                    f"{self.frame_path(key, episode)}: cannot open frames of episode {episode} ({exc})"
                ) from exc
            if len(self._stores) > 256:
                self._stores.clear()
            self._stores[cache_key] = store
        frames = np.asarray(frame_indices, np.int64)
        try:
            if len(frames) == 1:
                return store[int(frames[0])].read().result()[None]
            return store[frames].read().result()
        except ValueError as exc:
            raise FrameStoreError(
                f"{self.frame_path(key, episode)}: episode {episode}, camera {key}: "
                f"corrupted or unreadable chunk ({exc})"
            ) from exc

    def frame(self, position: int, frame_index: int) -> dict[str, Any]:
        row = self.episode_starts[position] + frame_index
        out: dict[str, Any] = {key: self.arrays[key][row] for key in self.arrays}
        for key in self.camera_keys:
            out[key] = self.images(position, key, [frame_index])[0]
        out["task"] = self.task(position, frame_index)
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_stores"] = {}
        return state


def verify_store(root: str | pathlib.Path) -> dict[int, int]:
    """Re-reads every episode; raises FrameStoreError on a count/checksum mismatch or bad chunk.

    Returns {episode_index: frames verified}.
    """
    store = FrameStore(root)
    verified = {}
    for position, episode in enumerate(store.episode_indices.tolist()):
        marker_path = store.root / "done" / f"{episode_name(episode)}.json"
        marker = json.loads(marker_path.read_text())
        for key in store.camera_keys:
            path = store.frame_path(key, episode)
            try:
                frames = read_array(path)
            except ValueError as exc:
                raise FrameStoreError(
                    f"{path}: episode {episode}, camera {key}: corrupted or unreadable chunk ({exc})"
                ) from exc
            if len(frames) != marker["length"] or len(frames) != store.episode_lengths[position]:
                raise FrameStoreError(
                    f"{path}: episode {episode}, camera {key}: {len(frames)} frames, expected {marker['length']}"
                )
            if checksum(frames) != marker["checksums"][key]:
                raise FrameStoreError(f"{path}: episode {episode}, camera {key}: checksum mismatch (corrupted data)")
        verified[episode] = int(store.episode_lengths[position])
    arrays_marker = json.loads((store.root / "arrays" / "done.json").read_text())
    for key, value in store.arrays.items():
        if checksum(value) != arrays_marker["checksums"][key]:
            raise FrameStoreError(f"{store.root / 'arrays' / key}: checksum mismatch (corrupted data)")
    return verified
