"""Checksums of saved arrays (``train/fingerprint.py``): any flipped bit shows, shardings do not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from embodied_jax.train import fingerprint
from embodied_jax.train.optimizer import path_str


def _flip_bit(x: np.ndarray, index: int, bit: int) -> np.ndarray:
    raw = x.copy().view(np.uint8).reshape(-1)
    raw[index * x.dtype.itemsize + bit // 8] ^= 1 << (bit % 8)
    return raw.view(x.dtype).reshape(x.shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "uint8", "int32", "float8_e4m3fn"])
def test_every_single_flipped_bit_changes_the_checksum(dtype):
    rng = np.random.default_rng(0)
    x = np.asarray(jnp.asarray(rng.normal(size=(6, 5)) * 4).astype(dtype))
    tree = {"x": jnp.asarray(x)}
    reference = fingerprint.fingerprint(tree, path_str)
    for index in (0, 1, 2, 17, 29):  # even and odd positions: the sign bit times an even weight would vanish
        for bit in range(8 * x.dtype.itemsize):
            flipped = {"x": jnp.asarray(_flip_bit(x, index, bit))}
            assert fingerprint.fingerprint(flipped, path_str) != reference, (index, bit)


def test_the_checksum_does_not_depend_on_the_sharding():
    devices = np.asarray(jax.devices()[:8]).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    x = jnp.arange(8 * 6, dtype=jnp.float32).reshape(8, 6) / 7
    tree = {"w": x, "b": jnp.array([True, False, True]), "key": jax.random.key(3)}
    sharded = {**tree, "w": jax.device_put(x, NamedSharding(mesh, PartitionSpec("data", "model")))}
    assert fingerprint.fingerprint(sharded, path_str) == fingerprint.fingerprint(tree, path_str)
    # Swapped values are not the same array.
    assert fingerprint.fingerprint({**tree, "w": x.T.reshape(8, 6)}, path_str) != fingerprint.fingerprint(
        tree, path_str
    )


def test_verify_names_the_leaves_that_differ():
    tree = {"a": jnp.ones(3), "b": jnp.zeros(2)}
    saved = {"algorithm": fingerprint.ALGORITHM, "leaves": fingerprint.fingerprint(tree, path_str)}
    fingerprint.verify(tree, saved, path_str, "step 4")
    with pytest.raises(fingerprint.FingerprintMismatch, match=r"step 4: 1 restored arrays differ .*\(b\)"):
        fingerprint.verify({**tree, "b": jnp.ones(2)}, saved, path_str, "step 4")
    with pytest.raises(fingerprint.FingerprintMismatch, match="algorithm"):
        fingerprint.verify(tree, {**saved, "algorithm": "md5"}, path_str, "step 4")
