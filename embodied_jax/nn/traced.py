"""NNX modules inside raw JAX transformations (``lax.fori_loop``, ``lax.scan``, ``jax.jit``).

NNX refuses to mutate a ``Variable`` from a trace level other than the one it was created
at (``TraceContextError``), so a module built outside a loop or scan body cannot run
inside it if its forward pass updates any state. The one rule of the project: split the
module outside, and rebuild it from its state inside the trace with fresh ``Variable``
objects of that trace (``merge_in_trace``). Mutations made inside are not carried out
(sampling loops and evaluation are read-only).

- ``merge_in_trace(graphdef, state)``: the module, rebuilt in the current trace.
- ``module_fori_loop(module, num_steps, body, init)``: ``carry = body(i, module, carry)`` for
  ``i`` in ``0 .. num_steps - 1`` under ``lax.fori_loop``, the module rebuilt in the body.
- ``module_scan(module, num_steps, body, init)``: the same under ``lax.scan``, where ``body``
  returns ``(carry, out)`` and each step's ``out`` is stacked.
- ``module_vjp(module, fn, *primals)``: ``jax.vjp`` of ``fn(module, *primals)`` with respect to
  the primals only, the module rebuilt inside the differentiated trace.

Layer stacks use NNX's own ``nnx.scan`` instead (``nn/stack.py``): there the state is
stacked along the scanned axis, a different thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx

Carry = TypeVar("Carry")


def merge_in_trace(graphdef: nnx.GraphDef, state: Any, *states: Any) -> Any:
    """``nnx.merge`` with new ``Variable`` objects owned by the current trace (same arrays)."""
    return nnx.merge(graphdef, state, *states, copy=True)


def module_fori_loop(
    module: nnx.Module, num_steps: int, body: Callable[[Any, Any, Carry], Carry], init: Carry
) -> Carry:
    """``lax.fori_loop(0, num_steps, ...)`` of ``carry = body(i, module, carry)``.

    The module is split here and rebuilt inside the loop body (``merge_in_trace``); its
    arrays are loop constants, so only ``carry`` flows between iterations.
    """
    graphdef, state = nnx.split(module)

    def step(i, carry):
        return body(i, merge_in_trace(graphdef, state), carry)

    return jax.lax.fori_loop(0, num_steps, step, init)


def module_scan(
    module: nnx.Module, num_steps: int, body: Callable[[Any, Any, Carry], tuple[Carry, Any]], init: Carry
) -> tuple[Carry, Any]:
    """``lax.scan`` over ``i = 0 .. num_steps - 1`` of ``carry, out = body(i, module, carry)``:
    (the last carry, every step's ``out`` stacked on a leading axis)."""
    graphdef, state = nnx.split(module)

    def step(carry, i):
        return body(i, merge_in_trace(graphdef, state), carry)

    return jax.lax.scan(step, init, jax.numpy.arange(num_steps))


def module_vjp(module: nnx.Module, fn: Callable[..., Any], *primals: Any, has_aux: bool = False) -> Any:
    """``jax.vjp(lambda *p: fn(module, *p), *primals, has_aux=has_aux)``: the module's arrays are
    constants of the differentiated function (no cotangent reaches them)."""
    graphdef, state = nnx.split(module)
    return jax.vjp(lambda *p: fn(merge_in_trace(graphdef, state), *p), *primals, has_aux=has_aux)
