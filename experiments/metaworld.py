"""Meta-World experiments by LeRobot's protocol: scripted demonstrations -> one language-conditioned
policy -> the suite, scored as LeRobot scores it.

``python -m experiments.launch metaworld_mt50`` (all 50 tasks, 10 evaluation episodes each, the
four difficulty groups and their average beside SmolVLA's and the other anchors' rows),
``metaworld_mt10`` (the ten MT10 tasks, 50 episodes each), ``metaworld_mt50_gr00t`` (the same with
GR00T-N1.5) and ``metaworld --tasks metaworld:<task>`` (one task; pick-place by default):

1. collect ``episodes`` scripted demonstrations per task in LeRobot's Meta-World environments
   (``embodied_jax.sim.metaworld``: the moved ``corner2`` camera, LeRobot's prompts, 500-step
   episodes ended by success; no noise, as the hub's ``lerobot/metaworld_mt50``; ``--collect-noise``
   adds DART noise; ``--task-data TASK=EPISODES[@NOISE]`` sets both for some tasks alone), in the
   hub dataset's layout, unless the run directory already holds them or
   ``--dataset`` names one (a copy of the hub's, for instance);
2. build the word-level tokenizer over both prompt sets of the 50 tasks;
3. train the demo-sized policy (one camera) with in-training evaluations on the validation seed;
4. evaluate the final policy on the test seed (never used by collection, calibration or the
   in-training evaluations); print per task, per difficulty group, the groups' average and the
   whole rate with 95% intervals beside the anchors (``results/anchors.jsonl``); write videos, the
   frame grid of one success and one failure per group and the learning curve per group;
   ``--record`` appends the result to ``experiments/benchmarks/results/<name>.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time

from embodied_jax.data.pipeline import DataConfig
from embodied_jax.data.sample_transform import ModelInputs
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.sources import LeRobotData
from embodied_jax.evaluation.in_training import MetaWorldEvaluation
from embodied_jax.models.gr00t import Gr00tConfig
from embodied_jax.models.pi05 import variants
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, MetricsConfig, OptimizerConfig, TrainConfig
from experiments.demo import build_gr00t_tokenizer, build_tokenizer, demo_gr00t_model
from experiments.registry import register, register_runner

IMAGE = 64
HORIZON = 8
CAMERAS = (("observation.image", "base_0_rgb"),)
GR00T_CAMERAS = (("observation.image", "ego_view"),)
RECORD = "metaworld.json"  # what a run directory was made for
ANCHOR_BENCHMARK = "metaworld_mt50"  # the anchors' rows (results/anchors.jsonl) of LeRobot's MT50 protocol
GROUPS = ("easy", "medium", "hard", "very_hard")


@dataclasses.dataclass(frozen=True)
class MetaWorldConfig(ExperimentConfig):
    tasks: str = "metaworld:mt10"
    episodes: int = 50  # scripted demonstrations per task
    collect_noise: float | None = 0.0  # DART std in action units; 0: none, as the hub's; None: calibrated per task
    # Some tasks collected otherwise: TASK=EPISODES or TASK=EPISODES@NOISE (NOISE a std or "auto",
    # calibrated), e.g. --task-data push=150@auto pick-place=150@auto for the precision tasks alone;
    # TASK may be a difficulty group (--task-data hard=150@auto: the run's hard tasks; a task overrides it).
    task_data: tuple[str, ...] = ()
    prompts: str = "lerobot"  # the prompts trained and evaluated with: LeRobot's descriptions, or "project"
    collect_workers: int = 0  # tasks collected in that many processes at once; 0: one per CPU core
    dataset: str | None = None  # a LeRobot dataset in the hub's layout to train on instead of collecting
    eval_episodes: int = 50  # per task, final evaluation
    eval_seed: int | None = None  # the final evaluation's reset seed: None, the test seed; 2 (validation) for levers
    eval_envs: int = 10  # environments stepped together per policy call
    num_videos: int = 1  # per task
    untrained_episodes: int = 0  # per task: the untrained policy's score beside the result (0: skip)
    record: bool = False  # append the result to experiments/benchmarks/results/<name>.jsonl
    shared_machine: bool = False  # for --record: other work shared the machine during the run


def run_directory(config: MetaWorldConfig) -> pathlib.Path:
    return pathlib.Path(config.workdir)


def check_reuse(config: MetaWorldConfig, workdir: pathlib.Path) -> None:
    """Refuse a run directory made for other tasks or data: its dataset or checkpoint would report on them."""
    from embodied_jax.sim import metaworld
    from embodied_jax.train.runtime import ConfigError

    wanted = {
        "tasks": list(metaworld.parse_tasks(config.tasks)),
        "image": list(config.data.pipeline.image_size),
        "protocol": "lerobot",
        "noise": config.collect_noise,
        "episodes": config.episodes,
        "prompts": config.prompts,
        "dataset": config.dataset,
    }
    if config.task_data:  # recorded only when set: older run directories stay reusable
        wanted["task_data"] = list(config.task_data)
    if config.evaluation.crop is not None:
        wanted["crop"] = list(config.evaluation.crop)
    if config.evaluation.camera_pos is not None:
        wanted["camera_pos"] = list(config.evaluation.camera_pos)
    record = workdir / RECORD
    if record.exists():
        saved = json.loads(record.read_text())
        if saved != wanted:
            raise ConfigError(f"{workdir} holds a Meta-World run of {saved}, not {wanted}: choose another --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(wanted))


def dataset_image_size(root: pathlib.Path) -> tuple[int, int]:
    """(H, W) of a dataset's ``observation.image`` as its info.json states it (HWC or CHW)."""
    from embodied_jax.data.lerobot_meta import DatasetMeta
    from embodied_jax.sim import metaworld

    height, width, _ = DatasetMeta.read(root).image_shape(metaworld.IMAGE_KEY)
    return height, width


