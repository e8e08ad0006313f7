"""Image transforms on uint8 HWC arrays: resize (with padding), random shift, random crop, rotation,
colour jitter.

Random transforms take a `np.random.Generator`; the pipeline hands in Grain's per-record
generator (`random_map`), so a run is reproducible from its seed. Resizing uses FFmpeg's
swscale (bilinear) through PyAV, which is fast and needs no extra imaging library.
`resize`, `resize_with_pad` and the uint8 -> float [-1, 1] conversion (`to_unit_range`) are
shared with the models' input builders and live in `embodied_jax.images`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from embodied_jax.config_registry import register
from embodied_jax.images import resize, resize_with_pad, to_unit_range


def random_crop_resize(image: np.ndarray, rng: np.random.Generator, scale: float = 0.95) -> np.ndarray:
    """Crop a random window of `scale` times each side, then resize back to the input size."""
    h, w = image.shape[:2]
    crop_h, crop_w = max(1, int(round(h * scale))), max(1, int(round(w * scale)))
    top = int(rng.integers(0, h - crop_h + 1))
    left = int(rng.integers(0, w - crop_w + 1))
    return resize(np.ascontiguousarray(image[top : top + crop_h, left : left + crop_w]), h, w)


def random_shift(image: np.ndarray, rng: np.random.Generator, pixels: int) -> np.ndarray:
    """Translate by up to `pixels` each way: pad every side by replicating the edge, then cut a
    window of the input's size at a random offset (DrQ's augmentation for pixel policies)."""
    h, w = image.shape[:2]
    padded = np.pad(image, ((pixels, pixels), (pixels, pixels), (0, 0)), mode="edge")
    top, left = (int(v) for v in rng.integers(0, 2 * pixels + 1, size=2))
    return np.ascontiguousarray(padded[top : top + h, left : left + w])


def rotate(image: np.ndarray, degrees: float) -> np.ndarray:
    """Rotate about the centre by `degrees` (bilinear, zero fill)."""
    h, w = image.shape[:2]
    theta = np.deg2rad(degrees)
    cos, sin = np.cos(theta), np.sin(theta)
    yy, xx = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32), indexing="ij")
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    src_x = cos * (xx - cx) + sin * (yy - cy) + cx
    src_y = -sin * (xx - cx) + cos * (yy - cy) + cy
    x0, y0 = np.floor(src_x).astype(np.int64), np.floor(src_y).astype(np.int64)
    fx, fy = (src_x - x0)[..., None], (src_y - y0)[..., None]
    padded = np.zeros((h + 2, w + 2, 3), np.float32)
    padded[1:-1, 1:-1] = image

    def at(y, x):
        return padded[np.clip(y + 1, 0, h + 1), np.clip(x + 1, 0, w + 1)]

    out = (
        at(y0, x0) * (1 - fx) * (1 - fy)
        + at(y0, x0 + 1) * fx * (1 - fy)
        + at(y0 + 1, x0) * (1 - fx) * fy
        + at(y0 + 1, x0 + 1) * fx * fy
    )
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def color_jitter(
    image: np.ndarray, *, brightness: float = 1.0, contrast: float = 1.0, saturation: float = 1.0, hue: float = 0.0
) -> np.ndarray:
    """Brightness/contrast/saturation factors (1 = unchanged) and a hue rotation in turns (0 = unchanged)."""
    x = image.astype(np.float32) / 255.0
    x = x * brightness
    gray = x @ np.array([0.299, 0.587, 0.114], np.float32)
    x = (x - gray.mean()) * contrast + gray.mean()
    gray = x @ np.array([0.299, 0.587, 0.114], np.float32)
    x = (x - gray[..., None]) * saturation + gray[..., None]
    if hue:
        # Rotate chroma in YIQ space: a linear approximation of an HSV hue shift.
        to_yiq = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.322], [0.211, -0.523, 0.312]], np.float32)
        angle = 2 * np.pi * hue
        rotation = np.array(
            [[1, 0, 0], [0, np.cos(angle), -np.sin(angle)], [0, np.sin(angle), np.cos(angle)]], np.float32
        )
        x = x @ (np.linalg.inv(to_yiq) @ rotation @ to_yiq).T.astype(np.float32)
    return np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)


@register
@dataclasses.dataclass(frozen=True)
class AugmentConfig:
    """Training-time image augmentation (all off when a field is 0 / 1). ``shift`` (pixels,
    default off) translates each image at random before the rest; it keeps every object's size,
    where a crop rescales."""

    shift: int = 0
    crop_scale: float = 0.95
    max_rotation_degrees: float = 5.0
    brightness: float = 0.3
    contrast: float = 0.4
    saturation: float = 0.5
    hue: float = 0.08

    ADDED_FIELDS = ("shift",)  # configs saved before it load with its default

    def __post_init__(self):
        if self.shift < 0:
            raise ValueError(f"shift={self.shift}: a number of pixels, at least 0")

    def apply(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        if self.shift:
            image = random_shift(image, rng, self.shift)
        if self.crop_scale < 1.0:
            image = random_crop_resize(image, rng, self.crop_scale)
        if self.max_rotation_degrees > 0:
            image = rotate(image, float(rng.uniform(-self.max_rotation_degrees, self.max_rotation_degrees)))
        if self.brightness or self.contrast or self.saturation or self.hue:
            image = color_jitter(
                image,
                brightness=float(rng.uniform(1 - self.brightness, 1 + self.brightness)),
                contrast=float(rng.uniform(1 - self.contrast, 1 + self.contrast)),
                saturation=float(rng.uniform(1 - self.saturation, 1 + self.saturation)),
                hue=float(rng.uniform(-self.hue, self.hue)),
            )
        return image


@dataclasses.dataclass(frozen=True)
class ImageTransform:
    """Resize-with-pad each camera to `size`, optionally augment, optionally convert to float [-1, 1].

    Call as `transform(sample, rng)`; `rng` may be None when `augment` is None.
    """

    cameras: Sequence[str]
    size: tuple[int, int] | None = (224, 224)
    augment: AugmentConfig | None = None
    as_float: bool = True

    def __call__(self, sample: dict[str, Any], rng: np.random.Generator | None = None) -> dict[str, Any]:
        out = dict(sample)
        for key in self.cameras:
            if key not in out:
                continue
            images = np.asarray(out[key])
            single = images.ndim == 3
            frames = images[None] if single else images
            processed = []
            for image in frames:
                if self.size is not None:
                    image = resize_with_pad(image, *self.size)
                if self.augment is not None:
                    if rng is None:
                        raise ValueError("augmentation needs the per-record rng")
                    image = self.augment.apply(image, rng)
                processed.append(to_unit_range(image) if self.as_float else image)
            out[key] = processed[0] if single else np.stack(processed)
        return out
