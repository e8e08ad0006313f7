"""``python -m experiments.benchmarks.rl_vs_bc RUN --task T --minutes M``: RL against more behaviour
cloning for the same wall time, from the same checkpoint, scored on the same held-out episodes.

Two arms start from RUN's latest checkpoint and run for ``--minutes`` each:

- **rl**: ``python -m experiments.launch rl_<task> --init-from RUN`` (PPO through Flow-SDE,
  ``embodied_jax/rl``) with ``--rl.minutes M``;
- **bc**: the run's own supervised training resumed from that checkpoint (its optimizer, data
  iterator and schedule; past the schedule's end, its final learning rate) on the same
  demonstrations, ended by SIGTERM after M minutes (the trainer saves a checkpoint and stops).

By default the arms run at the same time (each then has about half of the machine; ``--sequential``
runs one after the other). Then the start, the RL and the BC policy are evaluated by
``python -m embodied_jax.evaluate`` on ``--episodes`` episodes of the held-out seed ``--seed``
(the RL rollouts draw their resets from the RL seed, never this one), and the three success rates
with 95% Wilson intervals, a PNG of the learning curves (RL: rollout success per iteration; BC:
loss per step) and one JSON line are printed.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from typing import Annotated, Literal

import tyro

from embodied_jax import records
from embodied_jax.cli import parse_flags
from embodied_jax.errors import InputError
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """rl_vs_bc's command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]]
    """a behaviour-cloned run directory of this project"""
    task: str = "pick_place"
    minutes: float = 60.0
    """wall time of each arm"""
    episodes: int = 128
    seed: int = 1
    """held-out evaluation seed (the test seed, sim.seeds.TEST_SEED; the RL arm's in-training
    evaluations use the validation seed)"""
    out: str | None = None
    """default: runs/rl_vs_bc/<task>"""
    num_envs: int = 32
    """RL environments per rollout"""
    policy_lr: float | None = None
    """the RL arm's actor learning rate (default: RLConfig's)"""
    sequential: bool = False
    arms: tuple[Literal["rl", "bc"], ...] = ("rl", "bc")
    """the arms to run; an arm left out is evaluated from its workdir as an earlier run left it"""
    rl_flags: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """further launcher flags for the RL arm, one per use, e.g. --rl-flags=--rl.noise-level=0.5
    --rl-flags=--rl.demo-batch=32"""


def _latest_step(run: pathlib.Path) -> int:
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    if not steps:
        raise InputError(f"{run}: no checkpoint steps")
    return steps[-1]


def _bc_command(run: pathlib.Path, workdir: pathlib.Path) -> list[str]:
    """The BC arm: the run's training resumed in ``workdir`` (a copy of its latest checkpoint) on the
    same demonstrations: its schedule to its end, then the schedule's final learning rate, until
    SIGTERM (a run whose schedule had ended trains on at that rate)."""
    step = _latest_step(run)
    target = workdir / "checkpoints" / str(step)
    if not target.exists():
        shutil.copytree(run / "checkpoints" / str(step), target)
    code = (
        "import dataclasses, sys, json, pathlib\n"
        "from embodied_jax.config_registry import from_dict\n"
        "from embodied_jax.train.loop import train, Preempted\n"
        "from embodied_jax.train.config import MetricsConfig\n"
        f"meta = pathlib.Path({str(target)!r}) / 'config' / 'metadata'\n"
        "config = from_dict(json.loads(meta.read_text()))\n"
        "# The run's schedule to its end, then its final learning rate until the minutes are up (no\n"
        "# evaluation inside the minutes; SIGTERM saves and stops).\n"
        "optimizer = dataclasses.replace(config.optimizer,\n"
        "    decay_steps=config.optimizer.decay_steps or config.train.steps)\n"
        f"config = dataclasses.replace(config, workdir={str(workdir)!r}, optimizer=optimizer,\n"
        f"    train=dataclasses.replace(config.train, eval_every=0, steps={step} + 10**7),\n"
        "    metrics=MetricsConfig(progress_bar=False, tensorboard=False))\n"
        "try:\n    train(config)\nexcept Preempted as e:\n    print('stopped:', e)\n"
    )
    return [sys.executable, "-c", code]


def _wilson(successes: int, trials: int) -> tuple[float, float]:
    from embodied_jax.sim.closed_loop import wilson_interval

    return wilson_interval(successes, trials)


def _evaluate(ckpt: pathlib.Path, task: str, episodes: int, seed: int, out: pathlib.Path) -> dict:
    cmd = [sys.executable, "-m", "embodied_jax.evaluate", str(ckpt), "--task", task, "--envs", str(episodes)]
    subprocess.run([*cmd, "--seed", str(seed), "--out", str(out)], check=True)
    result = json.loads((out / "results.json").read_text())
    lo, hi = _wilson(result["successes"], result["episodes"])
    return {
        "success_rate": result["success_rate"],
        "ci95": [lo, hi],
        "episodes": result["episodes"],
        "step": result.get("step"),
    }


