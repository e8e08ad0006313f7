"""Streamed import/export between upstream safetensors checkpoints and our parameter trees.

Reading (``find_safetensors``, ``CheckpointReader``) and writing (``write_safetensors``) the
files, and moving tensors between them and a tree by a ``Layout`` (``layout``: the renaming,
transposing and planning).

Import (``import_checkpoint``) first plans everything from the safetensors headers alone and
raises ``WeightMismatchError`` listing every missing, unexpected and mis-shaped tensor before any
data is read. It then builds each leaf with ``jax.make_array_from_callback`` in its target
sharding: every device shard reads only its slice of the upstream tensor(s) through
``safetensors.safe_open(...).get_slice``, so the checkpoint is never held twice in host memory.
Values are cast to the leaf's dtype (the on-disk dtype is never checked).

Export (``export_checkpoint``) writes the same layout tensor by tensor with a streaming
safetensors writer (header first, then one tensor at a time); ignored tensors are copied only when
``like=`` names the original checkpoint, whose per-tensor dtypes are then kept as well.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from embodied_jax.models.weights.layout import (
    Entry,
    Layout,
    check_names,
    concrete_sharding,
    flatten_params,
    plan,
    unflatten_params,
)

log = logging.getLogger(__name__)

_NP_TO_ST = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
_ST_TO_NP = {v: k for k, v in _NP_TO_ST.items()}
_NUMPY_NATIVE = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U8", "BOOL"}


# ----------------------------------------------------------------------------- reading


def find_safetensors(src: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> file, for a ``.safetensors`` file, a sharded index json, or a directory."""
    from safetensors import safe_open

    src = Path(src)
    if src.is_dir():
        index = src / "model.safetensors.index.json"
        if index.is_file():
            src = index
        elif (src / "model.safetensors").is_file():
            src = src / "model.safetensors"
        else:
            files = sorted(src.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{src}: no model.safetensors, index json or *.safetensors file")
            return {name: f for f in files for name in safe_open(str(f), "numpy").keys()}
    if not src.is_file():
        raise FileNotFoundError(f"checkpoint not found: {src}")
    if src.name.endswith(".json"):
        weight_map = json.loads(src.read_text())["weight_map"]
        return {name: src.parent / fname for name, fname in weight_map.items()}
    return {name: src for name in safe_open(str(src), "numpy").keys()}


class CheckpointReader:
    """Lazy tensor-by-tensor (and slice-by-slice) access to one or several safetensors files."""

    def __init__(self, src: str | os.PathLike):
        self.src = Path(src)
        self.files = find_safetensors(src)
        self._handles: dict[tuple[Path, str], Any] = {}

    def _handle(self, name: str, framework: str = "numpy"):
        from safetensors import safe_open

        path = self.files[name]
        key = (path, framework)
        if key not in self._handles:
            self._handles[key] = safe_open(str(path), framework)
        return self._handles[key]

    def names(self) -> list[str]:
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._handle(name).get_slice(name).get_dtype()

    def metadata(self) -> dict[str, str]:
        first = next(iter(self.files), None)
        return dict(self._handle(first).metadata() or {}) if first else {}

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """The tensor, or its ``index`` slice, as a NumPy array in its on-disk dtype."""
        if self.dtype(name) in _NUMPY_NATIVE:
            piece = self._handle(name).get_slice(name)
            return np.asarray(piece[index] if index else piece[:] if self.shape(name) else piece[()])
        # bfloat16/float8: NumPy's loader cannot make these; read through JAX on the host CPU.
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            piece = self._handle(name, "flax").get_slice(name)
            value = piece[index] if index else piece[:] if self.shape(name) else piece[()]
            return np.asarray(jax.device_get(value))


# ----------------------------------------------------------------------------- import


def check_checkpoint(reader: CheckpointReader, layout: Layout, entries: list[Entry]) -> tuple[dict, list[str]]:
    """Match checkpoint names to entries; return ({slot: chosen entry}, ignored names) or raise."""
    names = {name: tuple(reader.shape(name)) for name in reader.names()}
    return check_names(f"{layout.name} checkpoint {reader.src}", names, entries, layout)


def _source_index(index: tuple[slice, ...], perm: tuple[int, ...] | None) -> tuple[slice, ...]:
    if perm is None:
        return index
    src = [slice(None)] * len(index)
    for i, p in enumerate(perm):
        src[p] = index[i]
    return tuple(src)


def _read_entry(reader: CheckpointReader, entry: Entry, index: tuple[slice, ...]) -> np.ndarray:
    value = reader.read(entry.upstream, _source_index(index, entry.transpose) if index else None)
    return value.transpose(entry.transpose) if entry.transpose is not None else value


def _leaf_callback(reader, leaf_entries: dict[int | None, Entry], shape, dtype):
    """``make_array_from_callback`` callback reading one shard; identical shards are read once."""
    cache: dict[tuple, np.ndarray] = {}
    scanned = None not in leaf_entries

    def callback(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key not in cache:
            if scanned:
                layers = range(*index[0].indices(shape[0]))
                parts = [_read_entry(reader, leaf_entries[i], index[1:]) for i in layers]
                value = np.stack(parts) if parts else np.zeros((0, *shape[1:]))
            else:
                value = _read_entry(reader, leaf_entries[None], index)
            cache.clear()
            cache[key] = value.astype(dtype)
        return cache[key]

    return callback


def import_checkpoint(src, layout: Layout, abstract_params: Any, shardings: Any = None, *, mesh=None) -> dict:
    """Read ``src`` into a nested dict of ``jax.Array`` matching ``abstract_params``.

    ``abstract_params``: nested dict or ``nnx.State`` of ``ShapeDtypeStruct``/arrays (the shapes
    and dtypes to produce). ``shardings``: the same tree of ``jax.sharding.Sharding`` (default: each
    leaf's own ``.sharding`` if it has one, else the default device); shardings over an abstract
    mesh (from ``nnx.eval_shape``) are placed on ``mesh``. Leaves matching ``layout.model_only``
    are left out of the result.
    """
    flat, keys = flatten_params(abstract_params)
    flat = {k: v for k, v in flat.items() if not layout.is_model_only(k)}
    flat_shardings = flatten_params(shardings)[0] if shardings is not None else {}
    entries = plan(layout, {k: tuple(v.shape) for k, v in flat.items()})
    reader = CheckpointReader(src)
    chosen, ignored = check_checkpoint(reader, layout, entries)
    if ignored:
        log.info(
            "%s import: skipped %d tensor(s) on the ignore list: %s", layout.name, len(ignored), ", ".join(ignored)
        )
    by_leaf: dict[str, dict[int | None, Entry]] = {}
    for (leaf, layer), entry in chosen.items():
        by_leaf.setdefault(leaf, {})[layer] = entry
    out = {}
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    for leaf, abstract in flat.items():
        shape, dtype = tuple(abstract.shape), np.dtype(abstract.dtype)
        sharding = concrete_sharding(flat_shardings.get(leaf) or getattr(abstract, "sharding", None) or default, mesh)
        callback = _leaf_callback(reader, by_leaf[leaf], shape, dtype)
        out[leaf] = jax.make_array_from_callback(shape, sharding, callback)
    return unflatten_params(out, keys)


# ----------------------------------------------------------------------------- export


def _host_value(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _st_dtype(dtype) -> str:
    name = jax.numpy.dtype(dtype).name
    if name not in _NP_TO_ST:
        raise ValueError(f"cannot write dtype {name} to safetensors")
    return _NP_TO_ST[name]


def _np_dtype(st_dtype: str) -> np.dtype:
    import ml_dtypes  # noqa: F401  (registers bfloat16/float8 with NumPy)

    return np.dtype(getattr(ml_dtypes, _ST_TO_NP[st_dtype], None) or _ST_TO_NP[st_dtype])


def write_safetensors(
    path,
    tensors: list[tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Stream tensors into one safetensors file: (name, shape, st dtype, producer) each, produced one at a time."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape, st_dtype, _ in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * _np_dtype(st_dtype).itemsize
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = dict(metadata)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, st_dtype, produce in tensors:
            value = np.ascontiguousarray(produce(), dtype=_np_dtype(st_dtype))
            if tuple(value.shape) != tuple(shape):
                raise ValueError(f"{name}: produced shape {value.shape}, header says {tuple(shape)}")
            f.write(value.tobytes())
    os.replace(tmp, path)


def export_checkpoint(
    params: Any, layout: Layout, dst, *, like=None, dtype=None, metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``params`` (nested dict / ``nnx.State`` of arrays) in the upstream layout to ``dst``.

    ``dst``: a ``.safetensors`` file or a directory (``model.safetensors`` inside). ``like``: the
    original checkpoint; its ignored tensors are copied and its per-tensor dtypes kept. ``dtype``
    overrides the written dtype of every model tensor. Returns the file written.
    """
    flat, _ = flatten_params(params)
    flat = {k: v for k, v in flat.items() if not layout.is_model_only(k)}
    entries = [e for e in plan(layout, {k: tuple(np.shape(v)) for k, v in flat.items()}) if e.canonical]
    like_reader = CheckpointReader(like) if like is not None else None
    like_names = set(like_reader.names()) if like_reader else set()

    def producer(entry: Entry):
        def produce():
            leaf = flat[entry.leaf]
            value = _host_value(leaf[entry.layer] if entry.layer is not None else leaf)
            return value.transpose(np.argsort(entry.transpose)) if entry.transpose is not None else value

        return produce

    tensors = []
    for e in entries:
        if dtype is not None:
            st = _st_dtype(dtype)
        elif e.upstream in like_names:
            st = like_reader.dtype(e.upstream)
        else:
            st = _st_dtype(flat[e.leaf].dtype)
        tensors.append((e.upstream, e.upstream_shape, st, producer(e)))
    if like_reader is not None:
        for name in like_reader.names():
            if layout.is_ignored(name):
                tensors.append(
                    (name, like_reader.shape(name), like_reader.dtype(name), lambda name=name: like_reader.read(name))
                )
    dst = Path(dst)
    if dst.suffix != ".safetensors":
        dst = dst / "model.safetensors"
    meta = dict(metadata or (like_reader.metadata() if like_reader else {}) or {"format": "pt"})
    write_safetensors(dst, tensors, meta)
    return dst
