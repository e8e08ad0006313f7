"""Scripted-expert demonstrations written as a LeRobot dataset.

    python -m embodied_jax.sim.collect TASK --episodes N --out DIR [--image-size H [W]]
    python -m embodied_jax.sim.collect metaworld:<task>[,<task>...]|metaworld:mt10 --episodes N --out DIR

Built-in tasks: episodes are simulated in batches (one jitted rollout of the task's
``collect_steps``, rendered with the configured renderer), cut at the step where they finished,
and, by default, only successful ones are kept until N are collected. Each frame holds
``observation.state`` (joint state), ``observation.images.<camera>`` (``scene`` and wrist
cameras) and ``action`` (the expert's joint targets); the episode's task string is the
instruction. Writing is done by :func:`embodied_jax.data.writer.write_lerobot_dataset`, with
GR00T's ``meta/modality.json`` (:func:`task_modality`: per arm a ``hand`` position and a
``gripper`` group of state and action, each camera as a video, the task as annotation).
``metaworld:`` tasks run Meta-World's own scripted policies in its own environments
(:mod:`embodied_jax.sim.metaworld`: N episodes per task, LeRobot's Meta-World layout).

Frames are stored losslessly by default (PNG in the parquet, LeRobot's ``image`` feature): a
frame read back is exactly the render the evaluation shows the policy. At the demo's 32 px a
few-pixel object straddles H.264's 2x2 chroma blocks and loses most of its colour
(``--image-storage video`` keeps the mp4 form, e.g. for large images).

DART: ``--noise`` perturbs the executed hand positions while the recorded actions stay the
expert's, so the demonstrations show recoveries. Its default is the task's calibrated level
(``Task.dart_noise``: the largest of ``NOISE_LEVELS`` at which the noisy expert still succeeds in
at least ``DART_TARGET`` of its episodes); ``--noise auto`` measures it again
(:func:`calibrate_noise`). Collection prints the noisy expert's success rate. ``metaworld:`` tasks
collect without noise by default, as the hub's ``lerobot/metaworld_mt50`` was made (``--noise X``
in action units, or ``auto``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import sys
from collections.abc import Sequence
from typing import Annotated, Literal

import jax
import numpy as np
import tyro

from embodied_jax.cli import INPUT_ERRORS, parse_flags, run_main
from embodied_jax.data.modality import Modality
from embodied_jax.errors import InputError
from embodied_jax.sim import dart
from embodied_jax.sim import env as env_lib
from embodied_jax.sim import rollout as rollout_lib
from embodied_jax.sim import tasks as tasks_lib
from embodied_jax.sim.dart import DART_TARGET
from embodied_jax.sim.seeds import CALIBRATION_SEED, COLLECTION_SEED

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


NOISE_LEVELS = (0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02)  # metres: the candidates of calibrate_noise
CALIBRATION_EPISODES = 128


def expert_success_rate(
    env: env_lib.Env, noise: float, *, episodes: int = CALIBRATION_EPISODES, seed: int = CALIBRATION_SEED
) -> float:
    """Fraction of ``episodes`` the scripted expert completes with ``noise`` (metres, std) on its
    executed hand positions, within the task's collection length (no rendering)."""
    steps = env.task.collect_steps or env.episode_limit
    run = rollout_lib.make_rollout(env, rollout_lib.expert_policy(env), episodes, steps=steps, execution_noise=noise)
    return float(np.asarray(run(jax.random.key(seed)).success[-1]).mean())


def calibrate_noise(
    env: env_lib.Env,
    *,
    target: float = DART_TARGET,
    levels: Sequence[float] = NOISE_LEVELS,
    episodes: int = CALIBRATION_EPISODES,
    seed: int = CALIBRATION_SEED,
) -> tuple[float, dict[float, float]]:
    """The largest of ``levels`` (ascending; stops at the first miss) at which the noisy expert
    succeeds in at least ``target`` of ``episodes``, 0.0 if none; and the success rate measured
    at each level tried (``sim/dart.py``)."""
    return dart.calibrate(lambda level: expert_success_rate(env, level, episodes=episodes, seed=seed), levels, target)


