"""Closed-loop evaluation of a trained checkpoint: ``python -m embodied_jax.evaluate CKPT --task TASK``.

``evaluate_policy(bundle, task, ...)`` is the library form (the demo's final evaluation calls
it too): ``envs`` episodes of a built-in task (``sim.tasks.TASKS``) or of a MuJoCo Playground
manipulation env (``playground:<Env>``, e.g. ``playground:PandaPickCube``, where Playground and
its robot assets are on disk; see ``sim.playground``), run in one jitted MJX program through
the bundle's ``act_fn``, so the policy sees exactly what ``predict`` would. It writes the
report to ``out_dir``: ``results.json`` (success rate with its 95% Wilson interval, episodes,
mean episode length, reward, the step evaluated), mp4 videos of the first ``videos``
episodes and a PNG grid of their frames.

The image size and ``execute_steps`` default to the checkpoint's own evaluation (its saved
``SimEvaluation``), else to the policy's input size and 5; the episodes to the test seed
(``sim.seeds.TEST_SEED``), never the validation seed its in-training evaluations used. The command line writes to
``<run>/eval/<task>-step<step>/`` unless ``--out`` says otherwise, so reports of other tasks,
steps or weights never overwrite each other; the checkpoint is opened read-only, so a run that
is still training can be evaluated.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

import embodied_jax.records as records
from embodied_jax.bundle import PolicyBundle, act_fn
from embodied_jax.cli import INPUT_ERRORS, add_verbose_flag, fail
from embodied_jax.errors import InputError
from embodied_jax.policy_evaluation import MetaWorldEvaluation, SimEvaluation
from embodied_jax.sim.seeds import TEST_SEED
from embodied_jax.sim.tasks import TASKS

PLAYGROUND = "playground:"
METAWORLD = "metaworld:"
DEFAULT_ENVS = 32
DEFAULT_EXECUTE_STEPS = 5


class EvaluationError(InputError, ValueError):
    """An evaluation that cannot run as asked (unknown task, env count, a task the policy does not fit)."""


def check_task(task: str) -> None:
    """``task`` names a built-in task or an available Playground env; Playground's absence (or its
    robot assets') is reported here, before a checkpoint is loaded."""
    if task in TASKS:
        return
    if task.startswith(METAWORLD):
        from embodied_jax.sim import metaworld

        try:
            metaworld.parse_tasks(task)
            metaworld.adapt()
        except metaworld.MetaWorldError as exc:
            raise EvaluationError(str(exc)) from exc
        return
    if task.startswith(PLAYGROUND) and task[len(PLAYGROUND) :]:
        from embodied_jax.sim import playground

        if task[len(PLAYGROUND) :] in playground.MENAGERIE_ENVS:  # Playground's own robots need their assets
            playground.ensure_assets()
        return
    raise EvaluationError(
        f"unknown task {task!r}: built-in tasks are {sorted(TASKS)}, {METAWORLD}<task>|mt10|mt50 for "
        f"Meta-World, or {PLAYGROUND}<Env> for a MuJoCo Playground manipulation env (e.g. {PLAYGROUND}PandaPickCube)"
    )


def make_env(task: str, image_size: tuple[int, int], *, instruction: str | None = None, phase_in_state: bool = False):
    """The MJX environment of ``task`` rendering ``image_size`` images (a ``sim.Env`` or a
    ``sim.playground.PlaygroundEnv``)."""
    from embodied_jax.sim import Env, EnvConfig  # MJX: imported when first used

    check_task(task)
    if task in TASKS:
        if instruction is not None:
            raise EvaluationError(f"task {task!r} is built in and has its own instruction: {TASKS[task].instruction!r}")
        return Env(task, EnvConfig(image_size=image_size, phase_in_state=phase_in_state))
    from embodied_jax.sim import playground

    config = EnvConfig(image_size=image_size, physics="warp", renderer="warp")
    try:
        return playground.load_playground_env(task[len(PLAYGROUND) :], instruction=instruction, config=config)
    except ValueError as exc:  # an unknown env name, or one without cameras
        raise EvaluationError(f"task {task!r}: {exc}") from exc


def defaults(bundle: PolicyBundle) -> dict[str, Any]:
    """What the run itself evaluated with (``envs``, ``execute_steps``, ``image_size``,
    ``phase_in_state``) and the test seed (``seed``): reported figures never reuse the validation
    seed the run's in-training evaluations chose its settings on."""
    evaluation = bundle.config.evaluation
    if isinstance(evaluation, SimEvaluation):
        return {
            "envs": evaluation.num_envs,
            "execute_steps": evaluation.execute_steps,
            "image_size": tuple(evaluation.image_size),
            "seed": TEST_SEED,  # not the run's own evaluation seed: that one chose its settings
            "phase_in_state": evaluation.phase_in_state,
        }
    from embodied_jax.sim import EnvConfig

    image_size = bundle.image_size or EnvConfig().image_size  # the policy's input size, where the run fixes one
    return {
        "envs": DEFAULT_ENVS,
        "execute_steps": DEFAULT_EXECUTE_STEPS,
        "image_size": image_size,
        "seed": TEST_SEED,
        "phase_in_state": False,
    }


