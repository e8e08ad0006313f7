"""Meta-World experiments: Meta-World's scripted demonstrations -> one language-conditioned π0.5 -> its suite.

``python -m experiments.launch metaworld_mt10`` (MT10, one policy for the ten tasks) and
``python -m experiments.launch metaworld --tasks metaworld:<task>`` (one task; pick-place by default):

1. collect ``episodes`` scripted demonstrations per task in Meta-World's own environments
   (``embodied_jax.sim.metaworld``: ``corner2`` images, 4-D state and actions, DART noise
   calibrated per task), unless the run directory already holds them;
2. build the word-level tokenizer over the 50 tasks' instructions;
3. train the demo-sized π0.5 (one camera) with in-training Meta-World evaluations;
4. evaluate the final policy and, beside it, the same architecture untrained, on seeds the
   collection never used; write per-task and per-difficulty results, videos, the frame grid and
   the learning curve (``learning_curve.png``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

from embodied_jax.data.pipeline import DataConfig
from embodied_jax.data.sample_transform import ModelInputs
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.sources import LeRobotData
from embodied_jax.models.pi05 import variants
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.policy_evaluation import MetaWorldEvaluation
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, MetricsConfig, OptimizerConfig, TrainConfig
from experiments.demo import build_tokenizer
from experiments.registry import register, register_runner

IMAGE = 64
HORIZON = 8
CAMERAS = (("observation.image", "base_0_rgb"),)
RECORD = "metaworld.json"  # what a run directory was made for


@dataclasses.dataclass(frozen=True)
class MetaWorldConfig(ExperimentConfig):
    tasks: str = "metaworld:mt10"
    episodes: int = 50  # scripted demonstrations per task
    collect_noise: float | None = None  # DART std in action units; None: calibrated per task
    eval_episodes: int = 50  # per task, final evaluation
    eval_envs: int = 10  # environments stepped together per policy call
    num_videos: int = 1  # per task
    untrained_episodes: int = 10  # per task: the untrained policy's score beside the result (0: skip)


def run_directory(config: MetaWorldConfig) -> pathlib.Path:
    return pathlib.Path(config.workdir)


def check_reuse(config: MetaWorldConfig, workdir: pathlib.Path) -> None:
    """Refuse a run directory made for other tasks: its dataset or checkpoint would report on them."""
    from embodied_jax.sim import metaworld
    from embodied_jax.train.runtime import ConfigError

    wanted = {"tasks": list(metaworld.parse_tasks(config.tasks)), "image": list(config.data.data.image_size)}
    record = workdir / RECORD
    if record.exists():
        saved = json.loads(record.read_text())
        if saved != wanted:
            raise ConfigError(f"{workdir} holds a Meta-World run of {saved}, not {wanted}: choose another --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(wanted))


def run_metaworld(config: MetaWorldConfig) -> int:
    """Collect scripted demonstrations of the tasks (or reuse them), train, evaluate in Meta-World."""
    from embodied_jax import load_policy
    from embodied_jax.evaluate import detail_lines, evaluate_metaworld, report_lines, summary_line
    from embodied_jax.sim import media, metaworld
    from embodied_jax.train.loop import train

    t0 = time.perf_counter()
    workdir = run_directory(config)
    check_reuse(config, workdir)
    dataset = workdir / "dataset"
    names = metaworld.parse_tasks(config.tasks)
    if (dataset / "meta" / "info.json").exists():
        print(f"[1/4] reusing {dataset}", flush=True)
    else:
        print(
            f"[1/4] collecting {config.episodes} scripted episodes of each of {len(names)} Meta-World tasks",
            flush=True,
        )
        metaworld.collect(
            names, config.episodes, dataset, image_size=tuple(config.data.data.image_size), noise=config.collect_noise
        )
    minutes = (time.perf_counter() - t0) / 60
    print(f"      collection: {minutes:.1f} min", flush=True)
    instructions = [metaworld.INSTRUCTIONS[t] for t in metaworld.MT50]
    tokenizer = build_tokenizer(workdir / "tokenizer.model", config.model.vocab_size, instructions)
    config = dataclasses.replace(
        config,
        workdir=str(workdir),
        model=dataclasses.replace(config.model, tokenizer_path=str(tokenizer)),
        data=dataclasses.replace(config.data, root=str(dataset)),
        evaluation=dataclasses.replace(config.evaluation, tasks=config.tasks),
    )
    t1 = time.perf_counter()
    print(f"[2/4] training {type(config.model).__name__} for {config.train.steps} steps ...", flush=True)
    result = train(config)
    print(f"      training: {(time.perf_counter() - t1) / 60:.1f} min", flush=True)
    out = workdir / "eval"
    out.mkdir(parents=True, exist_ok=True)
    curve = plot_learning_curve(workdir / "metrics.jsonl", out / "learning_curve.png", media)
    if config.eval_envs == 0:
        print("[3/4] final evaluation skipped (--eval-envs 0)")
        return 0
    print(f"[3/4] evaluating on {len(names)} tasks x {config.eval_episodes} episodes ...", flush=True)
    bundle = load_policy(workdir)
    kwargs = dict(episodes=config.eval_episodes, envs=config.eval_envs, execute_steps=config.evaluation.execute_steps)
    metrics = evaluate_metaworld(bundle, config.tasks, videos=config.num_videos, out_dir=out, **kwargs)
    lines = [summary_line(metrics), *detail_lines(metrics)]
    if config.untrained_episodes:
        kwargs["episodes"] = config.untrained_episodes
        untrained = evaluate_metaworld(untrained_policy(bundle), config.tasks, out_dir=out / "untrained", **kwargs)
        lines.append(f"untrained policy: {summary_line(untrained)}")
    losses = [h["loss"] for h in result.history if "loss" in h]
    final = f"; final loss {losses[-1]:.4f}" if losses else ""
    print(f"[4/4] wall time {(time.perf_counter() - t0) / 60:.1f} min{final}")
    print("\n".join(lines + report_lines(metrics, out)))
    if curve is not None:
        print(f"learning curve: {curve}")
    return 0


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


def plot_learning_curve(metrics_file: pathlib.Path, out: pathlib.Path, media) -> pathlib.Path | None:
    """Success rate vs step of every ``eval/.../success_rate`` in ``metrics.jsonl`` as a PNG."""
    if not metrics_file.exists():
        return None
    series: dict[str, list[tuple[int, float]]] = {}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key.startswith("eval/") and key.endswith("success_rate"):
                series.setdefault(key[len("eval/") : -len("/success_rate")], []).append((row["step"], value))
    if not series:
        return None
    return media.write_png(out, media.line_plot(series, title="closed-loop success rate vs training step"))


def metaworld_config(
    tasks: str = "metaworld:mt10", *, name: str = "metaworld_mt10", steps: int = 6000
) -> MetaWorldConfig:
    model = dataclasses.replace(
        variants.demo(action_dim=4, horizon=HORIZON, image_size=IMAGE), camera_names=tuple(slot for _, slot in CAMERAS)
    )
    return MetaWorldConfig(
        name=name,
        tasks=tasks,
        model=model,
        data=LeRobotData(
            DataConfig(
                sources=(),
                spec=SampleSpec(action_horizon=HORIZON, camera_keys=tuple(k for k, _ in CAMERAS)),
                image_size=(IMAGE, IMAGE),
                norm_modes=(("observation.state", "quantile"), ("action", "quantile")),
            ),
            ModelInputs(cameras=CAMERAS),
        ),
        train=TrainConfig(steps=steps, batch_size=32, log_every=100, eval_every=steps // 4, ema_decay=0.99),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=100, weight_decay=1e-4, clip_norm=1.0),
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(save_every=steps // 4, keep_last=2),
        metrics=MetricsConfig(progress_bar=True),
        evaluation=MetaWorldEvaluation(tasks=tasks, episodes=5, envs=5, execute_steps=4, image_size=(IMAGE, IMAGE)),
        workdir=f"runs/{name}",
    )


register_runner(MetaWorldConfig, run_metaworld)


@register("metaworld_mt10", "Meta-World MT10: scripted demos -> one language-conditioned π0.5 -> the ten tasks (CPU)")
def metaworld_mt10() -> MetaWorldConfig:
    return metaworld_config()


@register("metaworld", "one Meta-World task (--tasks metaworld:<task>; pick-place by default): demos -> π0.5 -> eval")
def metaworld_single() -> MetaWorldConfig:
    return metaworld_config("metaworld:pick-place", name="metaworld", steps=3000)