def evaluation_for_frames(evaluation: MetaWorldEvaluation, size: tuple[int, int]) -> MetaWorldEvaluation:
    """The evaluation of a policy trained on frames of ``size`` (a dataset not collected by this run):
    it renders at that size (LeRobot's style at LeRobot's 480) and the bundle resizes the frames
    exactly as training did."""
    from embodied_jax.sim import metaworld

    if tuple(size) == tuple(evaluation.image_size):
        return evaluation
    style = "lerobot" if tuple(size) == metaworld.LEROBOT_IMAGE_SIZE else evaluation.render_style
    return dataclasses.replace(evaluation, image_size=tuple(size), render_style=style)


def run_evaluation(config: MetaWorldConfig, dataset: pathlib.Path) -> MetaWorldEvaluation:
    """The run's evaluations: its tasks and prompts, rendered at the size of the frames it trains on
    (a collected dataset's frames are rendered at ``--data.pipeline.image-size``, which the
    evaluation's own default of 64 px would not match)."""
    evaluation = dataclasses.replace(config.evaluation, tasks=config.tasks, prompts=config.prompts)
    return evaluation_for_frames(evaluation, dataset_image_size(dataset))


def build_prompt_tokenizer(config: MetaWorldConfig, workdir: pathlib.Path) -> pathlib.Path:
    """The family's word-level tokenizer over both prompt sets' words: an evaluation may use the
    prompts the policy never trained on."""
    if is_gr00t(config):
        return build_gr00t_tokenizer(workdir / "tokenizer.json", metaworld_instructions())
    return build_tokenizer(workdir / "tokenizer.model", config.model.vocab_size, metaworld_instructions())


def metaworld_instructions() -> list[str]:
    from embodied_jax.sim import metaworld

    return [text for table in metaworld.PROMPTS.values() for text in table.values()]


def is_gr00t(config: MetaWorldConfig) -> bool:
    return isinstance(config.model, Gr00tConfig)


