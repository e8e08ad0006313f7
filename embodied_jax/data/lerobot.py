"""``LeRobotDataset``: a LeRobot dataset (v2.0, v2.1 or v3.0) on local disk, its per-frame tables read
into arrays and its camera frames looked up by timestamp.

All per-frame numeric columns are read once with pyarrow into one contiguous array per
feature; camera frames are decoded on demand (PyAV, per-process LRU of open files) or
taken from PNG bytes in the parquet. Episodes are addressed by *position* (0..num_episodes-1
over the episodes kept); `episode_indices[position]` is the dataset's own episode index.
Every error about a malformed dataset names the file and the episode. Its ``meta/`` is read by
``lerobot_meta`` (``DatasetMeta``: what a run fits its model to) and ``lerobot_episodes``.

A dataset is untrusted input: every count, index and size it declares is checked against what
the dataset holds before anything of that size is allocated, and an image file a cell names
stays inside its root (``embodied_jax.paths``).
"""

from __future__ import annotations

import collections
import pathlib
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data import video
from embodied_jax.data.episode_table import EpisodeTable
from embodied_jax.data.lerobot_episodes import EpisodeRecord, read_tasks_and_episodes
from embodied_jax.data.lerobot_meta import DatasetError, DatasetMeta, read_parquet
from embodied_jax.data.modality import Modality
from embodied_jax.paths import resolve_inside


