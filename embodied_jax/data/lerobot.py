"""Reader for LeRobot datasets v2.1 (and v2.0) and v3.0: metadata, tables, frames by timestamp.

All per-frame numeric columns are read once with pyarrow into one contiguous array per
feature; camera frames are decoded on demand (PyAV, per-process LRU of open files) or
taken from PNG bytes in the parquet. Episodes are addressed by *position* (0..num_episodes-1
over the episodes kept); `episode_indices[position]` is the dataset's own episode index.
Every error about a malformed dataset names the file and the episode. ``DatasetMeta`` is the
metadata alone (``info.json``, ``modality.json``): what a run fits its model to.

A dataset is untrusted input: every file it names stays inside its root
(``embodied_jax.paths``), its path templates are filled by ``lerobot_format.fill_template``, and
every count, index and size it declares is checked against what the dataset holds before
anything of that size is allocated.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import numbers
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
from embodied_jax.paths import resolve_inside

MAX_SECONDS = 1e9  # a video timestamp past this (31 years) is nonsense, not a long recording


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


def _inside(root: pathlib.Path, relative: str | pathlib.PurePath) -> pathlib.Path:
    """A file of the dataset at ``root``: inside it, and a regular file when it exists."""
    return resolve_inside(root, relative, what=f"dataset {root}", error=DatasetError, regular_file=True)


def _index(value: Any, where: str, field: str, *, high: int | None = None, low: int = 0) -> int:
    return fmt.bounded_int(value, where, field, low=low, high=high, error=DatasetError)


def _seconds(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= MAX_SECONDS:
        raise DatasetError(f"{where}: {field} = {fmt.shown(value)}: expected a time in [0, {MAX_SECONDS:g}] seconds")
    return float(value)


def _read_text(path: pathlib.Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError as exc:
        raise DatasetError(f"{path}: missing file") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path}: unreadable ({exc})") from exc


def _read_json(path: pathlib.Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except ValueError as exc:  # also integers past Python's digit limit
        raise DatasetError(f"{path}: invalid JSON ({exc})") from exc


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    rows = []
    for number, line in enumerate(_read_text(path).splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                raise DatasetError(f"{path}:{number}: invalid JSON ({exc})") from exc
            if not isinstance(rows[-1], dict):
                raise DatasetError(f"{path}:{number}: expected a JSON object, got {fmt.shown(rows[-1])}")
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
        info_path = _inside(root, fmt.INFO_PATH)
        info = _read_json(info_path)
        if not isinstance(info, dict):
            raise DatasetError(f"{info_path}: expected a JSON object, got {fmt.shown(info)}")
        version = str(info.get("codebase_version", ""))
        if version not in fmt.SUPPORTED_VERSIONS:
            raise DatasetError(f"{info_path}: codebase_version {version!r} is not one of {fmt.SUPPORTED_VERSIONS}")
        for key in ("fps", "features", "data_path"):
            if key not in info:
                raise DatasetError(f"{info_path}: missing field {key!r}")
        fps = info["fps"]
        if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not 0 < fps <= fmt.MAX_FPS:
            raise DatasetError(f"{info_path}: fps = {fmt.shown(fps)}: expected a frame rate in (0, {fmt.MAX_FPS}]")
        if not isinstance(info["features"], dict):
            raise DatasetError(f"{info_path}: features = {fmt.shown(info['features'])}: expected a JSON object")
        modality_path = _inside(root, fmt.MODALITY_PATH)
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
        if (
            not isinstance(shape, list)
            or len(shape) != 3
            or 3 not in (shape[0], shape[2])
            or not all(isinstance(s, int) and 0 < s <= fmt.MAX_IMAGE_SIDE for s in shape)
        ):
            raise DatasetError(
                f"{self.root / fmt.INFO_PATH}: camera {key!r} has shape {fmt.shown(shape)}, expected [H, W, 3] or "
                f"[3, H, W] (sides at most {fmt.MAX_IMAGE_SIDE})"
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
        tasks_path = _inside(self.root, fmt.V21_TASKS_PATH)
        task_rows = _read_jsonl(tasks_path)
        tasks_by_index = {}
        for row in task_rows:
            if "task_index" not in row or "task" not in row:
                raise DatasetError(f"{tasks_path}: each line needs 'task_index' and 'task', got {fmt.shown(row)}")
            tasks_by_index[_index(row["task_index"], str(tasks_path), "task_index", high=len(task_rows))] = str(
                row["task"]
            )
        tasks = [tasks_by_index.get(i, "") for i in range(max(tasks_by_index, default=-1) + 1)]
        chunk_size = _index(self.info.get("chunks_size", 1000), str(self.root / fmt.INFO_PATH), "chunks_size", low=1)
        records = []
        episodes_path = _inside(self.root, fmt.V21_EPISODES_PATH)
        rows = _read_jsonl(episodes_path)
        high = self._episode_bound(len(rows))
        for row in rows:
            if "episode_index" not in row or "length" not in row:
                raise DatasetError(
                    f"{episodes_path}: each line needs 'episode_index' and 'length', got {fmt.shown(row)}"
                )
            index = _index(row["episode_index"], str(episodes_path), "episode_index", high=high)
            length = _index(row["length"], f"{episodes_path}: episode {index}", "length", high=fmt.MAX_FRAMES)
            chunk = index // chunk_size
            data_path = self._template_path("data_path", episode_chunk=chunk, episode_index=index)
            videos = {
                key: VideoSpan(
                    self._template_path("video_path", episode_chunk=chunk, video_key=key, episode_index=index),
                    0.0,
                    length / self.fps,
                )
                for key in self.video_keys
            }
            records.append(EpisodeRecord(index, length, tuple(row.get("tasks", ())), data_path, None, videos))
        return tasks, records

    def _episode_bound(self, rows: int) -> int:
        """Episode indices lie below the number of episodes listed (or info.json's total_episodes)."""
        declared = self.info.get("total_episodes")
        declared = declared if isinstance(declared, int) and 0 <= declared < fmt.MAX_EPISODE_INDEX else 0
        return max(rows, declared)

    def _template_path(self, field: str, **values: int | str) -> pathlib.Path:
        """The file info.json's template ``field`` names for ``values``: inside the dataset."""
        where = f"{self.root / fmt.INFO_PATH}: {field}"
        try:
            relative = fmt.fill_template(self.info.get(field), **values)
        except ValueError as exc:
            raise DatasetError(f"{where}: {exc}") from exc
        return resolve_inside(self.root, relative, what=where, error=DatasetError, regular_file=True)

    def _v30_metadata(self) -> tuple[list[str], list[EpisodeRecord]]:
        tasks_path = _inside(self.root, fmt.V30_TASKS_PATH)
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
        rows = table.num_rows
        indices = [_index(i, str(tasks_path), "task_index", high=rows) for i in table.column("task_index").to_pylist()]
        strings = table.column(task_column).to_pylist()
        tasks = [""] * (max(indices, default=-1) + 1)
        for i, s in zip(indices, strings, strict=True):
            tasks[i] = str(s)

        files = sorted(self.root.glob("meta/episodes/chunk-*/file-*.parquet"))
        files = [_inside(self.root, path.relative_to(self.root)) for path in files]
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
        tables = [
            (path, _read_parquet(path, required + (["tasks"] if "tasks" in pq.read_schema(path).names else [])))
            for path in files
        ]
        # Files hold whole episodes: no chunk or file index reaches the number of episodes.
        total = sum(table.num_rows for _, table in tables)
        high = self._episode_bound(total)
        records = []
        for path, table in tables:
            for row in table.to_pylist():
                index = _index(row["episode_index"], str(path), "episode_index", high=high)
                where = f"{path}: episode {index}"
                data_path = self._template_path(
                    "data_path",
                    chunk_index=_index(row["data/chunk_index"], where, "data/chunk_index", high=total),
                    file_index=_index(row["data/file_index"], where, "data/file_index", high=total),
                )
                videos = {}
                for key in self.video_keys:
                    p = f"videos/{key}/"
                    videos[key] = VideoSpan(
                        self._template_path(
                            "video_path",
                            video_key=key,
                            chunk_index=_index(row[p + "chunk_index"], where, p + "chunk_index", high=total),
                            file_index=_index(row[p + "file_index"], where, p + "file_index", high=total),
                        ),
                        _seconds(row[p + "from_timestamp"], where, p + "from_timestamp"),
                        _seconds(row[p + "to_timestamp"], where, p + "to_timestamp"),
                    )
                length = _index(row["length"], where, "length", high=fmt.MAX_FRAMES)
                start = _index(row["dataset_from_index"], where, "dataset_from_index", high=fmt.MAX_FRAMES)
                stop = _index(row["dataset_to_index"], where, "dataset_to_index", high=fmt.MAX_FRAMES)
                if stop - start != length:
                    raise DatasetError(
                        f"{where}: dataset_to_index - dataset_from_index = {stop - start} but length = {length}"
                    )
                records.append(EpisodeRecord(index, length, tuple(row.get("tasks") or ()), data_path, start, videos))
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
