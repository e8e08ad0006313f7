"""A replay buffer of transitions on the host: NumPy rings of fixed capacity, uniform sampling,
saved and restored with the run (an interrupted off-policy run resumes with what it had seen)."""

from __future__ import annotations

import pathlib

import numpy as np


class ReplayBuffer:
    """``add({field: [N, ...]})`` appends N transitions (the oldest overwritten once ``capacity`` is
    reached); ``sample(rng, shape)`` draws ``{field: [*shape, ...]}`` uniformly with replacement."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"ReplayBuffer capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.fields: dict[str, np.ndarray] = {}
        self.size = 0
        self.cursor = 0

    def __len__(self) -> int:
        return self.size

    def add(self, transitions: dict[str, np.ndarray]) -> None:
        arrays = {k: np.asarray(v) for k, v in transitions.items()}
        counts = {len(v) for v in arrays.values()}
        if len(counts) != 1:
            raise ValueError(f"transitions of different lengths: { {k: len(v) for k, v in arrays.items()} }")
        n = counts.pop()
        if not self.fields:
            self.fields = {k: np.zeros((self.capacity, *v.shape[1:]), v.dtype) for k, v in arrays.items()}
        if set(arrays) != set(self.fields):
            raise ValueError(f"transition fields {sorted(arrays)} differ from the buffer's {sorted(self.fields)}")
        rows = (self.cursor + np.arange(n)) % self.capacity
        for k, v in arrays.items():
            if v.shape[1:] != self.fields[k].shape[1:]:
                raise ValueError(
                    f"field {k!r}: shape {v.shape[1:]} differs from the buffer's {self.fields[k].shape[1:]}"
                )
            self.fields[k][rows] = v
        self.cursor = int((self.cursor + n) % self.capacity)
        self.size = int(min(self.size + n, self.capacity))

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        if self.size == 0:
            raise ValueError("sampling from an empty replay buffer")
        idx = rng.integers(0, self.size, size=shape)
        return {k: v[idx] for k, v in self.fields.items()}

    def save(self, path: str | pathlib.Path) -> None:
        """Written to a temporary file and renamed: a crash mid-write leaves the previous file."""
        path = pathlib.Path(path)
        tmp = path.with_suffix(".tmp.npz")
        meta = np.asarray([self.capacity, self.size, self.cursor], np.int64)
        np.savez(tmp, __meta__=meta, **{k: v[: self.size] for k, v in self.fields.items()})
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | pathlib.Path) -> ReplayBuffer:
        with np.load(path) as data:
            capacity, size, cursor = (int(x) for x in data["__meta__"])
            buffer = cls(capacity)
            stored = {k: data[k] for k in data.files if k != "__meta__"}
        buffer.fields = {k: np.zeros((capacity, *v.shape[1:]), v.dtype) for k, v in stored.items()}
        for k, v in stored.items():
            buffer.fields[k][:size] = v
        buffer.size, buffer.cursor = size, cursor
        return buffer