def _plot(out: pathlib.Path, rl_rows: list[dict], bc_rows: list[dict], scores: dict) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    rl = [r for r in rl_rows if "success_rate" in r]
    axes[0].plot([r["step"] for r in rl], [r["success_rate"] for r in rl], marker=".")
    axes[0].set(title="RL: rollout success (Flow-SDE sampling)", xlabel="iteration", ylabel="success rate")
    bc = [r for r in bc_rows if "loss" in r]
    axes[1].plot([r["step"] for r in bc], [r["loss"] for r in bc])
    axes[1].set(title="BC: training loss", xlabel="step", ylabel="loss")
    names = list(scores)
    rates = [scores[n]["success_rate"] for n in names]
    errs = [
        [r - scores[n]["ci95"][0] for n, r in zip(names, rates, strict=True)],
        [scores[n]["ci95"][1] - r for n, r in zip(names, rates, strict=True)],
    ]
    axes[2].bar(names, rates, yerr=errs, capsize=6)
    axes[2].set(title="held-out success (95% CI)", ylim=(0, 1))
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    return path


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.rl_vs_bc", description=__doc__.splitlines()[0]
    )
    if args.minutes <= 0 or args.episodes < 1:
        raise InputError("rl_vs_bc: --minutes > 0 and --episodes >= 1")
    run = pathlib.Path(args.run)
    if not (run / "checkpoints").is_dir():
        raise InputError(f"{run}: not a run directory (no checkpoints/)")
    out = pathlib.Path(args.out or f"runs/rl_vs_bc/{args.task}")
    out.mkdir(parents=True, exist_ok=True)
    rl_dir, bc_dir = out / "rl", out / "bc"
    rl_cmd = [sys.executable, "-m", "experiments.launch", f"rl_{args.task}", "--init-from", str(run)]
    rl_cmd += ["--workdir", str(rl_dir), "--rl.minutes", str(args.minutes), "--rl.iterations", "1000000"]
    rl_cmd += ["--rl.eval-envs", "0", "--rl.num-envs", str(args.num_envs)]
    if args.policy_lr is not None:
        rl_cmd += ["--rl.policy-lr", str(args.policy_lr)]
    rl_cmd += ["--metrics.no-progress-bar", *args.rl_flags]
    bc_cmd = _bc_command(run, bc_dir)

    def start(cmd, name):
        log = open(out / f"{name}.log", "a")
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log

    def stop_after(proc, began):
        while proc.poll() is None:
            if time.monotonic() - began >= 60 * args.minutes:
                proc.send_signal(signal.SIGTERM)  # the trainer saves and stops
                proc.wait()
                break
            time.sleep(2)

    procs = {}
    began = time.monotonic()
    for name, cmd in (("rl", rl_cmd), ("bc", bc_cmd)):
        if name in args.arms:
            procs[name] = start(cmd, name)
            if args.sequential:
                proc, log = procs[name]
                if name == "bc":
                    stop_after(proc, time.monotonic())
                proc.wait()
                log.close()
    if not args.sequential:
        if "bc" in procs:
            stop_after(procs["bc"][0], began)
        for proc, log in procs.values():
            proc.wait()
            log.close()
    if "rl" in procs and procs["rl"][0].returncode != 0:
        raise RuntimeError(f"the RL arm failed (status {procs['rl'][0].returncode}): see {out / 'rl.log'}")

    scores = {}
    for name, ckpt in (("start", run), ("rl", rl_dir), ("bc", bc_dir)):
        scores[name] = _evaluate(ckpt, args.task, args.episodes, args.seed, out / "eval" / name)
    rl_rows, bc_rows = records.read(rl_dir / "metrics.jsonl"), records.read(bc_dir / "metrics.jsonl")
    png = _plot(out, rl_rows, bc_rows, scores)
    rl_last = [r for r in rl_rows if "success_rate" in r]
    result = {
        "task": args.task,
        "minutes": args.minutes,
        "episodes": args.episodes,
        "concurrent": not args.sequential,
        "success": {k: v["success_rate"] for k, v in scores.items()},
        "ci95": {k: v["ci95"] for k, v in scores.items()},
        "rl_iterations": len(rl_last),
        "rl_env_steps": rl_last[-1]["env_steps"] if rl_last else 0,
        "bc_steps": (scores["bc"]["step"] or 0) - (scores["start"]["step"] or 0),
        "gain_rl_points": 100 * (scores["rl"]["success_rate"] - scores["start"]["success_rate"]),
        "gain_bc_points": 100 * (scores["bc"]["success_rate"] - scores["start"]["success_rate"]),
    }
    for name, s in scores.items():
        lo, hi = s["ci95"]
        rate = 100 * s["success_rate"]
        print(f"{name:>5}: {rate:.1f}% (95% CI {100 * lo:.1f}-{100 * hi:.1f}%, {s['episodes']} episodes)")
    print(f"curves: {png}")
    print(json.dumps({"rl_vs_bc": result}))
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "rl_vs_bc"))
