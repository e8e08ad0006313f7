"""Normalisation statistics: one streaming pass (mean/std, min/max, quantiles), JSON, normalise/unnormalise.

Quantiles come from a deterministic mergeable sketch (a KLL-style stack of compactors):
compacting a sorted buffer of weight-w items moves any rank by at most w, and level h holds
weight 2^h items, so after n values the rank error is at most about log2(n/k)·n/(2k) — with
the default k = 4096 under 0.25% up to 10^9 values, i.e. inside the 0.5% budget.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data.samples import SampleSpec, gather_window

QUANTILES = dict(fmt.STATS_QUANTILES)  # q01, q10, q50, q90, q99
MODES = ("mean_std", "min_max", "quantile")


class QuantileSketch:
    """Per-column quantiles of a stream of [N, D] batches with bounded rank error."""

    def __init__(self, k: int = 4096):
        self.k = k
        self.levels: list[np.ndarray] = []
        self._parity: list[int] = []
        self.count = 0

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64)
        if values.ndim != 2:
            raise ValueError(f"QuantileSketch.add expects [N, D], got shape {values.shape}")
        self.count += len(values)
        self._push(0, values)

    def merge(self, other: QuantileSketch) -> None:
        self.count += other.count
        for level, values in enumerate(other.levels):
            self._push(level, values)

    def _push(self, level: int, values: np.ndarray) -> None:
        while len(self.levels) <= level:
            self.levels.append(np.zeros((0, values.shape[1])))
            self._parity.append(0)
        buffer = np.concatenate([self.levels[level], values]) if len(self.levels[level]) else values
        if len(buffer) < 2 * self.k:
            self.levels[level] = buffer
            return
        buffer = np.sort(buffer, axis=0)
        even = len(buffer) - len(buffer) % 2
        offset = self._parity[level]
        self._parity[level] ^= 1  # alternate which half survives so errors cancel
        self.levels[level] = buffer[even:]
        self._push(level + 1, buffer[offset:even:2])

    def quantiles(self, qs: Sequence[float]) -> np.ndarray:
        """[len(qs), D] estimates; exact (np.quantile) while nothing has been compacted."""
        if self.count == 0:
            raise ValueError("no values were added")
        if len(self.levels) == 1:
            return np.quantile(self.levels[0], qs, axis=0)
        values = np.concatenate(self.levels)
        weights = np.concatenate([np.full(len(v), 2.0**h) for h, v in enumerate(self.levels)])
        order = np.argsort(values, axis=0)
        sorted_values = np.take_along_axis(values, order, axis=0)
        cumulative = np.cumsum(weights[order], axis=0)
        total = cumulative[-1]
        out = []
        for q in qs:
            position = np.minimum((cumulative < q * total).sum(axis=0), len(values) - 1)
            out.append(sorted_values[position, np.arange(values.shape[1])])
        return np.stack(out)


class RunningStats:
    """Streaming count/mean/variance (Chan's merge), min, max and a quantile sketch for [N, D] batches."""

    def __init__(self, sketch_k: int = 4096):
        self.count = 0
        self.mean = None
        self.m2 = None
        self.min = None
        self.max = None
        self.sketch = QuantileSketch(sketch_k)

    def add(self, values: np.ndarray) -> None:
        values = np.asarray(values, np.float64)
        values = values.reshape(len(values), -1)
        if len(values) == 0:
            return
        n, mean, m2 = len(values), values.mean(0), ((values - values.mean(0)) ** 2).sum(0)
        if self.count == 0:
            self.count, self.mean, self.m2 = n, mean, m2
            self.min, self.max = values.min(0), values.max(0)
        else:
            if values.shape[1] != self.mean.shape[0]:
                raise ValueError(f"feature width changed from {self.mean.shape[0]} to {values.shape[1]}")
            total = self.count + n
            delta = mean - self.mean
            self.mean = self.mean + delta * n / total
            self.m2 = self.m2 + m2 + delta**2 * self.count * n / total
            self.count = total
            self.min, self.max = np.minimum(self.min, values.min(0)), np.maximum(self.max, values.max(0))
        self.sketch.add(values)

    def finalize(self) -> FeatureStats:
        if self.count == 0:
            raise ValueError("no values were added")
        qs = self.sketch.quantiles(list(QUANTILES.values()))
        return FeatureStats(
            mean=self.mean,
            std=np.sqrt(self.m2 / self.count),
            min=self.min,
            max=self.max,
            count=self.count,
            quantiles={name: qs[i] for i, name in enumerate(QUANTILES)},
        )


@dataclasses.dataclass
class FeatureStats:
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray
    count: int
    quantiles: dict[str, np.ndarray]

    @property
    def q01(self) -> np.ndarray:
        return self.quantiles["q01"]

    @property
    def q99(self) -> np.ndarray:
        return self.quantiles["q99"]

    def to_json(self) -> dict[str, Any]:
        out = {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max}
        out.update(self.quantiles)
        out = {k: np.asarray(v, np.float64).tolist() for k, v in out.items()}
        out["count"] = int(self.count)
        return out

    @classmethod
    def from_json(cls, payload: Mapping[str, Any], *, key: str = "?") -> FeatureStats:
        missing = [n for n in ("mean", "std", "min", "max") if n not in payload]
        if missing:
            raise ValueError(f"stats for {key!r} lack {missing}")
        count = payload.get("count", 0)
        count = int(np.asarray(count).reshape(-1)[0]) if np.size(count) else 0
        flat = lambda v: np.asarray(v, np.float64).reshape(-1)  # noqa: E731
        return cls(
            mean=flat(payload["mean"]),
            std=flat(payload["std"]),
            min=flat(payload["min"]),
            max=flat(payload["max"]),
            count=count,
            quantiles={n: flat(payload[n]) for n in QUANTILES if n in payload},
        )


class NormStats(dict):
    """Feature key -> FeatureStats; saved as JSON next to checkpoints."""

    def save(self, path: str | pathlib.Path) -> None:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"norm_stats": {k: v.to_json() for k, v in self.items()}}, indent=1))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> NormStats:
        """Reads our JSON or a LeRobot `meta/stats.json` (same per-feature fields)."""
        payload = json.loads(pathlib.Path(path).read_text())
        payload = payload.get("norm_stats", payload)
        return cls(
            {k: FeatureStats.from_json(v, key=k) for k, v in payload.items() if isinstance(v, Mapping) and "mean" in v}
        )