def resolve_noise(env: env_lib.Env, noise: float | str | None, *, seed: int = CALIBRATION_SEED) -> float:
    """``noise`` as metres: None -> the task's ``dart_noise``; ``"auto"`` -> :func:`calibrate_noise` (printed)."""
    if noise is None:
        return float(env.task.dart_noise)
    if noise == "auto":
        chosen, measured = calibrate_noise(env, seed=seed)
        table = ", ".join(f"{level * 100:g} cm: {rate:.1%}" for level, rate in measured.items())
        print(f"{env.name}: noisy expert success by DART noise ({CALIBRATION_EPISODES} episodes each): {table}")
        print(f"{env.name}: calibrated DART noise {chosen * 100:g} cm (expert success >= {DART_TARGET:.0%})")
        return chosen
    if isinstance(noise, str):
        raise ValueError(f"noise={noise!r}: metres (a number) or 'auto'")
    if not (noise >= 0 and np.isfinite(noise)):
        raise ValueError(f"noise={noise}: a finite std in metres, >= 0")
    return float(noise)


def success_line(task: str, noise: float, stats: dict) -> str:
    """``<task>: noisy expert succeeded in k of n episodes (p%) at x cm of DART noise``."""
    attempts, successes = stats.get("attempts", 0), stats.get("successes", 0)
    rate = successes / attempts if attempts else 0.0
    return (
        f"{task}: expert succeeded in {successes} of {attempts} simulated episodes ({rate:.1%}) "
        f"at {noise * 100:g} cm of DART noise"
    )


def task_modality(task: tasks_lib.Task, *, phase: bool = False) -> Modality:
    """The dataset's modality.json: state and action are ``[x, y, z, grip]`` per arm
    (``Task.robot_state``, ``Task.apply_action``), the state then the episode's ``phase`` when
    collected with it (``EnvConfig.phase_in_state``); cameras are ``observation.images.<camera>``."""
    groups = {}
    for i, arm in enumerate(task.arms):
        groups[f"{arm.prefix}hand"] = (4 * i, 4 * i + 3)
        groups[f"{arm.prefix}gripper"] = (4 * i + 3, 4 * i + 4)
    state = dict(groups)
    if phase:
        state["phase"] = (4 * len(task.arms), 4 * len(task.arms) + 1)
    return Modality(
        state=state,
        action=groups,
        video={camera: f"observation.images.{camera}" for camera in task.cameras},
        annotation={"human.task_description": "task_index"},  # GR00T's name for the instruction
    )


def expert_episodes(
    env: env_lib.Env,
    episodes: int,
    *,
    seed: int = COLLECTION_SEED,
    batch: int | None = None,
    keep_failures: bool = False,
    max_batches: int | None = None,
    noise: float = 0.0,
    stats: dict | None = None,
) -> list[dict]:
    """Run the scripted expert until ``episodes`` (successful, unless ``keep_failures``) are gathered.

    ``noise``: std (metres) of the perturbation of executed hand positions; the recorded
    actions stay the expert's (see :func:`~embodied_jax.sim.rollout.make_rollout`).
    ``max_batches`` (default: twice the batches needed at full success, plus 4) bounds the
    attempts when the expert fails often. ``stats``, if given, accumulates ``attempts`` and
    ``successes`` over every simulated episode (the noisy expert's success rate).
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
        if stats is not None:
            stats["attempts"] = stats.get("attempts", 0) + batch
            stats["successes"] = stats.get("successes", 0) + int(traj.success[-1].sum())
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
    seed: int = COLLECTION_SEED,
    batch: int | None = None,
    renderer: str = "auto",
    version: str = "v3.0",
    codec: str = "h264",
    image_storage: str = "png",
    keep_failures: bool = False,
    noise: float | str | None = None,
    phase_in_state: bool = False,
) -> pathlib.Path:
    """Write ``episodes`` expert demonstrations of ``task`` as a LeRobot dataset under ``out``.

    ``noise``: DART execution noise in metres; None: the task's calibrated ``dart_noise``;
    ``"auto"``: calibrated now (:func:`calibrate_noise`, printed). The noisy expert's success
    rate over every simulated episode is printed. ``phase_in_state``: the state ends with the
    episode's phase (``EnvConfig.phase_in_state``; evaluate with the same)."""
    from embodied_jax.data.writer import write_lerobot_dataset

    config = env_lib.EnvConfig(image_size=tuple(image_size), renderer=renderer, phase_in_state=phase_in_state)
    env = env_lib.Env(task, config)
    noise = resolve_noise(env, noise)  # on the calibration seed, never the collection's scenes
    stats: dict = {}
    eps = expert_episodes(env, episodes, seed=seed, batch=batch, keep_failures=keep_failures, noise=noise, stats=stats)
    print(success_line(task, noise, stats), flush=True)
    return write_lerobot_dataset(
        out,
        eps,
        fps=round(1.0 / env.control_dt),
        version=version,
        codec=codec,
        image_storage=image_storage,
        robot_type=ROBOT_TYPE,
        modality=task_modality(env.task, phase=phase_in_state).to_json(),
    )