def column_to_numpy(column: pa.ChunkedArray | pa.Array, shape: Sequence[int], *, where: str = "column") -> np.ndarray:
    """[N, *shape] array from a (possibly nested list) arrow column; ``where`` names it in errors."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows = len(array)
    while pa.types.is_list(array.type) or pa.types.is_fixed_size_list(array.type) or pa.types.is_large_list(array.type):
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    shape = tuple(int(s) for s in shape)
    if shape == (1,) and values.size == rows:
        return values.reshape(rows)
    if values.size != rows * int(np.prod(shape)):
        per_row = values.size / max(rows, 1)
        raise DatasetError(
            f"{where}: meta/info.json gives shape {list(shape)}, but the data holds {per_row:g} values per frame"
        )
    return values.reshape((rows,) + shape)


# Encoded frames kept in memory per dataset (and per loader process): 2 GiB holds about 340,000 frames
# of 64 px or 100,000 of 128 px as PNG.
IMAGE_CACHE_BYTES = 2 << 30


class LeRobotDataset(EpisodeTable):
    """A LeRobot dataset on local disk (v2.0, v2.1 or v3.0).

    Args:
      root: dataset directory (holds `meta/info.json`).
      tolerance_s: how far a stored timestamp may be from its frame's presentation time.
      skip_bad_episodes: skip malformed episodes (listed in `skipped`) instead of raising;
        then every camera of every episode is also probed by decoding its first and last frame.
      episodes: only these dataset episode indices (default: all).
      modality: a `Modality`, or None to use `meta/modality.json` when present.
    """

    def __init__(
        self,
        root: str | pathlib.Path,
        *,
        tolerance_s: float = 1e-4,
        skip_bad_episodes: bool = False,
        episodes: Iterable[int] | None = None,
        modality: Modality | None = None,
        video_cache_size: int = 16,
    ):
        self.root = pathlib.Path(root)
        self.tolerance_s = float(tolerance_s)
        self.skip_bad_episodes = skip_bad_episodes
        self.meta = DatasetMeta.read(self.root, modality=modality)
        self.info = self.meta.info
        self.version = self.meta.version
        self.fps = self.meta.fps
        self.features: dict[str, dict] = self.meta.features
        self.video_keys = self.meta.video_keys
        self.image_keys = self.meta.image_keys
        self.camera_keys = self.meta.camera_keys
        self.vector_keys = self.meta.vector_keys
        self.modality = self.meta.modality

        self.tasks, records = read_tasks_and_episodes(self.meta)
        if episodes is not None:
            wanted = set(int(e) for e in episodes)
            unknown = wanted - {r.episode_index for r in records}
            if unknown:
                raise DatasetError(f"{self.root}: episodes {sorted(unknown)} are not in the dataset")
            records = [r for r in records if r.episode_index in wanted]
        self.skipped: list[tuple[int, str]] = []
        self._load_tables(records)
        self._video_cache = video.VideoFileCache(video_cache_size)
        self._image_columns: collections.OrderedDict = collections.OrderedDict()
        self._image_lock = threading.Lock()
        if skip_bad_episodes:
            self._probe_cameras()

    # ----- tables ---------------------------------------------------------------------------------------------
    def _load_tables(self, records: list[EpisodeRecord]) -> None:
        annotation = [
            c
            for c in (self.modality.annotation_columns() if self.modality else ())
            if c not in fmt.BOOKKEEPING_KEYS and c not in self.vector_keys
        ]
        numeric = list(self.vector_keys) + annotation + list(fmt.BOOKKEEPING_KEYS)
        by_file: dict[pathlib.Path, list[EpisodeRecord]] = collections.defaultdict(list)
        for record in records:
            by_file[record.data_path].append(record)
        kept: list[tuple[EpisodeRecord, int, dict[str, np.ndarray]]] = []
        for path, members in by_file.items():
            try:
                table = read_parquet(path, numeric, episode=members[0].episode_index, also_require=self.image_keys)
            except DatasetError as exc:
                self._fail(members, str(exc))
                continue
            index_column = table.column(fmt.INDEX).to_numpy()
            for record in members:
                try:
                    rows = self._episode_rows(record, table, index_column)
                    arrays = {}
                    for key in numeric:
                        shape = self.features.get(key, {}).get("shape", [1])
                        arrays[key] = column_to_numpy(
                            table.column(key).slice(rows.start, len(rows)),
                            shape,
                            where=f"{path}: episode {record.episode_index}: feature {key!r}",
                        )
                    self._check_episode(record, arrays)
                except DatasetError as exc:
                    self._fail([record], str(exc))
                    continue
                kept.append((record, rows.start, arrays))
        kept.sort(key=lambda item: item[0].episode_index)
        if not kept:
            raise DatasetError(
                f"{self.root}: no usable episodes" + (f" ({len(self.skipped)} skipped)" if self.skipped else "")
            )
        self.episodes = [record for record, _, _ in kept]
        self.index_episodes([r.episode_index for r in self.episodes], [r.length for r in self.episodes])
        self._row_starts = [start for _, start, _ in kept]
        self.arrays = {key: np.concatenate([arrays[key] for _, _, arrays in kept]) for key in numeric}

    def _episode_rows(self, record: EpisodeRecord, table: pa.Table, index_column: np.ndarray) -> range:
        if record.dataset_from_index is None:  # v2.x: the file holds exactly this episode
            start, stop = 0, table.num_rows
        else:
            start = int(np.searchsorted(index_column, record.dataset_from_index))
            stop = int(np.searchsorted(index_column, record.dataset_from_index + record.length))
        if stop - start != record.length:
            raise DatasetError(
                f"{record.data_path}: episode {record.episode_index}: metadata says {record.length} frames "
                f"but the file has {stop - start} rows for it"
            )
        episode_column = table.column(fmt.EPISODE_INDEX).slice(start, stop - start).to_numpy()
        if not np.all(episode_column == record.episode_index):
            raise DatasetError(
                f"{record.data_path}: episode {record.episode_index}: rows {start}..{stop} carry "
                f"episode_index {sorted(set(episode_column.tolist()))}"
            )
        return range(start, stop)

    def _check_episode(self, record: EpisodeRecord, arrays: dict[str, np.ndarray]) -> None:
        where = f"{record.data_path}: episode {record.episode_index}"
        frames = arrays[fmt.FRAME_INDEX]
        if not np.array_equal(frames, np.arange(record.length)):
            raise DatasetError(f"{where}: frame_index is not 0..{record.length - 1}")
        timestamps = arrays[fmt.TIMESTAMP].astype(np.float64)
        # As upstream: consecutive timestamps are 1/fps apart within tolerance.
        gaps = np.abs(np.diff(timestamps) - 1.0 / self.fps)
        if gaps.size and gaps.max() > self.tolerance_s:
            bad = int(np.argmax(gaps)) + 1
            raise DatasetError(
                f"{where}: timestamp {timestamps[bad]:.6f} at frame {bad} is outside tolerance_s="
                f"{self.tolerance_s} of the {1.0 / self.fps:.6f}s frame period"
            )
        for key, span in record.videos.items():
            if not span.path.exists():
                raise DatasetError(f"{span.path}: missing video file for episode {record.episode_index}, camera {key}")
            if timestamps.size and span.from_timestamp + timestamps[-1] > span.to_timestamp + self.tolerance_s:
                raise DatasetError(
                    f"{span.path}: episode {record.episode_index}: timestamp {timestamps[-1]:.6f} is past "
                    f"the episode's video span [{span.from_timestamp}, {span.to_timestamp}]"
                )
        task_index = arrays[fmt.TASK_INDEX]
        if task_index.size and (task_index.min() < 0 or task_index.max() >= len(self.tasks)):
            raise DatasetError(f"{where}: task_index {int(task_index.max())} has no entry in the task table")

    def _fail(self, records: Sequence[EpisodeRecord], message: str) -> None:
        if not self.skip_bad_episodes:
            raise DatasetError(message)
        self.skipped.extend((r.episode_index, message) for r in records)

    def _probe_cameras(self) -> None:
        bad = []
        for position in range(self.num_episodes):
            try:
                last = int(self.episode_lengths[position]) - 1
                for key in self.camera_keys:
                    self.images(position, key, [0, last])
            except DatasetError as exc:
                bad.append(position)
                self.skipped.append((int(self.episode_indices[position]), str(exc)))
        if bad:
            keep = [p for p in range(self.num_episodes) if p not in set(bad)]
            if not keep:
                raise DatasetError(f"{self.root}: no usable episodes ({len(self.skipped)} skipped)")
            rows = np.concatenate([np.arange(self.episode_starts[p], self.episode_starts[p + 1]) for p in keep])
            self.arrays = {k: v[rows] for k, v in self.arrays.items()}
            self.episodes = [self.episodes[p] for p in keep]
            self._row_starts = [self._row_starts[p] for p in keep]
            self.index_episodes(self.episode_indices[keep], self.episode_lengths[keep])

    # ----- access ---------------------------------------------------------------------------------------------
    def image_shape(self, key: str) -> tuple[int, int, int]:
        return self.meta.image_shape(key)

    def images(self, position: int, key: str, frame_indices: Sequence[int]) -> np.ndarray:
        """uint8 [N, H, W, 3] frames of camera `key` for frames of an episode."""
        record = self.episodes[position]
        frame_indices = np.asarray(frame_indices, dtype=np.int64)
        length = int(self.episode_lengths[position])
        if frame_indices.size and (frame_indices.min() < 0 or frame_indices.max() >= length):
            raise IndexError(f"frames {frame_indices.tolist()} outside episode {record.episode_index} of {length}")
        if key in record.videos:
            span = record.videos[key]
            timestamps = (
                self.episode_array(position, fmt.TIMESTAMP)[frame_indices].astype(np.float64) + span.from_timestamp
            )
            try:
                video_file = self._video_cache.get(span.path)
                if video_file.size + (3,) != self.image_shape(key):  # before a frame of that size is decoded
                    raise DatasetError(
                        f"{span.path}: camera {key} decodes to {list(video_file.size) + [3]} (H, W, C), but "
                        f"meta/info.json gives {list(self.image_shape(key))} [episode {record.episode_index}]"
                    )
                return video_file.frames_at(timestamps, self.fps, self.tolerance_s)
            except video.VideoDecodeError as exc:
                raise DatasetError(f"{exc} [episode {record.episode_index}, camera {key}]") from exc
        if key in self.image_keys:
            column = self._image_column(record.data_path, key)
            start = self._row_starts[position]
            return np.stack([self._image(column[start + int(f)].as_py(), record, key, int(f)) for f in frame_indices])
        raise KeyError(f"{key!r} is not a camera of {self.root}; cameras: {self.camera_keys}")

    def _image(self, cell: Any, record: EpisodeRecord, key: str, frame: int) -> np.ndarray:
        """One frame of image feature ``key`` from its parquet cell (PNG bytes, or a file inside the dataset)."""
        where = f"{record.data_path}: episode {record.episode_index}: frame {frame} of {key}"
        data = cell.get("bytes") if isinstance(cell, dict) else cell
        if data is None and isinstance(cell, dict) and cell.get("path") is not None:
            path = resolve_inside(self.root, cell["path"], what=f"{where}: path", error=DatasetError, regular_file=True)
            try:
                data = path.read_bytes()
            except FileNotFoundError as exc:
                raise DatasetError(
                    f"{path}: missing image file [episode {record.episode_index}, frame {frame}, camera {key}]"
                ) from exc
            except OSError as exc:
                raise DatasetError(f"{path}: unreadable image file ({exc}) [{where}]") from exc
        if not isinstance(data, bytes):
            raise DatasetError(f"{where}: no image bytes in the cell (got {fmt.shown(cell)})")
        declared = video.png_size(data)
        if declared is not None and declared + (3,) != self.image_shape(key):  # before decoding that many pixels
            raise DatasetError(
                f"{where}: the PNG is {declared[0]}x{declared[1]}, meta/info.json gives {list(self.image_shape(key))}"
            )
        try:
            return video.decode_png(data)
        except Exception as exc:  # FFmpeg raises several error types for bad image bytes.
            raise DatasetError(f"{where} does not decode as an image ({exc})") from exc

    def _image_column(self, path: pathlib.Path, key: str) -> pa.ChunkedArray:
        """A data file's column of encoded frames, read whole (a file is one row group as written here)
        and kept while the columns kept fit in ``IMAGE_CACHE_BYTES`` (least recently used out first):
        a dataset whose frames fit is read once, however many files it spans. Keeping four files, as
        before, made a 128 px dataset of ten files ten times slower to train on than its 64 px copy in
        one file (random samples missed the cache more often than not, each miss a 92 MB read)."""
        cache_key = (str(path), key)
        with self._image_lock:
            column = self._image_columns.pop(cache_key, None)
            if column is None:
                column = read_parquet(path, [key]).column(key)
            self._image_columns[cache_key] = column
            while (
                len(self._image_columns) > 1 and sum(c.nbytes for c in self._image_columns.values()) > IMAGE_CACHE_BYTES
            ):
                self._image_columns.popitem(last=False)
            return column

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_video_cache"] = video.VideoFileCache(self._video_cache.capacity)
        state["_image_columns"] = collections.OrderedDict()
        state["_image_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._image_lock = threading.Lock()
