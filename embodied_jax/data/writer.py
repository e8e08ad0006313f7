"""Writes small LeRobot v2.1 / v3.0 datasets from arrays (tests and simulated demonstrations).

Real parquet (pyarrow) and real mp4 (PyAV, AV1 or H.264), laid out as LeRobot writes them:
v2.1 has one parquet and one mp4 per camera per episode; v3.0 packs whole episodes into
each parquet/mp4 (``episodes_per_file``, or by default as many as keep a parquet file within
``data_files_size_in_mb`` of Arrow data, as info.json states), so episodes after the first in a
file have a non-zero ``from_timestamp``; files roll over into a new ``chunk-NNN`` directory every
``chunk_size`` files. Cameras may instead be stored as PNG bytes inside the parquet.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data import video

CAMERA_PREFIX = "observation.images."
SINGLE_CAMERA = "observation.image"  # LeRobot's key for a dataset's only camera (e.g. its Meta-World sets)


def is_camera_key(key: str) -> bool:
    return key == SINGLE_CAMERA or key.startswith(CAMERA_PREFIX)


def write_lerobot_dataset(
    root: str | os.PathLike,
    episodes: Sequence[Mapping[str, Any]],
    *,
    fps: int,
    version: str = fmt.V30,
    codec: str = "h264",
    robot_type: str = "unknown",
    image_storage: str = "video",
    episodes_per_file: int | None = None,
    data_files_size_in_mb: float = 100,
    chunk_size: int = 1000,
    modality: Mapping | None = None,
    image_shape_order: str = "hwc",
) -> pathlib.Path:
    """Writes `episodes` as a LeRobot dataset under `root` and returns `root`.

    Each episode maps ``"task"`` to a string, ``"observation.state"`` and ``"action"`` to
    float32 [T, D] arrays, any ``"observation.images.<camera>"`` (or a single ``"observation.image"``)
    to uint8 [T, H, W, 3], and optional extra per-frame features [T, ...]: bool and integer arrays
    keep their dtype (``next.success``, ``task_id``), anything else is float32.
    ``image_shape_order``: how info.json states a camera's shape, ``"hwc"`` or ``"chw"`` (as some
    hub datasets do, ``lerobot/metaworld_mt50`` among them); the frames are the same.
    """
    if image_shape_order not in ("hwc", "chw"):
        raise ValueError(f"image_shape_order must be 'hwc' or 'chw', got {image_shape_order!r}")
    if version not in (fmt.V21, fmt.V30):
        raise ValueError(f"version must be {fmt.V21!r} or {fmt.V30!r}, got {version!r}")
    if image_storage not in ("video", "png"):
        raise ValueError(f"image_storage must be 'video' or 'png', got {image_storage!r}")
    if not episodes:
        raise ValueError("no episodes to write")
    root = pathlib.Path(root)
    (root / "meta").mkdir(parents=True, exist_ok=True)
    features, cameras, vectors = _features(episodes, fps, codec, image_storage, image_shape_order)
    tasks: dict[str, int] = {}
    for episode in episodes:
        tasks.setdefault(str(episode["task"]), len(tasks))
    lengths = [len(episode["action"]) for episode in episodes]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tables = [
        _episode_table(i, episode, int(starts[i]), fps, tasks, vectors, cameras, image_storage, features)
        for i, episode in enumerate(episodes)
    ]
    files = _file_groups([t.nbytes for t in tables], episodes_per_file, data_files_size_in_mb)
    episode_stats = [
        _episode_stats(episode, table, vectors, cameras) for episode, table in zip(episodes, tables, strict=True)
    ]

    if version == fmt.V21:
        files_per_episode = _write_v21(
            root, episodes, tables, cameras, fps, codec, image_storage, chunk_size, tasks, episode_stats
        )
        total_chunks = (len(episodes) + chunk_size - 1) // chunk_size
        data_path, video_path = fmt.V21_DATA_PATH, fmt.V21_VIDEO_PATH
    else:
        files_per_episode = _write_v30(
            root,
            episodes,
            tables,
            cameras,
            fps,
            codec,
            image_storage,
            files,
            chunk_size,
            tasks,
            episode_stats,
            starts,
        )
        total_chunks = files_per_episode
        data_path, video_path = fmt.V30_DATA_PATH, fmt.V30_VIDEO_PATH

    info = {
        "codebase_version": version,
        "robot_type": robot_type,
        "total_episodes": len(episodes),
        "total_frames": int(starts[-1]),
        "total_tasks": len(tasks),
        "total_videos": len(episodes) * len(cameras) if image_storage == "video" else 0,
        "total_chunks": total_chunks,
        "chunks_size": chunk_size,
        "fps": fps,
        "splits": {"train": f"0:{len(episodes)}"},
        "data_path": data_path,
        "video_path": video_path if cameras and image_storage == "video" else None,
        "features": features,
    }
    if version == fmt.V30:
        info.pop("total_chunks")
        info.pop("total_videos")
        info["data_files_size_in_mb"] = data_files_size_in_mb
        info["video_files_size_in_mb"] = 500
    _write_json(root / fmt.INFO_PATH, info)
    _write_json(root / fmt.STATS_PATH, _aggregate_stats(episode_stats, lengths))
    if modality is not None:
        _write_json(root / fmt.MODALITY_PATH, dict(modality))
    return root


def _vector_dtype(array: np.ndarray) -> np.dtype:
    """What a non-camera feature is stored as: bool and integer dtypes as they are, else float32."""
    if array.dtype == np.bool_ or np.issubdtype(array.dtype, np.integer):
        return array.dtype
    return np.dtype(np.float32)


def _features(episodes, fps, codec, image_storage, image_shape_order="hwc"):
    first = episodes[0]
    for required in ("task", "observation.state", "action"):
        if required not in first:
            raise ValueError(f"episode 0 has no {required!r}")
    cameras = sorted(k for k in first if is_camera_key(k))
    vectors = [k for k in first if k != "task" and not is_camera_key(k)]
    features: dict[str, dict] = {}
    for key in cameras:
        height, width = np.asarray(first[key]).shape[1:3]
        if image_storage == "video":
            features[key] = {
                "dtype": "video",
                "shape": [int(height), int(width), 3],
                "names": ["height", "width", "channels"],
                "info": {
                    "video.height": int(height),
                    "video.width": int(width),
                    "video.codec": codec,
                    "video.pix_fmt": "yuv420p",
                    "video.is_depth_map": False,
                    "video.fps": fps,
                    "video.channels": 3,
                    "has_audio": False,
                },
            }
        elif image_shape_order == "chw":
            features[key] = {
                "dtype": "image",
                "shape": [3, int(height), int(width)],
                "names": ["channels", "height", "width"],
            }
        else:
            features[key] = {
                "dtype": "image",
                "shape": [int(height), int(width), 3],
                "names": ["height", "width", "channels"],
            }
    for key in vectors:
        array = np.asarray(first[key])
        shape = list(array.shape[1:]) or [1]
        names = [f"{key.split('.')[-1]}_{i}" for i in range(shape[0])] if len(shape) == 1 and shape[0] > 1 else None
        features[key] = {"dtype": str(_vector_dtype(array)), "shape": shape, "names": names}
    for key, dtype in (
        (fmt.TIMESTAMP, "float32"),
        (fmt.FRAME_INDEX, "int64"),
        (fmt.EPISODE_INDEX, "int64"),
        (fmt.INDEX, "int64"),
        (fmt.TASK_INDEX, "int64"),
    ):
        features[key] = {"dtype": dtype, "shape": [1], "names": None}
    for i, episode in enumerate(episodes):
        length = len(episode["action"])
        for key in cameras + vectors:
            if key not in episode:
                raise ValueError(f"episode {i} lacks feature {key!r} that episode 0 has")
            if len(episode[key]) != length:
                raise ValueError(f"episode {i}: {key!r} has {len(episode[key])} frames, action has {length}")
    return features, cameras, vectors


def _float_column(array: np.ndarray) -> pa.Array:
    array = np.asarray(array, dtype=np.float32)
    if array.ndim == 1:
        return pa.array(array)
    column = pa.array(array.reshape(-1))
    for size in reversed(array.shape[1:]):
        column = pa.ListArray.from_arrays(pa.array(np.arange(0, len(column) + 1, size, dtype=np.int32)), column)
    return column


def _episode_table(episode_index, episode, start, fps, tasks, vectors, cameras, image_storage, features):
    length = len(episode["action"])
    columns: dict[str, pa.Array] = {}
    for key in vectors:
        array = np.asarray(episode[key])
        if _vector_dtype(array) == np.float32:
            columns[key] = _float_column(array)
        elif array.ndim == 1:
            columns[key] = pa.array(array.astype(_vector_dtype(array)))
        else:
            raise ValueError(f"{key!r}: a {array.dtype} feature holds one value per frame, got shape {array.shape[1:]}")
    if image_storage == "png":
        image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        for key in cameras:
            frames = np.asarray(episode[key])
            columns[key] = pa.array(
                [{"bytes": video.encode_png(frame), "path": f"frame_{i:06d}.png"} for i, frame in enumerate(frames)],
                type=image_type,
            )
    frame_index = np.arange(length, dtype=np.int64)
    columns[fmt.TIMESTAMP] = pa.array((frame_index / fps).astype(np.float32))
    columns[fmt.FRAME_INDEX] = pa.array(frame_index)
    columns[fmt.EPISODE_INDEX] = pa.array(np.full(length, episode_index, np.int64))
    columns[fmt.INDEX] = pa.array(start + frame_index)
    columns[fmt.TASK_INDEX] = pa.array(np.full(length, tasks[str(episode["task"])], np.int64))
    return pa.table(columns)


def _array_stats(values: np.ndarray, *, with_quantiles: bool = True) -> dict[str, list]:
    values = np.asarray(values, dtype=np.float64)
    stats = {
        "min": values.min(0),
        "max": values.max(0),
        "mean": values.mean(0),
        "std": values.std(0),
        "count": np.array([len(values)]),
    }
    if with_quantiles:
        for name, q in fmt.STATS_QUANTILES.items():
            stats[name] = np.quantile(values, q, axis=0)
    return {k: np.asarray(v).tolist() for k, v in stats.items()}


def _episode_stats(episode, table, vectors, cameras):
    stats = {}
    for key in vectors:
        values = np.asarray(episode[key], np.float64)
        stats[key] = _array_stats(values.reshape(len(values), -1))
    for key in (fmt.TIMESTAMP, fmt.FRAME_INDEX, fmt.EPISODE_INDEX, fmt.INDEX, fmt.TASK_INDEX):
        stats[key] = _array_stats(table.column(key).to_numpy()[:, None])
    for key in cameras:
        # LeRobot keeps per-channel image stats in [0, 1] with shape [3, 1, 1].
        frames = np.asarray(episode[key])[:: max(1, len(episode[key]) // 8)].astype(np.float64) / 255.0
        per_channel = frames.reshape(-1, 3)
        camera = _array_stats(per_channel, with_quantiles=False)
        stats[key] = {
            k: (np.asarray(v)[:, None, None].tolist() if k != "count" else [len(episode[key])])
            for k, v in camera.items()
        }
    return stats


def _aggregate_stats(episode_stats, lengths):
    """Dataset stats from per-episode stats (weighted mean/variance; quantiles length-weighted)."""
    weights = np.asarray(lengths, np.float64)
    total = {}
    for key in episode_stats[0]:
        per = [s[key] for s in episode_stats]
        mean = np.average([np.asarray(p["mean"]) for p in per], axis=0, weights=weights)
        second = np.average(
            [np.asarray(p["std"]) ** 2 + np.asarray(p["mean"]) ** 2 for p in per], axis=0, weights=weights
        )
        entry = {
            "min": np.min([p["min"] for p in per], 0),
            "max": np.max([p["max"] for p in per], 0),
            "mean": mean,
            "std": np.sqrt(np.maximum(second - mean**2, 0.0)),
            "count": [int(weights.sum())],
        }
        for name in fmt.STATS_QUANTILES:
            if name in per[0]:
                entry[name] = np.average([np.asarray(p[name]) for p in per], axis=0, weights=weights)
        total[key] = {k: np.asarray(v).tolist() for k, v in entry.items()}
    return total


def _write_v21(root, episodes, tables, cameras, fps, codec, image_storage, chunk_size, tasks, episode_stats):
    for i, table in enumerate(tables):
        chunk = i // chunk_size
        path = root / fmt.V21_DATA_PATH.format(episode_chunk=chunk, episode_index=i)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        if image_storage == "video":
            for key in cameras:
                video.encode_video(
                    root / fmt.V21_VIDEO_PATH.format(episode_chunk=chunk, video_key=key, episode_index=i),
                    [np.asarray(episodes[i][key])],
                    fps,
                    codec,
                )
    _write_jsonl(root / fmt.V21_TASKS_PATH, [{"task_index": v, "task": k} for k, v in tasks.items()])
    _write_jsonl(
        root / fmt.V21_EPISODES_PATH,
        [{"episode_index": i, "tasks": [str(e["task"])], "length": len(e["action"])} for i, e in enumerate(episodes)],
    )
    _write_jsonl(
        root / fmt.V21_EPISODES_STATS_PATH, [{"episode_index": i, "stats": s} for i, s in enumerate(episode_stats)]
    )
    return len(episodes)


def _file_groups(sizes: Sequence[int], episodes_per_file: int | None, size_in_mb: float) -> list[list[int]]:
    """The episodes of each v3.0 data file: ``episodes_per_file`` at a time, or else consecutive
    episodes while their tables stay within ``size_in_mb`` (an episode larger than that alone).
    Bounded files also keep each parquet column chunk far below the 2 GB that pyarrow reads whole."""
    if episodes_per_file is not None:
        if episodes_per_file < 1:
            raise ValueError(f"episodes_per_file must be >= 1, got {episodes_per_file}")
        return [list(range(i, min(len(sizes), i + episodes_per_file))) for i in range(0, len(sizes), episodes_per_file)]
    if size_in_mb <= 0:
        raise ValueError(f"data_files_size_in_mb must be > 0, got {size_in_mb}")
    limit, groups, total = size_in_mb * 2**20, [[]], 0
    for i, size in enumerate(sizes):
        if groups[-1] and total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def _write_v30(
    root,
    episodes,
    tables,
    cameras,
    fps,
    codec,
    image_storage,
    files,
    chunk_size,
    tasks,
    episode_stats,
    starts,
):
    rows: list[dict[str, Any]] = []
    for file_number, members in enumerate(files):
        chunk, file_index = divmod(file_number, chunk_size)
        path = root / fmt.V30_DATA_PATH.format(chunk_index=chunk, file_index=file_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables([tables[i] for i in members]), path)
        spans = {}
        if image_storage == "video":
            for key in cameras:
                spans[key] = video.encode_video(
                    root / fmt.V30_VIDEO_PATH.format(video_key=key, chunk_index=chunk, file_index=file_index),
                    [np.asarray(episodes[i][key]) for i in members],
                    fps,
                    codec,
                )
        for position, i in enumerate(members):
            row = {
                "episode_index": i,
                "tasks": [str(episodes[i]["task"])],
                "length": len(episodes[i]["action"]),
                "data/chunk_index": chunk,
                "data/file_index": file_index,
                "dataset_from_index": int(starts[i]),
                "dataset_to_index": int(starts[i + 1]),
            }
            for key in spans:
                row[f"videos/{key}/chunk_index"] = chunk
                row[f"videos/{key}/file_index"] = file_index
                row[f"videos/{key}/from_timestamp"] = float(spans[key][position][0])
                row[f"videos/{key}/to_timestamp"] = float(spans[key][position][1])
            row["meta/episodes/chunk_index"] = 0
            row["meta/episodes/file_index"] = 0
            for feature, stats in episode_stats[i].items():
                for name, value in stats.items():
                    row[f"stats/{feature}/{name}"] = np.asarray(value, np.float64).reshape(-1).tolist()
            rows.append(row)
    episodes_path = root / fmt.V30_EPISODES_PATH.format(chunk_index=0, file_index=0)
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), episodes_path)
    # LeRobot writes a pandas frame whose (unnamed) index holds the task strings.
    task_table = pa.table(
        {
            "task_index": pa.array(list(tasks.values()), pa.int64()),
            "__index_level_0__": pa.array(list(tasks.keys()), pa.string()),
        }
    )
    pandas_meta = {
        "index_columns": ["__index_level_0__"],
        "column_indexes": [],
        "columns": [
            {
                "name": "task_index",
                "field_name": "task_index",
                "pandas_type": "int64",
                "numpy_type": "int64",
                "metadata": None,
            },
            {
                "name": None,
                "field_name": "__index_level_0__",
                "pandas_type": "unicode",
                "numpy_type": "object",
                "metadata": None,
            },
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__},
        "pandas_version": "2.2.3",
    }
    task_table = task_table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})
    pq.write_table(task_table, root / fmt.V30_TASKS_PATH)
    return (len(files) + chunk_size - 1) // chunk_size


def _write_json(path: pathlib.Path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))


def _write_jsonl(path: pathlib.Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