def run_metaworld(config: MetaWorldConfig) -> int:
    """Collect scripted demonstrations of the tasks (or reuse them), train, evaluate in Meta-World."""
    from embodied_jax import load_policy, records
    from embodied_jax.evaluation.closed_loop import evaluate_metaworld, report_lines
    from embodied_jax.sim import media, metaworld
    from embodied_jax.train.loop import train
    from experiments.progress import expected_duration

    t0 = time.perf_counter()
    launched = config
    workdir = run_directory(config)
    names = metaworld.parse_tasks(config.tasks)
    task_data = metaworld.parse_task_data(config.task_data, names)  # a bad flag fails before anything is written
    check_reuse(config, workdir)
    print(expected_duration(config.name, setting_hash=records.setting_hash(launched)), flush=True)
    dataset = pathlib.Path(config.dataset) if config.dataset else workdir / "dataset"
    if (dataset / "meta" / "info.json").exists():
        print(f"[1/4] reusing {dataset}", flush=True)
    elif config.dataset:
        raise FileNotFoundError(f"--dataset {config.dataset}: no LeRobot dataset there (meta/info.json)")
    else:
        print(
            f"[1/4] collecting {config.episodes} scripted episodes of each of {len(names)} Meta-World tasks"
            + (f" ({', '.join(config.task_data)} apart)" if config.task_data else ""),
            flush=True,
        )
        metaworld.collect(
            names,
            config.episodes,
            dataset,
            view=dataclasses.replace(
                config.evaluation, image_size=tuple(config.data.pipeline.image_size), prompts=config.prompts
            ).view(),
            noise=config.collect_noise,
            task_data=task_data,
            workers=config.collect_workers or os.cpu_count() or 1,
        )
    collection_s = time.perf_counter() - t0
    print(f"      collection: {collection_s / 60:.1f} min", flush=True)
    tokenizer = build_prompt_tokenizer(config, workdir)
    evaluation = run_evaluation(config, dataset)
    config = dataclasses.replace(
        config,
        workdir=str(workdir),
        model=dataclasses.replace(config.model, tokenizer_path=str(tokenizer)),
        data=dataclasses.replace(config.data, root=str(dataset)),
        evaluation=evaluation,
    )
    t1 = time.perf_counter()
    print(f"[2/4] training {type(config.model).__name__} for {config.train.steps} steps ...", flush=True)
    result = train(config)
    training_s = time.perf_counter() - t1
    print(f"      training: {training_s / 60:.1f} min", flush=True)
    out = workdir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    curve = plot_learning_curve(
        workdir / "metrics.jsonl", out / "learning_curve.png", media, groups_only=len(names) > 10
    )
    if config.eval_envs == 0:
        print("[3/4] final evaluation skipped (--eval-envs 0)")
        return 0
    which = "test" if config.eval_seed in (None, metaworld.TEST_SEED) else f"seed {config.eval_seed}"
    print(f"[3/4] evaluating on {len(names)} tasks x {config.eval_episodes} episodes ({which}) ...", flush=True)
    t2 = time.perf_counter()
    bundle = load_policy(workdir)
    kwargs = dict(
        seed=config.eval_seed,
        episodes=config.eval_episodes,
        envs=config.eval_envs,
        execute_steps=config.evaluation.execute_steps,
        image_size=tuple(config.evaluation.image_size),
    )
    metrics = evaluate_metaworld(bundle, config.tasks, videos=config.num_videos, out_dir=out, **kwargs)
    evaluation_s = time.perf_counter() - t2
    lines = protocol_lines(metrics)
    if config.untrained_episodes:
        kwargs["episodes"] = config.untrained_episodes
        untrained = evaluate_metaworld(untrained_policy(bundle), config.tasks, out_dir=out / "untrained", **kwargs)
        lines.append(f"untrained policy: {untrained['success_rate']:.1%} of {untrained['episodes']} episodes")
    losses = [h["loss"] for h in result.history if "loss" in h]
    final = f"; final loss {losses[-1]:.4f}" if losses else ""
    wall = {"collection": collection_s, "training": training_s, "evaluation": evaluation_s}
    print(f"[4/4] wall time {(time.perf_counter() - t0) / 60:.1f} min{final}")
    print("\n".join(lines + report_lines(metrics, out)))
    if curve is not None:
        print(f"learning curve: {curve}")
    if config.record:
        from experiments import record

        row = record.success_row(
            config.name,
            config,
            result=recorded_result(metrics, names),
            seeds={
                "training": config.train.seed,
                "collection": metaworld.COLLECTION_SEED,
                "validation": config.evaluation.seed,
                "test": metrics["seed"],
            },
            wall_s=wall,
            shared_machine=config.shared_machine,
            setting=launched,
        )
        print(record.save(row))
    return 0


