"""The run's per-sample transform before the model's builder, as jnp for one row: the state
normalised as the host normalises it (and, for π0.5's prompt, the raw values at which its bins
change), images renamed to the model's slots and put in [-1, 1]; made once from a bundle
(``Front.of``) for ``bundle/device_io.py``, which hands it to the family's in-program form
(``Front`` is a ``policy.RowTransform``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.data.stats import normalize, unnormalize
from embodied_jax.errors import DeviceIOError
from embodied_jax.images import to_unit_range

if TYPE_CHECKING:
    from embodied_jax.bundle.policy_bundle import PolicyBundle


@dataclasses.dataclass(frozen=True)
class Front:
    """A ``policy.RowTransform``: the per-sample transform before the builder (``SampleTransform``:
    normalise, images, rename) on one row: state [S] -> normalised float32 [S]; images {dataset key: uint8 [H, W, 3]} ->
    {model slot: float32 [H, W, 3]}."""

    state_key: str
    state_dim: int | None
    state_norm: tuple[Any, str] | None  # (FeatureStats, mode)
    cameras: tuple[tuple[str, str], ...]  # (dataset key, model slot)
    image_size: tuple[int, int] | None
    as_float: bool

    @classmethod
    def of(cls, bundle: PolicyBundle) -> Front:
        transform, inputs = bundle.transform, bundle.inputs
        norm = None
        if transform.normalizer is not None and inputs.state_key in transform.normalizer.modes:
            mode = transform.normalizer.modes[inputs.state_key]
            stats = transform.normalizer.stats.get(inputs.state_key)
            if stats is None:
                raise DeviceIOError(f"norm_stats has no statistics for {inputs.state_key!r} ({mode} normalisation)")
            norm = (stats, mode)
        size = transform.images.size
        return cls(
            state_key=inputs.state_key,
            state_dim=bundle.state_dim,
            state_norm=norm,
            cameras=tuple(inputs.cameras),
            image_size=None if size is None else (int(size[0]), int(size[1])),
            as_float=transform.images.as_float,
        )

    def state(self, state: jax.Array) -> jax.Array:
        state = jnp.asarray(state, jnp.float32)
        if self.state_norm is None:
            return state
        stats, mode = self.state_norm
        return normalize(state, stats, mode, key=self.state_key, xp=jnp)

    def host_state(self, state: np.ndarray) -> np.ndarray:
        """One raw state normalised on the host, as the bundle's transform does (NumPy)."""
        state = np.asarray(state, np.float32)
        if self.state_norm is None:
            return state
        stats, mode = self.state_norm
        return normalize(state, stats, mode, key=self.state_key)

    def host_raw_state(self, normalised: np.ndarray) -> np.ndarray:
        """A raw state whose normalisation is about ``normalised`` (probe states)."""
        if self.state_norm is None:
            return np.asarray(normalised, np.float32)
        stats, mode = self.state_norm
        return unnormalize(normalised, stats, mode, key=self.state_key)

    def thresholds(self, edges: np.ndarray) -> np.ndarray:
        """[S, K] float32: per state dimension, the smallest raw float32 value whose host
        normalisation is >= ``edges[k]`` (NaN: none); [1, K] (the edges) without normalisation.
        A binary search over the ordered float32 values: normalising (float64, one rounding to
        float32) and clipping are monotone."""
        edges = np.asarray(edges, np.float32)
        if self.state_norm is None:
            return edges[None]
        width = len(np.asarray(self.state_norm[0].mean))
        shape = (len(edges), width)
        low, high = np.full(shape, _order(-np.inf)), np.full(shape, _order(np.inf))

        def reaches(order):  # [K, S] bool: the normalisation of those values reaches each edge
            with np.errstate(over="ignore", invalid="ignore"):  # the search starts at +-inf
                return self.host_state(_from_order(order)) >= edges[:, None]

        while (low < high).any():
            middle = (low + high) // 2
            above = reaches(middle)
            high, low = np.where(above, middle, high), np.where(above, low, middle + 1)
        return np.where(reaches(low), _from_order(low), np.float32(np.nan)).T.copy()

    def images(self, images: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        out = {}
        for key, slot in self.cameras:
            image = images[key]
            if self.image_size is not None and tuple(image.shape[:2]) != self.image_size:
                raise DeviceIOError(
                    f"{key}: images of {image.shape[0]}x{image.shape[1]}, the run's image size is "
                    f"{self.image_size[0]}x{self.image_size[1]}: device_io does not resize (the host "
                    "resizes through swscale); render at the run's image size"
                )
            out[slot] = to_unit_range(image, xp=jnp) if self.as_float else image
        return out


def _order(value: Any) -> np.ndarray:
    """float32 -> int64 keys in the floats' order (-0.0 and 0.0 alike)."""
    bits = np.asarray(value, np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _from_order(order: np.ndarray) -> np.ndarray:
    """The inverse of ``_order``."""
    return np.where(order < 0, (-order) | 0x80000000, order).astype(np.uint32).view(np.float32)
