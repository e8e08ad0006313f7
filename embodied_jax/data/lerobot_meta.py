"""What a LeRobot dataset's ``meta/info.json`` and ``meta/modality.json`` say (``DatasetMeta``, read
without its tables or videos), ``DatasetError``, and the checked reading of the dataset's files.

A dataset is untrusted input: every file it names stays inside its root (``inside``, by
``embodied_jax.paths``), and a JSON, JSONL or parquet file that is missing, unreadable or
malformed raises ``DatasetError`` naming the file (and, where known, the episode).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data.modality import Modality
from embodied_jax.errors import InputError
from embodied_jax.paths import resolve_inside


class DatasetError(InputError, ValueError):
    """A malformed LeRobot dataset; the message names the file and, where known, the episode."""


def inside(root: pathlib.Path, relative: str | pathlib.PurePath) -> pathlib.Path:
    """A file of the dataset at ``root``: inside it, and a regular file when it exists."""
    return resolve_inside(root, relative, what=f"dataset {root}", error=DatasetError, regular_file=True)


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


def read_jsonl(path: pathlib.Path) -> list[dict]:
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


# pyarrow reads a nested column (PNG frames: struct<bytes, path>) whole only while one row group's
# chunk of it stays under 2 GB; a row group larger than this (one file of a large dataset written
# unsplit) is read batch by batch.
WHOLE_READ_BYTES = 2**31 - 1


def read_parquet(
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
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{where}: unreadable parquet ({exc})") from exc
    if columns is not None or also_require:
        missing = [c for c in list(columns or ()) + list(also_require) if c not in schema.names]
        if missing:
            raise DatasetError(f"{where}: missing column(s) {missing}; the file has {schema.names}")
    names = list(columns) if columns is not None else None
    try:
        groups = parquet.metadata
        largest = max((groups.row_group(i).total_byte_size for i in range(groups.num_row_groups)), default=0)
        if largest <= WHOLE_READ_BYTES:
            return pq.read_table(path, columns=names)
        subset = schema if names is None else pa.schema([schema.field(n) for n in names])
        return pa.Table.from_batches(list(parquet.iter_batches(batch_size=65536, columns=names)), schema=subset)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{where}: unreadable parquet ({exc})") from exc


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
        info_path = inside(root, fmt.INFO_PATH)
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
        modality_path = inside(root, fmt.MODALITY_PATH)
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
