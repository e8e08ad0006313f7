"""``--dry-run``: what a run would hold and move per device, without allocating it.

Everything comes from ``eval_shape`` and each leaf's placement: parameter counts, bytes per
device, and the parameters whose placement fell back from the rules' first choice. With
``compile`` the train step is also compiled ahead of time for the batch as
``ShapeDtypeStruct``s (nothing materialised), under the same mesh context as training, and
the report adds XLA's memory analysis, the largest buffers live at the memory peak (from
XLA's live-range dump), the activations the remat policy keeps (counted from the jaxpr),
the collectives parsed from the HLO next to their analytic count from the parameter tree,
and with ``gpu_memory_gb`` a memory plan from a second compile at twice the per-device
batch. The last line is one JSON summary (``dry-run summary: {...}``).
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
from flax import nnx, traverse_util

from embodied_jax.config_registry import to_dict
from embodied_jax.parallel.hlo import compile_with_dumps, dot_flops, peak_buffers
from embodied_jax.parallel.hlo_collectives import collective_stats
from embodied_jax.parallel.mesh import axis_size, describe_mesh
from embodied_jax.parallel.partition import describe_spec
from embodied_jax.parallel.sharding import batch_shardings, data_parallel_size
from embodied_jax.train import scaling
from embodied_jax.train.runtime import Runtime

H200_BYTES = 141e9
PEAK_BUFFERS_SHOWN = 12


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


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def fallbacks(rt: Runtime) -> list[tuple[str, tuple, Any, str]]:
    """(path, shape, spec, why) of every parameter placed other than by the rules' first choice."""
    out = []
    for template, placements in zip(rt.parts.templates, rt.parts.placements(rt.mesh, rt.rules), strict=True):
        flat = traverse_util.flatten_dict(placements)
        for path, variable in nnx.to_flat_state(template):
            placement = flat[tuple(path)]
            if placement.fallback:
                out.append(
                    (
                        "/".join(map(str, path)),
                        tuple(variable.shape),
                        describe_spec(placement.spec, rt.mesh),
                        placement.fallback,
                    )
                )
    return out


def abstract_batch(model_config, batch_size: int):
    """The model's synthetic batch of ``batch_size`` rows as ShapeDtypeStructs (one row is built)."""
    one = model_config.synthetic_batch(1)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch_size, *np.shape(x)[1:]), np.asarray(x).dtype), one)


def compile_step(rt: Runtime, batch_size: int):
    """(compiled train step for a global batch of ``batch_size``, seconds to compile, XLA's
    live-range dump of it); a real compile, never the persistent cache's copy."""
    batch = abstract_batch(rt.config.model, batch_size)
    shardings = batch_shardings(rt.mesh, batch, rt.rules)
    batch = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), batch, shardings)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), rt.abstract_state, rt.shardings
    )
    with rt.context():
        lowered = rt.step_function(batch).lower(abstract_state, batch)
        t0 = time.perf_counter()
        compiled, live_range = compile_with_dumps(lowered, module="train_step")
    return compiled, time.perf_counter() - t0, live_range


def memory_analysis(compiled) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "temp_size_in_bytes",
        "alias_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    return {f: int(getattr(analysis, f)) for f in fields if analysis is not None and hasattr(analysis, f)}


def device_bytes(mem: dict[str, int]) -> int:
    """What one device must hold: arguments + temp + outputs - aliased (donated) outputs."""
    return (
        mem.get("argument_size_in_bytes", 0)
        + mem.get("temp_size_in_bytes", 0)
        + mem.get("output_size_in_bytes", 0)
        - mem.get("alias_size_in_bytes", 0)
    )


