"""``python -m experiments.benchmarks.metaworld_goal_views``: how well one camera frame can say where a
Meta-World task's randomised object and goal are, from geometry alone.

A single view fixes a point's two image coordinates; its depth along the camera ray stays open.
For each task, positions are drawn from the task's reset space (``_random_reset_space``, which
Meta-World samples uniformly at every reset: the object's xyz, then the goal's), projected through
LeRobot's ``corner2`` pose (``sim.metaworld.MetaWorldEnv``) onto a ``size`` x ``size`` pixel grid,
and each point is guessed as the mean 3D position of all draws that land on its pixel: the best a
policy can do that finds the marker's pixel exactly and nothing else. Printed per task and point:
the mean error of that guess, the fraction within ``radius`` (5 cm: reach's success distance), and
the same fraction for a policy that ignores the image (one guess for every episode). Cues the
projection leaves out (the marker's apparent size, occlusion by the arm while it moves) can only
help a policy, so the fractions are lower bounds for a policy that sees the marker.
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """metaworld_goal_views' command line."""

    tasks: tuple[str, ...] = ("reach", "push", "pick-place", "peg-insert-side")
    sizes: tuple[int, ...] = (64, 480)
    draws: int = 2_000_000
    radius: float = 0.05  # metres
    seed: int = 0


def pixel_guess_errors(points: np.ndarray, pixels: np.ndarray) -> np.ndarray:
    """Distance of each point to the mean of the points that share its pixel."""
    _, group, count = np.unique(pixels, axis=0, return_inverse=True, return_counts=True)
    group = group.reshape(-1)
    means = np.stack([np.bincount(group, points[:, k]) / count for k in range(points.shape[1])], axis=1)
    return np.linalg.norm(points - means[group], axis=1)


def project(points: np.ndarray, cam_pos: np.ndarray, cam_mat: np.ndarray, fovy_deg: float, size: int) -> np.ndarray:
    """Integer pixel (column, row) of world points in a MuJoCo camera (looking down its -z axis)."""
    cam = (points - cam_pos) @ cam_mat
    focal = (size / 2) / np.tan(np.deg2rad(fovy_deg) / 2)
    depth = -cam[:, 2]
    return np.floor(np.stack([focal * cam[:, 0] / depth, focal * cam[:, 1] / depth], axis=1)).astype(np.int64)


def main(argv: list[str] | None = None) -> dict:
    import mujoco

    from embodied_jax.sim import metaworld

    args = parse_flags(Flags, args=argv, prog="python -m experiments.benchmarks.metaworld_goal_views")
    rng = np.random.default_rng(args.seed)
    result: dict = {"radius_m": args.radius, "draws": args.draws}
    for task in args.tasks:
        env = metaworld.MetaWorldEnv(task)
        try:
            raw = env._env
            camera = mujoco.mj_name2id(raw.model, mujoco.mjtObj.mjOBJ_CAMERA, metaworld.CAMERA)
            cam_pos, cam_mat = raw.data.cam_xpos[camera].copy(), raw.data.cam_xmat[camera].reshape(3, 3).copy()
            fovy = float(raw.model.cam_fovy[camera])
            space = raw._random_reset_space
            low, high = np.asarray(space.low, float), np.asarray(space.high, float)
        finally:
            env.close()
        draws = rng.uniform(low, high, (args.draws, low.size))
        for name, part in (("object", slice(0, 3)), ("goal", slice(low.size - 3, low.size))):
            if np.allclose(low[part], high[part]):
                continue  # not randomised in this task
            points = draws[:, part]
            blind = np.linalg.norm(points - points.mean(axis=0), axis=1)
            row = {"blind_within": round(float((blind < args.radius).mean()), 3)}
            for size in args.sizes:
                errors = pixel_guess_errors(points, project(points, cam_pos, cam_mat, fovy, size))
                row[f"{size}px"] = {
                    "within": round(float((errors < args.radius).mean()), 3),
                    "mean_error_cm": round(100 * float(errors.mean()), 2),
                }
            result[f"{task}/{name}"] = row
            seen = "; ".join(
                f"{size} px: within {100 * row[f'{size}px']['within']:.1f}%, mean error "
                f"{row[f'{size}px']['mean_error_cm']:.1f} cm"
                for size in args.sizes
            )
            print(f"{task:16s} {name:6s} blind: within {100 * row['blind_within']:.1f}%;  {seen}")
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "metaworld_goal_views"))
