"""Layer stacks: scanned (one compiled body over stacked params) or unrolled, with remat.

``build_stack(factory, num_layers, *, scan, rngs)`` calls ``factory(rngs) -> layer``:

- ``scan=True``: one module whose parameters carry a leading ``layers`` axis (logical
  name ``"layers"`` prepended to every variable's ``out_sharding``), built with
  ``nnx.vmap`` over ``num_layers`` split rngs.
- ``scan=False``: an ``nnx.List`` of ``num_layers`` independent layers; parameter paths
  are ``<stack>.<i>.<name>``. Weight importers must handle both layouts (stack per-layer
  upstream tensors into the scanned leaf along axis 0).

``run_stack(stack, carry, *args, scan, remat_policy, with_outputs=False, **kwargs)`` runs
``layer(carry, *args, **kwargs)`` through every layer. ``args``/``kwargs`` are shared by
all layers (broadcast), except that an argument wrapped in ``PerLayer(x)`` is sliced
along its leading axis (one slice per layer, e.g. a per-layer KV cache). A layer
returns the new carry, or ``(carry, out)`` when ``with_outputs=True``; then run_stack
returns ``(carry, outs)`` with ``outs`` stacked along a leading layers axis.

``remat_policy``: "none" (store activations), "dots_saveable" (keep matmul outputs,
recompute the rest; this keeps the float32 attention logits too), "full" (keep nothing but
layer inputs), "dots_with_no_batch_dims_saveable" (keep the weight matmuls' outputs, not
the attention's), "save_attention" (keep only each attention's q, k, v and output: the
backward pass recomputes the MLPs and the softmax; about a sixth of the activations of
"dots_with_no_batch_dims_saveable" for a Gemma layer). Scan and remat change memory and
compile time, never the numbers. Under FSDP a scanned stack needs a policy other than
"none": without one the backward pass keeps every layer's gathered weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from embodied_jax.nn.attention import ATTENTION_NAMES

REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_attention": jax.checkpoint_policies.save_only_these_names(*ATTENTION_NAMES),
}


@struct.dataclass
class PerLayer:
    """Marks a run_stack argument whose leading axis indexes layers."""

    value: Any


def build_stack(factory: Callable[[nnx.Rngs], nnx.Module], num_layers: int, *, scan: bool, rngs: nnx.Rngs):
    """``num_layers`` layers from ``factory``: one scanned module or an ``nnx.List``."""
    if num_layers < 1:
        raise ValueError(f"build_stack: num_layers must be >= 1, got {num_layers}")
    if not scan:
        return nnx.List([factory(rngs) for _ in range(num_layers)])

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=num_layers, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(layer_rngs):
        return factory(layer_rngs)

    return create(rngs)


def _checkpointed(fn, remat_policy: str):
    if remat_policy not in REMAT_POLICIES:
        raise ValueError(f"remat_policy={remat_policy!r} is not one of {tuple(REMAT_POLICIES)}")
    if remat_policy == "none":
        return fn
    return nnx.remat(fn, policy=REMAT_POLICIES[remat_policy], prevent_cse=False)


def _split_per_layer(args, kwargs):
    is_marker = lambda x: isinstance(x, PerLayer)  # noqa: E731
    per_layer = jax.tree.map(lambda x: x.value if is_marker(x) else None, (args, kwargs), is_leaf=is_marker)
    shared = jax.tree.map(lambda x: None if is_marker(x) else x, (args, kwargs), is_leaf=is_marker)
    return per_layer, shared


def _merge(per_layer, shared):
    return jax.tree.map(lambda p, s: s if p is None else p, per_layer, shared, is_leaf=lambda x: x is None)


def run_stack(stack, carry, *args, scan: bool, remat_policy: str = "none", with_outputs: bool = False, **kwargs):
    """Run every layer of ``stack`` on ``carry``; see the module docstring."""
    per_layer, shared = _split_per_layer(args, kwargs)

    def apply(layer, carry, layer_inputs):
        call_args, call_kwargs = _merge(layer_inputs, shared)
        result = layer(carry, *call_args, **call_kwargs)
        return result if with_outputs else (result, None)

    apply = _checkpointed(apply, remat_policy)

    if not scan:
        if not isinstance(stack, (list, tuple, nnx.List)):
            raise TypeError(f"run_stack(scan=False) expects a list of layers, got {type(stack).__name__}")
        outs = []
        for i, layer in enumerate(stack):
            layer_inputs = jax.tree.map(
                lambda x, i=i: None if x is None else x[i], per_layer, is_leaf=lambda x: x is None
            )
            carry, out = apply(layer, carry, layer_inputs)
            outs.append(out)
        if not with_outputs:
            return carry
        return carry, jax.tree.map(lambda *xs: jnp.stack(xs), *outs)

    if isinstance(stack, (list, tuple, nnx.List)):
        raise TypeError("run_stack(scan=True) expects a scanned module from build_stack(scan=True), got a list")

    @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata={nnx.PARTITION_NAME: "layers"})
    def body(layer, carry, layer_inputs):
        return apply(layer, carry, layer_inputs)

    carry, outs = body(stack, carry, per_layer)
    return (carry, outs) if with_outputs else carry
