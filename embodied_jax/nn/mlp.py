"""Feed-forward blocks: GatedMLP (GeGLU / SwiGLU, Gemma/Qwen naming) and a two-layer MLP."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from embodied_jax.nn.dense import Dense
from embodied_jax.nn.lora import LoRAConfig
from embodied_jax.parallel.partition import shard_tokens

ACTIVATIONS = {
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not one of {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nnx.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(
        self,
        width: int,
        hidden: int,
        *,
        activation: str = "gelu_tanh",
        fp8: str = "none",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        lora: LoRAConfig | None = None,
        rngs: nnx.Rngs,
    ):
        self.activation = get_activation(activation)
        common = dict(use_bias=False, fp8=fp8, dtype=dtype, param_dtype=param_dtype, lora=lora, rngs=rngs)
        self.gate_proj = Dense(width, hidden, axes=("embed", "mlp"), **common)
        self.up_proj = Dense(width, hidden, axes=("embed", "mlp"), **common)
        self.down_proj = Dense(hidden, width, axes=("mlp", "embed"), **common)

    def __call__(self, x):
        return self.down_proj(shard_tokens(self.activation(self.gate_proj(x)) * self.up_proj(x), "act_mlp"))


class MLP(nnx.Module):
    """``fc2(act(fc1(x)))``; attribute names configurable (``names``) to match upstream."""

    def __init__(
        self,
        width: int,
        hidden: int,
        *,
        activation: str = "gelu_tanh",
        out_features: int | None = None,
        use_bias: bool = True,
        names: Sequence[str] = ("fc1", "fc2"),
        fp8: str = "none",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        lora: LoRAConfig | None = None,
        rngs: nnx.Rngs,
    ):
        if len(names) != 2 or names[0] == names[1]:
            raise ValueError(f"MLP: names must be two distinct attribute names, got {tuple(names)}")
        self.activation = get_activation(activation)
        self.names = tuple(names)
        common = dict(use_bias=use_bias, fp8=fp8, dtype=dtype, param_dtype=param_dtype, lora=lora, rngs=rngs)
        setattr(self, names[0], Dense(width, hidden, axes=("embed", "mlp"), **common))
        setattr(self, names[1], Dense(hidden, out_features or width, axes=("mlp", "embed"), **common))

    def __call__(self, x):
        first, second = (getattr(self, n) for n in self.names)
        return second(shard_tokens(self.activation(first(x)), "act_mlp"))
