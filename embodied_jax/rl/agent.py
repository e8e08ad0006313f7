"""A flow policy as pure functions of its trainable weights: what the rollout and the update call.

``FlowAgent`` holds ``merge(params) -> model`` (the model rebuilt in the current trace with the
trainable ``params``, its other state closed over) and two functions of those ``params``:

- ``sample(params, observation, progress, rng) -> Decision``: the robot's action chunk sampled
  through Flow-SDE (``nn/flow.py``), the chain of intermediate states and its log-probability,
  with the model's observation it was sampled from (kept for the update);
- ``log_prob(params, model_observation, chain) -> [B]``: the chain's log-probability under
  ``params`` (the model's ``chain_log_prob``);
- ``features(params, model_observation) -> [B, F]``: the action expert's features, for a value
  head on the expert (``RLConfig.expert_features``).
- ``flow_loss(params, model_observation, chunk, rng) -> [B]``: the model's training loss on each
  decision's own sampled chunk (``Policy.example_losses``; the ``weighted_flow`` and
  ``self_imitation`` objectives).
- ``bc_loss(params, batch, rng) -> scalar``: behaviour cloning's loss (``Policy.loss``) on a
  training batch of the run's data (the demonstrations beside the RL objective).

``observe`` turns the simulator's observation ({"state", "images"}, jnp) into the model's inputs
and ``act`` the model's normalised chunk into robot actions, both inside the program: for a
trained run they are ``bundle.device_io``'s; for the toy policy the identity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx

from embodied_jax.nn import flow
from embodied_jax.nn.traced import merge_in_trace


class Decision(NamedTuple):
    """One chunk-level decision of a batch [B, ...]."""

    actions: jax.Array  # robot actions [B, H, A]
    chain: jax.Array  # the sampler's states [B, num_steps + 1, ...] (batch first, for sharding)
    log_prob: jax.Array  # [B]
    model_observation: Any  # the model's inputs (pytree of [B, ...])


@dataclasses.dataclass(frozen=True)
class FlowAgent:
    merge: Callable[[Any], Any]  # trainable params -> the model (``train.state.ModelParts.merge``)
    observe: Callable[[dict[str, Any]], Any]  # simulator observation -> model observation (jnp)
    act: Callable[[jax.Array, jax.Array], jax.Array]  # (model chunk, robot state) -> robot actions
    sde: flow.FlowSDE
    num_steps: int | None = None  # the sampler's steps (None: the model's own)

    def sample(self, params, observation: dict[str, Any], rng: jax.Array) -> Decision:
        model_obs = self.observe(observation)
        trace = self.merge(params).sample_actions(model_obs, rng, num_steps=self.num_steps, trace=True, sde=self.sde)
        actions = self.act(trace.actions, observation["state"])
        chain = jax.numpy.moveaxis(trace.states, 0, 1)
        return Decision(actions, chain, flow.chunk_log_prob(trace.log_density), model_obs)

    def features(self, params, model_observation: Any) -> jax.Array:
        """[B, F] the action expert's features of the observations (``Policy.action_features``), with
        no gradient to the policy: what a value head on the expert reads."""
        return jax.lax.stop_gradient(self.merge(params).action_features(model_observation))

    def flow_loss(self, params, model_observation: Any, chunk: jax.Array, rng: jax.Array) -> jax.Array:
        """[B]: the flow-matching loss of regressing each observation onto ``chunk`` (the chain's last
        state: the normalised chunk the decision executed from)."""
        return self.merge(params).example_losses({**model_observation, "actions": chunk}, rng)

    def bc_loss(self, params, batch: Any, rng: jax.Array) -> jax.Array:
        """Behaviour cloning's loss on a training batch (the run's data pipeline's)."""
        return self.merge(params).loss(batch, rng)[0]

    def log_prob(self, params, model_observation: Any, chain: jax.Array) -> jax.Array:
        states = jax.numpy.moveaxis(chain, 1, 0)
        return self.merge(params).chain_log_prob(model_observation, states, self.sde, num_steps=self.num_steps)


def module_merge(model: nnx.Module, trainable: Any = nnx.Param) -> tuple[Callable[[Any], Any], Any]:
    """``(merge, params)`` of a built module: its ``trainable`` state as the params, the rest fixed."""
    graphdef, params, *rest = nnx.split(model, trainable, ...)
    return (lambda p: merge_in_trace(graphdef, p, *rest)), params
