"""Dense and Einsum layers with optional FP8 matmuls, parameters named by logical axes.

``fp8`` selects how the matmul runs:

- ``"none"``: ``jnp.einsum`` in the compute dtype.
- ``"flax"``: delayed-scaling FP8 built from Flax's linen-agnostic ops in
  ``flax.linen.fp8_ops`` (``in_qdq`` for inputs and kernel in e4m3, ``out_qdq`` for the
  output gradient in e5m2). The amax histories (length ``amax_history_length``, default
  16) and scales live in ``embodied_jax.variables.Fp8Meta`` variables whose gradient *is*
  their updated value; the trainer overwrites them with it and never optimises or clips
  them. Because the update arrives as a gradient, an FP8 layer must be called ONCE per
  differentiated function (several calls would sum their updates): batch repeated uses
  (e.g. several flow samples) into one call.
  On CPU this is emulated (no speed-up); on Hopper XLA rewrites the q/dq pattern to FP8 GEMMs.
- ``"te"``: Transformer Engine's ``dense`` with per-tensor current scaling (stateless)
  on a GPU with TE installed. Without a GPU or TE the layer falls back to ``"flax"``
  and logs one line saying why (the FP8 meta variables therefore always exist).

``lora=LoRAConfig(rank, alpha)`` adds ``lora_a``/``lora_b`` beside ``kernel`` (see lora.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

from embodied_jax.nn.lora import LoRAConfig, lora_delta, make_lora_params
from embodied_jax.parallel.partition import cast_parameter, logical_names, shard_tokens
from embodied_jax.variables import Fp8Meta

log = logging.getLogger(__name__)

FP8_MODES = ("none", "flax", "te")
DEFAULT_AMAX_HISTORY = 16
_LOGGED: set[str] = set()

Initializer = Callable[..., jax.Array]
# Logical name of an activation's feature axis, from the output axis of the kernel that made it.
ACTIVATION_AXES = {"mlp": "act_mlp", "heads": "act_heads", "kv_heads": "act_kv_heads"}


def default_kernel_init(in_axis=-2, out_axis=-1) -> Initializer:
    return nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis)


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.warning(message)


def te_unavailable_reason() -> str | None:
    """Why Transformer Engine FP8 cannot be used here, or None when it can."""
    if jax.default_backend() != "gpu":
        return f"no GPU (default backend {jax.default_backend()!r})"
    try:
        from transformer_engine.jax import dense as _te_dense  # noqa: F401
        from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode  # noqa: F401
    except Exception as exc:
        return f"transformer_engine.jax not importable ({exc.__class__.__name__}: {exc})"
    return None


def resolve_fp8(fp8: str) -> str:
    """Validate ``fp8`` and return the mode that will actually run (te -> flax fallback)."""
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8={fp8!r} is not one of {FP8_MODES}")
    if fp8 == "te":
        reason = te_unavailable_reason()
        if reason:
            _log_once(f"fp8='te' unavailable: {reason}; falling back to fp8='flax'")
            return "flax"
    return fp8


class Fp8Scaling(nnx.Module):
    """Delayed-scaling state of one FP8 matmul (Flax's variable names) and its dot_general."""

    def __init__(self, amax_history_length: int = DEFAULT_AMAX_HISTORY):
        def history():
            return Fp8Meta(jnp.zeros((amax_history_length,), jnp.float32), out_sharding=("fp8_meta",))

        def scale():
            return Fp8Meta(jnp.ones((1,), jnp.float32), out_sharding=("fp8_meta",))

        self.input_amax_history = history()
        self.kernel_amax_history = history()
        self.output_grad_amax_history = history()
        self.input_scale = scale()
        self.kernel_scale = scale()
        self.output_grad_scale = scale()

    def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        del precision, preferred_element_type  # the q/dq dot runs at default precision
        meta = lambda v: v[...]  # noqa: E731
        compute_dtype = lhs.dtype
        lhs = fp8_ops.in_qdq(
            compute_dtype, jnp.float8_e4m3fn, lhs, meta(self.input_scale), meta(self.input_amax_history)
        )
        rhs = fp8_ops.in_qdq(
            compute_dtype, jnp.float8_e4m3fn, rhs, meta(self.kernel_scale), meta(self.kernel_amax_history)
        )
        out = jax.lax.dot_general(lhs, rhs, dimension_numbers)
        return fp8_ops.out_qdq(
            compute_dtype, jnp.float8_e5m2, out, meta(self.output_grad_scale), meta(self.output_grad_amax_history)
        )


def _te_einsum(spec: str, x, kernel):
    """Contract x's trailing dims with kernel's leading dims through TE's FP8 dense."""
    from transformer_engine.jax.dense import dense as te_dense
    from transformer_engine.jax.quantize import QuantizerFactory, ScalingMode

    lhs_spec, out_spec = spec.replace(" ", "").split("->")
    x_spec, k_spec = lhs_spec.split(",")
    contracted = [c for c in k_spec if c in x_spec and c not in out_spec]
    n = len(contracted)
    if x_spec[-n:] != "".join(contracted) or k_spec[:n] != "".join(contracted) or out_spec != x_spec[:-n] + k_spec[n:]:
        raise ValueError(f"fp8='te' supports einsums contracting x's trailing with kernel's leading dims, got {spec!r}")
    quantizers = QuantizerFactory.create_set(scaling_mode=ScalingMode.CURRENT_TENSOR_SCALING)
    dims = (tuple(range(x.ndim - n, x.ndim)), tuple(range(n)))
    return te_dense(x, kernel, None, contracting_dims=dims, quantizer_set=quantizers)


class Einsum(nnx.Module):
    """``jnp.einsum(spec, x, kernel)`` with param ``kernel`` of ``kernel_shape``."""

    def __init__(
        self,
        spec: str,
        kernel_shape: Sequence[int],
        *,
        axes: Sequence[str | None],
        fp8: str = "none",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer | None = None,
        amax_history_length: int = DEFAULT_AMAX_HISTORY,
        lora: LoRAConfig | None = None,
        rngs: nnx.Rngs,
    ):
        kernel_shape = tuple(int(s) for s in kernel_shape)
        if len(axes) != len(kernel_shape):
            raise ValueError(f"Einsum {spec!r}: axes {tuple(axes)} do not match kernel_shape {kernel_shape}")
        self.spec = spec
        self.dtype = dtype
        self.fp8_requested = fp8
        self.fp8 = resolve_fp8(fp8)
        init = kernel_init or default_kernel_init(in_axis=0, out_axis=-1)
        self.kernel = nnx.Param(init(rngs.params(), kernel_shape, param_dtype), out_sharding=tuple(axes))
        self.fp8_scaling = Fp8Scaling(amax_history_length) if self.fp8 != "none" else None
        self.lora = lora
        if lora is not None:
            self.lora_a, self.lora_b = make_lora_params(spec, kernel_shape, axes, lora, param_dtype, rngs)

    def __call__(self, x):
        dtype = self.dtype or self.kernel.dtype
        x = jnp.asarray(x, dtype)
        kernel = cast_parameter(self.kernel, dtype)
        if self.fp8 == "none":
            y = jnp.einsum(self.spec, x, kernel)
        elif self.fp8 == "te":
            y = _te_einsum(self.spec, x, kernel).astype(dtype)
        else:
            y = jnp.einsum(self.spec, x, kernel, _dot_general=self.fp8_scaling.dot_general)
        if self.lora is not None:
            y = y + lora_delta(self.spec, x, self.lora_a[...], self.lora_b[...], self.lora)
        return y


class Dense(nnx.Module):
    """``x @ kernel + bias`` over the last axis; params ``kernel`` [in, out], ``bias`` [out]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: Sequence[str | None] = ("embed", "mlp"),
        use_bias: bool = True,
        fp8: str = "none",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Initializer | None = None,
        bias_init: Initializer | None = None,
        amax_history_length: int = DEFAULT_AMAX_HISTORY,
        lora: LoRAConfig | None = None,
        rngs: nnx.Rngs,
    ):
        if len(axes) != 2:
            raise ValueError(f"Dense: axes must name (in, out), got {tuple(axes)}")
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.fp8_requested = fp8
        self.fp8 = resolve_fp8(fp8)
        init = kernel_init or default_kernel_init()
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), param_dtype), out_sharding=tuple(axes))
        if use_bias:
            binit = bias_init or nnx.initializers.zeros_init()
            self.bias = nnx.Param(binit(rngs.params(), (out_features,), param_dtype), out_sharding=(axes[1],))
        else:
            self.bias = None
        self.fp8_scaling = Fp8Scaling(amax_history_length) if self.fp8 != "none" else None
        self.lora = lora
        if lora is not None:
            self.lora_a, self.lora_b = make_lora_params(
                "...i,io->...o", (in_features, out_features), axes, lora, param_dtype, rngs
            )

    def __call__(self, x):
        dtype = self.dtype or self.kernel.dtype
        x = jnp.asarray(x, dtype)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Dense: input last dim {x.shape[-1]} != in_features {self.in_features}")
        kernel = cast_parameter(self.kernel, dtype)
        # One 2-D matmul over all tokens: its weight gradient contracts a single axis, which
        # XLA:CPU's dot takes as is (contracting [batch, length] first copies the output
        # gradient transposed, 10-20% of a train step).
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.fp8 == "none":
            y = jnp.einsum("ni,io->no", x, kernel)
        elif self.fp8 == "te":
            y = _te_einsum("ani,io->ano", x[None], kernel)[0].astype(dtype)
        else:
            y = jnp.einsum("ni,io->no", x, kernel, _dot_general=self.fp8_scaling.dot_general)
        if self.lora is not None:
            y = y + lora_delta("ni,io->no", x, self.lora_a[...], self.lora_b[...], self.lora)
        if self.bias is not None:
            y = y + self.bias[...].astype(dtype)
        y = y.reshape(*lead, self.out_features)
        # Split like the batch, never like the weight (whose placement the partitioner would
        # otherwise propagate to the output and then gather the batch to match).
        return shard_tokens(y, ACTIVATION_AXES.get(logical_names(self.kernel)[1], "act_embed"))
