"""What the families' in-program input forms share (``policy.InProgramBuilder``): a row's state
padded to the model's width, and an image's size checked against the size a builder takes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from embodied_jax.errors import DeviceIOError, ObservationError


def pad_state(state: jax.Array, width: int, value: Any = 0) -> jax.Array:
    """A row's state [S] padded to the model's ``max_state_dim`` (with ``value``)."""
    if state.shape[0] > width:
        raise ObservationError(f"state has {state.shape[0]} dims, more than the model's max_state_dim={width}")
    return jnp.pad(state, (0, width - state.shape[0]), constant_values=value)


def check_image_size(slot: str, image: jax.Array, size: tuple[int, int] | None, family: str) -> None:
    """Refuse an image of another size than ``size`` (the host builder would resize it, which no
    jnp resize reproduces)."""
    if size is not None and tuple(image.shape[:2]) != tuple(size):
        raise DeviceIOError(
            f"camera slot {slot!r}: images of {image.shape[0]}x{image.shape[1]} reach the {family} builder, "
            f"which takes {size[0]}x{size[1]} (it would resize on the host): set the data's image_size to "
            "the model's"
        )
