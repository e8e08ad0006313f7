"""The Policy contract: the only thing training, evaluation and serving know of a model.

A model is an ``nnx.Module`` with two methods (DESIGN.md):

- ``loss(batch, rng, *, noise=None, time=None) -> (scalar, metrics)``
- ``sample_actions(observation, rng, *, num_steps=None, noise=None) -> actions``

and it is built from a frozen ``ModelConfig`` dataclass that can also produce a
synthetic batch of the exact training shapes (used by ``--dry-run``, benchmarks and
the tests). ``metrics`` may contain ``"tokens"``: the number of real (non-padding)
tokens in the batch, from which the trainer reports tokens/s.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx

Batch = dict[str, Any]


@runtime_checkable
class Policy(Protocol):
    def loss(
        self, batch: Batch, rng: jax.Array, *, noise: jax.Array | None = None, time: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def sample_actions(
        self, observation: Batch, rng: jax.Array, *, num_steps: int | None = None, noise: jax.Array | None = None
    ) -> jax.Array: ...


class ModelConfig(Protocol):
    """What an experiment needs of a model family's config."""

    def make(self, rngs: nnx.Rngs) -> nnx.Module:
        """Build the model (a Policy). Parameters carry logical axis names."""
        ...

    def synthetic_batch(self, batch_size: int, seed: int = 0) -> Batch:
        """A training batch of the exact shapes and dtypes, as NumPy arrays."""
        ...
