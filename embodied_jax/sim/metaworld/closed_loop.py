"""Closed-loop evaluation in Meta-World's environments by LeRobot's protocol (its environment, prompts,
500-step episodes ended by the first success): several stepped per batched policy call, frames
rendered only when the policy decides; success per task and difficulty group (and their average, as
LeRobot's figures are reported), videos."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from embodied_jax.sim.metaworld.env import View, check_gl
from embodied_jax.sim.metaworld.suite import (
    DIFFICULTY,
    FPS,
    IMAGE_KEY,
    PREFIX,
    STATE_KEY,
    STEP_LIMIT,
    TEST_SEED,
    difficulty,
    episode_seed,
    parse_tasks,
)

# A policy: a raw observation batch in dataset keys ({"observation.state": [B, 4], "observation.image":
# [B, H, W, 3], "task": [B] str, "frame_index": int64 [B], steps since reset}) and a seed -> actions
# [B, horizon, 4] (what PolicyBundle.predict takes).
BatchPolicy = Callable[[Mapping[str, Any], int], np.ndarray]


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    episodes: int = 10  # per task
    envs: int = 10  # environments stepped together: one policy call per decision for all of them
    execute_steps: int = 4  # actions executed from each chunk before the next decision
    seed: int = TEST_SEED  # reset seeds of the reported figures; VALIDATION_SEED for choosing settings
    videos: int = 1  # first episodes per task written as mp4 (decision frames)
    limit: int = STEP_LIMIT  # steps per episode (LeRobot's: Meta-World's max_path_length)
    view: View = View()  # the frames' size and rendering and the prompts (LeRobot's descriptions by default)


def evaluate(
    policy: BatchPolicy,
    tasks: str | Sequence[str],
    settings: EvalSettings = EvalSettings(),
    *,
    out_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Closed-loop success of ``policy`` per task, per difficulty group and overall (95% Wilson
    intervals); with ``out_dir``: per-task videos of the first episodes and a frame grid."""
    from embodied_jax.sim import media
    from embodied_jax.sim.closed_loop import wilson_interval

    names = parse_tasks(tasks) if isinstance(tasks, str) else tuple(tasks)
    if settings.episodes < 1 or settings.envs < 1 or settings.execute_steps < 1 or settings.limit < 1:
        raise ValueError(f"{settings}: episodes, envs, execute_steps and limit must be >= 1")
    check_gl()
    out = None if out_dir is None else pathlib.Path(out_dir)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    per_task: dict[str, dict[str, Any]] = {}
    grid_rows = []
    examples: dict[tuple[str, bool], tuple[str, np.ndarray]] = {}  # (group, success) -> (task, first video)
    for t, task in enumerate(names):
        successes, lengths, videos, video_successes = _evaluate_task(
            policy, task, settings, call_seed=settings.seed * 7919 + t
        )
        wins = int(np.sum(successes))
        low, high = wilson_interval(wins, len(successes))
        entry = {
            "successes": wins,
            "success_rate": wins / len(successes),
            "success_ci95": [low, high],
            "episodes": len(successes),
            "mean_episode_length": float(np.mean(lengths)),
            "difficulty": difficulty(task),
        }
        if out is not None and videos:
            entry["videos"] = [
                str(media.write_mp4(out / f"{task}_episode{i}.mp4", video, fps=max(1, FPS // settings.execute_steps)))
                for i, video in enumerate(videos)
            ]
            grid_rows.append(_strip(videos[0]))
            for video, won in zip(videos, video_successes, strict=True):
                examples.setdefault((difficulty(task), won), (task, video))
        per_task[task] = entry
    groups = {}
    for group, members in DIFFICULTY.items():
        present = [per_task[m] for m in members if m in per_task]
        if present:
            wins = sum(e["successes"] for e in present)
            total = sum(e["episodes"] for e in present)
            groups[group] = {
                "success_rate": wins / total,
                "success_ci95": list(wilson_interval(wins, total)),
                "episodes": total,
            }
    wins = sum(e["successes"] for e in per_task.values())
    total = sum(e["episodes"] for e in per_task.values())
    metrics = {
        "task": PREFIX + ",".join(names),
        "success_rate": wins / total,
        "success_ci95": list(wilson_interval(wins, total)),
        "mean_task_success": float(np.mean([e["success_rate"] for e in per_task.values()])),
        # LeRobot's and SmolVLA's "average": the mean of the difficulty groups' rates.
        "group_average": float(np.mean([g["success_rate"] for g in groups.values()])),
        "episodes": total,
        "mean_episode_length": float(np.mean([e["mean_episode_length"] for e in per_task.values()])),
        "per_task": per_task,
        "per_difficulty": groups,
        "settings": dataclasses.asdict(settings),
        "image_size": list(settings.view.image_size),
        "videos": [v for e in per_task.values() for v in e.get("videos", [])],
    }
    if out is not None and grid_rows:
        metrics["frame_grid"] = str(
            media.write_png(out / "metaworld_frames.png", media.frame_grid(np.stack(grid_rows)))
        )
        # One success and one failure per difficulty group (where the recorded episodes have them).
        picked = [(g, won, *examples[(g, won)]) for g in DIFFICULTY for won in (True, False) if (g, won) in examples]
        if picked:
            rows = np.stack([_strip(video) for *_, video in picked])
            metrics["group_frame_grid"] = str(media.write_png(out / "metaworld_groups.png", media.frame_grid(rows)))
            metrics["group_frame_rows"] = [
                {"difficulty": g, "outcome": "success" if won else "failure", "task": task}
                for g, won, task, _ in picked
            ]
    return metrics


def _strip(video: np.ndarray, frames: int = 8) -> np.ndarray:
    """``frames`` decision frames spread over an episode's video, first and last included."""
    return video[np.linspace(0, len(video) - 1, frames).round().astype(int)]


def _evaluate_task(policy: BatchPolicy, task: str, settings: EvalSettings, *, call_seed: int):
    envs = [settings.view.env(task) for _ in range(min(settings.envs, settings.episodes))]
    if settings.limit > envs[0].max_path_length:
        raise ValueError(f"limit={settings.limit}: Meta-World ends its episodes at {envs[0].max_path_length} steps")
    successes, lengths, videos, video_successes = [], [], [], []
    try:
        for start in range(0, settings.episodes, len(envs)):
            ids = list(range(start, min(start + len(envs), settings.episodes)))
            group = envs[: len(ids)]
            for env, i in zip(group, ids, strict=True):
                env.reset(episode_seed(settings.seed, task, i))
            done = np.zeros(len(group), bool)
            success = np.zeros(len(group), bool)
            length = np.zeros(len(group), int)
            recording = [i < settings.videos for i in ids]
            frames: list[list[np.ndarray]] = [[] for _ in ids]
            last = [None] * len(group)
            decision = 0
            while not done.all():
                for b, env in enumerate(group):
                    if not done[b]:
                        last[b] = (env.state(), env.render())
                        if recording[b]:
                            frames[b].append(last[b][1])
                # Always a batch of `envs` rows (finished or missing rows repeat one), so the policy compiles once.
                rows = [last[b] for b in range(len(group))] + [last[0]] * (len(envs) - len(group))
                steps = [length[b] for b in range(len(group))] + [length[0]] * (len(envs) - len(group))
                batch = {
                    STATE_KEY: np.stack([r[0] for r in rows]),
                    IMAGE_KEY: np.stack([r[1] for r in rows]),
                    "task": [envs[0].instruction] * len(rows),
                    "frame_index": np.asarray(steps, np.int64),
                }
                chunk = np.asarray(policy(batch, call_seed * 100_003 + start * 1009 + decision))
                decision += 1
                if chunk.shape[1] < settings.execute_steps:
                    raise ValueError(f"policy returns {chunk.shape[1]} actions per chunk < execute_steps")
                for b, env in enumerate(group):
                    for j in range(settings.execute_steps):
                        if done[b]:
                            break
                        success[b] = env.step(chunk[b, j])
                        length[b] += 1
                        done[b] = success[b] or length[b] >= settings.limit
            successes += list(success)
            lengths += list(length)
            videos += [np.stack(f) for f, r in zip(frames, recording, strict=True) if r]
            video_successes += [bool(w) for w, r in zip(success, recording, strict=True) if r]
    finally:
        for env in envs:
            env.close()
    return successes, lengths, videos, video_successes