def report(
    rt: Runtime, compile: bool = False, out=print, gpu_memory_gb: float | None = None, show_config: bool = True
) -> dict[str, Any]:
    s, sh = rt.abstract_state, rt.shardings
    config = rt.config
    counts = parameter_counts({"params": s.params, "frozen": s.frozen})
    per_module: dict[str, int] = defaultdict(int)
    for tree in (s.params, s.frozen):
        for name, n in parameter_counts(tree).items():
            per_module[name] += n
    state = scaling.state_bytes(s, sh)
    dev, tot = state["per_device"], state["total"]
    param_bytes = dev["params"] + dev["frozen"] + dev["fp8"]
    opt_bytes = dev["opt_state"]
    total_bytes = sum(tot.values())
    fsdp = axis_size(rt.mesh, "fsdp")
    if show_config:
        out("config:")
        out(json.dumps(to_dict(config), indent=2))
    out(f"mesh: {describe_mesh(rt.mesh)}")
    out("parameters per module:")
    for name, n in sorted(per_module.items()):
        out(f"  {name}: {n}")
    out(f"trainable parameters: {counts.get('params', 0)}")
    out(f"parameters: {sum(counts.values())}")
    out(
        f"bytes per device: parameters {param_bytes} ({_gib(param_bytes)}), optimizer state {opt_bytes} "
        f"({_gib(opt_bytes)}), EMA {dev['ema']} ({_gib(dev['ema'])})"
    )
    out(
        f"bytes in total (all devices): {total_bytes} ({_gib(total_bytes)}); per device "
        f"{(param_bytes + opt_bytes + dev['ema']) / (total_bytes / fsdp):.3f} x total/fsdp"
    )
    moved = fallbacks(rt)
    out(f"placement fallbacks: {len(moved)} parameters placed other than by the rules' first choice")
    for path, shape, spec, why in moved:
        out(f"  {path} {list(shape)} -> {spec}: {why}")
    dp = data_parallel_size(rt.mesh, rt.rules)
    micro = config.train.batch_size // config.train.grad_accum_steps
    result: dict[str, Any] = {
        "parameters": sum(counts.values()),
        "trainable_parameters": counts.get("params", 0),
        "per_module": dict(per_module),
        "param_bytes_per_device": param_bytes,
        "opt_bytes_per_device": opt_bytes,
        "ema_bytes_per_device": dev["ema"],
        "total_state_bytes": total_bytes,
        "num_devices": int(rt.mesh.devices.size),
        "fsdp": fsdp,
        "data_parallel": dp,
        "examples_per_device": micro / dp,
        "fallbacks": len(moved),
    }
    if compile:
        result.update(_compiled_report(rt, out, micro, dp, state, gpu_memory_gb))
    peak = peak_host_bytes()
    out(f"peak host memory: {peak} ({_gib(peak)})")
    result["peak_host_bytes"] = peak
    out("dry-run summary: " + json.dumps(result))
    return result


