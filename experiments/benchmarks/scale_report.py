"""``python -m experiments.benchmarks.scale_report NAME --devices N``: a train step at cluster scale.

Compiles the full-size train step of experiment NAME for N virtual CPU devices (fsdp = N,
the per-device batch of ``--examples-per-device``) and turns its figures into a projected
step time on H200 nodes for 8, 64, 256 and 1024 GPUs (and N). Per configuration:

- memory: parameter / optimizer / EMA bytes per device from the placements on that mesh;
  temp (activation) bytes from the compile, which depend on the per-device batch and not on
  the device count (the scale tests check this);
- compute: XLA's FLOP count of the compiled per-device step (remat recompute included)
  at ``--mfu`` of the H200's 989 TFLOP/s bf16 peak;
- communication: the analytic FSDP traffic of the parameter tree (``train.scaling``; the
  compiled HLO's count is printed beside it), with bf16 weight gathers and f32 gradient
  reductions as on a GPU, over hierarchical rings: each GPU moves (g-1)/g of an array over
  NVLink inside its node (900 GB/s), each node receives (nodes-1)/nodes of it over RDMA
  (400 GB/s = 3.2 Tb/s per node); all-reduce moves twice;
- step time = compute + communication - the part of communication hidden behind compute
  (``--overlap`` of the compute time at most).

Left out: collective latency (per-message start-up cost, which dominates small arrays at
large scale), stragglers and jitter, the input pipeline, optimizer-step kernels, attention
kernels other than the XLA reference (cuDNN/TE are faster), and topology effects such as
rail-optimised networks. The output ends with one JSON line per configuration; the last one
is the compiled configuration.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Annotated

import tyro

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness

H200 = {"peak_flops": 989e12, "memory_bytes": 141e9, "nvlink_bytes_per_s": 900e9, "node_rdma_bytes_per_s": 400e9}
DEFAULT_EXAMPLES_PER_DEVICE = {"pi05": 32, "gr00t_n15": 64}
PROJECTED = (8, 64, 256, 1024)


def comm_seconds(payload: dict[str, float], gpus: int, gpus_per_node: int) -> float:
    """Hierarchical-ring time for collectives over all ``gpus`` (FSDP groups span the job)."""
    local = min(gpus, gpus_per_node)
    nodes = max(gpus // gpus_per_node, 1)
    per_array = (local - 1) / local / H200["nvlink_bytes_per_s"] + (nodes - 1) / nodes / H200["node_rdma_bytes_per_s"]
    passes = {"all-gather": 1, "reduce-scatter": 1, "all-reduce": 2}
    return sum(payload.get(kind, 0.0) * n for kind, n in passes.items()) * per_array


def gpu_payload(rt_parts, mesh, remat: bool, rules) -> tuple[dict[str, float], float]:
    """(analytic array bytes per kind on a GPU: bf16 gathers, f32 reductions; their wire total)."""
    from embodied_jax.train import scaling

    placements = rt_parts.placements(mesh, rules)
    wire = scaling.analytic_collectives(
        rt_parts, placements, mesh, remat=remat, rules=rules, gather_itemsize=lambda own: min(own, 2), reduce_itemsize=4
    )
    g = math.prod(mesh.shape.values())
    return {k: v * g / (g - 1) if g > 1 else 0.0 for k, v in wire.items() if k != "total"}, wire["total"]


@dataclasses.dataclass(frozen=True)
class Flags:
    """scale_report's command line."""

    name: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="NAME")]]
    """experiment (pi05, gr00t_n15, ...)"""
    devices: int
    """virtual devices to compile for (fsdp = N)"""
    gpus_per_node: int = 8
    examples_per_device: int | None = None
    """per-device batch (default: pi05 32, gr00t_n15 64)"""
    mfu: float = 0.4
    """achieved fraction of peak bf16 FLOP/s"""
    overlap: float = 0.8
    """communication hidden behind compute, as a fraction of the compute time"""
    round_examples: float | None = None
    """also report the wall time of a training round of this many examples"""
    round_node_hours: float | None = None
    """... or of the round that one node (--gpus-per-node GPUs) trains in this many hours"""
    overrides: tyro.conf.Positional[Annotated[tuple[str, ...], tyro.conf.arg(metavar="[OVERRIDES ...]")]] = ()
    """experiment overrides, after --"""


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.scale_report", description=__doc__.split("\n\n")[0]
    )

    from embodied_jax.parallel.virtual_devices import use_virtual_devices

    use_virtual_devices(args.devices)

    from embodied_jax.parallel.mesh import MeshConfig, abstract_mesh
    from embodied_jax.train import loop, scaling
    from embodied_jax.train.dry_run import report
    from embodied_jax.train.state import state_shardings
    from experiments.launch import parse

    per_device = args.examples_per_device or DEFAULT_EXAMPLES_PER_DEVICE.get(args.name, 1)
    config = parse([args.name, *args.overrides])
    config = dataclasses.replace(
        config,
        mesh=dataclasses.replace(config.mesh, data=1, fsdp=args.devices),
        train=dataclasses.replace(config.train, batch_size=per_device * args.devices, grad_accum_steps=1),
    )
    rt = loop.build(config)
    compiled = report(
        rt,
        compile=True,
        show_config=False,
        out=lambda line: None if line.startswith("dry-run summary") else print(line),
    )
    remat = config.model.remat_policy != "none"
    flops_per_example = compiled["flops_per_device"] / per_device
    fixed_device_bytes = compiled["device_bytes"] - (
        compiled["param_bytes_per_device"] + compiled["opt_bytes_per_device"] + compiled["ema_bytes_per_device"]
    )
    state_total = compiled["total_state_bytes"]

    print(
        f"\nProjection for H200 nodes ({args.gpus_per_node} GPUs each): peak {H200['peak_flops'] / 1e12:.0f} TFLOP/s "
        f"bf16 at MFU {args.mfu:g}; NVLink {H200['nvlink_bytes_per_s'] / 1e9:.0f} GB/s per GPU inside a node; "
        f"RDMA {H200['node_rdma_bytes_per_s'] / 1e9:.0f} GB/s per node; communication hidden up to "
        f"{args.overlap:g} x compute; {per_device} examples per GPU; bf16 weight gathers, f32 gradient reductions."
    )
    print(
        f"{'GPUs':>6} {'state/GPU GiB':>14} {'temp GiB':>9} {'fits':>5} {'compute s':>10} {'comm s':>8} "
        f"{'step s':>8} {'examples/s':>11} {'scaling':>8}"
    )
    rows = []
    base = None
    sizes = sorted(set(PROJECTED) | {args.devices})
    for gpus in sizes:
        mesh = abstract_mesh(MeshConfig(data=1, fsdp=gpus), gpus)
        placements = rt.parts.placements(mesh, rt.rules)
        state = scaling.state_bytes(
            rt.abstract_state, state_shardings(rt.abstract_state, rt.parts, rt.tx, mesh, rt.rules)
        )
        dev = state["per_device"]
        payload, analytic_wire_gpu = gpu_payload(rt.parts, mesh, remat, rt.rules)
        compute = flops_per_example * per_device / (H200["peak_flops"] * args.mfu)
        comm = comm_seconds(payload, gpus, args.gpus_per_node)
        step = compute + comm - min(comm, args.overlap * compute)
        throughput = per_device * gpus / step
        base = base or throughput / gpus
        state_per_device = dev["params"] + dev["frozen"] + dev["fp8"] + dev["opt_state"] + dev["ema"]
        device_bytes = state_per_device + fixed_device_bytes
        cpu_wire = scaling.analytic_collectives(
            rt.parts, placements, mesh, remat=remat, rules=rt.rules, gather_itemsize=lambda _: 4, reduce_itemsize=4
        )["total"]
        row = {
            "model": args.name,
            "devices": gpus,
            "compiled": False,
            "fsdp": gpus,
            "examples_per_device": per_device,
            "param_bytes_per_device": dev["params"] + dev["frozen"] + dev["fp8"],
            "opt_bytes_per_device": dev["opt_state"],
            "ema_bytes_per_device": dev["ema"],
            "temp_bytes_per_device": compiled["temp_bytes_per_device"],
            "collective_bytes_per_device": cpu_wire,
            "analytic_collective_bytes_per_device": cpu_wire,
            "gpu_collective_bytes_per_device": analytic_wire_gpu,
            "total_state_bytes": state_total,
            "fits_h200": device_bytes <= H200["memory_bytes"],
            "device_bytes": device_bytes,
            "compute_s": compute,
            "comm_s": comm,
            "projected_step_s": step,
            "examples_per_s": throughput,
            "scaling_efficiency": throughput / gpus / base,
        }
        rows.append(row)
        print(
            f"{gpus:>6} {state_per_device / 2**30:>14.3f} {compiled['temp_bytes_per_device'] / 2**30:>9.2f} "
            f"{'yes' if row['fits_h200'] else 'no':>5} {compute:>10.3f} {comm:>8.3f} {step:>8.3f} "
            f"{throughput:>11.1f} {row['scaling_efficiency']:>8.1%}"
        )
    one_node = next((r for r in rows if r["devices"] == args.gpus_per_node), None)
    round_examples = args.round_examples
    if args.round_node_hours and one_node:
        round_examples = args.round_node_hours * 3600 * one_node["examples_per_s"]
        print(
            f"round: the {round_examples:.3g} examples one {args.gpus_per_node}-GPU node trains in "
            f"{args.round_node_hours:g} h"
        )
    if round_examples:
        for row in rows:
            print(
                f"a round of {round_examples:.3g} examples on {row['devices']} H200: "
                f"{round_examples / row['examples_per_s'] / 60:.1f} min "
                f"({math.ceil(round_examples / (per_device * row['devices']))} steps)"
            )
    compiled_row = dict(next(r for r in rows if r["devices"] == args.devices))
    compiled_row.update(
        compiled=True,
        collective_bytes_per_device=compiled["collective_bytes_per_device"],
        analytic_collective_bytes_per_device=compiled["analytic_collective_bytes_per_device"],
        param_bytes_per_device=compiled["param_bytes_per_device"],
        opt_bytes_per_device=compiled["opt_bytes_per_device"],
        temp_bytes_per_device=compiled["temp_bytes_per_device"],
        fits_h200=compiled["fits_h200"],
        device_bytes=compiled["device_bytes"],
        compile_seconds=compiled["compile_seconds"],
        peak_host_bytes=compiled["peak_host_bytes"],
        collectives=compiled["collectives"],
        activation_bytes_per_example_cpu=compiled["activation_bytes_per_example_cpu"],
    )
    rows.append(compiled_row)
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    sys.exit(harness.run(main, "scale_report"))  # --record: the result appended to results/scale_report.jsonl
