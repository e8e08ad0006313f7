"""The train state and its abstract-then-sharded initialisation.

An NNX model is split into four groups of variables, each kept as a plain nested dict
(what Orbax and optax handle best): trainable parameters, frozen parameters (matching
``optimizer.freeze``), FP8 scaling state (``Fp8Meta``) and any other state. ``ModelParts``
remembers the graph definition and abstract templates to merge them back into a module
inside the jitted step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from embodied_jax.parallel.partition import Placement, parameter_placements
from embodied_jax.parallel.rules import ShardingRules
from embodied_jax.parallel.sharding import replicated
from embodied_jax.train.config import OptimizerConfig
from embodied_jax.train.optimizer import matches_any, path_str
from embodied_jax.variables import Fp8Meta

GROUPS = ("params", "frozen", "fp8", "other")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of steps taken
    params: dict  # trainable parameters
    frozen: dict  # frozen parameters (no gradient, no optimizer state)
    fp8: dict  # FP8 scaling state, overwritten with its gradient
    other: dict  # any other model state
    opt_state: Any
    ema: dict | None  # exponential moving average of ``params``
    rng: jax.Array
    skips: jax.Array  # consecutive non-finite steps (reset by a finite one)
    total_skips: jax.Array


def _filters(freeze: tuple[str, ...]):
    def frozen(path, _value) -> bool:
        return matches_any(freeze, path_str(path))

    trainable = nnx.All(nnx.Param, nnx.Not(frozen))
    return trainable, nnx.Param, Fp8Meta, ...


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """Graph definition plus abstract per-group templates of a model."""

    graphdef: Any
    templates: tuple[nnx.State, ...]  # one per GROUPS entry, abstract leaves
    freeze: tuple[str, ...]

    def merge(self, params: dict, frozen: dict, fp8: dict, other: dict) -> nnx.Module:
        states = []
        for template, pure in zip(self.templates, (params, frozen, fp8, other), strict=True):
            state = jax.tree.map(lambda x: x, template)  # fresh Variables, same metadata
            nnx.replace_by_pure_dict(state, pure)
            states.append(state)
        return nnx.merge(self.graphdef, *states)

    def split(self, model: nnx.Module) -> tuple[dict, dict, dict, dict]:
        _, *states = nnx.split(model, *_filters(self.freeze))
        return tuple(s.to_pure_dict() for s in states)

    def placements(self, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> tuple[dict, ...]:
        """``partition.Placement`` per leaf of each group (spec and any fallback note)."""
        return tuple(nnx.State(parameter_placements(t, mesh, rules)).to_pure_dict() for t in self.templates)

    def shardings(self, mesh: Mesh, rules: ShardingRules = ShardingRules()) -> tuple[dict, ...]:
        return tuple(
            jax.tree.map(lambda p: NamedSharding(mesh, p.spec), group, is_leaf=_is_placement)
            for group in self.placements(mesh, rules)
        )


def _is_placement(x) -> bool:
    return isinstance(x, Placement)


def abstract_model(model_config: Any, seed: int = 0) -> nnx.Module:
    """The model with abstract leaves; shardings come from ``parallel.partition``, not Flax."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: model_config.make(nnx.Rngs(seed)))


def model_parts(model_config: Any, freeze: tuple[str, ...] = ()) -> ModelParts:
    graphdef, *templates = nnx.split(abstract_model(model_config), *_filters(freeze))
    return ModelParts(graphdef, tuple(templates), tuple(freeze))


def _cast(tree: dict, dtype: str | None) -> dict:
    if dtype is None:
        return tree
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def make_init_fn(
    model_config: Any,
    parts: ModelParts,
    tx: optax.GradientTransformation,
    opt_config: OptimizerConfig,
    mesh: Mesh,
    ema: bool,
):
    """``init(seed) -> TrainState``: jit it with ``out_shardings`` to initialise sharded."""

    def init(seed: jax.Array) -> TrainState:
        # Placement comes from the caller's out_shardings (``parallel.partition``), not Flax.
        with nnx.use_eager_sharding(False):
            model = model_config.make(nnx.Rngs(jax.random.key(seed)))
        params, frozen, fp8, other = parts.split(model)
        frozen = _cast(frozen, opt_config.frozen_dtype)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            frozen=frozen,
            fp8=fp8,
            other=other,
            opt_state=tx.init(params),
            ema=jax.tree.map(jnp.copy, params) if ema else None,
            rng=jax.random.key_data(jax.random.fold_in(jax.random.key(seed), 1)),
            skips=jnp.zeros((), jnp.int32),
            total_skips=jnp.zeros((), jnp.int32),
        )

    return init


def state_shardings(
    abstract_state: TrainState,
    parts: ModelParts,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: ShardingRules = ShardingRules(),
) -> TrainState:
    """Shardings of every leaf: parameters from their logical axes, optimizer state like its
    parameters, scalars replicated."""
    params, frozen, fp8, other = parts.shardings(mesh, rules)
    rep = replicated(mesh)
    opt = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_state.opt_state,
        params,
        transform_non_params=lambda _: rep,
        is_leaf=lambda x: isinstance(x, NamedSharding),
    )
    return TrainState(
        step=rep,
        params=params,
        frozen=frozen,
        fp8=fp8,
        other=other,
        opt_state=opt,
        ema=params if abstract_state.ema is not None else None,
        rng=rep,
        skips=rep,
        total_skips=rep,
    )


def init_seed(seed: int) -> jax.Array:
    return jnp.asarray(seed, jnp.uint32)
