"""Reader for LeRobot datasets v2.1 (and v2.0) and v3.0: metadata, tables, frames by timestamp.

All per-frame numeric columns are read once with pyarrow into one contiguous array per
feature; camera frames are decoded on demand (PyAV, per-process LRU of open files) or
taken from PNG bytes in the parquet. Episodes are addressed by *position* (0..num_episodes-1
over the episodes kept); `episode_indices[position]` is the dataset's own episode index.
Every error about a malformed dataset names the file and the episode. ``DatasetMeta`` is the
metadata alone (``info.json``, ``modality.json``): what a run fits its model to.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data import video
from embodied_jax.data.modality import Modality
from embodied_jax.errors import InputError


class DatasetError(InputError, ValueError):
    """A malformed LeRobot dataset; the message names the file and, where known, the episode."""


@dataclasses.dataclass(frozen=True)
class VideoSpan:
    path: pathlib.Path
    from_timestamp: float
    to_timestamp: float


@dataclasses.dataclass(frozen=True)
class EpisodeRecord:
    episode_index: int
    length: int
    tasks: tuple[str, ...]
    data_path: pathlib.Path
    dataset_from_index: int | None
    videos: Mapping[str, VideoSpan]


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DatasetError(f"{path}: missing file") from exc
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: invalid JSON ({exc})") from exc


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError as exc:
        raise DatasetError(f"{path}: missing file") from exc
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: invalid JSON ({exc})") from exc
    return rows


def _read_parquet(
    path: pathlib.Path,
    columns: Sequence[str] | None = None,
    *,
    episode: int | None = None,
    also_require: Sequence[str] = (),
) -> pa.Table:
    where = f"{path}" + (f" (episode {episode})" if episode is not None else "")
    if not path.exists():
        raise DatasetError(f"{where}: missing file")
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{where}: unreadable parquet ({exc})") from exc
    if columns is not None or also_require:
        missing = [c for c in list(columns or ()) + list(also_require) if c not in schema.names]
        if missing:
            raise DatasetError(f"{where}: missing column(s) {missing}; the file has {schema.names}")
    try:
        return pq.read_table(path, columns=list(columns) if columns is not None else None)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{where}: unreadable parquet ({exc})") from exc


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


@dataclasses.dataclass(frozen=True)
class DatasetMeta:
    """What ``meta/info.json`` and ``meta/modality.json`` say of a dataset, read without its tables
    or videos (a run fits its model to this before anything else is read)."""

    root: pathlib.Path
    info: dict[str, Any]
    modality: Modality | None

    @classmethod
    def read(cls, root: str | pathlib.Path, *, modality: Modality | None = None) -> DatasetMeta:
        """``modality``: use this instead of ``meta/modality.json`` (read when present)."""
        root = pathlib.Path(root)
        info = _read_json(root / fmt.INFO_PATH)
        version = str(info.get("codebase_version", ""))
        if version not in fmt.SUPPORTED_VERSIONS:
            raise DatasetError(
                f"{root / fmt.INFO_PATH}: codebase_version {version!r} is not one of {fmt.SUPPORTED_VERSIONS}"
            )
        for key in ("fps", "features", "data_path"):
            if key not in info:
                raise DatasetError(f"{root / fmt.INFO_PATH}: missing field {key!r}")
        modality_path = root / fmt.MODALITY_PATH
        try:
            if modality is None and modality_path.exists():
                modality = Modality.load(modality_path)
            if modality is not None:
                modality.validate(info["features"], source=str(modality_path))
        except ValueError as exc:
            raise DatasetError(str(exc)) from exc
        return cls(root, info, modality)

    @property
    def version(self) -> str:
        return str(self.info["codebase_version"])

    @property
    def fps(self) -> float:
        return float(self.info["fps"])

    @property
    def features(self) -> dict[str, dict]:
        return self.info["features"]

    @property
    def video_keys(self) -> tuple[str, ...]:
        return tuple(k for k, f in self.features.items() if f.get("dtype") == "video")

    @property
    def image_keys(self) -> tuple[str, ...]:
        return tuple(k for k, f in self.features.items() if f.get("dtype") == "image")

    @property
    def camera_keys(self) -> tuple[str, ...]:
        return self.video_keys + self.image_keys

    @property
    def vector_keys(self) -> tuple[str, ...]:
        """Per-frame numeric features (state, action, ...), bookkeeping columns left out."""
        return tuple(
            k
            for k, f in self.features.items()
            if f.get("dtype") not in ("video", "image", "string") and k not in fmt.BOOKKEEPING_KEYS
        )

    def width(self, key: str) -> int:
        """Values per frame of a numeric feature (its ``shape`` in info.json)."""
        shape = self.features.get(key, {}).get("shape")
        if not isinstance(shape, list) or not shape:
            raise DatasetError(f"{self.root / fmt.INFO_PATH}: feature {key!r} has no shape (got {shape!r})")
        return int(np.prod(shape))

    def image_shape(self, key: str) -> tuple[int, int, int]:
        """(H, W, C) of camera ``key`` from its info.json shape, stored HWC or CHW."""
        feature = self.features.get(key, {})
        shape = feature.get("shape")
        if not isinstance(shape, list) or len(shape) != 3 or 3 not in (shape[0], shape[2]):
            raise DatasetError(
                f"{self.root / fmt.INFO_PATH}: camera {key!r} has shape {shape!r}, expected [H, W, 3] or [3, H, W]"
            )
        names = feature.get("names") or []
        if list(names[:1]) == ["channels"] or (shape[0] == 3 and shape[2] != 3):
            return int(shape[1]), int(shape[2]), int(shape[0])
        return int(shape[0]), int(shape[1]), int(shape[2])


class LeRobotDataset:
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

        if self.version == fmt.V30:
            self.tasks, records = self._v30_metadata()
        else:
            self.tasks, records = self._v21_metadata()
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

    # ----- metadata -------------------------------------------------------------------------------------------
    def _v21_metadata(self) -> tuple[list[str], list[EpisodeRecord]]:
        tasks_path = self.root / fmt.V21_TASKS_PATH
        task_rows = _read_jsonl(tasks_path)
        tasks_by_index = {}
        for row in task_rows:
            if "task_index" not in row or "task" not in row:
                raise DatasetError(f"{tasks_path}: each line needs 'task_index' and 'task', got {row}")
            tasks_by_index[int(row["task_index"])] = str(row["task"])
        tasks = [tasks_by_index.get(i, "") for i in range(max(tasks_by_index, default=-1) + 1)]
        chunk_size = int(self.info.get("chunks_size", 1000))
        video_template = self.info.get("video_path")
        records = []
        episodes_path = self.root / fmt.V21_EPISODES_PATH
        for row in _read_jsonl(episodes_path):
            if "episode_index" not in row or "length" not in row:
                raise DatasetError(f"{episodes_path}: each line needs 'episode_index' and 'length', got {row}")
            index = int(row["episode_index"])
            chunk = index // chunk_size
            data_path = self.root / self.info["data_path"].format(episode_chunk=chunk, episode_index=index)
            videos = {
                key: VideoSpan(
                    self.root / video_template.format(episode_chunk=chunk, video_key=key, episode_index=index),
                    0.0,
                    float(row["length"]) / self.fps,
                )
                for key in self.video_keys
            }
            records.append(
                EpisodeRecord(index, int(row["length"]), tuple(row.get("tasks", ())), data_path, None, videos)
            )
        return tasks, records

    def _v30_metadata(self) -> tuple[list[str], list[EpisodeRecord]]:
        tasks_path = self.root / fmt.V30_TASKS_PATH
        table = _read_parquet(tasks_path)
        names = table.column_names
        if "task_index" not in names:
            raise DatasetError(f"{tasks_path}: missing column 'task_index'; the file has {names}")
        task_column = next((c for c in ("task", "__index_level_0__") if c in names), None)
        if task_column is None:
            task_column = next((c for c in names if pa.types.is_string(table.schema.field(c).type)), None)
        if task_column is None:
            raise DatasetError(
                f"{tasks_path}: no task string column (expected the index 'task' or '__index_level_0__')"
            )
        indices = table.column("task_index").to_pylist()
        strings = table.column(task_column).to_pylist()
        tasks = [""] * (max(indices, default=-1) + 1)
        for i, s in zip(indices, strings, strict=True):
            tasks[int(i)] = str(s)

        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetError(
                f"{self.root / 'meta' / 'episodes'}: missing episode metadata files (chunk-*/file-*.parquet)"
            )
        required = [
            "episode_index",
            "length",
            "data/chunk_index",
            "data/file_index",
            "dataset_from_index",
            "dataset_to_index",
        ]
        for key in self.video_keys:
            required += [f"videos/{key}/{c}" for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
        records = []
        video_template = self.info.get("video_path")
        for path in files:
            table = _read_parquet(path, required + (["tasks"] if "tasks" in pq.read_schema(path).names else []))
            for row in table.to_pylist():
                index = int(row["episode_index"])
                data_path = self.root / self.info["data_path"].format(
                    chunk_index=int(row["data/chunk_index"]), file_index=int(row["data/file_index"])
                )
                videos = {}
                for key in self.video_keys:
                    p = f"videos/{key}/"
                    videos[key] = VideoSpan(
                        self.root
                        / video_template.format(
                            video_key=key,
                            chunk_index=int(row[p + "chunk_index"]),
                            file_index=int(row[p + "file_index"]),
                        ),
                        float(row[p + "from_timestamp"]),
                        float(row[p + "to_timestamp"]),
                    )
                length = int(row["length"])
                if int(row["dataset_to_index"]) - int(row["dataset_from_index"]) != length:
                    raise DatasetError(
                        f"{path}: episode {index}: dataset_to_index - dataset_from_index "
                        f"= {int(row['dataset_to_index']) - int(row['dataset_from_index'])} but length = {length}"
                    )
                records.append(
                    EpisodeRecord(
                        index, length, tuple(row.get("tasks") or ()), data_path, int(row["dataset_from_index"]), videos
                    )
                )
        records.sort(key=lambda r: r.episode_index)
        return tasks, records

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
                table = _read_parquet(path, numeric, episode=members[0].episode_index, also_require=self.image_keys)
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
        self.episode_indices = np.array([r.episode_index for r in self.episodes], np.int64)
        self.episode_lengths = np.array([r.length for r in self.episodes], np.int64)
        self.episode_starts = np.concatenate([[0], np.cumsum(self.episode_lengths)]).astype(np.int64)
        self._row_starts = [start for _, start, _ in kept]
        self.arrays = {key: np.concatenate([arrays[key] for _, _, arrays in kept]) for key in numeric}
        self._position = {int(e): i for i, e in enumerate(self.episode_indices)}

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
            self.episode_indices = self.episode_indices[keep]
            self.episode_lengths = self.episode_lengths[keep]
            self.episode_starts = np.concatenate([[0], np.cumsum(self.episode_lengths)]).astype(np.int64)
            self._position = {int(e): i for i, e in enumerate(self.episode_indices)}

    # ----- access ---------------------------------------------------------------------------------------------
    @property
    def num_episodes(self) -> int:
        return len(self.episodes)

    @property
    def num_frames(self) -> int:
        return int(self.episode_starts[-1])

    def position_of(self, episode_index: int) -> int:
        """Position (0..num_episodes-1) of a dataset episode index."""
        if int(episode_index) not in self._position:
            raise KeyError(f"{self.root}: episode {episode_index} is not loaded")
        return self._position[int(episode_index)]

    def episode_array(self, position: int, key: str) -> np.ndarray:
        """All frames of one per-frame feature of an episode, [T, ...]."""
        return self.arrays[key][self.episode_starts[position] : self.episode_starts[position + 1]]

    def task(self, position: int, frame_index: int) -> str:
        return self.tasks[int(self.arrays[fmt.TASK_INDEX][self.episode_starts[position] + frame_index])]

    def image_shape(self, key: str) -> tuple[int, int, int]:
        return self.meta.image_shape(key)

    def images(self, position: int, key: str, frame_indices: Sequence[int]) -> np.ndarray:
        """uint8 [N, H, W, 3] frames of camera `key` for frames of an episode."""
        record = self.episodes[position]
        frame_indices = np.asarray(frame_indices, dtype=np.int64)
        if key in record.videos:
            span = record.videos[key]
            timestamps = (
                self.episode_array(position, fmt.TIMESTAMP)[frame_indices].astype(np.float64) + span.from_timestamp
            )
            try:
                frames = self._video_cache.get(span.path).frames_at(timestamps, self.fps, self.tolerance_s)
            except video.VideoDecodeError as exc:
                raise DatasetError(f"{exc} [episode {record.episode_index}, camera {key}]") from exc
            if frames.shape[1:] != self.image_shape(key):
                raise DatasetError(
                    f"{span.path}: camera {key} decodes to {list(frames.shape[1:])} (H, W, C), but meta/info.json "
                    f"gives {list(self.image_shape(key))} [episode {record.episode_index}]"
                )
            return frames
        if key in self.image_keys:
            column = self._image_column(record.data_path, key)
            start = self._row_starts[position]
            out = []
            for frame in frame_indices:
                cell = column[start + int(frame)].as_py()
                data = cell.get("bytes") if isinstance(cell, dict) else cell
                if data is None and isinstance(cell, dict) and cell.get("path"):
                    data = (self.root / cell["path"]).read_bytes()
                try:
                    out.append(video.decode_png(data))
                except Exception as exc:  # FFmpeg raises several error types for bad image bytes.
                    raise DatasetError(
                        f"{record.data_path}: episode {record.episode_index}: frame {int(frame)} of "
                        f"{key} does not decode as an image ({exc})"
                    ) from exc
            return np.stack(out)
        raise KeyError(f"{key!r} is not a camera of {self.root}; cameras: {self.camera_keys}")

    def _image_column(self, path: pathlib.Path, key: str) -> pa.ChunkedArray:
        cache_key = (str(path), key)
        with self._image_lock:
            column = self._image_columns.pop(cache_key, None)
            if column is None:
                column = _read_parquet(path, [key]).column(key)
            self._image_columns[cache_key] = column
            while len(self._image_columns) > 4:
                self._image_columns.popitem(last=False)
            return column

    def frame(self, position: int, frame_index: int) -> dict[str, Any]:
        """One frame's raw values: every feature under its dataset key, cameras uint8 HWC, task string."""
        if not 0 <= frame_index < self.episode_lengths[position]:
            raise IndexError(
                f"frame {frame_index} outside episode {self.episode_indices[position]} "
                f"(length {self.episode_lengths[position]})"
            )
        row = self.episode_starts[position] + frame_index
        out: dict[str, Any] = {key: self.arrays[key][row] for key in self.arrays}
        for key in self.camera_keys:
            out[key] = self.images(position, key, [frame_index])[0]
        out["task"] = self.task(position, frame_index)
        return out

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_video_cache"] = video.VideoFileCache(self._video_cache.capacity)
        state["_image_columns"] = collections.OrderedDict()
        state["_image_lock"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._image_lock = threading.Lock()
