"""First-fit packing of variable-length token samples into fixed-length rows (Grain's packer).

Output rows follow the DESIGN.md batch contract: every token stream (`token_keys`) has
length `seq_len`; `segment_ids` (int32, 1.. per packed sample, 0 = padding) and `positions`
(int32, restarting at 0 in every segment) describe the packing. Samples are never split
across rows and at most `max_samples_per_row` share a row. Every other per-sample value
(images, state, actions, task) is stacked to [max_samples_per_row, ...] in segment order,
zero-filled past the row's samples, with `sample_mask` marking real entries; each row also
reports its `padding_fraction` (padding tokens / seq_len).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import grain
import numpy as np

SEGMENT_IDS = "segment_ids"
POSITIONS = "positions"
SAMPLE_MASK = "sample_mask"
PADDING_FRACTION = "padding_fraction"


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    seq_len: int
    token_keys: tuple[str, ...] = ("tokens", "token_mask")
    max_samples_per_row: int = 8
    num_packing_bins: int = 16
    shuffle_bins: bool = False


@dataclasses.dataclass(frozen=True)
class _CheckLengths:
    config: PackingConfig

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        lengths = {}
        for key in self.config.token_keys:
            if key not in sample:
                raise KeyError(f"packing needs token stream {key!r}; the sample has {sorted(sample)}")
            value = np.asarray(sample[key])
            if value.ndim != 1:
                raise ValueError(f"token stream {key!r} must be 1-D, got shape {value.shape}")
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

    def __call__(self, row: dict[str, Any]) -> dict[str, Any]:
        key0 = self.config.token_keys[0]
        out: dict[str, Any] = {}
        for key, dtype in zip(self.config.token_keys, self.token_dtypes):
            out[key] = np.asarray(row[key]).astype(dtype)
        segment_ids = np.asarray(row[f"{key0}_segment_ids"], np.int32)
        out[SEGMENT_IDS] = segment_ids
        out[POSITIONS] = np.asarray(row[f"{key0}_positions"], np.int32)
        count = int(segment_ids.max(initial=0))
        capacity = self.config.max_samples_per_row
        for key, values in row.items():
            if key in self.config.token_keys or key.endswith("_segment_ids") or key.endswith("_positions"):
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


def pack(dataset: grain.IterDataset, config: PackingConfig, *, seed: int = 0, meta_keys: tuple[str, ...],
         token_dtypes: tuple | None = None) -> grain.IterDataset:
    """Packs samples (dicts with `config.token_keys` 1-D streams and `meta_keys` per-sample values)."""
    if config.max_samples_per_row < 1:
        raise ValueError(f"max_samples_per_row must be >= 1, got {config.max_samples_per_row}")
    dtypes = token_dtypes or tuple(np.int32 for _ in config.token_keys)
    checked = dataset.map(_CheckLengths(config))
    packed = grain.experimental.FirstFitPackIterDataset(
        checked,
        length_struct={key: config.seq_len for key in config.token_keys},
        num_packing_bins=config.num_packing_bins,
        seed=seed,
        shuffle_bins=config.shuffle_bins,
        meta_features=tuple(meta_keys),
        max_sequences_per_bin=config.max_samples_per_row,
    )
    return packed.map(_FinishRow(config, dtypes))


def padding_fraction(batch: dict[str, Any]) -> float:
    """Mean padding fraction of a packed batch (from its segment ids)."""
    segment_ids = np.asarray(batch[SEGMENT_IDS])
    return float(1.0 - np.count_nonzero(segment_ids) / segment_ids.size)
