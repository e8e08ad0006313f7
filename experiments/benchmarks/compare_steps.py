"""``python -m experiments.benchmarks.compare_steps NAME --variant "ARGS" [--variant "ARGS" ...]``

Times train steps of configuration variants of one experiment against each other in one
process: each variant (the experiment's overrides, e.g. ``--variant "" --variant
"--model.no-scan-layers"``) is built and compiled as ``train_step`` builds it (``compile_step``), then one step of each
runs in turn for ``--rounds`` rounds after a warm-up round (``harness.alternate``). A change of this machine's speed,
which moves single runs by ±20% on a shared 2-core CPU, then hits every variant alike.

Prints per variant the median and first quartile of the step's seconds and of the process's
CPU seconds, the ratio of each median to the first variant's, and ends with one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import statistics
import sys
from typing import Annotated

import tyro

from embodied_jax.cli import parse_flags
from embodied_jax.errors import InputError
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """compare_steps's command line."""

    experiment: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="NAME")]]
    """the experiment (as the launcher names it)"""
    variant: tyro.conf.UseAppendAction[Annotated[tuple[str, ...], tyro.conf.arg(metavar="ARGS")]] = ()
    """overrides of one variant ('' for none)"""
    rounds: int = 12


def _attach_variant_values(argv: list[str]) -> list[str]:
    """``--variant VALUE`` as ``--variant=VALUE``: a variant's overrides start with ``--``
    (``--variant "--model.scan-layers"``), which tyro would otherwise take for the next flag."""
    out, args = [], iter(argv)
    for arg in args:
        value = next(args, None) if arg == "--variant" else None
        out.append(arg if value is None else f"--variant={value}")
    return out


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_flags(
        Flags,
        args=_attach_variant_values(argv),
        prog="python -m experiments.benchmarks.compare_steps",
        description=__doc__.splitlines()[0],
    )
    if len(args.variant) < 2:
        raise InputError("compare_steps: give at least two --variant (use --variant '' for the experiment as is)")

    from experiments.benchmarks.train_step import compile_step
    from experiments.launch import parse

    def one_step(run):
        def step():
            built = run["built"]
            with built.runtime.context():
                run["state"], metrics = built.step(run["state"], built.batches[0])
            return metrics

        return step

    runs = []
    for variant in args.variant:
        built = compile_step(parse([args.experiment, *shlex.split(variant)]), num_batches=1)
        runs.append({"built": built, "state": built.state})
    times = harness.alternate({i: one_step(run) for i, run in enumerate(runs)}, rounds=args.rounds, warmup=1)
    for i, run in enumerate(runs):
        run.update(times[i])
    base = statistics.median(runs[0]["wall"])
    result = {"experiment": args.experiment, "rounds": args.rounds, "variants": []}
    for variant, run in zip(args.variant, runs, strict=True):
        wall, cpu = statistics.median(run["wall"]), statistics.median(run["cpu"])
        row = {
            "variant": variant,
            "median_step_s": wall,
            # one round (--rounds 1): its one time is the quartile too
            "q1_step_s": statistics.quantiles(run["wall"], n=4)[0] if len(run["wall"]) > 1 else wall,
            "median_cpu_s": cpu,
            "ratio_to_first": wall / base,
        }
        result["variants"].append(row)
        label = variant or "(as registered)"
        print(f"{label:40s} median {wall:.3f} s  q1 {row['q1_step_s']:.3f} s  cpu {cpu:.3f} s  x{wall / base:.2f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "compare_steps"))  # --record: the result appended to results/compare_steps.jsonl
