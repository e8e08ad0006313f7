"""The Policy contract: all that training, evaluation and serving know of a model family.

A family ships two classes (DESIGN.md, "Contracts"):

- a ``PolicyConfig``: a frozen dataclass that builds the model (``make``), produces a
  synthetic batch of the exact training shapes (``synthetic_batch``: ``--dry-run``,
  benchmarks, tests) and the per-sample ``input_builder`` for real data; its optional
  hooks have defaults here, so callers never probe for them;
- a ``Policy``: the ``nnx.Module`` it builds, with ``loss``, ``sample_actions`` and
  ``chain_log_prob`` (the likelihood of a Flow-SDE sample, for reinforcement learning).

Its input builder (host, NumPy, one sample) may also have an in-program form
(``InProgramBuilder.in_program``): the same inputs as jnp for one row inside a jitted program,
given the run's per-sample transform before the builder (``RowTransform``). Rollouts in one
program (``bundle/device_io.py``) call it; no code outside the family knows its layout.

Before a run on a dataset the data source fits the config to the dataset's metadata
(``fit_to_dataset`` with ``DatasetFeatures``: cameras, state and action widths), so the
saved config is the one that trained and loading a policy never needs the dataset.

Metrics returned by ``loss`` may contain ``tokens`` (real, non-padding tokens) and
``examples`` (real samples; packed rows hold several), from which the trainer reports
throughput.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Batch = dict[str, Any]
InputBuilder = Callable[[dict[str, Any]], dict[str, Any]]


class RowTransform(Protocol):
    """The run's per-sample transform before the model's builder (normalise, images, rename), on
    one row: what a family's in-program form builds on (``bundle/front.py`` implements it)."""

    state_key: str  # the dataset key of the state
    state_dim: int | None  # the run's state width (None: not fixed)
    cameras: tuple[tuple[str, str], ...]  # (dataset key, model slot) of each camera the run reads

    def state(self, state: jax.Array) -> jax.Array:
        """One raw state [S] normalised as the host normalises it (jnp, float32)."""
        ...

    def images(self, images: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """{dataset key: uint8 [H, W, 3]} -> {model slot: image} as the host's transform gives them."""
        ...

    def host_state(self, state: np.ndarray) -> np.ndarray:
        """One raw state normalised on the host (NumPy), as the bundle's transform does."""
        ...

    def host_raw_state(self, normalised: np.ndarray) -> np.ndarray:
        """A raw state whose normalisation is about ``normalised`` (probe states)."""
        ...

    def thresholds(self, edges: np.ndarray) -> np.ndarray:
        """[S, K] float32: per state dimension, the smallest raw value whose host normalisation is
        >= ``edges[k]`` (NaN: none); [1, K] when the state is not normalised."""
        ...


@dataclasses.dataclass(frozen=True)
class InProgramInputs:
    """A family's input builder for one instruction as jnp: ``row(raw_state [S], images {dataset
    key: uint8 [H, W, 3]})`` gives one row of the observation the host builder gives (keys, shapes,
    dtypes; tokens exactly), vmappable; ``host_tokens(raw_states [..., S])``, when set, gives the
    prompt's ``(tokens, token_mask)`` from the host (``jax.pure_callback``) instead of ``row``."""

    row: Callable[[jax.Array, Mapping[str, jax.Array]], dict[str, jax.Array]]
    host_tokens: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None


@runtime_checkable
class InProgramBuilder(Protocol):
    """An input builder with an in-program form (both families' builders)."""

    def in_program(self, instruction: str, front: RowTransform) -> InProgramInputs:
        """The builder's inputs for ``instruction`` as jnp (``InProgramInputs``); everything constant
        for the instruction made here, once, on the host. A run the form cannot express is a
        ``errors.DeviceIOError`` naming what is missing."""
        ...


@runtime_checkable
class Policy(Protocol):
    """What the trainer, the evaluator and a policy bundle call on a built model."""

    def loss(
        self, batch: Batch, rng: jax.Array, *, noise: jax.Array | None = None, time: jax.Array | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

    def sample_actions(
        self,
        observation: Batch,
        rng: jax.Array,
        *,
        num_steps: int | None = None,
        noise: jax.Array | None = None,
        prefix_actions: jax.Array | None = None,
        prefix_weights: jax.Array | None = None,
        max_guidance: float = 5.0,
    ) -> jax.Array:
        """A normalised action chunk [B, horizon, action_dim] for an unpacked observation.

        Real-time chunking (``nn/rtc.py``; π0.5 and GR00T): ``prefix_actions`` [B, horizon, action_dim]
        (the model's normalised action space; usually the previous chunk shifted by the steps it
        executed, ``rtc.shift_prefix``) and ``prefix_weights`` [horizon] or [B, horizon]
        (``rtc.prefix_weights``) guide sampling so the chunk continues the actions still executing;
        steps of weight 1 are returned as the prefix. ``max_guidance`` is the paper's β. None: plain
        sampling, unchanged.

        Reinforcement learning (``embodied_jax/rl``) calls ``sample_actions(observation, rng,
        trace=True, sde=FlowSDE(...))``: a ``nn.flow.FlowTrace`` of the Flow-SDE sample (its
        ``states`` [num_steps + 1, B, ...] and per-element ``log_density``), and ``chain_log_prob``."""
        ...

    def action_features(self, observation: Batch) -> jax.Array:
        """[B, F]: what the action expert makes of an observation, deterministically (its velocity at
        the start of sampling from a zero chunk): the input of a value head on the action expert
        (reinforcement learning's ``RLConfig.expert_features``)."""
        ...

    def example_losses(self, batch: Batch, rng: jax.Array) -> jax.Array:
        """[B]: the training loss of each example of an unpacked batch with ``actions`` (what
        reinforcement learning's ``weighted_flow`` objective weights by each decision's advantage)."""
        ...

    def chain_log_prob(
        self, observation: Batch, states: jax.Array, sde: Any, *, num_steps: int | None = None
    ) -> jax.Array:
        """The log-probability [B] of a sampled chain ``states`` (a ``FlowTrace``'s) under ``sde`` with
        this model's weights: the sum of its stochastic steps' Gaussian log-densities (``nn/flow.py``)."""
        ...


@dataclasses.dataclass(frozen=True)
class DatasetFeatures:
    """What a dataset offers a model, from its metadata (``PolicyConfig.fit_to_dataset``)."""

    camera_keys: tuple[str, ...]  # the dataset cameras the run reads, in order
    # Their names: modality.json's video names, or the slots the run maps them to
    # (--data.inputs.cameras); None when the dataset names none of them.
    camera_names: tuple[str, ...] | None
    state_dim: int
    action_dim: int
    fps: float
    modality: bool  # the samples carry meta/modality.json's views (state.<group>, ...)
    privileged_dim: int = 0  # width of the training-only feature (ModelInputs.privileged_key); 0: none


def check_noise_scale(config: Any) -> None:
    """``config.noise_scale`` (the spread of sampling's initial noise) is finite and >= 0."""
    scale = config.noise_scale
    if not (np.isfinite(scale) and scale >= 0):
        name = type(config).__name__
        raise ValueError(f"{name}.noise_scale={scale} must be finite and >= 0 (1: the flow's own noise)")


def initial_noise(config: Any, rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Sampling's starting chunk: N(0, 1) noise of ``shape`` times ``config.noise_scale`` (0: zeros,
    the flow's centre; the key is then unused)."""
    return config.noise_scale * jax.random.normal(rng, shape, jnp.float32)


# A family's model and FLOP count, registered beside their code (``implements``) so that its config
# (pure data) never imports them: the config is what the model and the count read, not the reverse.
_FAMILY_PARTS: dict[type, dict[str, Callable[..., Any]]] = {}
PARTS = ("make", "training_flops")


def implements(config_type: type, part: str):
    """Register the decorated ``fn(config, ...)`` as ``part`` of ``config_type`` (and its subclasses):
    ``"make"`` (``fn(config, rngs) -> Policy``) or ``"training_flops"`` (``fn(config, batch)``)."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")

    def register(fn):
        _FAMILY_PARTS.setdefault(config_type, {})[part] = fn
        return fn

    return register


def _part(config: Any, part: str) -> Callable[..., Any] | None:
    for cls in type(config).__mro__:
        fn = _FAMILY_PARTS.get(cls, {}).get(part)
        if fn is not None:
            return fn
    return None


class PolicyConfig(abc.ABC):
    """Base of every model family's config (subclasses are frozen dataclasses)."""

    remat_policy: str = "none"  # what the layer stacks keep for the backward pass (nn.stack)
    camera_names: tuple[str, ...] = ()  # image slots, in order (none: the model reads no images)
    action_horizon: int = 0  # steps of each action chunk a sample holds (0: the family names none)
    # Fields that name files the model reads (a tokenizer): copied into every checkpoint and
    # exported policy (``embodied_jax.assets``), so a policy loads wherever it is moved.
    asset_fields: ClassVar[tuple[str, ...]] = ()

    def make(self, rngs: nnx.Rngs) -> nnx.Module:
        """Build the model (a ``Policy``). Parameters carry logical axis names. Default: the builder
        the family registered with ``implements(ConfigType, "make")``."""
        build = _part(self, "make")
        if build is None:
            raise TypeError(f"{type(self).__name__} builds no model: its family registers none (policy.implements)")
        return build(self, rngs)

    @abc.abstractmethod
    def synthetic_batch(self, batch_size: int, seed: int = 0) -> Batch:
        """A training batch of the exact shapes and dtypes, as NumPy arrays."""

    def input_builder(self, packed: bool = False) -> InputBuilder:
        """The per-sample builder that turns a renamed data sample (``{"task", "state",
        "images", "actions"}``) into model inputs; ``packed``: its variable-length form for
        ``data/packing.py``. Families that train only on synthetic data have none."""
        raise TypeError(f"{type(self).__name__} has no input builder: it trains on synthetic batches only")

    def fit_to_dataset(self, features: DatasetFeatures) -> PolicyConfig:
        """This config with the fields a dataset determines taken from ``features`` (run once
        before training, ``DataSource.fit``); a dataset the model cannot take is a ``ValueError``
        that names what does not fit and the flag that would. Default: unchanged."""
        return self

    @property
    def trains_privileged_head(self) -> bool:
        """Whether training regresses a privileged feature (``ModelInputs.privileged_key``) with a
        training-only head; a run that loads one for a model without it is refused. Default: no."""
        return False

    def freeze_regexes(self) -> tuple[str, ...]:
        """Parameter-path regexes the model itself keeps frozen (added to ``optimizer.freeze``)."""
        return ()

    def action_expert_regexes(self) -> tuple[str, ...]:
        """Parameter-path regexes of the part that turns the observation's features into the
        action (the action expert): what reinforcement learning trains by default while the
        vision tower and the language model stay fixed. Default: every parameter."""
        return (r".*",)

    def training_flops(self, batch: Batch) -> dict[str, float] | None:
        """Analytic FLOPs of one training step on ``batch`` (NumPy), ``{"weights", "attention",
        "unused"}``; None when the family has no count (``implements(ConfigType, "training_flops")``)."""
        count = _part(self, "training_flops")
        return None if count is None else count(self, batch)


def conforms(model: Any) -> bool:
    """Whether a built model has the ``Policy`` methods (``loss``, ``sample_actions``)."""
    return isinstance(model, Policy)
