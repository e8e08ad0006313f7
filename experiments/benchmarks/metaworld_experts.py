"""``python -m experiments.benchmarks.metaworld_experts [--tasks metaworld:mt50]``: how well Meta-World's
scripted policies solve each task in LeRobot's environments, the ceiling of demonstrations made as
the hub's were.

Each task's scripted policy runs ``--episodes`` episodes without noise (``--noise`` adds DART noise)
on the calibration seed, without rendering, up to the protocol's 500 steps; printed per task: its
difficulty group, successes, the 95% interval and the mean length of the successful episodes, then
per group.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """metaworld_experts' command line."""

    tasks: str = "metaworld:mt50"
    episodes: int = 50
    noise: float = 0.0


def main(argv: list[str] | None = None) -> dict:
    from embodied_jax.sim import metaworld
    from embodied_jax.sim.closed_loop import wilson_interval

    args = parse_flags(Flags, args=argv, prog="python -m experiments.benchmarks.metaworld_experts")
    per_task = {}
    for task in metaworld.parse_tasks(args.tasks):
        env = metaworld.MetaWorldEnv(task)
        try:
            results = [
                metaworld.expert_episode(
                    env, metaworld.episode_seed(metaworld.CALIBRATION_SEED, task, i), noise=args.noise, record=False
                )
                for i in range(args.episodes)
            ]
        finally:
            env.close()
        wins = sum(r.success for r in results)
        lengths = [r.length for r in results if r.success]
        low, high = wilson_interval(wins, len(results))
        per_task[task] = {
            "difficulty": metaworld.difficulty(task),
            "successes": wins,
            "episodes": len(results),
            "success_ci95": [low, high],
            "mean_success_length": float(np.mean(lengths)) if lengths else None,
        }
        length = f"{np.mean(lengths):5.0f}" if lengths else "    -"
        print(
            f"{task:26s} {metaworld.difficulty(task):9s} {wins:3d}/{len(results)} "
            f"({100 * low:5.1f}-{100 * high:5.1f}%)  mean length {length}",
            flush=True,
        )
    groups = {}
    for group in metaworld.DIFFICULTY:
        members = [e for e in per_task.values() if e["difficulty"] == group]
        if members:
            wins, total = sum(e["successes"] for e in members), sum(e["episodes"] for e in members)
            groups[group] = wins / total
            print(f"{group:9s} {wins}/{total} ({wins / total:.1%})")
    return {"tasks": args.tasks, "noise": args.noise, "per_difficulty": groups, "per_task": per_task}


if __name__ == "__main__":
    sys.exit(harness.run(main, "metaworld_experts"))
