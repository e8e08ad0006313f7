"""Demonstrations beside the RL objective: batches of the starting run's own training data.

``DemoBatches`` opens the run's data pipeline (its saved config's ``data``: the same dataset,
statistics and transforms behaviour cloning trained on) and hands the update one batch per
minibatch, stacked; the update adds behaviour cloning's loss on them (``ppo.py``,
``PPOSettings.demo_coef``). The iterator's state is saved with every RL checkpoint, so a resumed
run draws the batches the uninterrupted run would have.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from embodied_jax.errors import InputError


class DemoBatches:
    def __init__(self, st, batch_size: int, per_update: int, seed: int):
        if st.bundle is None:
            raise InputError("rl.demo_batch needs --init-from RUN: the toy policy has no demonstrations")
        self.per_update = per_update
        self.iterator = st.base.data.make_iterator(
            model=st.base.model, process_index=0, process_count=1, batch_size=batch_size, seed=seed
        )

    def next_update(self) -> Any:
        """``per_update`` training batches stacked on a leading axis (one per minibatch)."""
        batches = [next(self.iterator) for _ in range(self.per_update)]
        return jax.tree.map(lambda *xs: np.stack(xs), *batches)

    def close(self) -> None:
        self.iterator.close()