def recorded_result(metrics: dict, names: tuple[str, ...]) -> dict:
    """The figures a row keeps: whole rate, groups, their average, per task; with intervals and counts."""
    from embodied_jax.sim import metaworld

    suites = {"mt50": metaworld.MT50, "mt10": metaworld.MT10}
    return {
        "suite": next((name for name, tasks in suites.items() if set(tasks) == set(names)), ",".join(names)),
        "protocol": "lerobot",
        "success_rate": metrics["success_rate"],
        "success_ci95": metrics["success_ci95"],
        "episodes": metrics["episodes"],
        "group_average": metrics["group_average"],
        "per_difficulty": {
            g: {k: e[k] for k in ("success_rate", "success_ci95", "episodes")}
            for g, e in metrics["per_difficulty"].items()
        },
        "per_task": {
            t: {k: e[k] for k in ("success_rate", "success_ci95", "episodes")} for t, e in metrics["per_task"].items()
        },
    }


def anchor_rows() -> list[dict]:
    """The anchors' MT50 rows by LeRobot's protocol (``results/anchors.jsonl``), in file order."""
    from experiments.benchmarks.report import latest_anchors

    return latest_anchors().get(ANCHOR_BENCHMARK, [])


def protocol_lines(metrics: dict) -> list[str]:
    """The report by LeRobot's protocol: the overall rate, per task, then the four difficulty groups
    and their average (the figure LeRobot and SmolVLA report) beside the anchors' rows."""
    low, high = metrics["success_ci95"]
    lines = [
        f"{metrics['task']}: {metrics['success_rate']:.1%} of {metrics['episodes']} episodes "
        f"(95% CI {low:.1%}-{high:.1%}), mean episode length {metrics['mean_episode_length']:.1f} steps"
    ]
    for task, entry in metrics["per_task"].items():
        low, high = entry["success_ci95"]
        lines.append(f"  {task:26s} {entry['success_rate']:6.1%} (95% CI {low:.1%}-{high:.1%}, {entry['episodes']})")
    groups = metrics["per_difficulty"]
    header = "| policy | " + " | ".join(GROUPS) + " | average |"
    lines += ["", header, "|---" * (len(GROUPS) + 2) + "|"]

    def cell(group: str) -> str:
        if group not in groups:
            return "-"
        low, high = groups[group]["success_ci95"]
        return f"{100 * groups[group]['success_rate']:.1f} ({100 * low:.0f}-{100 * high:.0f})"

    ours = [cell(g) for g in GROUPS]
    lines.append(
        f"| this run ({metrics['episodes']} episodes) | "
        + " | ".join(ours)
        + f" | {100 * metrics['group_average']:.1f} |"
    )
    for anchor in anchor_rows():
        figures = anchor["result"]
        cells = [f"{figures[g]:.1f}" if g in figures else "-" for g in GROUPS]
        lines.append(
            f"| {anchor['anchor']} | " + " | ".join(cells) + f" | {figures.get('average', float('nan')):.1f} |"
        )
    lines.append("average: the mean of the difficulty groups' rates (LeRobot's and SmolVLA's figure).")
    return lines


def untrained_policy(bundle):
    """``bundle`` with freshly initialised weights (same architecture, statistics and tokenizer)."""
    import copy

    from flax import nnx

    from embodied_jax.loading import serving_runtime

    rt = serving_runtime(bundle.config, None)
    with rt.context():
        model = bundle.config.model.make(nnx.Rngs(0))
    untrained = copy.copy(bundle)
    untrained.params = nnx.state(model)
    untrained.step = 0
    return untrained