def _compiled_report(rt: Runtime, out, micro: int, dp: int, state, gpu_memory_gb) -> dict[str, Any]:
    config = rt.config
    backend = jax.default_backend()
    compiled, seconds, live_text = compile_step(rt, config.train.batch_size)
    mem = memory_analysis(compiled)
    out(f"compiled train step on {backend} in {seconds:.1f} s")
    out(
        f"XLA memory analysis ({backend}, per device): "
        + ", ".join(f"{k.removesuffix('_in_bytes')}={_gib(v)}" for k, v in mem.items())
    )
    temp = mem.get("temp_size_in_bytes", 0)
    dev = state["per_device"]
    out(
        f"per device: parameters {_gib(dev['params'] + dev['frozen'] + dev['fp8'])}, optimizer state "
        f"{_gib(dev['opt_state'])}, EMA {_gib(dev['ema'])}, temp (activations and buffers) {_gib(temp)}; "
        f"arguments + temp + outputs - aliased {_gib(device_bytes(mem))}"
    )
    hlo = compiled.as_text()
    peak = peak_buffers(live_text, hlo)
    if peak:
        out(f"largest buffers live at the memory peak (of {len(peak)}, {_gib(sum(b.bytes for b in peak))} in all):")
        for buffer in peak[:PEAK_BUFFERS_SHOWN]:
            out(f"  {_gib(buffer.bytes)} {buffer.shape} {buffer.op_name[-110:]}")
    flops = dot_flops(hlo)
    out(f"matmul FLOPs per device per step (HLO, loops counted per trip): {flops:.4g}")
    result: dict[str, Any] = {
        "compile_seconds": seconds,
        "backend": backend,
        "memory_analysis": mem,
        "temp_bytes_per_device": temp,
        "device_bytes": device_bytes(mem),
        "fits_h200": device_bytes(mem) <= H200_BYTES,
        "flops_per_device": flops,
    }

    policy = config.model.remat_policy
    kept = scaling.activation_bytes(rt.parts, config.model)
    per_example = sum(kept.values())
    stored = scaling.stored_on_cpu(kept)
    examples = micro / dp
    out(
        f"activations kept for backward (remat_policy={policy!r}, from the jaxpr): {_gib(per_example)} per "
        f"example in the program's dtypes ({', '.join(f'{k} {_gib(v)}' for k, v in sorted(kept.items()) if v)}), "
        f"{_gib(stored)} as XLA:CPU stores them (x{stored / max(per_example, 1):.2f}); at {examples:g} examples "
        f"per device {_gib(stored * examples)}: temp / that = {temp / max(stored * examples, 1):.2f}"
    )
    result.update(activation_bytes_per_example=per_example, activation_bytes_per_example_cpu=stored)

    stats = collective_stats(hlo, rt.mesh)
    out("collectives per device per step (HLO; bytes sent, ring algorithms; loops counted per trip):")
    for kind, row in stats.by_kind().items():
        out(
            f"  {kind}: {row['count']} ops, {_gib(row['bytes'])} ({row['bytes']:.0f} bytes; arrays "
            f"{_gib(row['payload_bytes'])})"
        )
    for axis, row in sorted(stats.by_axis().items()):
        out(f"  over {axis}: {row['count']} ops, {_gib(row['bytes'])}")
    placements = rt.parts.placements(rt.mesh, rt.rules)
    remat = policy != "none"
    cpu = backend == "cpu"
    analytic = scaling.analytic_collectives(
        rt.parts,
        placements,
        rt.mesh,
        remat=remat,
        rules=rt.rules,
        gather_itemsize=(lambda _: 4) if cpu else (lambda own: min(own, 2)),
        reduce_itemsize=4,
    )
    dtypes = "f32 as XLA:CPU moves them" if cpu else "bf16 gathers, f32 reductions"
    out(
        f"analytic collectives (parameter tree; {dtypes}): "
        + ", ".join(f"{k} {_gib(v)}" for k, v in analytic.items())
        + f"; HLO / analytic = {stats.total_bytes / max(analytic['total'], 1):.3f}"
    )
    result.update(
        collective_bytes_per_device=stats.total_bytes,
        collectives=stats.by_kind(),
        collectives_by_axis=stats.by_axis(),
        analytic_collective_bytes_per_device=analytic["total"],
        analytic_collectives=analytic,
    )

    if gpu_memory_gb:
        # A second compile at a larger per-device batch (at least 8 examples more: XLA's buffer
        # assignment moves by more than one small example's activations) for the slope.
        per_device = config.train.batch_size / dp
        larger = max(2 * per_device, per_device + 8)
        second, extra_seconds, _ = compile_step(rt, int(larger * dp))
        at = {per_device: device_bytes(mem), larger: device_bytes(memory_analysis(second))}
        plan = scaling.memory_plan(
            at,
            state_total=sum(state["total"].values()),
            state_per_device=sum(dev.values()),
            gpu_bytes=gpu_memory_gb * 1e9,
            global_examples=config.train.batch_size,
        )
        out(
            f"memory plan for {gpu_memory_gb:g} GB GPUs (from a second compile at {larger:g} examples per device, "
            f"{extra_seconds:.1f} s): {_gib(plan['bytes_per_example'])} per example, {_gib(plan['fixed_bytes'])} "
            f"fixed; at most {plan['max_examples_per_device']} examples per device on this mesh; "
            f"train.batch_size={config.train.batch_size} needs at least {plan['devices_needed']} GPUs"
        )
        result["memory_plan"] = plan
    return result
