"""Real-time chunking under a simulated inference delay: success and action jerk at chunk boundaries.

    python -m experiments.benchmarks.rtc_delay --policy RUN_DIR [--task reach] [--envs 64]
                                               [--execute-steps 4] [--delays 0 1 2 4] [--seed S]

A trained policy (``load_policy``) runs closed-loop in batched MJX (``sim.Evaluator``), queried
every K steps; each chunk arrives d steps after its observation and the robot runs the previous
chunk meanwhile (``EvalConfig.inference_delay``, whose docstring gives the timing). For every d,
naive switching (the new chunk from its step d on) is compared with real-time chunking (the
query guided towards the previous chunk's rest, ``EvalConfig.rtc``; ``act_fn(..., rtc=True)``),
with the same episodes and policy noise in every cell (seed: ``--seed``, default the run's
evaluation seed). Reported: success rate with its 95% Wilson interval, mean episode length, and
the squared third difference of the executed actions (summed over action dims, robot units) at
the stencils straddling a chunk switch and elsewhere. Prints a markdown table and one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from typing import Annotated

import jax
import tyro

from embodied_jax.bundle import act_fn
from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness

DELAYS = (0, 1, 2, 4)
EXECUTE_STEPS = 4


def evaluate_cells(bundle, task: str, *, envs: int, execute_steps: int, delays, seed: int, image_size, guidance):
    """One metrics dict per (d, method), in table order."""
    from embodied_jax.evaluation.closed_loop import check_fits, make_env
    from embodied_jax.sim import EvalConfig, Evaluator

    env = make_env(task, image_size)
    check_fits(bundle, env, task)
    cells = []
    for delay in delays:
        for method in ("naive", "rtc"):
            act, params = act_fn(bundle, env.instruction, rtc=method == "rtc", max_guidance=guidance)
            config = EvalConfig(
                num_envs=envs,
                execute_steps=execute_steps,
                num_videos=0,
                seed=seed,
                inference_delay=delay,
                rtc=method == "rtc",
            )
            start = time.perf_counter()
            metrics = Evaluator(env, act, config)(jax.random.key(seed), params=params)
            cells.append({"delay": delay, "method": method, "seconds": time.perf_counter() - start, **metrics})
            print(f"  d={delay} {method}: {metrics['success_rate']:.1%} ({cells[-1]['seconds']:.0f} s)", flush=True)
    return cells


def _jerk(value) -> str:
    return "-" if value is None else f"{value:.3e}"


def table(cells) -> str:
    lines = [
        "| d | method | success rate (95% CI) | mean episode length | jerk at boundaries | jerk elsewhere |",
        "|---|---|---|---|---|---|",
    ]
    for c in cells:
        low, high = c["success_ci95"]
        lines.append(
            f"| {c['delay']} | {c['method']} | {c['success_rate']:.1%} ({low:.1%}-{high:.1%}) | "
            f"{c['mean_episode_length']:.1f} | {_jerk(c['jerk_at_boundaries'])} | {_jerk(c['jerk_elsewhere'])} |"
        )
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Flags:
    """rtc_delay's command line."""

    policy: Annotated[str, tyro.conf.arg(metavar="RUN_DIR")]
    """a trained run (load_policy)"""
    task: str = "reach"
    envs: int = 64
    execute_steps: int = EXECUTE_STEPS
    """K: actions per replan"""
    delays: tuple[int, ...] = DELAYS
    """inference delays d (steps)"""
    seed: int | None = None
    """episode and noise seed (default: the run's)"""
    max_guidance: float = 5.0
    """RTC's maximum guidance weight β"""


def main(argv=None) -> dict:
    from embodied_jax.evaluation.closed_loop import EvaluationError, check_task, defaults

    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.rtc_delay", description=__doc__.splitlines()[0]
    )
    k = args.execute_steps
    if args.envs < 1:
        raise EvaluationError(f"--envs {args.envs}: evaluate at least one environment")
    if k < 1:
        raise EvaluationError(f"--execute-steps {k}: execute at least one action of each chunk")
    if not args.delays:
        raise EvaluationError("--delays: name at least one inference delay")
    bad = [d for d in args.delays if not 0 <= d <= k]
    if bad:
        raise EvaluationError(f"--delays {bad}: each between 0 and --execute-steps {k} (each chunk must arrive first)")
    check_task(args.task)
    from embodied_jax import load_policy  # builds the model: after the cheap checks

    bundle = load_policy(args.policy)
    horizon = int(bundle.config.model.action_horizon)
    if horizon < k + max(args.delays):
        raise EvaluationError(
            f"the policy's chunks of {horizon} actions cannot cover --execute-steps {k} plus a delay of "
            f"{max(args.delays)}: lower either"
        )
    settings = defaults(bundle)
    seed = settings["seed"] if args.seed is None else args.seed
    image_size = tuple(settings["image_size"])
    print(
        f"{type(bundle.config.model).__name__} step {bundle.step} from {args.policy}: {args.task}, {args.envs} envs, "
        f"H={horizon}, K={k} (the run evaluated with K={settings['execute_steps']}), image {image_size}, seed {seed}",
        flush=True,
    )
    cells = evaluate_cells(
        bundle,
        args.task,
        envs=args.envs,
        execute_steps=k,
        delays=args.delays,
        seed=seed,
        image_size=image_size,
        guidance=args.max_guidance,
    )
    print()
    print(table(cells))
    keys = ("delay", "method", "success_rate", "success_ci95", "mean_episode_length")
    keys += ("jerk_at_boundaries", "jerk_elsewhere", "seconds")
    summary = {
        "benchmark": "rtc_delay",
        "policy": str(args.policy),
        "step": bundle.step,
        "task": args.task,
        "envs": args.envs,
        "execute_steps": k,
        "horizon": horizon,
        "seed": seed,
        "max_guidance": args.max_guidance,
        "cells": [{key: c[key] for key in keys} for c in cells],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    sys.exit(harness.run(main, "rtc_delay"))  # --record: the result appended to results/rtc_delay.jsonl
