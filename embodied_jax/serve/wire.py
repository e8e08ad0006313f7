"""The wire format of openpi's policy server: msgpack with NumPy arrays as tagged maps.

An array travels as ``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str,
b"shape": shape}`` and a NumPy scalar as ``{b"__npgeneric__": True, b"data": value, b"dtype":
dtype.str}``, which is what ``openpi_client.msgpack_numpy`` packs and unpacks, so an unmodified
``openpi-client`` talks to this server. Errors travel as websocket *text* frames (openpi-client
raises on those).

Decoding is for messages from strangers: only bool, integer, float and string arrays and
scalars are accepted (object, void and complex would need pickle or allocate what the message
only declares), an array's bytes must be exactly what its dtype and shape declare, a scalar
must fit its dtype, maps nest at most ``MAX_DEPTH`` deep, and every failure is a ``WireError``
whose text never quotes the decoded value.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from embodied_jax.errors import InputError

ACCEPTED_KINDS = "biufUS"  # bool, int, uint, float, str, bytes
MAX_DEPTH = 16  # maps and lists inside one message
MAX_NDIM = 8


class WireError(InputError, ValueError):
    """A message that is not msgpack-numpy (or holds an array kind that cannot travel)."""


def _pack(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind not in ACCEPTED_KINDS:
        raise WireError(f"arrays of dtype {obj.dtype} cannot be sent")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _dtype(obj: dict, what: str) -> np.dtype:
    name = obj.get(b"dtype")
    if not isinstance(name, (str, bytes)) or len(name) > 16:
        raise WireError(f"{what}: 'dtype' must be a NumPy dtype string such as '<f4'")
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as e:
        raise WireError(f"{what}: unknown dtype {name[:16]!r}") from e
    if dtype.kind not in ACCEPTED_KINDS or dtype.itemsize == 0:
        raise WireError(f"{what}: dtype {dtype} is not accepted (bool, integer, float or string only)")
    return dtype


def _array(obj: dict) -> np.ndarray:
    dtype = _dtype(obj, "array")
    shape, data = obj.get(b"shape"), obj.get(b"data")
    if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM:
        raise WireError(f"array: 'shape' must be a list of at most {MAX_NDIM} sizes")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise WireError("array: 'shape' must hold non-negative integers")
    if not isinstance(data, bytes):
        raise WireError("array: 'data' must be raw bytes")
    if len(data) != int(np.prod(shape, dtype=object)) * dtype.itemsize:
        raise WireError(f"array: {len(data)} bytes of data do not make a {dtype} array of shape {tuple(shape)}")
    return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))


def _scalar(obj: dict) -> np.generic:
    dtype = _dtype(obj, "scalar")
    data = obj.get(b"data")
    python = {"b": bool, "i": int, "u": int, "f": (int, float), "U": str, "S": bytes}[dtype.kind]
    if not isinstance(data, python) or (dtype.kind != "b" and isinstance(data, bool)):
        raise WireError(f"scalar: a {dtype} scalar needs a {dtype.kind!r}-kind value, got {type(data).__name__}")
    if dtype.kind in "iu" and not np.iinfo(dtype).min <= data <= np.iinfo(dtype).max:
        raise WireError(f"scalar: the value does not fit {dtype} [{np.iinfo(dtype).min}, {np.iinfo(dtype).max}]")
    if dtype.kind in "US" and len(data) * dtype.itemsize > 2**20:
        raise WireError("scalar: strings longer than 1 MiB are not accepted")
    try:
        with np.errstate(over="ignore"):  # a float too large for float16/32 becomes inf (refused later)
            return dtype.type(data)
    except (OverflowError, ValueError, TypeError) as e:
        raise WireError(f"scalar: the value cannot be a {dtype} ({type(e).__name__})") from e


def _unpack(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        return _array(obj)
    if b"__npgeneric__" in obj:
        return _scalar(obj)
    return obj


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack)


def _depth(obj: Any, limit: int) -> int:
    """How deep maps and lists nest in ``obj`` (stops counting past ``limit``)."""
    deepest, stack = 0, [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend((v, depth + 1) for v in node)
    return deepest


def unpackb(data: bytes) -> Any:
    """Decode one message; anything that is not acceptable msgpack-numpy is a ``WireError``."""
    try:
        decoded = msgpack.unpackb(data, object_hook=_unpack)
    except WireError:
        raise
    except RecursionError as e:
        raise WireError(f"the message nests maps or lists deeper than {MAX_DEPTH} levels") from e
    except (ValueError, TypeError, KeyError, OverflowError, MemoryError, msgpack.UnpackException) as e:
        raise WireError(f"the message is not msgpack-numpy ({type(e).__name__})") from e
    if _depth(decoded, MAX_DEPTH) > MAX_DEPTH:
        raise WireError(f"the message nests maps or lists deeper than {MAX_DEPTH} levels")
    return decoded
