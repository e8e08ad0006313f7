"""The time a compiled step's matmuls take when each runs alone (``train_step --matmul-floor``).

``matmul_floor(hlo_text)`` lists the program's distinct ``dot`` instructions
(``embodied_jax.parallel.hlo.dots``: shapes, dimension numbers, executions per step), compiles
each as one ``jax.lax.dot_general`` on random operands of its shapes and dtypes, and times it
(median of ``repeats`` calls, less the median call of a 1x1 matmul: the dispatch a step does
not pay per op). ``matmul_floor_s`` sums time x executions: how long the step's matmuls take one after
another, each with the whole machine and none fused with anything else. A step is bounded by it
only loosely (XLA may run two small matmuls side by side, one per core, faster than one after
the other), but a step much slower than it loses its time outside the matmuls, and a target
below it needs matmuls faster than XLA runs them alone.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from embodied_jax.parallel.hlo import Dot, dots

_DTYPES = {
    "f32": jnp.float32,
    "bf16": jnp.bfloat16,
    "f16": jnp.float16,
    "f8e4m3fn": jnp.float8_e4m3fn,
    "f8e5m2": jnp.float8_e5m2,
}


def _median_call_s(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _operand(dtype: str, shape: tuple[int, ...], seed: int):
    if dtype not in _DTYPES:
        raise ValueError(f"matmul_floor: no random operand for HLO dtype {dtype!r}")
    values = np.random.default_rng(seed).standard_normal(shape, np.float32)
    return jnp.asarray(values).astype(_DTYPES[dtype])


def plain_matmul(m: int, k: int, n: int) -> Dot:
    """The float32 [m, k] @ [k, n] matmul, run once."""
    return Dot("f32", (m, k), "f32", (k, n), (((1,), (0,)), ((), ())), "f32", 1)


def time_dot(dot: Dot, repeats: int = 9) -> float:
    """Median seconds of one call of ``dot`` compiled alone."""
    args = (_operand(dot.lhs_dtype, dot.lhs_shape, 0), _operand(dot.rhs_dtype, dot.rhs_shape, 1))
    out = _DTYPES.get(dot.result_dtype)
    fn = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dot.dimension_numbers, preferred_element_type=out))
    return _median_call_s(fn, args, repeats)


def matmul_floor(hlo_text: str, repeats: int = 9) -> dict:
    """``matmul_floor_s`` (the matmuls one after another, each alone), their FLOPs and rate, the
    dispatch subtracted per call, and the five costliest distinct matmuls."""
    found = dots(hlo_text)
    dispatch = time_dot(plain_matmul(1, 1, 1), repeats=max(repeats, 31))
    rows = []
    for dot in found:
        seconds = max(time_dot(dot, repeats) - dispatch, 0.0)
        rows.append((seconds * dot.count, dot, seconds))
    floor = sum(r[0] for r in rows)
    flops = sum(d.flops * d.count for d in found)
    top = sorted(rows, key=lambda r: -r[0])[:5]
    return {
        "matmul_floor_s": floor,
        "matmul_floor_flops": flops,
        "matmul_floor_flops_per_s": flops / floor if floor else None,
        "matmul_floor_distinct": len(found),
        "matmul_floor_calls": sum(d.count for d in found),
        "matmul_floor_dispatch_s": dispatch,
        "matmul_floor_top": [
            {
                "lhs": list(d.lhs_shape),
                "rhs": list(d.rhs_shape),
                "count": d.count,
                "s": total,
                "flops_per_s": d.flops / s if s else None,
            }
            for total, d, s in top
        ],
    }
