"""``python -m experiments.benchmarks.image_reliance RUN [--dataset DIR]``: how much a trained policy's
actions depend on its camera image, against how much the demonstrations' actions differ.

For each task of the run's dataset, the first frame of ``--episodes`` episodes (their robot states
are alike; what tells the episodes apart is where the objects and the goal are, which only the
image shows) is given to the policy twice with the same sampling keys: with its own image, and
with the first episode's image in every row. Printed per task: the mean absolute change of the
predicted first ``--steps`` actions when the image is swapped (``image_effect``), the spread of the
demonstrations' own first actions across those episodes (``demo_spread``) and their ratio. A
policy that reads the goal from the image moves its actions about as much as the demonstrations
differ (ratio near 1); a ratio near 0 is a policy that ignores its camera.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Annotated

import numpy as np
import tyro

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """image_reliance's command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]]
    """a trained run directory"""
    dataset: str | None = None
    """its dataset (default: the run's dataset/ directory)"""
    episodes: int = 8
    steps: int = 8


def main(argv: list[str] | None = None) -> dict:
    import jax

    from embodied_jax import load_policy
    from embodied_jax.data.lerobot import LeRobotDataset

    args = parse_flags(Flags, args=argv, prog="python -m experiments.benchmarks.image_reliance")
    bundle = load_policy(args.run)
    ds = LeRobotDataset(args.dataset or pathlib.Path(args.run) / "dataset")
    camera, state_key = bundle.inputs.camera_keys[0], bundle.inputs.state_key
    by_task: dict[str, list[int]] = {}
    for episode in range(ds.num_episodes):
        by_task.setdefault(ds.task(episode, 0), []).append(episode)
    result = {}
    for task, episodes in by_task.items():
        episodes = episodes[: args.episodes]
        images = np.stack([ds.images(e, camera, [0])[0] for e in episodes])
        states = np.stack([ds.episode_array(e, state_key)[0] for e in episodes])
        demo = np.stack([ds.episode_array(e, "action")[: args.steps].mean(0) for e in episodes])
        own = {camera: images, state_key: states, "task": [task] * len(episodes)}
        swapped = {**own, camera: np.repeat(images[:1], len(episodes), axis=0)}
        key = jax.random.key(0)
        a = np.asarray(bundle.predict(own, rng=key))[:, : args.steps].mean(1)
        b = np.asarray(bundle.predict(swapped, rng=key))[:, : args.steps].mean(1)
        effect = float(np.abs(a - b)[1:].mean())  # row 0 is the same in both
        spread = float(np.abs(demo - demo.mean(0)).mean())
        ratio = effect / spread if spread > 1e-6 else None  # demonstrations that start alike say nothing
        result[task] = {"image_effect": effect, "demo_spread": spread, "ratio": ratio}
        shown = "-" if ratio is None else f"{ratio:.3f}"
        print(f"{task[:48]:48s} image effect {effect:.4f}  demo spread {spread:.4f}  ratio {shown}")
    return {"run": args.run, "per_task": result}


if __name__ == "__main__":
    sys.exit(harness.run(main, "image_reliance"))
