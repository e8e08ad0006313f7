"""A checksum of every array of a saved train state, so a restore can prove it read the saved values.

TensorStore checks the OCDBT manifest and b-tree nodes (CRC-32C) but not the zstd-compressed
array chunks: a byte flipped inside a chunk usually fails to decompress, but one inside a
literal run decompresses into a different value and restores without an error. ``Checkpointer``
therefore saves each leaf's checksum beside the state (the ``fingerprint`` item) and compares
after every restore; a mismatch is damage to the step's own bytes (``FingerprintMismatch``).

The checksum of a leaf is the sum, modulo 2**32, of each element's bits (as an unsigned integer
of its width) times ``2 * flat_index + 1``. The weights are odd, so any single flipped bit changes
the sum; the flat index comes from per-dimension iotas, so the sum is computed on the arrays'
own shardings (each device sums its part, then one all-reduce) and never gathers an array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "u32-odd-weighted-sum/v1"

_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


class FingerprintMismatch(ValueError):
    """Restored values differ from the checksums saved with them: the step's bytes are damaged."""


def _bits(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if x.dtype.itemsize not in _UNSIGNED:
        raise TypeError(f"no checksum for dtype {x.dtype} (itemsize {x.dtype.itemsize})")
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32)


def _leaf_checksum(x: jax.Array) -> jax.Array:
    bits = _bits(x)
    index = jnp.zeros(bits.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(bits.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[dim]
    return jnp.sum(bits * (2 * index + 1), dtype=jnp.uint32)


@jax.jit
def _checksums(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_leaf_checksum(x) for x in leaves]


def fingerprint(tree, path_str) -> dict[str, int]:
    """``{path: checksum}`` for every array leaf of ``tree`` (``None`` leaves are absent)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [path_str(path) for path, _ in flat]
    sums = _checksums([x for _, x in flat])
    # Replicated scalars: every process reads its own copy (no cross-process gather).
    return {p: int(np.asarray(s.addressable_data(0))) for p, s in zip(paths, sums, strict=True)}


def verify(tree, saved: dict, path_str, where: str) -> None:
    """Raise ``FingerprintMismatch`` naming the leaves of ``tree`` whose checksums differ from ``saved``
    (``{"algorithm", "leaves"}``, as ``Checkpointer.save`` wrote it)."""
    if saved.get("algorithm") != ALGORITHM:
        raise FingerprintMismatch(f"{where}: fingerprint algorithm {saved.get('algorithm')!r}, expected {ALGORITHM!r}")
    expected = saved.get("leaves", {})
    now = fingerprint(tree, path_str)
    differ = sorted(p for p in now if expected.get(p) != now[p])
    if differ:
        shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
        raise FingerprintMismatch(
            f"{where}: {len(differ)} restored arrays differ from the checksums saved with them ({shown})"
        )
