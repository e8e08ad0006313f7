"""The batch-iterator contract: what the trainer and the checkpointer call on a data iterator.

Every ``DataSource.make_iterator`` returns a ``BatchIterator``: per-process NumPy batches
(``__next__``), a JSON-serialisable position (``get_state``/``set_state``, saved with every
checkpoint), the normalisation statistics it applies (saved too, so a policy bundle
normalises exactly as training did) and ``close``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any

from embodied_jax.data.stats import FeatureStats
from embodied_jax.errors import InputError


class IteratorStateMismatch(InputError, ValueError):
    """A saved iterator position made by another pipeline (batch size, seed, process layout)."""


class BatchIterator(abc.ABC):
    # True when the state does not depend on the process layout, so a checkpoint restores
    # under another number of processes (``train.checkpoint``).
    layout_independent_state: bool = False

    @property
    def stats(self) -> Mapping[str, FeatureStats] | None:
        """The normalisation statistics the batches were made with (None: not normalised)."""
        return None

    def __iter__(self) -> BatchIterator:
        return self

    @abc.abstractmethod
    def __next__(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def set_state(self, state: Mapping[str, Any]) -> None: ...

    def close(self) -> None:
        """Release worker processes and open files (the trainer calls it at the end of a run)."""
        return None

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