def compute_stats(
    sources: Any,
    keys: Sequence[str] = ("observation.state", "action"),
    *,
    spec: SampleSpec | None = None,
    sketch_k: int = 4096,
) -> NormStats:
    """Statistics of `keys` over every frame of one frame source or a sequence of them (a mixture).

    With a `spec` whose `delta_action_mask` is set, action statistics are taken over the delta
    action chunks the samples will hold (as openpi does); otherwise over per-frame values.
    """
    if not isinstance(sources, (list, tuple)):
        sources = [sources]
    running = {key: RunningStats(sketch_k) for key in keys}
    for source in sources:
        for key in keys:
            if key not in source.arrays:
                raise KeyError(f"feature {key!r} is not in dataset {getattr(source, 'root', source)}")
        for position in range(source.num_episodes):
            for key in keys:
                values = source.episode_array(position, key)
                if spec is not None and spec.delta_action_mask is not None and key == spec.action_keys[0]:
                    values = _delta_chunks(source, position, key, spec)
                running[key].add(np.asarray(values).reshape(len(values), -1) if values.ndim > 1 else values[:, None])
    return NormStats({key: r.finalize() for key, r in running.items()})


def _delta_chunks(source, position: int, key: str, spec: SampleSpec) -> np.ndarray:
    actions = source.episode_array(position, key)
    states = source.episode_array(position, spec.state_keys[0])
    offsets = spec.offsets(key, source.fps)
    chunks = np.stack(
        [gather_window(actions, t, offsets, relative=key in spec.relative_keys)[0] for t in range(len(actions))]
    )
    mask = np.asarray(spec.delta_action_mask, bool)
    chunks = chunks.astype(np.float32)
    chunks[..., : len(mask)] -= np.where(mask, states[:, : len(mask)], 0.0)[:, None, :]
    return chunks.reshape(-1, chunks.shape[-1])


