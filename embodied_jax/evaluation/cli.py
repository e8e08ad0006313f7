"""Closed-loop evaluation of a trained checkpoint: ``python -m embodied_jax.evaluate CKPT --task TASK``.

Flags are ``EvaluateFlags`` (tyro; ``--help`` lists them with their defaults). The command writes
its report to ``<run>/eval/<task>-step<step>/`` unless ``--out`` says otherwise, so reports of
other tasks, steps or weights never overwrite each other; the checkpoint is opened read-only, so
a run that is still training can be evaluated. With ``--record`` the result becomes a row of
``<results>/evaluate.jsonl`` (``embodied_jax/records.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import tyro

import embodied_jax.records as records
from embodied_jax.bundle import PolicyBundle
from embodied_jax.cli import INPUT_ERRORS, parse_flags, run_main
from embodied_jax.evaluation.closed_loop import (
    DEFAULT_ENVS,
    DEFAULT_EXECUTE_STEPS,
    METAWORLD,
    PLAYGROUND,
    EvaluationError,
    check_task,
    detail_lines,
    evaluate_metaworld,
    evaluate_policy,
    report_lines,
    summary_line,
)

PROG = "python -m embodied_jax.evaluate"


@dataclasses.dataclass(frozen=True)
class EvaluateFlags:
    """``python -m embodied_jax.evaluate``'s command line."""

    ckpt: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="CKPT")]]
    """a run directory or its checkpoints/ directory"""
    task: Annotated[
        str, tyro.conf.arg(help=f"a built-in task, {METAWORLD}<task>[,<task>]|mt10|mt50, or {PLAYGROUND}<Env>")
    ]
    envs: Annotated[
        int | None,
        tyro.conf.arg(
            help=f"built-in tasks: episodes, simulated together (default: the run's, else {DEFAULT_ENVS}); "
            "Meta-World: environments stepped together per policy call (default 10)"
        ),
    ] = None
    episodes: int | None = None
    """episodes per task (Meta-World; default 10); for a built-in task the same as --envs"""
    videos: int = 0
    """first episodes written as mp4"""
    step: int | None = None
    """checkpoint step (default: the latest)"""
    no_ema: bool = False
    """the trained parameters, not their EMA"""
    out: str | None = None
    """report directory (default: <run>/eval/<task>-step<step>)"""
    seed: int | None = None
    """episode and noise seed (default: the test seed, 1; in-training evaluations use the validation seed, 2)"""
    execute_steps: Annotated[
        int | None,
        tyro.conf.arg(
            help="actions executed from each chunk before replanning "
            f"(default: the run's, else {DEFAULT_EXECUTE_STEPS})"
        ),
    ] = None
    noise_scale: float | None = None
    """spread of sampling's initial noise, N(0, s^2): 1 the flow's own, 0 its centre (default: the run's)"""
    instruction: str | None = None
    """the prompt for a Playground env (default: its name)"""
    prompts: Literal["lerobot", "project"] | None = None
    """Meta-World: LeRobot's task descriptions or the project's own sentences (default: the run's)"""
    render_style: Literal["fast", "lerobot"] | None = None
    """Meta-World: 'lerobot' renders with Meta-World's own settings (default: the run's)"""
    image_size: Annotated[int | None, tyro.conf.arg(metavar="PX")] = None
    """Meta-World: square render size (default: the policy's input size; 480 is LeRobot's)"""
    record: Annotated[
        bool,
        tyro.conf.arg(
            help="append the result, with the commit of the checkout run from, the run's config hash, the seed, "
            f"episodes and wall time, to <results>/evaluate.jsonl (default results: ./{records.RESULTS})"
        ),
    ] = False
    results: str | None = None
    """for --record: the results directory"""
    shared_machine: bool = False
    """for --record: other work shared the machine during the run"""


def report_dir(
    ckpt: str | pathlib.Path, task: str, step: int, *, use_ema: bool = True, noise_scale: float | None = None
) -> pathlib.Path:
    """``<run>/eval/<task>-step<step>`` (``-no-ema`` for the raw parameters, ``-noise<s>`` for a
    noise scale other than the run's); ``ckpt``: the run directory or its ``checkpoints/``."""
    path = pathlib.Path(ckpt)
    run = path.parent if path.name == "checkpoints" and not (path / "checkpoints").is_dir() else path
    name = f"{task.replace(':', '-')}-step{step}" + ("" if use_ema else "-no-ema")
    if noise_scale is not None:
        name += f"-noise{noise_scale:g}"
    return run / "eval" / name


