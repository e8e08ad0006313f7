"""Scripted-expert demonstrations written as a LeRobot dataset.

    python -m embodied_jax.sim.collect TASK --episodes N --out DIR [--image-size H [W]]

Episodes are simulated in batches (one jitted rollout of the task's ``collect_steps``,
rendered with the configured renderer), cut at the step where they finished, and, by default, only successful
ones are kept until N are collected. Each frame holds ``observation.state`` (joint
state), ``observation.images.<camera>`` (``scene`` and wrist cameras, mp4) and
``action`` (the expert's joint targets); the episode's task string is the
instruction. Writing is done by :func:`embodied_jax.data.writer.write_lerobot_dataset`,
with GR00T's ``meta/modality.json`` (:func:`task_modality`: per arm a ``hand`` position and a
``gripper`` group of state and action, each camera as a video, the task as annotation).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import sys
from collections.abc import Sequence

import jax
import numpy as np

from embodied_jax.cli import INPUT_ERRORS, add_verbose_flag, fail
from embodied_jax.data.modality import Modality
from embodied_jax.sim import env as env_lib
from embodied_jax.sim import rollout as rollout_lib
from embodied_jax.sim import tasks as tasks_lib

ROBOT_TYPE = "embodied_jax_gantry"
_FRAME_BUDGET_BYTES = 400_000_000  # bound on the images held per rollout batch
ROLLOUT_CACHE_SIZE = 8  # compiled expert rollouts kept per process (least recently used dropped)


@dataclasses.dataclass(frozen=True)
class _RolloutKey:
    """What an expert rollout program depends on; ``env`` (the first one seen) is not part of it."""

    task_type: type
    task_name: str
    episode_limit: int
    model_fingerprint: str
    config: env_lib.EnvConfig
    batch: int
    steps: int
    noise: float
    env: env_lib.Env = dataclasses.field(compare=False, hash=False, repr=False)


@functools.lru_cache(maxsize=ROLLOUT_CACHE_SIZE)
def _build_rollout(key: _RolloutKey):
    return rollout_lib.make_rollout(
        key.env, rollout_lib.expert_policy(key.env), key.batch, steps=key.steps, render=True, execution_noise=key.noise
    )


def _expert_rollout(env: env_lib.Env, batch: int, steps: int, noise: float):
    """The jitted expert rollout, one per task, model, config and shape (the last
    ``ROLLOUT_CACHE_SIZE`` of them in a process).

    Reused rather than rebuilt for a fresh ``Env`` of the same task: a new trace would give
    Warp's render calls new ids, so the compilation cache could not recognise the program.
    """
    task = env.task
    return _build_rollout(
        _RolloutKey(
            type(task),
            task.name,
            task.episode_limit,
            env_lib.model_fingerprint(env.mj_model),
            env.config,
            batch,
            steps,
            noise,
            env,
        )
    )


def task_modality(task: tasks_lib.Task) -> Modality:
    """The dataset's modality.json: state and action are ``[x, y, z, grip]`` per arm
    (``Task.robot_state``, ``Task.apply_action``), cameras are ``observation.images.<camera>``."""
    groups = {}
    for i, arm in enumerate(task.arms):
        groups[f"{arm.prefix}hand"] = (4 * i, 4 * i + 3)
        groups[f"{arm.prefix}gripper"] = (4 * i + 3, 4 * i + 4)
    return Modality(
        state=groups,
        action=groups,
        video={camera: f"observation.images.{camera}" for camera in task.cameras},
        annotation={"human.task_description": "task_index"},  # GR00T's name for the instruction
    )


def expert_episodes(
    env: env_lib.Env,
    episodes: int,
    *,
    seed: int = 0,
    batch: int | None = None,
    keep_failures: bool = False,
    max_batches: int | None = None,
    noise: float = 0.0,
) -> list[dict]:
    """Run the scripted expert until ``episodes`` (successful, unless ``keep_failures``) are gathered.

    ``noise``: std (metres) of the perturbation of executed hand positions; the recorded
    actions stay the expert's (see :func:`~embodied_jax.sim.rollout.make_rollout`).
    ``max_batches`` (default: twice the batches needed at full success, plus 4) bounds the
    attempts when the expert fails often.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    h, w = env.config.image_size
    steps = env.task.collect_steps or env.episode_limit
    per_episode = steps * len(env.cameras) * h * w * 3
    batch = batch or max(1, min(episodes, 64, _FRAME_BUDGET_BYTES // per_episode))
    run = _expert_rollout(env, batch, steps, noise)
    max_batches = max_batches or 2 * -(-episodes // batch) + 4
    out: list[dict] = []
    rng = jax.random.key(seed)
    for _ in range(max_batches):
        rng, key = jax.random.split(rng)
        traj = jax.tree.map(np.asarray, run(key))
        lengths = rollout_lib.episode_lengths(traj)
        for b in range(batch):
            if len(out) == episodes:
                return out
            if not (keep_failures or traj.success[-1, b]):
                continue
            n = int(lengths[b])
            episode = {
                "task": env.instruction,
                "observation.state": traj.state[:n, b].astype(np.float32),
                "action": traj.action[:n, b].astype(np.float32),
            }
            for cam, frames in traj.images.items():
                episode[f"observation.images.{cam}"] = frames[:n, b]
            out.append(episode)
    if len(out) < episodes:
        raise RuntimeError(f"{env.name}: only {len(out)} successful expert episodes in {max_batches} batches")
    return out


def collect(
    task: str,
    episodes: int,
    out: str | os.PathLike,
    *,
    image_size: tuple[int, int] = (64, 64),
    seed: int = 0,
    batch: int | None = None,
    renderer: str = "auto",
    version: str = "v3.0",
    codec: str = "h264",
    keep_failures: bool = False,
    noise: float = 0.0,
) -> pathlib.Path:
    """Write ``episodes`` expert demonstrations of ``task`` as a LeRobot dataset under ``out``."""
    from embodied_jax.data.writer import write_lerobot_dataset

    env = env_lib.Env(task, env_lib.EnvConfig(image_size=tuple(image_size), renderer=renderer))
    eps = expert_episodes(env, episodes, seed=seed, batch=batch, keep_failures=keep_failures, noise=noise)
    return write_lerobot_dataset(
        out,
        eps,
        fps=round(1.0 / env.control_dt),
        version=version,
        codec=codec,
        robot_type=ROBOT_TYPE,
        modality=task_modality(env.task).to_json(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embodied_jax.sim.collect", description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=sorted(tasks_lib.TASKS))
    parser.add_argument("--episodes", type=int, required=True)
    parser.add_argument("--out", required=True, help="dataset directory to create")
    parser.add_argument(
        "--image-size",
        type=int,
        nargs="+",
        default=[64],
        metavar="PX",
        help="square size, or height width (default 64)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=None, help="episodes simulated per rollout")
    parser.add_argument("--renderer", choices=("auto", "warp", "raycast"), default="auto")
    parser.add_argument("--version", choices=("v3.0", "v2.1"), default="v3.0")
    parser.add_argument("--codec", choices=("h264", "av1"), default="h264")
    parser.add_argument("--keep-failures", action="store_true", help="also write unsuccessful episodes")
    parser.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="std (metres) of noise on executed hand positions; recorded actions stay clean",
    )
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    if len(args.image_size) not in (1, 2):
        parser.error("--image-size takes one (square) or two (height width) integers")
    size = tuple(args.image_size) * (2 if len(args.image_size) == 1 else 1)
    try:
        root = collect(
            args.task,
            args.episodes,
            args.out,
            image_size=size,
            seed=args.seed,
            batch=args.batch,
            renderer=args.renderer,
            version=args.version,
            codec=args.codec,
            keep_failures=args.keep_failures,
            noise=args.noise,
        )
    except INPUT_ERRORS + (ValueError,) as exc:
        return fail(exc, verbose=args.verbose)
    print(f"wrote {args.episodes} {args.task} episodes to {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
