"""The value network: a small MLP of the critic's input and the episode's progress.

The input is the robot state and, by default, the simulator's privileged state (objects' and
goal's poses, latched facts: ``rollout.critic_input``): what decides success on a manipulation
task is where the object is, which the policy sees only in its images. The critic is never
deployed, so nothing privileged reaches the policy. A separate network: it costs nothing next to
the policy's forward pass (``docs/rl.md``). With ``RLConfig.expert_features`` its input also holds
the action expert's features of the policy's observation (``Policy.action_features``, no gradient
to the policy): a value head on the expert, as πRL has, beside the privileged state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Critic(nnx.Module):
    def __init__(self, state_dim: int, width: int = 128, depth: int = 2, *, rngs: nnx.Rngs):
        dims = [state_dim + 1, *[width] * depth]
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(dims[:-1], dims[1:], strict=True)])
        self.out = nnx.Linear(dims[-1], 1, kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, state: jax.Array, progress: jax.Array) -> jax.Array:
        """Values [B] of critic inputs [B, S] at ``progress`` [B] (decisions taken / per episode)."""
        h = jnp.concatenate([jnp.asarray(state, jnp.float32), progress[:, None].astype(jnp.float32)], axis=-1)
        for layer in self.layers:
            h = jnp.tanh(layer(h))
        return self.out(h)[:, 0]