def _check_step(ckpt: pathlib.Path, step: int) -> None:
    """``--step`` names a step the run saved (an exported policy holds one, which load_policy checks)."""
    steps_dir = ckpt / "checkpoints" if (ckpt / "checkpoints").is_dir() else ckpt
    steps = sorted(int(p.name) for p in steps_dir.glob("*") if p.name.isdigit() and p.is_dir())
    if steps and step not in steps:
        raise EvaluationError(f"--step {step}: {steps_dir} holds steps {steps}")


def _check(args: EvaluateFlags) -> None:
    for flag, value, least in (
        ("--envs", args.envs, 1),
        ("--episodes", args.episodes, 1),
        ("--videos", args.videos, 0),
        ("--execute-steps", args.execute_steps, 1),
    ):
        if value is not None and value < least:
            raise EvaluationError(f"{flag} {value}: must be at least {least}")
    if args.noise_scale is not None and not (math.isfinite(args.noise_scale) and args.noise_scale >= 0):
        raise EvaluationError(f"--noise-scale {args.noise_scale}: must be finite and at least 0")
    check_task(args.task)
    if not args.task.startswith(METAWORLD) and None not in (args.envs, args.episodes) and args.envs != args.episodes:
        raise EvaluationError(f"--envs {args.envs} and --episodes {args.episodes}: a built-in task runs them together")
    if args.step is not None:
        _check_step(pathlib.Path(args.ckpt), args.step)


def evaluate(args: EvaluateFlags, argv: Sequence[str]) -> dict[str, Any]:
    """Run the evaluation ``args`` describe, print its report, record it when asked; its metrics."""
    _check(args)
    from embodied_jax.loading import load_policy  # builds the model: after the cheap checks

    edits = None if args.noise_scale is None else {"noise_scale": args.noise_scale}
    bundle = load_policy(args.ckpt, step=args.step, use_ema=not args.no_ema, model_edits=edits)
    out = (
        pathlib.Path(args.out)
        if args.out
        else report_dir(args.ckpt, args.task, bundle.step, use_ema=not args.no_ema, noise_scale=args.noise_scale)
    )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EvaluationError(f"cannot write the report to {out}: {exc.strerror}; choose another --out") from exc
    started = time.perf_counter()
    if args.task.startswith(METAWORLD):
        print(f"evaluating step {bundle.step} of {args.ckpt} on {args.task} in Meta-World ...", flush=True)
        metrics = evaluate_metaworld(
            bundle,
            args.task,
            episodes=args.episodes,
            envs=args.envs,
            videos=args.videos,
            out_dir=out,
            seed=args.seed,
            execute_steps=args.execute_steps,
            prompts=args.prompts,
            render_style=args.render_style,
            image_size=None if args.image_size is None else (args.image_size, args.image_size),
        )
    else:
        print(f"evaluating step {bundle.step} of {args.ckpt} on {args.task} in batched MJX ...", flush=True)
        metrics = evaluate_policy(
            bundle,
            args.task,
            envs=args.envs if args.envs is not None else args.episodes,
            videos=args.videos,
            out_dir=out,
            seed=args.seed,
            execute_steps=args.execute_steps,
            instruction=args.instruction,
        )
    print(summary_line(metrics))
    print("\n".join(detail_lines(metrics) + report_lines(metrics, out)))
    if args.record:
        path = record(metrics, bundle, args, argv, time.perf_counter() - started)
        print(f"recorded: {path}")
    return metrics


def record(metrics: dict[str, Any], bundle: PolicyBundle, args: EvaluateFlags, argv: Sequence[str], seconds: float):
    """Append the evaluation's row (``embodied_jax/records.py``) to ``<results>/evaluate.jsonl``."""
    root = pathlib.Path.cwd()
    entry = records.row(
        "evaluate",
        root=root,
        command=f"{PROG} " + shlex.join(argv),
        result=records.closed_loop_result(metrics),
        config=bundle.config,
        extra={
            "checkpoint": str(args.ckpt),
            "seeds": {"evaluation": metrics.get("seed")},
            "wall_s": {"evaluation": round(seconds, 1)},
            "machine": {**records.machine(), "shared": bool(args.shared_machine)},
        },
    )
    return records.append(entry, args.results or root / records.RESULTS)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: flags parsed by tyro; bad input one ``error: ...`` line, status 2."""
    # The project's own warnings; absl (Orbax's logger) warns about its type-handler registry on every start.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)

    def run(args: list[str]) -> None:
        flags = parse_flags(EvaluateFlags, args=args, prog=PROG, description=__doc__.splitlines()[0])
        evaluate(flags, args)

    return run_main(run, argv, INPUT_ERRORS + (ValueError,))


if __name__ == "__main__":
    sys.exit(main())
