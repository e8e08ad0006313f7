"""Image preprocessing shared by the data layer and the models' input builders (NumPy; ``to_unit_range``
also in jnp, for the models' in-program input forms).

A bottom-floor module (it imports nothing of the library), so every part may use it.

- ``to_unit_range``: uint8 [0, 255] -> float32 [-1, 1] as ``x / 127.5 - 1`` (one rounding,
  exact at 0 and 255; upstream's ``x / 255 * 2 - 1`` and ``x * (2 / 255) - 1`` differ from it in
  the last float32 bit only). ``floats`` says how a float image is read (the models differ).
- ``resize``: bilinear resize of a uint8 [H, W, 3] image through FFmpeg's swscale (PyAV).
- ``resize_with_pad``: resize keeping the aspect ratio and centre on a black canvas
  (0 for uint8, -1 for float images in [-1, 1], as openpi's ``image_tools.resize_with_pad``);
  ``rounding`` picks how the resized size is computed (the callers differ).
"""

from __future__ import annotations

from typing import Any

import numpy as np

FLOAT_RANGES = ("signed", "auto")
UNIT_RANGE = np.arange(256, dtype=np.float32) / 127.5 - 1.0  # uint8 pixel -> float32 [-1, 1]
ROUNDINGS = ("round", "floor")


def to_unit_range(image: Any, *, floats: str = "signed", xp: Any = np) -> Any:
    """uint8 [0, 255] -> float32 [-1, 1] (the Observation contract); float input per ``floats``:

    - ``"signed"``: already in [-1, 1], returned as float32 (data layer, GR00T's builder: Eagle's
      processor normalises uint8 images only);
    - ``"auto"``: an image wholly inside [0, 1] is read as [0, 1] and mapped with ``x * 2 - 1``,
      any other as already in [-1, 1] (π0.5's builder: LeRobot hands π0.5 float images in [0, 1]).

    ``xp``: ``numpy`` on the host, or ``jax.numpy`` inside a jitted program (one image per call:
    "auto" reads the whole array, so map it over a batch with ``jax.vmap``). uint8 pixels are
    looked up in one 256-entry table (``UNIT_RANGE``) either way: XLA turns a division by a
    constant into a multiplication by its reciprocal, which rounds 255 to 1.0000001.
    """
    if floats not in FLOAT_RANGES:
        raise ValueError(f"to_unit_range: floats must be one of {FLOAT_RANGES}, got {floats!r}")
    image = xp.asarray(image)
    if image.dtype == np.uint8:
        return xp.asarray(UNIT_RANGE)[image]
    image = image.astype(xp.float32)
    if floats != "auto":
        return image
    inside = (image.min(initial=0.0) >= 0.0) & (image.max(initial=0.0) <= 1.0)
    if xp is np:
        return image * 2.0 - 1.0 if inside else image
    return xp.where(inside, image * 2.0 - 1.0, image)


def resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of a uint8 [H, W, 3] image (returns the input when the size already matches)."""
    import av

    if image.shape[:2] == (height, width):
        return image
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
    return frame.reformat(width=width, height=height, format="rgb24", interpolation="BILINEAR").to_ndarray()


def _resize_float(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of a float [H, W, C] image in [-1, 1], channel by channel (PIL "F"), clipped to [-1, 1]."""
    from PIL import Image

    channels = [
        np.asarray(Image.fromarray(image[..., c].astype(np.float32), mode="F").resize((width, height), Image.BILINEAR))
        for c in range(image.shape[-1])
    ]
    return np.clip(np.stack(channels, axis=-1), -1.0, 1.0)


def resize_with_pad(image: np.ndarray, height: int, width: int, *, rounding: str = "round") -> np.ndarray:
    """Resize an [H, W, C] image keeping its aspect ratio, centred on a black height x width canvas.

    uint8 images are resized with swscale and padded with 0; float images (in [-1, 1]) with PIL's
    float bilinear filter, clipped to [-1, 1] and padded with -1 (black either way, as openpi).
    ``rounding`` sets the resized size:

    - ``"round"``: ``max(1, round(side * min(height / H, width / W)))`` (the data layer's frame
      resizing: ``ImageTransform``, the frame-store converter);
    - ``"floor"``: ``int(side / max(W / width, H / height))`` (openpi's and LeRobot's π0.5
      ``resize_with_pad``; π0.5's input builder).

    Returns the input unchanged when it already has the size.
    """
    if rounding not in ROUNDINGS:
        raise ValueError(f"resize_with_pad: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    in_h, in_w = image.shape[:2]
    if (in_h, in_w) == (height, width):
        return image
    if rounding == "round":
        scale = min(height / in_h, width / in_w)
        new_h, new_w = max(1, int(round(in_h * scale))), max(1, int(round(in_w * scale)))
    else:
        ratio = max(in_w / width, in_h / height)
        new_h, new_w = int(in_h / ratio), int(in_w / ratio)
    if image.dtype == np.uint8:
        resized, black = resize(image, new_h, new_w), 0
    else:
        resized, black = _resize_float(image, new_h, new_w), -1.0
    out = np.full((height, width, image.shape[-1]), black, resized.dtype)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    out[top : top + new_h, left : left + new_w] = resized
    return out
