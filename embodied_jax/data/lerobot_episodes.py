"""The task and episode tables of a LeRobot dataset's ``meta/`` (v2.x JSONL, v3.0 parquet): one
``EpisodeRecord`` per episode, with its data file and video spans.

Every index, length and time these tables declare is bounded (by the number of episodes listed,
``lerobot_format.MAX_FRAMES``, ``MAX_SECONDS``), and every file they name is filled from
``info.json``'s templates by ``lerobot_format.fill_template`` and kept inside the dataset.
"""

from __future__ import annotations

import dataclasses
import numbers
import pathlib
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data.lerobot_meta import DatasetError, DatasetMeta, inside, read_jsonl, read_parquet
from embodied_jax.paths import resolve_inside

MAX_SECONDS = 1e9  # a video timestamp past this (31 years) is nonsense, not a long recording


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


def _index(value: Any, where: str, field: str, *, high: int | None = None, low: int = 0) -> int:
    return fmt.bounded_int(value, where, field, low=low, high=high, error=DatasetError)


def _seconds(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value <= MAX_SECONDS:
        raise DatasetError(f"{where}: {field} = {fmt.shown(value)}: expected a time in [0, {MAX_SECONDS:g}] seconds")
    return float(value)


def read_tasks_and_episodes(meta: DatasetMeta) -> tuple[list[str], list[EpisodeRecord]]:
    """The dataset's task strings (by task index) and a record of every episode its ``meta/`` lists."""
    if meta.version == fmt.V30:
        return _v30_metadata(meta)
    return _v21_metadata(meta)


def _v21_metadata(meta: DatasetMeta) -> tuple[list[str], list[EpisodeRecord]]:
    tasks_path = inside(meta.root, fmt.V21_TASKS_PATH)
    task_rows = read_jsonl(tasks_path)
    tasks_by_index = {}
    for row in task_rows:
        if "task_index" not in row or "task" not in row:
            raise DatasetError(f"{tasks_path}: each line needs 'task_index' and 'task', got {fmt.shown(row)}")
        tasks_by_index[_index(row["task_index"], str(tasks_path), "task_index", high=len(task_rows))] = str(row["task"])
    tasks = [tasks_by_index.get(i, "") for i in range(max(tasks_by_index, default=-1) + 1)]
    chunk_size = _index(meta.info.get("chunks_size", 1000), str(meta.root / fmt.INFO_PATH), "chunks_size", low=1)
    records = []
    episodes_path = inside(meta.root, fmt.V21_EPISODES_PATH)
    rows = read_jsonl(episodes_path)
    high = _episode_bound(meta, len(rows))
    for row in rows:
        if "episode_index" not in row or "length" not in row:
            raise DatasetError(f"{episodes_path}: each line needs 'episode_index' and 'length', got {fmt.shown(row)}")
        index = _index(row["episode_index"], str(episodes_path), "episode_index", high=high)
        length = _index(row["length"], f"{episodes_path}: episode {index}", "length", high=fmt.MAX_FRAMES)
        chunk = index // chunk_size
        data_path = _template_path(meta, "data_path", episode_chunk=chunk, episode_index=index)
        videos = {
            key: VideoSpan(
                _template_path(meta, "video_path", episode_chunk=chunk, video_key=key, episode_index=index),
                0.0,
                length / meta.fps,
            )
            for key in meta.video_keys
        }
        records.append(EpisodeRecord(index, length, tuple(row.get("tasks", ())), data_path, None, videos))
    return tasks, records


def _episode_bound(meta: DatasetMeta, rows: int) -> int:
    """Episode indices lie below the number of episodes listed (or info.json's total_episodes)."""
    declared = meta.info.get("total_episodes")
    declared = declared if isinstance(declared, int) and 0 <= declared < fmt.MAX_EPISODE_INDEX else 0
    return max(rows, declared)


def _template_path(meta: DatasetMeta, field: str, **values: int | str) -> pathlib.Path:
    """The file info.json's template ``field`` names for ``values``: inside the dataset."""
    where = f"{meta.root / fmt.INFO_PATH}: {field}"
    try:
        relative = fmt.fill_template(meta.info.get(field), **values)
    except ValueError as exc:
        raise DatasetError(f"{where}: {exc}") from exc
    return resolve_inside(meta.root, relative, what=where, error=DatasetError, regular_file=True)


def _v30_metadata(meta: DatasetMeta) -> tuple[list[str], list[EpisodeRecord]]:
    tasks_path = inside(meta.root, fmt.V30_TASKS_PATH)
    table = read_parquet(tasks_path)
    names = table.column_names
    if "task_index" not in names:
        raise DatasetError(f"{tasks_path}: missing column 'task_index'; the file has {names}")
    task_column = next((c for c in ("task", "__index_level_0__") if c in names), None)
    if task_column is None:
        task_column = next((c for c in names if pa.types.is_string(table.schema.field(c).type)), None)
    if task_column is None:
        raise DatasetError(f"{tasks_path}: no task string column (expected the index 'task' or '__index_level_0__')")
    rows = table.num_rows
    indices = [_index(i, str(tasks_path), "task_index", high=rows) for i in table.column("task_index").to_pylist()]
    strings = table.column(task_column).to_pylist()
    tasks = [""] * (max(indices, default=-1) + 1)
    for i, s in zip(indices, strings, strict=True):
        tasks[i] = str(s)

    files = sorted(meta.root.glob("meta/episodes/chunk-*/file-*.parquet"))
    files = [inside(meta.root, path.relative_to(meta.root)) for path in files]
    if not files:
        raise DatasetError(
            f"{meta.root / 'meta' / 'episodes'}: missing episode metadata files (chunk-*/file-*.parquet)"
        )
    required = [
        "episode_index",
        "length",
        "data/chunk_index",
        "data/file_index",
        "dataset_from_index",
        "dataset_to_index",
    ]
    for key in meta.video_keys:
        required += [f"videos/{key}/{c}" for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp")]
    tables = [
        (path, read_parquet(path, required + (["tasks"] if "tasks" in pq.read_schema(path).names else [])))
        for path in files
    ]
    # Files hold whole episodes: no chunk or file index reaches the number of episodes.
    total = sum(table.num_rows for _, table in tables)
    high = _episode_bound(meta, total)
    records = []
    for path, table in tables:
        for row in table.to_pylist():
            index = _index(row["episode_index"], str(path), "episode_index", high=high)
            where = f"{path}: episode {index}"
            data_path = _template_path(
                meta,
                "data_path",
                chunk_index=_index(row["data/chunk_index"], where, "data/chunk_index", high=total),
                file_index=_index(row["data/file_index"], where, "data/file_index", high=total),
            )
            videos = {}
            for key in meta.video_keys:
                p = f"videos/{key}/"
                videos[key] = VideoSpan(
                    _template_path(
                        meta,
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