PROG = "python -m embodied_jax.sim.collect"


@dataclasses.dataclass(frozen=True)
class CollectFlags:
    """``python -m embodied_jax.sim.collect``'s command line."""

    task: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="TASK")]]
    """a built-in task or metaworld:<task>[,<task>...]|mt10|mt50"""
    episodes: int
    """episodes to write (per task for metaworld:)"""
    out: str
    """dataset directory to create"""
    image_size: Annotated[tuple[int, ...], tyro.conf.arg(metavar="PX [PX]")] = (64,)
    """square size, or height width"""
    seed: int = COLLECTION_SEED
    batch: int | None = None
    """episodes simulated per rollout"""
    renderer: Literal["auto", "warp", "raycast"] = "auto"
    version: Literal["v3.0", "v2.1"] = "v3.0"
    image_storage: Literal["png", "video"] = "png"
    """png: lossless frames in the parquet; video: mp4 in --codec"""
    codec: Literal["h264", "av1"] = "h264"
    """with --image-storage video"""
    keep_failures: bool = False
    """also write unsuccessful episodes"""
    phase_in_state: bool = False
    """append the episode's phase (step / limit) to the state"""
    max_steps: int | None = None
    """metaworld: tasks only: steps per episode (default: the evaluation's limit, 500)"""
    noise: str | None = None
    """std of DART noise on executed hand positions (recorded actions stay the expert's); 'auto': calibrate it
    now; default: the task's calibrated level (metaworld: none, as the hub's)"""
    workers: int = 1
    """metaworld: tasks only: tasks collected in that many processes at once"""
    prompts: Literal["lerobot", "project"] = "lerobot"
    """metaworld: tasks only: LeRobot's task descriptions or the project's own sentences"""
    render_style: Literal["fast", "lerobot"] = "fast"
    """metaworld: tasks only: 'lerobot' renders with Meta-World's own settings (LeRobot's frames at 480)"""


def _checked(args: CollectFlags) -> tuple[tuple[int, int], float | str | None]:
    """The image size (height, width) and the noise the flags ask for, or an ``InputError``."""
    from embodied_jax.sim import metaworld

    if len(args.image_size) not in (1, 2):
        raise InputError("--image-size takes one (square) or two (height width) integers")
    size = tuple(args.image_size) * (2 if len(args.image_size) == 1 else 1)
    metaworld_task = metaworld.is_metaworld(args.task)
    if not metaworld_task and args.task not in tasks_lib.TASKS:
        raise InputError(f"task {args.task!r}: one of {sorted(tasks_lib.TASKS)} or metaworld:<task>")
    if args.max_steps is not None and not metaworld_task:
        raise InputError("--max-steps is for metaworld: tasks (a built-in task collects its own collect_steps)")
    noise: float | str | None = args.noise
    if noise not in (None, "auto"):
        try:
            noise = float(noise)
        except ValueError:
            raise InputError(f"--noise {noise!r}: metres (a number) or 'auto'") from None
    return size, noise


def run(args: CollectFlags) -> pathlib.Path:
    """Collect what ``args`` describe; the dataset's directory."""
    from embodied_jax.sim import metaworld

    size, noise = _checked(args)
    if metaworld.is_metaworld(args.task):
        root = metaworld.collect(
            args.task,
            args.episodes,
            args.out,
            view=metaworld.View(size, args.prompts, args.render_style),
            seed=args.seed,
            noise=None if noise == "auto" else 0.0 if noise is None else noise,  # none by default, as the hub's
            keep_failures=args.keep_failures,
            image_storage=args.image_storage,
            codec=args.codec,
            workers=args.workers,
            **({} if args.max_steps is None else {"max_steps": args.max_steps}),
        )
        print(f"wrote {args.episodes} episodes of each of {args.task} to {root}")
        return root
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
        image_storage=args.image_storage,
        keep_failures=args.keep_failures,
        noise=noise,
        phase_in_state=args.phase_in_state,
    )
    print(f"wrote {args.episodes} {args.task} episodes to {root}")
    return root


def main(argv: Sequence[str] | None = None) -> int:
    def parse_and_run(args: list[str]) -> None:
        run(parse_flags(CollectFlags, args=args, prog=PROG, description=__doc__.splitlines()[0]))

    return run_main(parse_and_run, argv, INPUT_ERRORS + (ValueError,))


if __name__ == "__main__":
    sys.exit(main())