def plot_learning_curve(
    metrics_file: pathlib.Path, out: pathlib.Path, media, *, groups_only: bool = False
) -> pathlib.Path | None:
    """Success rate vs step of every ``eval/.../success_rate`` in ``metrics.jsonl`` as a PNG;
    ``groups_only``: the overall rate and the difficulty groups' (MT50's 50 tasks would crowd it)."""
    if not metrics_file.exists():
        return None
    series: dict[str, list[tuple[int, float]]] = {}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key.startswith("eval/") and key.endswith("success_rate"):
                name = key[len("eval/") : -len("/success_rate")]
                if groups_only and name != "metaworld" and name.rsplit("/", 1)[-1] not in GROUPS:
                    continue
                series.setdefault(name, []).append((row["step"], value))
    if not series:
        return None
    return media.write_png(out, media.line_plot(series, title="closed-loop success rate vs training step"))


def metaworld_config(
    tasks: str = "metaworld:mt10",
    *,
    name: str = "metaworld_mt10",
    steps: int = 6000,
    arch: str = "pi05",
    eval_episodes: int = 50,
    in_training_episodes: int = 5,
) -> MetaWorldConfig:
    from embodied_jax.sim import metaworld

    if arch == "gr00t":
        cameras = GR00T_CAMERAS
        model = dataclasses.replace(
            demo_gr00t_model(action_dim=4, horizon=HORIZON, image_size=IMAGE, instructions=metaworld_instructions()),
            camera_names=tuple(slot for _, slot in cameras),
        )
    else:
        cameras = CAMERAS
        model = dataclasses.replace(
            variants.demo(action_dim=4, horizon=HORIZON, image_size=IMAGE),
            camera_names=tuple(slot for _, slot in cameras),
        )
    return MetaWorldConfig(
        name=name,
        tasks=tasks,
        model=model,
        data=LeRobotData(
            DataConfig(
                sources=(),
                spec=SampleSpec(action_horizon=HORIZON, camera_keys=tuple(k for k, _ in cameras)),
                image_size=(IMAGE, IMAGE),
                norm_modes=(("observation.state", "quantile"), ("action", "quantile")),
            ),
            ModelInputs(cameras=cameras),
        ),
        train=TrainConfig(steps=steps, batch_size=32, log_every=100, eval_every=steps // 4, ema_decay=0.99),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=100, weight_decay=1e-4, clip_norm=1.0),
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(save_every=steps // 4, keep_last=2),
        metrics=MetricsConfig(progress_bar=True),
        evaluation=MetaWorldEvaluation(
            tasks=tasks,
            episodes=in_training_episodes,
            envs=in_training_episodes,
            execute_steps=4,
            image_size=(IMAGE, IMAGE),
            seed=metaworld.VALIDATION_SEED,
        ),
        eval_episodes=eval_episodes,
        workdir=f"runs/{name}",
    )


register_runner(MetaWorldConfig, run_metaworld)


@register(
    "metaworld_mt50",
    "Meta-World MT50 by LeRobot's protocol: 50 scripted demos per task -> one π0.5 -> 10 episodes per task (CPU)",
)
def metaworld_mt50() -> MetaWorldConfig:
    return metaworld_config("metaworld:mt50", name="metaworld_mt50", eval_episodes=10, in_training_episodes=2)


@register("metaworld_mt50_gr00t", "metaworld_mt50 with GR00T-N1.5 (demo size): --tasks metaworld:mt10 for MT10")
def metaworld_mt50_gr00t() -> MetaWorldConfig:
    return metaworld_config(
        "metaworld:mt50", name="metaworld_mt50_gr00t", arch="gr00t", eval_episodes=10, in_training_episodes=2
    )


@register("metaworld_mt10", "Meta-World MT10 by LeRobot's protocol, 50 episodes per task: demos -> π0.5 -> eval (CPU)")
def metaworld_mt10() -> MetaWorldConfig:
    return metaworld_config()


@register("metaworld", "one Meta-World task (--tasks metaworld:<task>; pick-place by default): demos -> π0.5 -> eval")
def metaworld_single() -> MetaWorldConfig:
    return metaworld_config("metaworld:pick-place", name="metaworld", steps=3000)
