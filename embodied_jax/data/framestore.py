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

A store is untrusted input: its keys name paths inside it only (``embodied_jax.paths``), and the
shape each array declares is checked before TensorStore allocates it (the per-frame arrays
against the bytes their chunks hold, frames against ``framestore.json``'s episode lengths and
camera sizes).
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data.episode_table import EpisodeTable
from embodied_jax.data.modality import Modality
from embodied_jax.errors import InputError
from embodied_jax.paths import resolve_inside

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


def open_array(path: pathlib.Path) -> Any:
    """The zarr3 array at ``path``, opened (its metadata read), nothing of its data read yet."""
    return ts.open({"driver": "zarr3", "kvstore": _kvstore(path)}, open=True).result()


def read_array(path: pathlib.Path) -> np.ndarray:
    """All of the array at ``path`` (arrays this process wrote; a store's are read through ``FrameStore``)."""
    return open_array(path).read().result()


def _stored_bytes(path: pathlib.Path) -> int:
    """Bytes of the chunk files under ``path`` (links not followed, metadata left out)."""
    total = 0
    for folder, _, names in os.walk(path):
        for name in names:
            file = os.path.join(folder, name)
            if name != "zarr.json" and not os.path.islink(file):
                total += os.lstat(file).st_size
    return total


def checksum(values: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()


def atomic_write_json(path: pathlib.Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


class FrameStore(EpisodeTable):
    """Reads a converted store with the frame-source interface of `LeRobotDataset`.

    Args:
      root: the store directory.
      require_complete: raise if an episode lacks its `done` marker (an unfinished conversion).
    """

    def __init__(self, root: str | pathlib.Path, *, require_complete: bool = True):
        self.root = pathlib.Path(root)
        summary_path = self._inside(SUMMARY)
        try:
            self.summary = json.loads(summary_path.read_text())
        except FileNotFoundError as exc:
            raise FrameStoreError(f"{summary_path}: missing file (not a frame store)") from exc
        except (OSError, ValueError) as exc:
            raise FrameStoreError(f"{summary_path}: unreadable ({exc})") from exc
        if not isinstance(self.summary, dict) or self.summary.get("format") != FORMAT:
            found = self.summary.get("format") if isinstance(self.summary, dict) else self.summary
            raise FrameStoreError(f"{summary_path}: format {fmt.shown(found)} is not {FORMAT!r}")
        fps = self._field("fps", numbers.Real)
        if not 0 < fps <= fmt.MAX_FPS:
            raise FrameStoreError(f"{summary_path}: fps = {fps!r}: expected a frame rate in (0, {fmt.MAX_FPS}]")
        self.fps = float(fps)
        self.tasks = list(self._field("tasks", list))
        self.camera_shapes = {key: self._camera_shape(key, v) for key, v in self._field("cameras", dict).items()}
        self.camera_keys = tuple(self.camera_shapes)
        self.image_size = self._field("image_size", (list, type(None)))
        self.features = self._field("features", dict)
        self.version = self._field("source_version", str)
        episodes = [e if isinstance(e, dict) else {} for e in self._field("episodes", list)]

        def number(episode: dict, name: str, high: int) -> int:
            where = f"{summary_path}: episodes"
            return fmt.bounded_int(episode.get(name), where, name, high=high, error=FrameStoreError)

        self.index_episodes(
            [number(e, "episode_index", fmt.MAX_EPISODE_INDEX) for e in episodes],
            [number(e, "length", fmt.MAX_FRAMES) for e in episodes],
        )
        try:
            self.modality = Modality.from_json(self.summary["modality"]) if self.summary.get("modality") else None
        except ValueError as exc:
            raise FrameStoreError(f"{summary_path}: field 'modality': {exc}") from exc
        if not self._inside("arrays", "done.json").exists():
            raise FrameStoreError(f"{self.root}: per-frame arrays were not written (unfinished conversion)")
        if require_complete:
            done = {int(e): self._inside("done", f"{episode_name(e)}.json") for e in self.episode_indices}
            missing = [e for e, marker in done.items() if not marker.exists()]
            if missing:
                raise FrameStoreError(
                    f"{self.root}: episodes {missing[:10]}{'...' if len(missing) > 10 else ''} "
                    f"were not converted (run the conversion again to resume)"
                )
        self.arrays = {key: self._read_frame_array(key) for key in self._field("array_keys", list)}
        tasks = self.arrays.get(fmt.TASK_INDEX)
        if tasks is not None and tasks.size and (tasks.min() < 0 or tasks.max() >= len(self.tasks)):
            raise FrameStoreError(
                f"{self.root / 'arrays' / fmt.TASK_INDEX}: task_index {int(tasks.max())} has no entry in "
                f"{SUMMARY}'s {len(self.tasks)} tasks"
            )
        self._stores: dict[tuple[str, int], Any] = {}

    def _inside(self, *parts: object, field: str | None = None) -> pathlib.Path:
        what = f"frame store {self.root}" + (f": {SUMMARY} field {field!r}" if field else "")
        return resolve_inside(self.root, *parts, what=what, error=FrameStoreError, regular_file=field is None)

    def _field(self, name: str, kind: type | tuple[type, ...]) -> Any:
        if name not in self.summary:
            raise FrameStoreError(f"{self.root / SUMMARY}: missing field {name!r}")
        value = self.summary[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise FrameStoreError(f"{self.root / SUMMARY}: field {name!r} = {fmt.shown(value)} has the wrong type")
        return value

    def _camera_shape(self, key: str, shape: Any) -> tuple[int, int, int]:
        if (
            not isinstance(shape, list)
            or len(shape) != 3
            or shape[2] != 3
            or not all(isinstance(s, int) and 0 < s <= fmt.MAX_IMAGE_SIDE for s in shape)
        ):
            raise FrameStoreError(
                f"{self.root / SUMMARY}: cameras[{key!r}] = {fmt.shown(shape)}: expected [H, W, 3] with sides "
                f"at most {fmt.MAX_IMAGE_SIDE}"
            )
        return shape[0], shape[1], shape[2]

    def _open(self, path: pathlib.Path, what: str) -> Any:
        try:
            return open_array(path)
        except ValueError as exc:
            raise FrameStoreError(f"{path}: cannot open {what} ({exc})") from exc

    def _read_frame_array(self, key: str) -> np.ndarray:
        """The per-frame array ``key``, its declared size checked against the bytes it stores first."""
        path = self._inside("arrays", key, field="array_keys")
        store = self._open(path, f"per-frame array {key!r}")
        shape, dtype = tuple(store.shape), store.dtype.numpy_dtype
        declared, stored = math.prod(shape) * dtype.itemsize, _stored_bytes(path)
        if not shape or shape[0] != self.num_frames or declared > stored:
            raise FrameStoreError(
                f"{path}: declares a {dtype} array of shape {list(shape)} ({declared} bytes), but {SUMMARY} "
                f"lists {self.num_frames} frames and its chunks hold {stored} bytes"
            )
        try:
            return store.read().result()
        except ValueError as exc:
            raise FrameStoreError(f"{path}: unreadable ({exc})") from exc

    def _frames(self, key: str, position: int) -> Any:
        """Camera ``key``'s frames of the episode at ``position``, opened, its shape checked."""
        episode, length = int(self.episode_indices[position]), int(self.episode_lengths[position])
        path = self.frame_path(key, episode)
        store = self._open(path, f"frames of episode {episode}")
        expected = (length, *self.camera_shapes[key])
        if tuple(store.shape) != expected or store.dtype.numpy_dtype != np.uint8:
            raise FrameStoreError(
                f"{path}: episode {episode}, camera {key}: declares {store.dtype.numpy_dtype} {list(store.shape)}, "
                f"but {SUMMARY} gives uint8 {list(expected)}"
            )
        return store

    def frame_path(self, key: str, episode_index: int) -> pathlib.Path:
        return self._inside("frames", key, episode_name(episode_index), field="cameras")

    def images(self, position: int, key: str, frame_indices: Sequence[int]) -> np.ndarray:
        if key not in self.camera_keys:
            raise KeyError(f"{key!r} is not a camera of {self.root}; cameras: {self.camera_keys}")
        cache_key = (key, position)
        store = self._stores.get(cache_key)
        episode = int(self.episode_indices[position])
        if store is None:
            store = self._frames(key, position)
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
        marker = json.loads(store._inside("done", f"{episode_name(episode)}.json").read_text())
        for key in store.camera_keys:
            path = store.frame_path(key, episode)
            frames_store = store._frames(key, position)  # its shape checked before it is read whole
            try:
                frames = frames_store.read().result()
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
    arrays_marker = json.loads(store._inside("arrays", "done.json").read_text())
    for key, value in store.arrays.items():
        if checksum(value) != arrays_marker["checksums"][key]:
            raise FrameStoreError(f"{store.root / 'arrays' / key}: checksum mismatch (corrupted data)")
    return verified
