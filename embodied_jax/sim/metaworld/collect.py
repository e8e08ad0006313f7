"""Meta-World's scripted policies as LeRobot demonstrations in ``lerobot/metaworld_mt50``'s layout:
the image, the 4-D state and action, the 39-value environment state, ``next.reward``,
``next.success`` and ``task_id``; no noise by default (as the hub's), DART noise calibrated per task
on request."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import multiprocessing
import os
import pathlib
import pickle
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from embodied_jax.sim import dart
from embodied_jax.sim.dart import DART_TARGET
from embodied_jax.sim.metaworld.env import MetaWorldEnv, View, check_gl
from embodied_jax.sim.metaworld.suite import (
    ACTION_KEY,
    CALIBRATION_SEED,
    COLLECTION_SEED,
    ENV_STATE_KEY,
    FPS,
    IMAGE_KEY,
    REWARD_KEY,
    ROBOT_TYPE,
    STATE_KEY,
    STEP_LIMIT,
    SUCCESS_KEY,
    SUITES,
    TASK_ID_KEY,
    MetaWorldError,
    episode_seed,
    parse_tasks,
    task_id,
)

NOISE_LEVELS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
CALIBRATION_EPISODES = 50


@dataclasses.dataclass
class ExpertResult:
    success: bool
    length: int
    episode: dict[str, Any] | None  # recorded frames (None when not recording)


def expert_episode(
    env: MetaWorldEnv, seed: int, *, noise: float = 0.0, record: bool = True, limit: int = STEP_LIMIT
) -> ExpertResult:
    """Meta-World's scripted policy for one episode. ``noise``: std of Gaussian noise on the
    executed end-effector delta (DART; the recorded action stays the expert's). Frame t holds
    the observation before action t, and ``next.reward`` / ``next.success`` what action t led to;
    the episode ends with the action that succeeded, or at ``limit`` steps."""
    env.reset(seed)
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in (STATE_KEY, ENV_STATE_KEY, ACTION_KEY, IMAGE_KEY, REWARD_KEY, SUCCESS_KEY)}
    success, length = False, 0
    while length < limit and not success:
        action = env.expert_action()
        if record:
            rows[STATE_KEY].append(env.state())
            rows[ENV_STATE_KEY].append(env.environment_state())
            rows[ACTION_KEY].append(action)
            rows[IMAGE_KEY].append(env.render())
        executed = action.copy()
        if noise:
            executed[:3] += noise * rng.standard_normal(3)
        success = env.step(executed)
        length += 1
        if record:
            rows[REWARD_KEY].append(env.reward)
            rows[SUCCESS_KEY].append(success)
    episode = None
    if record:
        episode = {
            "task": env.instruction,
            STATE_KEY: np.stack(rows[STATE_KEY]),
            ENV_STATE_KEY: np.stack(rows[ENV_STATE_KEY]),
            ACTION_KEY: np.clip(np.stack(rows[ACTION_KEY]), -1.0, 1.0).astype(np.float32),
            IMAGE_KEY: np.stack(rows[IMAGE_KEY]),
            REWARD_KEY: np.asarray(rows[REWARD_KEY], np.float32),
            SUCCESS_KEY: np.asarray(rows[SUCCESS_KEY], bool),
            TASK_ID_KEY: np.full(length, task_id(env.task), np.int16),
        }
    return ExpertResult(success, length, episode)


def calibrate_noise(
    task: str,
    *,
    target: float = DART_TARGET,
    levels: Sequence[float] = NOISE_LEVELS,
    episodes: int = CALIBRATION_EPISODES,
    seed: int = CALIBRATION_SEED,
) -> tuple[float, dict[float, float]]:
    """The largest of ``levels`` (ascending; stops at the first miss) at which the noisy scripted
    policy succeeds in at least ``target`` of ``episodes`` (no rendering), 0.0 if none; and the
    success rate measured at each level tried (on the calibration seed, apart from every other)."""
    env = MetaWorldEnv(task)

    def success_rate(level: float) -> float:
        seeds = [episode_seed(seed, task, i) for i in range(episodes)]
        return sum(expert_episode(env, s, noise=level, record=False).success for s in seeds) / episodes

    try:
        return dart.calibrate(success_rate, levels, target)
    finally:
        env.close()


HUB_FRAMES_PER_EPISODE = 82  # lerobot/metaworld_mt50: 204,806 frames in 2500 episodes


@dataclasses.dataclass(frozen=True)
class _TaskJob:
    task: str
    episodes: int
    view: View
    seed: int
    noise: float | None
    keep_failures: bool
    max_attempts: int
    max_steps: int


def _collect_task(job: _TaskJob) -> tuple[list[str], list[dict]]:
    """One task's demonstrations (and the lines to print): its own process when collecting in parallel."""
    lines, recorded = [], []
    level = job.noise
    if level is None:
        level, measured = calibrate_noise(job.task, seed=CALIBRATION_SEED + job.seed)
        table = ", ".join(f"{k:g}: {v:.0%}" for k, v in measured.items())
        lines.append(
            f"metaworld:{job.task}: scripted success by DART noise ({CALIBRATION_EPISODES} episodes each): {table}"
        )
    env = job.view.env(job.task)
    kept, attempts, wins = 0, 0, 0
    try:
        while kept < job.episodes and attempts < job.max_attempts:
            seed = episode_seed(job.seed, job.task, attempts)
            result = expert_episode(env, seed, noise=level, limit=job.max_steps)
            attempts += 1
            wins += result.success
            if result.success or job.keep_failures:
                recorded.append(result.episode)
                kept += 1
    finally:
        env.close()
    lines.append(
        f"metaworld:{job.task}: scripted policy succeeded in {wins} of {attempts} episodes ({wins / attempts:.1%}) "
        f"at DART noise {level:g}"
    )
    if kept < job.episodes:
        raise RuntimeError(f"metaworld:{job.task}: only {kept} successful episodes in {attempts} attempts")
    return lines, recorded


def _collect_task_kept(job: _TaskJob, parts: pathlib.Path) -> tuple[list[str], list[dict]]:
    """:func:`_collect_task`, its result kept in ``parts`` until the dataset is written: a collection
    interrupted after some tasks resumes with the others (a part is reused only for the same job)."""
    path = parts / f"{job.task}-{hashlib.sha256(repr(job).encode()).hexdigest()[:12]}.pkl"
    if path.exists():
        with path.open("rb") as f:
            lines, recorded = pickle.load(f)
        return [*lines, f"metaworld:{job.task}: reused from the interrupted collection ({path.name})"], recorded
    result = _collect_task(job)
    parts.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    with partial.open("wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(partial, path)  # a part is complete or absent
    return result


def check_memory(tasks: int, episodes: int, image_size: tuple[int, int], available: int | None = None) -> None:
    """Refuse a collection whose frames (held in memory until the dataset is written) would take more
    than half of the available memory, at the hub dataset's mean episode length."""
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return
    needed = tasks * episodes * HUB_FRAMES_PER_EPISODE * int(np.prod(image_size)) * 3
    if needed > available // 2:
        raise MetaWorldError(
            f"{tasks} tasks x {episodes} episodes at {image_size[0]}x{image_size[1]} hold about "
            f"{needed / 2**30:.1f} GiB of frames until the dataset is written, more than half of the "
            f"{available / 2**30:.1f} GiB available: collect fewer tasks per dataset or at a smaller --image-size"
        )


def parse_task_data(items: Sequence[str], tasks: Sequence[str]) -> dict[str, tuple[int, float | None]]:
    """``TASK=EPISODES`` or ``TASK=EPISODES@NOISE`` per item (NOISE a DART std, or ``auto``:
    calibrated) -> {task: (episodes, noise)}, the collection settings of those tasks alone.

    TASK may be a suite or difficulty group (``hard``, ``very_hard``, ...): it sets every task of
    the run in that group; an item naming one task overrides its group's."""
    out: dict[str, tuple[int, float | None]] = {}
    by_group: dict[str, tuple[int, float | None]] = {}
    for item in items:
        name, _, setting = item.partition("=")
        episodes, _, noise = setting.partition("@")
        try:
            count = int(episodes)
            level = None if noise == "auto" else float(noise) if noise else 0.0
        except ValueError:
            count, level = 0, 0.0
        members = [t for t in SUITES[name] if t in tasks] if name in SUITES else [name] if name in tasks else []
        if not members or count < 1 or (level is not None and not (np.isfinite(level) and level >= 0)):
            raise MetaWorldError(
                f"--task-data {item!r}: give TASK=EPISODES or TASK=EPISODES@NOISE (NOISE >= 0 or auto) "
                f"for one of this run's tasks ({', '.join(tasks)}) or a group holding some of them "
                f"({', '.join(SUITES)})"
            )
        target = by_group if name in SUITES else out
        for task in members:
            if task in target:
                raise MetaWorldError(f"--task-data names {task} twice")
            target[task] = (count, level)
    return {task: out.get(task, by_group.get(task)) for task in tasks if task in out or task in by_group}


def collect(
    tasks: str | Sequence[str],
    episodes: int,
    out: str | os.PathLike,
    *,
    view: View | None = None,
    seed: int = COLLECTION_SEED,
    noise: float | None = 0.0,
    task_data: Mapping[str, tuple[int, float | None]] | None = None,
    keep_failures: bool = False,
    max_attempts: int | None = None,
    image_storage: str = "png",
    codec: str = "h264",
    max_steps: int = STEP_LIMIT,
    workers: int = 1,
    log: Callable[[str], None] = print,
) -> pathlib.Path:
    """``episodes`` scripted demonstrations per task written as one LeRobot v3.0 dataset in
    ``lerobot/metaworld_mt50``'s layout (its features, dtypes and 80 fps); frames and prompts as
    ``view`` shows them (:class:`View`: 64 px by default, 480 for the hub's frames).

    ``noise``: DART std in action units for every task (0: none, as the hub's dataset); None:
    calibrated per task (:func:`calibrate_noise`, printed). Episode ``i`` of a task resets with
    ``episode_seed(seed, task, i)``; failed episodes are skipped (unless ``keep_failures``) and
    the next seed tried, at most ``max_attempts`` (default 2 x episodes + 10) per task. Frames are
    lossless PNG by default, as the hub stores them (``image_storage="video"``: mp4 in ``codec``).
    ``max_steps``: the episode's step limit (:data:`STEP_LIMIT`, the evaluation's; lower only for
    quick checks).
    ``workers``: tasks collected in that many processes at once (the dataset is the same).
    ``task_data``: {task: (episodes, noise)} in place of ``episodes`` and ``noise`` for those tasks
    (:func:`parse_task_data`), e.g. more and noisier demonstrations of the precision tasks alone.
    Each finished task is kept in ``<out>.parts/`` until the dataset is written: a collection
    interrupted (a crash, the end of a session) and run again collects only the tasks it had not
    finished."""
    from embodied_jax.data.writer import write_lerobot_dataset

    names = parse_tasks(tasks) if isinstance(tasks, str) else tuple(tasks)
    if episodes < 1 or max_steps < 1 or workers < 1:
        raise ValueError(f"episodes ({episodes}), max_steps ({max_steps}) and workers ({workers}) must be >= 1")
    check_gl()
    if noise is not None and not (np.isfinite(noise) and noise >= 0):
        raise ValueError(f"noise={noise}: a finite std in action units, >= 0")
    view = view or View()
    settings = {task: (episodes, noise) for task in names}
    unknown = sorted(set(task_data or {}) - set(names))
    if unknown:
        raise MetaWorldError(f"task_data names tasks outside the collection: {unknown}")
    settings.update(task_data or {})
    check_memory(len(names), int(np.mean([count for count, _ in settings.values()])), view.image_size)
    jobs = [
        _TaskJob(
            task,
            settings[task][0],
            view,
            seed,
            settings[task][1],
            keep_failures,
            max_attempts or 2 * settings[task][0] + 10,
            max_steps,
        )
        for task in names
    ]
    recorded: list[dict] = []
    parts = pathlib.Path(out).with_name(pathlib.Path(out).name + ".parts")
    collect_task = functools.partial(_collect_task_kept, parts=parts)
    with contextlib.ExitStack() as stack:
        results = map(collect_task, jobs)
        if min(workers, len(jobs)) > 1:
            context = multiprocessing.get_context("spawn")
            pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)), mp_context=context)
            stack.callback(pool.shutdown, cancel_futures=True)
            results = pool.map(collect_task, jobs)
        for lines, episodes_of_task in results:  # in task order, whatever the workers' order
            for line in lines:
                log(line)
            recorded += episodes_of_task
    written = write_lerobot_dataset(
        out,
        recorded,
        fps=FPS,
        version="v3.0",
        image_storage=image_storage,
        codec=codec,
        robot_type=ROBOT_TYPE,
        image_shape_order="chw",
    )
    shutil.rmtree(parts, ignore_errors=True)
    return written
