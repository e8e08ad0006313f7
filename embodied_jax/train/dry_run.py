"""``--dry-run``: what a run would hold per device, without allocating it.

Everything comes from ``eval_shape`` and each leaf's sharded shape; with ``compile``
the train step is also compiled ahead of time and XLA's memory analysis printed.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from collections import defaultdict
from typing import Any

import jax
import numpy as np

from embodied_jax.parallel.mesh import describe_mesh
from embodied_jax.parallel.sharding import batch_sharding, sharded_bytes_per_device
from embodied_jax.train.config import to_dict
from embodied_jax.train.loop import Runtime
from embodied_jax.train.step import jit_train_step, make_train_step


def parameter_counts(abstract_params: dict) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
        counts[str(path[0].key)] += int(np.prod(leaf.shape, dtype=np.int64))
    return dict(counts)


def peak_host_bytes() -> int:
    """Peak resident memory of this process. Linux's VmHWM belongs to the process image;
    ``ru_maxrss`` can carry the parent's peak into a freshly spawned child."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


def report(rt: Runtime, compile: bool = False, out=print) -> dict[str, Any]:
    s, sh = rt.abstract_state, rt.shardings
    counts = parameter_counts({"params": s.params, "frozen": s.frozen})
    per_module: dict[str, int] = defaultdict(int)
    for tree in (s.params, s.frozen):
        for name, n in parameter_counts(tree).items():
            per_module[name] += n
    total = sum(counts.values())
    trainable = counts.get("params", 0)
    param_bytes = sharded_bytes_per_device((s.params, s.frozen, s.fp8), (sh.params, sh.frozen, sh.fp8))
    opt_bytes = sharded_bytes_per_device((s.opt_state, s.ema), (sh.opt_state, sh.ema))
    total_bytes = sum(
        int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves((s.params, s.frozen, s.fp8, s.opt_state, s.ema))
    )
    out("config:")
    out(json.dumps(to_dict(rt.config), indent=2))
    out(f"mesh: {describe_mesh(rt.mesh)}")
    out("parameters per module:")
    for name, n in sorted(per_module.items()):
        out(f"  {name}: {n}")
    out(f"trainable parameters: {trainable}")
    out(f"parameters: {total}")
    out(f"bytes per device: parameters {param_bytes} ({_gib(param_bytes)}), "
        f"optimizer state {opt_bytes} ({_gib(opt_bytes)})")
    out(f"bytes in total (all devices): {total_bytes} ({_gib(total_bytes)})")
    result = {
        "parameters": total, "trainable_parameters": trainable, "per_module": dict(per_module),
        "param_bytes_per_device": param_bytes, "opt_bytes_per_device": opt_bytes,
        "total_state_bytes": total_bytes, "num_devices": int(rt.mesh.devices.size),
    }
    if compile:
        cfg = rt.config
        batch = cfg.model.synthetic_batch(cfg.train.batch_size)
        abstract_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=batch_sharding(rt.mesh, np.ndim(x))),
            batch,
        )
        abstract_state = jax.tree.map(
            lambda x, shard: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard), s, sh
        )
        step = jit_train_step(make_train_step(rt.parts, rt.tx, rt.schedule, cfg.train, rt.mesh), sh, batch, rt.mesh)
        t0 = time.perf_counter()
        compiled = step.lower(abstract_state, abstract_batch).compile()
        seconds = time.perf_counter() - t0
        backend = jax.default_backend()
        analysis = compiled.memory_analysis()
        out(f"compiled train step on {backend} in {seconds:.1f} s")
        mem = {}
        if analysis is not None:
            for field in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                          "alias_size_in_bytes", "generated_code_size_in_bytes"):
                if hasattr(analysis, field):
                    mem[field] = int(getattr(analysis, field))
            out(f"XLA memory analysis ({backend}, per device): " +
                ", ".join(f"{k.removesuffix('_in_bytes')}={_gib(v)}" for k, v in mem.items()))
        result.update(compile_seconds=seconds, backend=backend, memory_analysis=mem)
    peak = peak_host_bytes()
    out(f"peak host memory: {peak} ({_gib(peak)})")
    result["peak_host_bytes"] = peak
    return result
