"""The one packer: variable-length samples -> fixed-shape packed rows (Grain's first-fit packer).

Every model reads the layout made here (DESIGN.md batch contract). A sample, as a model's
input builder emits it with packing on, has

- token streams (``token_keys``, default ``tokens``): 1-D, equal lengths, no padding; image
  tokens are image-token ids that the model fills from the sample's images in order;
- ``images`` (``image_key``): [n, H, W, 3], only the cameras the sample has (n may be 0);
- any other per-sample value (state, actions, masks, embodiment id, ...).

A packed row has

- every token stream at ``seq_len``; ``segment_ids`` (int32, 1.. per sample, 0 = padding),
  ``positions`` (int32, restarting at 0 in every sample);
- ``images`` [max_images_per_row, H, W, 3] and ``image_segment_ids`` [max_images_per_row]
  (the sample each image belongs to, 0 = empty slot), images in sample order;
- every other value stacked to [max_samples_per_row, ...] in segment order, zero past the
  row's samples, with ``sample_mask`` marking real entries; ``padding_fraction`` (padding
  tokens / seq_len).

Samples are never split across rows and keep contiguous token runs. ``pack`` works on a
Grain ``IterDataset`` (the training pipeline); ``pack_samples`` packs a list (benchmarks,
tests, synthetic batches) through the same packer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from embodied_jax.config_registry import register

SEGMENT_IDS = "segment_ids"
POSITIONS = "positions"
IMAGE_SEGMENT_IDS = "image_segment_ids"
SAMPLE_MASK = "sample_mask"
PADDING_FRACTION = "padding_fraction"


@register
@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """``seq_len`` tokens per row; 0 turns packing off (``--data.packing.seq-len N`` turns it on).

    ``max_images_per_row`` 0 means ``seq_len // tokens_per_image`` of the model's builder
    (every image costs that many tokens, so a full row never holds more).
    """

    seq_len: int = 0
    max_samples_per_row: int = 8
    max_images_per_row: int = 0
    num_packing_bins: int = 16
    shuffle_bins: bool = False
    token_keys: tuple[str, ...] = ("tokens",)
    image_key: str = "images"

    @property
    def enabled(self) -> bool:
        return self.seq_len > 0

    def resolved(self, tokens_per_image: int | None) -> PackingConfig:
        """This config with ``max_images_per_row`` filled in from the builder's image cost."""
        if self.max_images_per_row or not tokens_per_image:
            return self
        return dataclasses.replace(self, max_images_per_row=max(1, self.seq_len // tokens_per_image))

    def validate(self) -> None:
        if self.seq_len < 1:
            raise ValueError(f"packing: seq_len must be >= 1 when packing is on, got {self.seq_len}")
        if self.max_samples_per_row < 1:
            raise ValueError(f"packing: max_samples_per_row must be >= 1, got {self.max_samples_per_row}")
        if self.max_images_per_row < 0:
            raise ValueError(f"packing: max_images_per_row must be >= 0, got {self.max_images_per_row}")


@dataclasses.dataclass(frozen=True)
class _CheckSample:
    config: PackingConfig
    with_images: bool

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        lengths = {}
        for key in self.config.token_keys:
            if key not in sample:
                raise KeyError(f"packing needs token stream {key!r}; the sample has {sorted(sample)}")
            value = np.asarray(sample[key])
            if value.ndim != 1:
                raise ValueError(
                    f"token stream {key!r} must be 1-D (a packing input builder emits unpadded "
                    f"samples), got shape {value.shape}"
                )
            lengths[key] = len(value)
        if len(set(lengths.values())) != 1:
            raise ValueError(f"token streams of one sample must have equal lengths, got {lengths}")
        length = next(iter(lengths.values()))
        if not 0 < length <= self.config.seq_len:
            raise ValueError(f"a sample has {length} tokens; packing needs 1..seq_len={self.config.seq_len}")
        out = dict(sample)
        for key in self.config.token_keys:
            value = np.asarray(sample[key])
            out[key] = value.astype(np.int32) if value.dtype == bool else value
        if self.with_images:
            images = np.asarray(sample[self.config.image_key])
            if images.ndim != 4:
                raise ValueError(f"packing: {self.config.image_key!r} must be [n, H, W, C], got {images.shape}")
            if len(images) > self.config.max_images_per_row:
                raise ValueError(
                    f"a sample has {len(images)} images; packing allows max_images_per_row="
                    f"{self.config.max_images_per_row}"
                )
            out[self.config.image_key] = images
        return out


def _stack_padded(values: list, capacity: int) -> np.ndarray:
    first = np.asarray(values[0])
    if first.dtype.kind in "US":
        out = np.full((capacity,) + first.shape, "", dtype=object)
    else:
        out = np.zeros((capacity,) + first.shape, dtype=first.dtype)
    for i, value in enumerate(values):
        out[i] = value
    return out.astype(str) if first.dtype.kind in "US" else out


@dataclasses.dataclass(frozen=True)
class _FinishRow:
    config: PackingConfig
    token_dtypes: tuple
    with_images: bool

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        config = self.config
        key0 = config.token_keys[0]
        out: dict[str, Any] = {}
        for key, dtype in zip(config.token_keys, self.token_dtypes, strict=True):
            out[key] = np.asarray(row[key]).astype(dtype)
        segment_ids = np.asarray(row[f"{key0}_segment_ids"], np.int32)
        out[SEGMENT_IDS] = segment_ids
        out[POSITIONS] = np.asarray(row[f"{key0}_positions"], np.int32)
        packed = set(config.token_keys)
        if self.with_images:
            out[config.image_key] = np.asarray(row[config.image_key])
            out[IMAGE_SEGMENT_IDS] = np.asarray(row[f"{config.image_key}_segment_ids"], np.int32)
            packed.add(config.image_key)
        count = int(segment_ids.max(initial=0))
        capacity = config.max_samples_per_row
        for key, values in row.items():
            if key in packed or key.endswith("_segment_ids") or key.endswith("_positions"):
                continue
            values = list(values)
            if len(values) != count:
                raise ValueError(f"packed row holds {count} samples but {len(values)} values of {key!r}")
            out[key] = _stack_padded(values, capacity)
        mask = np.zeros(capacity, bool)
        mask[:count] = True
        out[SAMPLE_MASK] = mask
        out[PADDING_FRACTION] = np.float32(1.0 - np.count_nonzero(segment_ids) / len(segment_ids))
        return out


def pack(
    dataset: grain.IterDataset,
    config: PackingConfig,
    *,
    seed: int = 0,
    probe: dict[str, Any],
) -> grain.IterDataset:
    """Packs samples shaped like ``probe`` (one sample of ``dataset``) into rows (module docstring)."""
    config.validate()
    with_images = config.image_key in probe
    if with_images and config.max_images_per_row < 1:
        raise ValueError(
            "packing: samples carry images, so max_images_per_row must be >= 1 "
            "(or resolved from the builder's tokens_per_image)"
        )
    dtypes = tuple(np.asarray(probe[k]).dtype for k in config.token_keys)
    dtypes = tuple(np.bool_ if d == np.dtype(bool) else d for d in dtypes)
    lengths = {key: config.seq_len for key in config.token_keys}
    if with_images:
        lengths[config.image_key] = config.max_images_per_row
    meta = tuple(k for k in probe if k not in lengths)
    checked = dataset.map(_CheckSample(config, with_images))
    packed = grain.experimental.FirstFitPackIterDataset(
        checked,
        length_struct=lengths,
        num_packing_bins=config.num_packing_bins,
        seed=seed,
        shuffle_bins=config.shuffle_bins,
        meta_features=meta,
        max_sequences_per_bin=config.max_samples_per_row,
    )
    return packed.map(_FinishRow(config, dtypes, with_images))


def pack_samples(
    samples: Sequence[dict[str, Any]],
    config: PackingConfig,
    *,
    num_rows: int | None = None,
) -> dict[str, np.ndarray]:
    """Pack a list of samples into one batch of rows (first fit over ``num_packing_bins`` bins).

    ``num_rows`` pads the batch with empty rows to a fixed row count (raises if too small).
    """
    if not samples:
        raise ValueError("pack_samples: no samples")
    config = dataclasses.replace(config, num_packing_bins=max(config.num_packing_bins, len(samples)))
    ds = grain.MapDataset.source(list(samples)).to_iter_dataset()
    rows = list(pack(ds, config, probe=samples[0]))
    if num_rows is not None:
        if len(rows) > num_rows:
            raise ValueError(
                f"pack_samples: the samples need {len(rows)} rows of {config.seq_len} tokens, num_rows={num_rows}"
            )
        rows += [_empty_row(rows[0]) for _ in range(num_rows - len(rows))]
    return {key: np.stack([r[key] for r in rows]) for key in rows[0]}


def _empty_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: (np.full_like(v, "") if v.dtype.kind in "US" else np.zeros_like(v)) for k, v in row.items()}
    out[PADDING_FRACTION] = np.float32(1.0)
    return out


def padding_fraction(batch: dict[str, Any]) -> float:
    """Mean padding fraction of a packed batch (from its segment ids)."""
    segment_ids = np.asarray(batch[SEGMENT_IDS])
    return float(1.0 - np.count_nonzero(segment_ids) / segment_ids.size)
