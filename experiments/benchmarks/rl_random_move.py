"""``python -m experiments.benchmarks.rl_random_move START MOVED --task T``: does RL's move of the
weights cost what any move of its size costs?

``START`` is a behaviour-cloned run, ``MOVED`` an RL run from it (its checkpoint ``--moved-step``).
RL's move is the difference of the two sets of weights, leaf by leaf (only the weights RL trained
differ). Each random move has the same norm as RL's in every leaf (times ``--scales``), in a
direction drawn from a Gaussian. Every policy is scored as RL's held-out evaluation scores it (the
deployed sampler, ``--episodes`` episodes of ``--eval-seed``, by default the validation seed; the
same episodes and noise for all), so the start's and the RL checkpoint's figures are the RL run's own in-training ones.

Printed per policy: success, the weights' distance from the start, and how far its deployed
actions moved: the mean |a - a_start| of the first chunk over ``--observations`` start states and
``--draws`` initial noises shared by all policies, in units of the start's spread over draws (a
random direction of a given norm moves the outputs less than a trained one, so the sizes are also
compared where the policy acts).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
from typing import Annotated

import tyro

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """rl_random_move's command line."""

    start: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="START")]]
    """the behaviour-cloned run RL started from"""
    moved: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="MOVED")]]
    """the RL run (its checkpoints hold the moved weights)"""
    task: str = "handover"
    moved_step: int | None = None
    """the RL checkpoint's iteration (default: the latest)"""
    scales: tuple[float, ...] = (1.0,)
    """random moves' norms, as multiples of RL's move's (leaf by leaf)"""
    random_draws: int = 2
    """random directions per scale"""
    episodes: int = 64
    eval_seed: int = 2
    """the episodes' seed (default: the validation seed, RL's held-out evaluation's)"""
    observations: int = 8
    draws: int = 16
    seed: int = 0


def random_move(delta: dict, key, scale: float) -> dict:
    """A Gaussian direction with ``scale`` times ``delta``'s norm in every leaf (zero where ``delta`` is)."""
    import jax
    import jax.numpy as jnp

    leaves, treedef = jax.tree.flatten(delta)
    out = []
    for leaf, k in zip(leaves, jax.random.split(key, len(leaves)), strict=True):
        leaf = jnp.asarray(leaf, jnp.float32)
        noise = jax.random.normal(k, leaf.shape, jnp.float32)
        norm = jnp.linalg.norm(leaf)
        out.append(scale * norm * noise / jnp.maximum(jnp.linalg.norm(noise), 1e-30))
    return jax.tree.unflatten(treedef, out)


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.rl_random_move", description=__doc__.splitlines()[0]
    )
    if args.episodes < 1 or args.random_draws < 0 or any(s <= 0 for s in args.scales):
        raise SystemExit("--episodes >= 1, --random-draws >= 0 and positive --scales")
    import jax
    import jax.numpy as jnp
    import numpy as np

    from embodied_jax.loading import restore_run
    from embodied_jax.rl.config import RLConfig, RLExperimentConfig
    from embodied_jax.rl.diagnostics import executed_actions
    from embodied_jax.rl.held_out import HeldOutEvaluation
    from embodied_jax.rl.start import start

    config = RLExperimentConfig(
        init_from=args.start,
        rl=RLConfig(task=args.task, num_envs=args.observations, eval_envs=args.episodes, eval_seed=args.eval_seed),
    )
    st = start(config, jax.local_devices()[:1])
    if st.host_stepped:
        raise SystemExit("built-in (MJX) tasks only")
    _, _, moved_state, _, moved_step = restore_run(args.moved, step=args.moved_step, devices=jax.local_devices()[:1])
    moved = moved_state.ema if moved_state.ema is not None else moved_state.params
    start_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), st.params)
    delta = jax.tree.map(lambda m, s: jnp.asarray(m, jnp.float32) - s, moved, start_params)
    moved_leaves = sum(int(np.any(np.asarray(d) != 0)) for d in jax.tree.leaves(delta))

    def with_move(move):
        return jax.tree.map(lambda s, d, ref: (s + d).astype(ref.dtype), start_params, move, st.params)

    policies = {"start": st.params, f"RL iteration {moved_step}": with_move(delta)}
    key = jax.random.key(args.seed)
    for j, scale in enumerate(args.scales):  # a direction of its own for every (scale, draw)
        for i in range(args.random_draws):
            move = random_move(delta, jax.random.fold_in(jax.random.fold_in(key, 1 + j), i), scale)
            policies[f"random x{scale:g} #{i}"] = with_move(move)

    states = jax.jit(jax.vmap(st.env.reset))(jax.random.split(jax.random.fold_in(key, 7), args.observations))
    observation = jax.device_get(st.env.observe(states))
    observation["time_step"] = np.zeros((args.observations,), np.int32)
    deployed = jax.jit(functools.partial(executed_actions, st.agent, rl_sampler=False))
    noise_keys = jax.random.split(jax.random.fold_in(key, 8), args.draws)

    def sample(params, keys):
        return deployed(params, observation, keys)

    reference = np.asarray(sample(st.params, noise_keys), np.float64)  # [draws, B, H, A]
    spread = max(float(reference.std(0).mean()), 1e-12)
    evaluate = HeldOutEvaluation(st, config, st.execute_steps)
    rows = {}
    for name, params in policies.items():
        actions = np.asarray(sample(params, noise_keys), np.float64)
        distance = float(
            np.sqrt(
                sum(
                    float(jnp.sum((jnp.asarray(a, jnp.float32) - b) ** 2))
                    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start_params), strict=True)
                )
            )
        )
        success = float(evaluate(params)["success_rate"])
        rows[name] = {
            "success": success,
            "weight_distance": distance,
            "action_move": float(np.abs(actions - reference).mean() / spread),
        }
        print(
            f"{name:>18}: success {100 * success:5.1f}% of {args.episodes}, weights {distance:.4f} from the start, "
            f"deployed actions moved {rows[name]['action_move']:.3f} start spreads",
            flush=True,
        )
    result = {
        "task": args.task,
        "moved_step": moved_step,
        "episodes": args.episodes,
        "eval_seed": args.eval_seed,
        "leaves_moved": moved_leaves,
        "start_spread": spread,
        "policies": rows,
    }
    print(json.dumps({"rl_random_move": result}))
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "rl_random_move"))
