"""The wire format of openpi's policy server: msgpack with NumPy arrays as tagged maps.

An array travels as ``{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str,
b"shape": shape}`` and a NumPy scalar as ``{b"__npgeneric__": True, b"data": value, b"dtype":
dtype.str}``, which is what ``openpi_client.msgpack_numpy`` packs and unpacks, so an unmodified
``openpi-client`` talks to this server. Object, void and complex arrays are refused (they would
need pickle). Errors travel as websocket *text* frames (openpi-client raises on those).
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from embodied_jax.errors import InputError


class WireError(InputError, ValueError):
    """A message that is not msgpack-numpy (or holds an array kind that cannot travel)."""


def _pack(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in ("V", "O", "c"):
        raise WireError(f"arrays of dtype {obj.dtype} cannot be sent")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _unpack(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind in ("V", "O", "c"):
            raise WireError(f"arrays of dtype {dtype} are not accepted")
        return np.ndarray(buffer=obj[b"data"], dtype=dtype, shape=tuple(obj[b"shape"]))
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_pack)


def unpackb(data: bytes) -> Any:
    """Decode one message; anything that is not msgpack-numpy is a ``WireError``."""
    try:
        return msgpack.unpackb(data, object_hook=_unpack)
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
        raise WireError(f"the message is not msgpack-numpy: {type(e).__name__}: {e}") from e
