"""Synthetic data: a data source (``SyntheticData``, the default of ``ExperimentConfig.data``) and its
checkpointable iterator over batches of a model's exact training shapes."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from embodied_jax.config_registry import register
from embodied_jax.data.iterator import BatchIterator
from embodied_jax.data.sources import DataSource


@register
@dataclasses.dataclass(frozen=True)
class SyntheticData(DataSource):
    """Batches from the model config's ``synthetic_batch``: a deterministic function of the step."""

    def make_iterator(
        self, *, model: Any, process_index: int, process_count: int, batch_size: int, seed: int
    ) -> BatchIterator:
        return SyntheticIterator(model, process_index, process_count, batch_size, seed)


class SyntheticIterator(BatchIterator):
    """Batch ``n`` depends only on (seed, n): every process slices the same global batch.

    The state is the number of batches already produced, so a restored run continues
    with exactly the batches an uninterrupted one would have seen, and one process with
    8 devices sees the same global batches as two processes with 4 each.
    """

    # The state is the same on every process and for any process count: a checkpoint
    # restores under another number of processes (see ``IteratorStateHandler``).
    layout_independent_state = True

    def __init__(self, model: Any, process_index: int, process_count: int, batch_size: int, seed: int):
        if batch_size % process_count:
            raise ValueError(f"train.batch_size={batch_size} is not divisible by {process_count} processes")
        self._model = model
        self._rows = slice(
            process_index * batch_size // process_count, (process_index + 1) * batch_size // process_count
        )
        self._batch_size = batch_size
        self._seed = seed
        self._next = 0

    def __next__(self) -> dict[str, Any]:
        seed = int(np.random.SeedSequence([self._seed, self._next]).generate_state(1)[0])
        batch = self._model.synthetic_batch(self._batch_size, seed=seed)
        self._next += 1
        return _slice_rows(batch, self._rows)

    def get_state(self) -> dict[str, int]:
        return {"next_batch": self._next}

    def set_state(self, state: dict[str, int]) -> None:
        self._next = int(state["next_batch"])


def _slice_rows(tree: Any, rows: slice) -> Any:
    if isinstance(tree, dict):
        return {k: _slice_rows(v, rows) for k, v in tree.items()}
    return np.asarray(tree)[rows]