def _check_fits(bundle: PolicyBundle, env, task: str) -> None:
    """The policy's actions and cameras fit the task (its state is checked by the bundle, by name)."""
    if bundle.action_dim is not None and bundle.action_dim != env.action_dim:
        raise EvaluationError(
            f"task {task!r} takes {env.action_dim}-dim actions, but the policy predicts {bundle.action_dim}"
        )
    rendered = {f"observation.images.{camera}" for camera in env.cameras}
    missing = [key for key in bundle.inputs.camera_keys if key not in rendered]
    if missing:
        raise EvaluationError(
            f"task {task!r} renders cameras {list(env.cameras)}, but the policy needs {missing} as well"
        )


def evaluate_policy(
    bundle: PolicyBundle,
    task: str,
    *,
    envs: int | None = None,
    videos: int = 0,
    out_dir: str | pathlib.Path | None = None,
    seed: int | None = None,
    execute_steps: int | None = None,
    image_size: tuple[int, int] | None = None,
    instruction: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``bundle`` closed-loop on ``task``; returns the report (and writes it, with its
    videos and frame grid, to ``out_dir`` when given). Unset settings come from ``defaults``;
    ``instruction``: the prompt for a Playground env (default: its name)."""
    from embodied_jax.sim import EvalConfig, Evaluator

    if task.startswith(METAWORLD):  # ``envs`` episodes per task
        return evaluate_metaworld(
            bundle, task, episodes=envs, videos=videos, out_dir=out_dir, seed=seed, execute_steps=execute_steps
        )
    settings = defaults(bundle)
    envs = settings["envs"] if envs is None else envs
    execute_steps = settings["execute_steps"] if execute_steps is None else execute_steps
    seed = settings["seed"] if seed is None else seed
    image_size = tuple(settings["image_size"] if image_size is None else image_size)
    if envs < 1:
        raise EvaluationError(f"envs={envs}: evaluate at least one environment")
    if not 0 <= videos <= envs:
        raise EvaluationError(f"videos={videos}: between 0 and the {envs} environments evaluated")
    if execute_steps < 1:
        raise EvaluationError(f"execute_steps={execute_steps}: execute at least one action of each chunk")
    env = make_env(task, image_size, instruction=instruction, phase_in_state=settings["phase_in_state"])
    _check_fits(bundle, env, task)
    act, params = act_fn(bundle, env.instruction)
    config = EvalConfig(num_envs=envs, execute_steps=execute_steps, num_videos=videos, seed=seed)
    metrics = Evaluator(env, act, config)(params=params, out_dir=out_dir)
    metrics = {**metrics, "step": bundle.step, "seed": seed}
    if out_dir is not None:
        (pathlib.Path(out_dir) / "results.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def evaluate_metaworld(
    bundle: PolicyBundle,
    task: str,
    *,
    episodes: int | None = None,
    envs: int | None = None,
    videos: int = 0,
    out_dir: str | pathlib.Path | None = None,
    seed: int | None = None,
    execute_steps: int | None = None,
    prompts: str | None = None,
    render_style: str | None = None,
    image_size: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """``bundle`` closed-loop in Meta-World by LeRobot's protocol (``sim.metaworld``): ``episodes``
    per task (default 10), ``envs`` of them stepped together with one ``predict`` call per decision,
    on the test seed unless ``seed`` says otherwise; images at the size the run's Meta-World
    evaluation renders (else the policy's input size; ``image_size``: 480 renders LeRobot's frames,
    which the bundle resizes as in training); ``execute_steps``, ``prompts`` and ``render_style``
    default to the run's evaluation."""
    import jax

    from embodied_jax.sim import metaworld

    settings = defaults(bundle)
    run = bundle.config.evaluation if isinstance(bundle.config.evaluation, MetaWorldEvaluation) else None
    episodes = 10 if episodes is None else episodes
    config = metaworld.EvalSettings(
        episodes=episodes,
        envs=min(episodes, envs or metaworld.EvalSettings.envs),
        execute_steps=settings["execute_steps"] if execute_steps is None else execute_steps,
        seed=metaworld.TEST_SEED if seed is None else seed,
        videos=videos,
        prompts=prompts or (run.prompts if run else metaworld.EvalSettings.prompts),
        render_style=render_style or (run.render_style if run else metaworld.EvalSettings.render_style),
        crop=run.crop if run else None,  # the window of the frame the policy was trained on
    )
    missing = [key for key in bundle.inputs.camera_keys if key != metaworld.IMAGE_KEY]
    if missing or bundle.action_dim not in (None, 4):
        raise EvaluationError(
            f"Meta-World gives {metaworld.IMAGE_KEY} and takes 4-dim actions; the policy needs cameras "
            f"{list(bundle.inputs.camera_keys)} and predicts {bundle.action_dim}-dim actions"
        )
    # The run's own Meta-World evaluation renders at the size its frames had (480 for the hub's data).
    image_size = tuple(image_size or (run.image_size if run else None) or bundle.image_size or settings["image_size"])

    def policy(batch, call_seed):
        return bundle.predict(batch, rng=jax.random.key(call_seed))

    try:
        metrics = metaworld.evaluate(policy, task, config, image_size=image_size, out_dir=out_dir)
    except metaworld.MetaWorldError as exc:
        raise EvaluationError(str(exc)) from exc
    metrics = {**metrics, "step": bundle.step, "seed": config.seed}
    if out_dir is not None:
        (pathlib.Path(out_dir) / "results.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def summary_line(metrics: dict[str, Any]) -> str:
    """``<task>: success rate ... (95% CI ..., N episodes), mean episode length ... steps``."""
    low, high = metrics["success_ci95"]
    return (
        f"{metrics['task']}: success rate {metrics['success_rate']:.1%} "
        f"(95% CI {low:.1%}-{high:.1%}, {metrics['episodes']} episodes), "
        f"mean episode length {metrics['mean_episode_length']:.1f} steps"
    )


def detail_lines(metrics: dict[str, Any]) -> list[str]:
    """Per task and per difficulty group of a Meta-World report (nothing for a single built-in task)."""
    lines = []
    for name, key in (("task", "per_task"), ("difficulty", "per_difficulty")):
        for label, entry in metrics.get(key, {}).items():
            low, high = entry["success_ci95"]
            rate, episodes = entry["success_rate"], entry["episodes"]
            lines.append(f"  {name} {label}: {rate:.1%} (95% CI {low:.1%}-{high:.1%}, {episodes} episodes)")
    if "mean_task_success" in metrics:
        lines.append(f"  mean of the per-task success rates: {metrics['mean_task_success']:.1%}")
    return lines


def report_lines(metrics: dict[str, Any], out_dir: str | pathlib.Path) -> list[str]:
    """Where the report went: ``results: ...``, one ``video: ...`` per video, ``frames: ...``."""
    lines = [f"results: {pathlib.Path(out_dir) / 'results.json'}"]
    lines += [f"video: {video}" for video in metrics.get("videos", [])]
    if "frame_grid" in metrics:
        lines.append(f"frames: {metrics['frame_grid']}")
    if "group_frame_grid" in metrics:
        rows = ", ".join(f"{r['difficulty']} {r['outcome']} ({r['task']})" for r in metrics["group_frame_rows"])
        lines.append(f"frames per difficulty group: {metrics['group_frame_grid']} (rows: {rows})")
    return lines


def report_dir(ckpt: str | pathlib.Path, task: str, step: int, *, use_ema: bool = True) -> pathlib.Path:
    """``<run>/eval/<task>-step<step>`` (``-no-ema`` for the raw parameters); ``ckpt``: the run
    directory or its ``checkpoints/``."""
    path = pathlib.Path(ckpt)
    run = path.parent if path.name == "checkpoints" and not (path / "checkpoints").is_dir() else path
    name = f"{task.replace(':', '-')}-step{step}" + ("" if use_ema else "-no-ema")
    return run / "eval" / name


def _check_step(ckpt: pathlib.Path, step: int) -> None:
    """``--step`` names a step the run saved (an exported policy holds one, which load_policy checks)."""
    steps_dir = ckpt / "checkpoints" if (ckpt / "checkpoints").is_dir() else ckpt
    steps = sorted(int(p.name) for p in steps_dir.glob("*") if p.name.isdigit() and p.is_dir())
    if steps and step not in steps:
        raise EvaluationError(f"--step {step}: {steps_dir} holds steps {steps}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embodied_jax.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("ckpt", metavar="CKPT", help="a run directory or its checkpoints/ directory")
    parser.add_argument(
        "--task",
        required=True,
        help=f"a built-in task ({', '.join(sorted(TASKS))}), {METAWORLD}<task>[,<task>]|mt10|mt50, "
        f"or {PLAYGROUND}<Env>",
    )
    parser.add_argument(
        "--envs",
        type=int,
        default=None,
        help=f"built-in tasks: episodes, simulated together (default: the run's, else {DEFAULT_ENVS}); "
        f"Meta-World: environments stepped together per policy call (default 10)",
    )
    parser.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="episodes per task (Meta-World; default 10); for a built-in task the same as --envs",
    )
    parser.add_argument("--videos", type=int, default=0, help="first episodes written as mp4 (default 0)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--no-ema", action="store_true", help="the trained parameters, not their EMA")
    parser.add_argument("--out", default=None, help="report directory (default: <run>/eval/<task>-step<step>)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="episode and noise seed (default: the test seed, 1; in-training evaluations use the validation seed, 2)",
    )
    parser.add_argument(
        "--execute-steps",
        type=int,
        default=None,
        help=f"actions executed from each chunk before replanning (default: the run's, else {DEFAULT_EXECUTE_STEPS})",
    )
    parser.add_argument("--instruction", default=None, help="the prompt for a Playground env (default: its name)")
    parser.add_argument(
        "--prompts",
        choices=("lerobot", "project"),
        default=None,
        help="Meta-World: LeRobot's task descriptions or the project's own sentences (default: the run's)",
    )
    parser.add_argument(
        "--render-style",
        choices=("fast", "lerobot"),
        default=None,
        help="Meta-World: 'lerobot' renders with Meta-World's own settings (default: the run's)",
    )
    parser.add_argument(
        "--image-size",
        type=int,
        default=None,
        metavar="PX",
        help="Meta-World: square render size (default: the policy's input size; 480 is LeRobot's)",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="append the result, with the commit of the checkout run from, the run's config hash, the seed, "
        f"episodes and wall time, to <results>/evaluate.jsonl (default results: ./{records.RESULTS})",
    )
    parser.add_argument("--results", default=None, help="for --record: the results directory")
    parser.add_argument(
        "--shared-machine", action="store_true", help="for --record: other work shared the machine during the run"
    )
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    # The project's own warnings; absl (Orbax's logger) warns about its type-handler registry on every start.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        for flag, value, least in (
            ("--envs", args.envs, 1),
            ("--episodes", args.episodes, 1),
            ("--videos", args.videos, 0),
            ("--execute-steps", args.execute_steps, 1),
        ):
            if value is not None and value < least:
                raise EvaluationError(f"{flag} {value}: must be at least {least}")
        check_task(args.task)
        metaworld_task = args.task.startswith(METAWORLD)
        if not metaworld_task and None not in (args.envs, args.episodes) and args.envs != args.episodes:
            raise EvaluationError(
                f"--envs {args.envs} and --episodes {args.episodes}: a built-in task runs them together"
            )
        if args.step is not None:
            _check_step(pathlib.Path(args.ckpt), args.step)
        from embodied_jax.loading import load_policy  # builds the model: after the cheap checks

        bundle = load_policy(args.ckpt, step=args.step, use_ema=not args.no_ema)
        out = (
            pathlib.Path(args.out)
            if args.out
            else report_dir(args.ckpt, args.task, bundle.step, use_ema=not args.no_ema)
        )
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise EvaluationError(f"cannot write the report to {out}: {exc.strerror}; choose another --out") from exc
        started = time.perf_counter()
        if metaworld_task:
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
    except INPUT_ERRORS + (ValueError,) as exc:
        return fail(exc, verbose=args.verbose)
    print(summary_line(metrics))
    print("\n".join(detail_lines(metrics) + report_lines(metrics, out)))
    if args.record:
        seconds = time.perf_counter() - started
        argv = sys.argv[1:] if argv is None else list(argv)
        path = record(metrics, bundle, args, argv, seconds)
        print(f"recorded: {path}")
    return 0


def record(metrics: dict[str, Any], bundle: PolicyBundle, args: argparse.Namespace, argv, seconds: float):
    """Append the evaluation's row (``embodied_jax/records.py``) to ``<results>/evaluate.jsonl``."""
    result = records.closed_loop_result(metrics)
    root = pathlib.Path.cwd()
    entry = records.row(
        "evaluate",
        root=root,
        command="python -m embodied_jax.evaluate " + shlex.join(argv),
        result=result,
        config=bundle.config,
        extra={
            "checkpoint": str(args.ckpt),
            "seeds": {"evaluation": metrics.get("seed")},
            "wall_s": {"evaluation": round(seconds, 1)},
            "machine": {**records.machine(), "shared": bool(args.shared_machine)},
        },
    )
    return records.append(entry, args.results or root / records.RESULTS)


if __name__ == "__main__":
    sys.exit(main())
