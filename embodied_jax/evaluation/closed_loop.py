"""A policy bundle's closed-loop evaluation on a task: the library entry the command line
(``evaluation/cli.py``), the demo, the Meta-World experiments and the benchmarks call.

``evaluate_policy(bundle, task, ...)``: ``envs`` episodes of a built-in task (``sim.tasks.TASKS``)
or of a MuJoCo Playground manipulation env (``playground:<Env>``, e.g.
``playground:PandaPickCube``, where Playground and its robot assets are on disk; see
``sim.playground``), run in one jitted MJX program through the bundle's ``act_fn``, so the policy
sees exactly what ``predict`` would. It writes the report to ``out_dir``: ``results.json``
(success rate with its 95% Wilson interval, episodes, mean episode length, reward, the step
evaluated), mp4 videos of the first ``videos`` episodes and a PNG grid of their frames.

``evaluate_metaworld(bundle, task, ...)`` runs Meta-World's own environments by LeRobot's
protocol (``sim/metaworld/closed_loop.py``).

The image size and ``execute_steps`` default to the checkpoint's own evaluation (its saved
``SimEvaluation``), else to the policy's input size and 5; the episodes to the test seed
(``sim.seeds.TEST_SEED``), never the validation seed its in-training evaluations used.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from embodied_jax.bundle import PolicyBundle, act_fn
from embodied_jax.errors import InputError
from embodied_jax.evaluation.in_training import MetaWorldEvaluation, SimEvaluation
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


def check_fits(bundle: PolicyBundle, env, task: str) -> None:
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
    check_fits(bundle, env, task)
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
    # The run's own view (its frames' size, 480 for the hub's data, window and camera, its prompts)
    # unless an argument says otherwise.
    try:
        shown = run.view() if run else metaworld.View(tuple(bundle.image_size or settings["image_size"]))
        view = metaworld.View(
            tuple(image_size or shown.image_size),
            prompts or shown.prompts,
            render_style or shown.render_style,
            shown.crop,
            shown.camera_pos,
        )
    except metaworld.MetaWorldError as exc:
        raise EvaluationError(str(exc)) from exc
    config = metaworld.EvalSettings(
        episodes=episodes,
        envs=min(episodes, envs or metaworld.EvalSettings.envs),
        execute_steps=settings["execute_steps"] if execute_steps is None else execute_steps,
        seed=metaworld.TEST_SEED if seed is None else seed,
        videos=videos,
        view=view,
    )
    missing = [key for key in bundle.inputs.camera_keys if key != metaworld.IMAGE_KEY]
    if missing or bundle.action_dim not in (None, 4):
        raise EvaluationError(
            f"Meta-World gives {metaworld.IMAGE_KEY} and takes 4-dim actions; the policy needs cameras "
            f"{list(bundle.inputs.camera_keys)} and predicts {bundle.action_dim}-dim actions"
        )

    def policy(batch, call_seed):
        return bundle.predict(batch, rng=jax.random.key(call_seed))

    try:
        metrics = metaworld.evaluate(policy, task, config, out_dir=out_dir)
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
