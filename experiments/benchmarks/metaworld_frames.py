"""``python -m experiments.benchmarks.metaworld_frames``: what one Meta-World frame costs to render and to
store, at the sizes a run trains at and at LeRobot's 480x480, in both render styles.

One environment of ``--task`` (LeRobot's construction, ``sim.metaworld.MetaWorldEnv``) is reset
on the collection seed and stepped by its scripted policy; at each of ``--frames`` steps every
(size, style) renders the scene in alternation, and each frame is encoded as the dataset stores it
(PNG in the parquet). Printed per (size, style): the median render and PNG-encode milliseconds,
the mean PNG bytes, and the ratio of render + encode to the 64 px fast frame's, with what that
makes of MT50's collection (2500 episodes of the scripted policies' mean length) on one core.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import numpy as np

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """metaworld_frames' command line."""

    task: str = "pick-place"
    frames: int = 40
    sizes: tuple[int, ...] = (64, 128, 480)
    mt50_frames: int = 205_000  # the hub dataset's lerobot/metaworld_mt50: 204,806 frames in 2500 episodes


def main(argv: list[str] | None = None) -> dict:
    from embodied_jax.data.video import encode_png
    from embodied_jax.sim import metaworld

    args = parse_flags(Flags, args=argv, prog="python -m experiments.benchmarks.metaworld_frames")
    variants = [(size, style) for size in args.sizes for style in metaworld.RENDER_STYLES]
    envs = {v: metaworld.MetaWorldEnv(args.task, (v[0], v[0]), render_style=v[1]) for v in variants}
    times: dict = {v: {"render": [], "encode": [], "bytes": []} for v in variants}
    try:
        seed = metaworld.episode_seed(metaworld.COLLECTION_SEED, args.task, 0)
        for env in envs.values():
            env.reset(seed)
            env.render()  # the renderer's first frame makes its context: not timed
        for _ in range(args.frames):
            action = next(iter(envs.values())).expert_action()
            for v, env in envs.items():
                t0 = time.perf_counter()
                frame = env.render()
                t1 = time.perf_counter()
                png = encode_png(frame)
                t2 = time.perf_counter()
                times[v]["render"].append(t1 - t0)
                times[v]["encode"].append(t2 - t1)
                times[v]["bytes"].append(len(png))
                env.step(action)
    finally:
        for env in envs.values():
            env.close()
    base = next(v for v in variants if v[1] == "fast")
    result = {}
    for v in variants:
        render_ms = 1e3 * float(np.median(times[v]["render"]))
        encode_ms = 1e3 * float(np.median(times[v]["encode"]))
        result[f"{v[0]}px_{v[1]}"] = {
            "render_ms": round(render_ms, 2),
            "png_encode_ms": round(encode_ms, 2),
            "png_kb": round(float(np.mean(times[v]["bytes"])) / 1024, 1),
            "mt50_minutes_one_core": round(args.mt50_frames * (render_ms + encode_ms) / 6e4, 1),
            "mt50_dataset_gb": round(args.mt50_frames * float(np.mean(times[v]["bytes"])) / 1e9, 2),
        }
    ref = result[f"{base[0]}px_{base[1]}"]
    for name, r in result.items():
        r["cost_vs_base"] = round((r["render_ms"] + r["png_encode_ms"]) / (ref["render_ms"] + ref["png_encode_ms"]), 2)
        print(
            f"{name:16s} render {r['render_ms']:6.1f} ms  png {r['png_encode_ms']:6.1f} ms  {r['png_kb']:7.1f} KB  "
            f"x{r['cost_vs_base']:.2f} of {base[0]}px fast;  MT50 ({args.mt50_frames:,} frames): "
            f"{r['mt50_minutes_one_core']:.0f} min on one core, {r['mt50_dataset_gb']:.2f} GB"
        )
    return {"task": args.task, "frames": args.frames, **result}


if __name__ == "__main__":
    sys.exit(harness.run(main, "metaworld_frames"))