def _check(x: np.ndarray, stats: FeatureStats, key: str) -> None:
    if x.shape[-1] != stats.mean.shape[0]:
        raise ValueError(f"{key!r} has width {x.shape[-1]} but its statistics have width {stats.mean.shape[0]}")


def normalize(x: Any, stats: FeatureStats, mode: str, *, eps: float = 1e-8, key: str = "?", xp: Any = np) -> Any:
    """``x`` normalised by ``mode`` (float32). ``xp``: ``numpy`` on the host, or ``jax.numpy`` inside a
    jitted program (the statistics then enter as float32 constants)."""
    x = xp.asarray(x, xp.float32)
    _check(x, stats, key)

    def const(v):
        return v if xp is np else xp.asarray(np.asarray(v, np.float32))

    if mode == "mean_std":
        return ((x - const(stats.mean)) / (const(stats.std) + eps)).astype(xp.float32)
    low, high = _range(stats, mode, key)
    return xp.clip(2.0 * (x - const(low)) / (const(high) - const(low) + eps) - 1.0, -1.0, 1.0).astype(xp.float32)


def unnormalize(x: Any, stats: FeatureStats, mode: str, *, eps: float = 1e-8, key: str = "?", xp: Any = np) -> Any:
    """The inverse of ``normalize`` (float32; ``xp`` as there). On the host the statistics stay
    float64 until the cast; in a jitted program they enter as float32 constants (the scale
    ``std + eps``, ``high - low + eps`` summed in float64 first)."""
    x = xp.asarray(x, xp.float32)
    _check(x, stats, key)

    def const(v):
        return v if xp is np else xp.asarray(np.asarray(v, np.float32))

    if mode == "mean_std":
        return (x * const(stats.std + eps) + const(stats.mean)).astype(xp.float32)
    low, high = _range(stats, mode, key)
    return ((xp.clip(x, -1.0, 1.0) + 1.0) / 2.0 * const(high - low + eps) + const(low)).astype(xp.float32)


def _range(stats: FeatureStats, mode: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    if mode == "min_max":
        return stats.min, stats.max
    if mode == "quantile":
        if "q01" not in stats.quantiles or "q99" not in stats.quantiles:
            raise ValueError(f"quantile normalisation of {key!r} needs q01/q99 statistics")
        return stats.q01, stats.q99
    raise ValueError(f"unknown normalisation mode {mode!r} for {key!r}; expected one of {MODES}")


class Normalizer:
    """Normalises (and inverts) the features named in `modes` of a sample or batch dict."""

    def __init__(self, stats: Mapping[str, FeatureStats], modes: Mapping[str, str]):
        for key, mode in modes.items():
            if mode not in MODES:
                raise ValueError(f"unknown normalisation mode {mode!r} for {key!r}; expected one of {MODES}")
            if key not in stats:
                raise KeyError(f"no statistics for {key!r}; have {sorted(stats)}")
        self.stats = stats
        self.modes = dict(modes)

    def normalize(self, sample: dict) -> dict:
        out = dict(sample)
        for key, mode in self.modes.items():
            if key in out:
                out[key] = normalize(out[key], self.stats[key], mode, key=key)
        return out

    def unnormalize(self, sample: dict) -> dict:
        out = dict(sample)
        for key, mode in self.modes.items():
            if key in out:
                out[key] = unnormalize(out[key], self.stats[key], mode, key=key)
        return out

    def __call__(self, sample: dict) -> dict:
        return self.normalize(sample)


def iter_values(values: Iterable[np.ndarray], sketch_k: int = 4096) -> FeatureStats:
    """Statistics of a stream of [N, D] batches (any source, e.g. a generator over files)."""
    running = RunningStats(sketch_k)
    for batch in values:
        running.add(batch)
    return running.finalize()
