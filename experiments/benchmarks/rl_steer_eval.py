"""``python -m experiments.benchmarks.rl_steer_eval RUN``: a noise-steering run (``rl_steer_*``,
``docs/rl.md``) scored on held-out episodes against the policy it steers.

Three policies on the same episodes (``--episodes`` per task of ``--seed``, by default the test
seed, which the run's own evaluations never use): the behaviour-cloned policy as deployed (the
initial noise drawn from N(0, 1)), the same policy from zero noise (the untrained actor's mean:
the flow's centre, a choice of sampler that needs no learning) and the policy with the trained
actor's mean noise. Printed per policy: the success rate with its 95% interval, per task where
there are several.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Annotated

import tyro

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """rl_steer_eval's command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]]
    """the steering run's workdir"""
    episodes: int = 50
    """per task (Meta-World) or in all (a built-in task)"""
    seed: int = 1
    """the episodes' seed (default: the test seed; the run chose its settings on the validation seed, 2)"""
    step: int | None = None
    """the steering checkpoint's iteration (default: the latest)"""


def steering_config(run: pathlib.Path):
    """The steering run's config, rebuilt from its ``steer_config.json``."""
    from embodied_jax.config_registry import from_dict
    from embodied_jax.rl.steer_loop import CONFIG
    from embodied_jax.sim.metaworld.suite import is_metaworld
    from experiments.rl import RLSteerConfig, RLSteerMetaWorldConfig

    path = run / CONFIG
    if not path.exists():
        raise SystemExit(f"{run}: no {CONFIG}: not a steering run (python -m experiments.launch rl_steer_*)")
    saved = json.loads(path.read_text())
    rl, steer = from_dict(saved["rl"]), from_dict(saved["steer"])
    if is_metaworld(rl.task):
        return RLSteerMetaWorldConfig(init_from=saved["init_from"], tasks=rl.task, rl=rl, steer=steer, workdir=str(run))
    model = {"model": from_dict(saved["model"])} if "model" in saved else {}
    return RLSteerConfig(init_from=saved["init_from"], rl=rl, steer=steer, workdir=str(run), **model)


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.rl_steer_eval", description=__doc__.splitlines()[0]
    )
    if args.episodes < 1:
        raise SystemExit("--episodes >= 1")
    import jax

    from embodied_jax.rl.steer_loop import held_out_evaluation, load_actor, setup
    from embodied_jax.sim.closed_loop import wilson_interval

    run = pathlib.Path(args.run)
    config = steering_config(run)
    config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, num_envs=min(config.rl.num_envs, 10)))
    s = setup(config, jax.local_devices()[:1])
    try:
        actor, step = load_actor(run, s, config, args.step)
        evaluate = held_out_evaluation(s, config, args.seed, args.episodes)
        policies = {
            "as deployed (noise N(0, 1))": lambda: evaluate(s.policy_params),
            "zero noise (the flow's centre)": lambda: evaluate(s.policy_params, s.params.actor, True),
            f"steered (iteration {step})": lambda: evaluate(s.policy_params, actor, True),
        }
        rows = {}
        for name, score in policies.items():
            result = score()
            episodes = int(result.get("episodes", args.episodes))
            wins = round(result["success_rate"] * episodes)
            low, high = wilson_interval(wins, episodes)
            per_task = {t: e["success_rate"] for t, e in result.get("per_task", {}).items()}
            rows[name] = {"success_rate": result["success_rate"], "ci95": [low, high], "episodes": episodes}
            if len(per_task) > 1:
                rows[name]["per_task"] = per_task
            shown = (
                "" if len(per_task) < 2 else "  (" + ", ".join(f"{t} {100 * v:.0f}%" for t, v in per_task.items()) + ")"
            )
            rate = f"{100 * result['success_rate']:5.1f}% ({100 * low:.1f}-{100 * high:.1f}%)"
            print(f"{name:>32}: {rate} of {episodes}{shown}", flush=True)
    finally:
        if s.st.host_stepped:
            s.env.close()
    result = {"task": config.rl.task, "step": step, "seed": args.seed, "episodes": args.episodes, "policies": rows}
    print(json.dumps({"rl_steer_eval": result}))
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "rl_steer_eval"))
