"""The Policy contract: all that training, evaluation and serving know of a model family.

A family ships two classes (DESIGN.md, "Contracts"):

- a ``PolicyConfig``: a frozen dataclass that builds the model (``make``), produces a
  synthetic batch of the exact training shapes (``synthetic_batch``: ``--dry-run``,
  benchmarks, tests) and the per-sample ``input_builder`` for real data; its optional
  hooks have defaults here, so callers never probe for them;
- a ``Policy``: the ``nnx.Module`` it builds, with ``loss`` and ``sample_actions``.

Metrics returned by ``loss`` may contain ``tokens`` (real, non-padding tokens) and
``examples`` (real samples; packed rows hold several), from which the trainer reports
throughput.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx

Batch = dict[str, Any]
InputBuilder = Callable[[dict[str, Any]], dict[str, Any]]


@runtime_checkable
class Policy(Protocol):
    """What the trainer, the evaluator and a policy bundle call on a built model."""

    def loss(
        self, batch: Batch, rng: jax.Array, *, noise: jax.Array | None = None, time: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def sample_actions(
        self, observation: Batch, rng: jax.Array, *, num_steps: int | None = None, noise: jax.Array | None = None
    ) -> jax.Array: ...


class PolicyConfig(abc.ABC):
    """Base of every model family's config (subclasses are frozen dataclasses)."""

    remat_policy: str = "none"  # what the layer stacks keep for the backward pass (nn.stack)

    @abc.abstractmethod
    def make(self, rngs: nnx.Rngs) -> nnx.Module:
        """Build the model (a ``Policy``). Parameters carry logical axis names."""

    @abc.abstractmethod
    def synthetic_batch(self, batch_size: int, seed: int = 0) -> Batch:
        """A training batch of the exact shapes and dtypes, as NumPy arrays."""

    def input_builder(self, packed: bool = False) -> InputBuilder:
        """The per-sample builder that turns a renamed data sample (``{"task", "state",
        "images", "actions"}``) into model inputs; ``packed``: its variable-length form for
        ``data/packing.py``. Families that train only on synthetic data have none."""
        raise TypeError(f"{type(self).__name__} has no input builder: it trains on synthetic batches only")

    def freeze_regexes(self) -> tuple[str, ...]:
        """Parameter-path regexes the model itself keeps frozen (added to ``optimizer.freeze``)."""
        return ()

    def training_flops(self, batch: Batch) -> dict[str, float] | None:
        """Analytic FLOPs of one training step on ``batch`` (NumPy), ``{"weights", "attention",
        "unused"}``; None when the family has no count."""
        return None


def conforms(model: Any) -> bool:
    """Whether a built model has the ``Policy`` methods (``loss``, ``sample_actions``)."""
    return isinstance(model, Policy)
