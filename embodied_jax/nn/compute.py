"""``Compute``: how a model's modules compute, as one frozen settings object.

It owns the six settings every module of a model shares: the compute dtype, the parameter
dtype, the FP8 matmul mode (``nn.dense``), the attention implementation (``nn.attention``),
whether layer stacks are scanned and what they keep for the backward pass (``nn.stack``).
A model config keeps them as its own saved fields (``--model.dtype`` and friends) and builds
one ``Compute`` (its ``compute`` property); every model module takes it whole and passes it
down, so none re-types the six. The shared layers (``Dense``, norms, MLPs, embeddings) keep
their plain keywords; ``dense`` and ``dtypes`` give them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Compute:
    """The compute settings of a model (defaults: float32 parameters, each layer computing in
    its parameters' dtype, no FP8, the platform's attention, scanned stacks without remat)."""

    dtype: str | None = None  # compute dtype ("bfloat16", "float32"); None: the parameters' dtype
    param_dtype: str = "float32"
    fp8: str = "none"  # nn.dense.FP8_MODES
    attention_impl: str = "auto"  # nn.attention
    scan_layers: bool = True  # nn.stack: one scanned layer body, or unrolled layers
    remat_policy: str = "none"  # nn.stack.REMAT_POLICIES

    @classmethod
    def of(cls, config: Any) -> Compute:
        """The settings a config holds under the same field names (a model config)."""
        return cls(**{field.name: getattr(config, field.name) for field in dataclasses.fields(cls)})

    @property
    def compute_dtype(self) -> jnp.dtype | None:
        return None if self.dtype is None else jnp.dtype(self.dtype)

    @property
    def weight_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def dtypes(self) -> dict[str, Any]:
        """``dtype`` and ``param_dtype`` as jnp dtypes: the keywords of norms and embeddings."""
        return dict(dtype=self.compute_dtype, param_dtype=self.weight_dtype)

    @property
    def dense(self) -> dict[str, Any]:
        """``dtypes`` and ``fp8``: the keywords of ``nn.dense.Dense`` and the MLPs."""
        return dict(fp8=self.fp8, **self.dtypes)

    @property
    def stack(self) -> dict[str, Any]:
        """``scan`` and ``remat_policy``: the keywords of ``nn.stack.run_stack``."""
        return dict(scan=self.scan_layers, remat_policy=self.remat_policy)
