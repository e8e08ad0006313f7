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

import argparse
import json
import shlex
import statistics
import sys

from embodied_jax.errors import InputError
from experiments.benchmarks import harness


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--variant", action="append", default=[], help="overrides of one variant ('' for none)")
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args(argv)
    if len(args.variant) < 2:
        raise InputError("compare_steps: give at least two --variant (use --variant '' for the experiment as is)")

    from experiments.benchmarks.harness import alternate
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
    times = alternate({i: one_step(run) for i, run in enumerate(runs)}, rounds=args.rounds, warmup=1)
    for i, run in enumerate(runs):
        run.update(times[i])
    base = statistics.median(runs[0]["wall"])
    result = {"experiment": args.experiment, "rounds": args.rounds, "variants": []}
    for variant, run in zip(args.variant, runs, strict=True):
        wall, cpu = statistics.median(run["wall"]), statistics.median(run["cpu"])
        row = {
            "variant": variant,
            "median_step_s": wall,
            "q1_step_s": statistics.quantiles(run["wall"], n=4)[0],
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
