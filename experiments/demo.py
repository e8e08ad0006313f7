"""The default experiment (``python -m experiments.launch`` with no name): end to end on a CPU.

1. collect demonstrations of a built-in MJX task with its scripted expert, written as a
   LeRobot dataset (``embodied_jax.sim.collect``);
2. build a small SentencePiece tokenizer for the prompts (the real π0.5 uses PaliGemma's);
3. train a small π0.5-architecture policy on the dataset through the Grain pipeline
   (the ``demo_gr00t`` experiment trains the GR00T-N1.5 architecture instead);
4. load the checkpoint as a policy bundle (``embodied_jax.load_policy``) and evaluate it
   closed-loop in batched MJX; print the success rate and where videos and plots are.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from collections.abc import Sequence

from embodied_jax.data.pipeline import DataConfig
from embodied_jax.data.sample_transform import ModelInputs
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.sources import LeRobotData
from embodied_jax.evaluation.in_training import SimEvaluation
from embodied_jax.models.gr00t import Gr00tConfig
from embodied_jax.models.gr00t import variants as gr00t_variants
from embodied_jax.models.gr00t.inputs import SPECIAL_TOKENS, eagle_prompt
from embodied_jax.models.pi05 import variants as pi05_variants
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, MetricsConfig, OptimizerConfig, TrainConfig
from experiments.registry import register, register_runner

IMAGE = 32
CAMERAS = (("observation.images.scene", "base_0_rgb"), ("observation.images.wrist", "left_wrist_0_rgb"))
GR00T_CAMERAS = (("observation.images.scene", "ego_view"), ("observation.images.wrist", "wrist_view"))
GR00T_PAD = "<|endoftext|>"
RECORD = "demo.json"  # what a demo run directory was made for (task, model)


def gr00t_words(instructions: Sequence[str] | None = None, num_images: int = len(GR00T_CAMERAS)) -> list[str]:
    """The plain words of the GR00T demo's vocabulary: ``[UNK]``, then every word (as the
    ``tokenizers`` Whitespace pre-tokenizer splits them) of the Eagle chat prompt around the
    instructions (default: the built-in tasks')."""
    from tokenizers import pre_tokenizers

    from embodied_jax.sim.tasks import TASKS

    if instructions is None:
        instructions = [cls.instruction for cls in TASKS.values()]
    split = pre_tokenizers.Whitespace()
    words = set()
    for instruction in instructions:
        text = eagle_prompt(instruction, num_images=num_images, image_tokens=1)
        for special in SPECIAL_TOKENS:
            text = text.replace(special, " ")
        words.update(word for word, _ in split.pre_tokenize_str(text))
    return ["[UNK]", *sorted(words)]


def gr00t_vocabulary(instructions: Sequence[str] | None = None) -> list[str]:
    """The GR00T demo's vocabulary in id order: the plain words, the chat/image special tokens, the pad token."""
    return [*gr00t_words(instructions), *SPECIAL_TOKENS, GR00T_PAD]


def demo_gr00t_model(
    action_dim: int = 4, horizon: int = 8, image_size: int = IMAGE, instructions: Sequence[str] | None = None
) -> Gr00tConfig:
    """The ``demo_gr00t`` size (``models/gr00t/variants.py:demo``) with the vocabulary of
    ``instructions`` (default: the built-in tasks')."""
    vocab = gr00t_vocabulary(instructions)
    return gr00t_variants.demo(
        action_dim, horizon, image_size, vocab_size=len(vocab), image_token_id=vocab.index("<IMG_CONTEXT>")
    )


def build_gr00t_tokenizer(path: pathlib.Path, instructions: Sequence[str] | None = None) -> pathlib.Path:
    """A word-level ``tokenizer.json`` over :func:`gr00t_vocabulary` (GR00T reads Qwen3's format)."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    words = gr00t_words(instructions)
    tokenizer = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([*SPECIAL_TOKENS, GR00T_PAD])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def build_tokenizer(path: pathlib.Path, vocab_size: int, instructions: Sequence[str] | None = None) -> pathlib.Path:
    """A word-level SentencePiece model of the task prompts (default: the built-in tasks'
    instructions): one token per word and per state bin.

    Like PaliGemma's tokenizer (which the real π0.5 uses), every state bin 0..255 is a single
    token, so the whole discretised state fits in the prompt; a character-level model trained
    on so small a corpus would spell numbers digit by digit and overflow ``max_token_len``.
    """
    from embodied_jax.models.tokenizer import train_sentencepiece
    from embodied_jax.sim.tasks import TASKS

    if instructions is None:
        instructions = [cls.instruction for cls in TASKS.values()]
    # Each bin as a plain word and as the last (";"-terminated) word of the state.
    corpus = [f"Task: {text}, State: {' '.join([str(b)] * 8)};\nAction: " for text in instructions for b in range(256)]
    return train_sentencepiece(corpus, path, vocab_size=vocab_size, model_type="word")


@dataclasses.dataclass(frozen=True)
class DemoConfig(ExperimentConfig):
    task: str = "reach"
    episodes: int = 3000
    eval_envs: int = 128  # 0: train only (no closed-loop evaluation)
    num_videos: int = 4
    # Std (metres) of noise on the expert's executed moves; labels stay the expert's. The
    # demonstrations then also show how to recover from off-path states (DART). None: the
    # task's calibrated level (``Task.dart_noise``: 1.5 cm for reach, 0.5 cm for pick_place,
    # 0.25 cm for handover, each with the expert still >= 90% successful).
    collect_noise: float | None = None
    # Hand positions as moves relative to the observed state (the task's position dims; grips
    # stay absolute): each step moves at most 3.5 cm, so normalised deltas resolve millimetres where
    # absolute targets spread over the whole workspace (the measurement: docs/manipulation.md).
    delta_actions: bool = True
    # Tasks that train longer than ``train.steps`` (that factor times it): handover moves two arms
    # and still improves at 6000 steps (docs/manipulation.md).
    task_steps_factor: tuple[tuple[str, float], ...] = (("handover", 1.5),)
    # Tasks whose GR00T policy trains on that many times the model's flow-matching draws per
    # observation (``flow_samples_per_obs``): on pick_place 8 draws instead of 4 scored 91.4 / 80.5%
    # on the validation seed against 78.1 / 71.9% (training seeds 0 / 1; docs/manipulation.md).
    gr00t_task_flow_samples_factor: tuple[tuple[str, int], ...] = (("pick_place", 2),)
    # The demo's own word-level tokenizer, built before training: "sentencepiece" (the π0.5
    # demo; PaliGemma's format) or "qwen3_words" (the GR00T demo; a Qwen3 tokenizer.json).
    tokenizer: str = "sentencepiece"
    record: bool = False  # append the result to experiments/benchmarks/results/<name>.jsonl
    shared_machine: bool = False  # for --record: other work shared the machine during the run


def build_demo_tokenizer(config: DemoConfig, workdir: pathlib.Path) -> pathlib.Path:
    builders = {
        "sentencepiece": lambda: build_tokenizer(workdir / "tokenizer.model", config.model.vocab_size),
        "qwen3_words": lambda: build_gr00t_tokenizer(workdir / "tokenizer.json"),
    }
    if config.tokenizer not in builders:
        raise ValueError(f"tokenizer={config.tokenizer!r}: one of {sorted(builders)}")
    return builders[config.tokenizer]()


def run_directory(config: DemoConfig) -> pathlib.Path:
    """``--workdir``, or by default one directory per task: ``runs/demo/<task>``."""
    if config.workdir == default_workdir(config):
        return pathlib.Path(config.workdir) / config.task
    return pathlib.Path(config.workdir)


def default_workdir(config: DemoConfig) -> str:
    return f"runs/{config.name}"


def check_reuse(config: DemoConfig, workdir: pathlib.Path) -> None:
    """Refuse a run directory made for another task or model: resuming its checkpoint or
    training on its dataset would report a policy that never saw this task."""
    from embodied_jax.sim.tasks import TASKS
    from embodied_jax.train.runtime import ConfigError

    dataset = workdir / "dataset"
    if dataset.is_dir() and any(dataset.iterdir()) and not (dataset / "meta" / "info.json").exists():
        raise ConfigError(
            f"{dataset} exists but holds no LeRobot dataset (no meta/info.json): remove it or choose another --workdir"
        )
    wanted = {"task": config.task, "model": type(config.model).__name__}
    if config.evaluation.phase_in_state:  # recorded only when on: older run directories stay reusable
        wanted["phase_in_state"] = True
    record = workdir / RECORD
    if record.exists():
        saved = json.loads(record.read_text())
        changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in wanted.items() if saved.get(k) != v]
        if changed:
            raise ConfigError(
                f"{workdir} holds a demo run of another kind ({', '.join(changed)}): choose another "
                f"--workdir (by default each task has its own: runs/{config.name}/<task>)"
            )
    if (dataset / "meta" / "info.json").exists():
        from embodied_jax.data.lerobot import LeRobotDataset

        tasks = LeRobotDataset(dataset).tasks
        instruction = TASKS[config.task].instruction
        if list(tasks) != [instruction]:
            raise ConfigError(
                f"{dataset} holds demonstrations of {list(tasks)}, not of '{config.task}' ({instruction!r}): "
                f"choose another --workdir (by default each task has its own: runs/{config.name}/<task>)"
            )
    workdir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(wanted))


def run_demo(config: DemoConfig) -> int:
    """The demo's pipeline: collect expert demonstrations (or reuse them), train, evaluate closed-loop."""
    from embodied_jax import load_policy, records
    from embodied_jax.sim.collect import collect
    from embodied_jax.train.loop import train
    from experiments.progress import expected_duration, heartbeat

    t0 = time.perf_counter()
    workdir = run_directory(config)
    dataset = workdir / "dataset"
    check_reuse(config, workdir)
    fitted = fit_to_task(config)
    print(expected_duration(config.name, setting_hash=records.setting_hash(fitted)), flush=True)
    wall = {}
    if (dataset / "meta" / "info.json").exists():
        from embodied_jax.data.lerobot import LeRobotDataset

        episodes = LeRobotDataset(dataset).num_episodes
        print(f"[1/4] reusing {dataset} ({config.task}, {episodes} episodes)", flush=True)
    else:
        print(f"[1/4] collecting {config.episodes} expert episodes of '{config.task}' ...", flush=True)
        noise = config.collect_noise  # None: the task's calibrated DART noise (Task.dart_noise)
        with heartbeat("collecting"):
            collect(
                config.task,
                config.episodes,
                dataset,
                image_size=tuple(config.data.pipeline.image_size),
                noise=noise,
                phase_in_state=config.evaluation.phase_in_state,  # the state the policy will be evaluated with
            )
    wall["collection"] = time.perf_counter() - t0
    tokenizer = build_demo_tokenizer(config, workdir)
    spec = fitted.data.pipeline.spec
    if config.delta_actions:
        from embodied_jax.sim.tasks import TASKS

        spec = dataclasses.replace(spec, delta_action_mask=tuple(bool(m) for m in TASKS[config.task].position_mask()))
    run = dataclasses.replace(
        fitted,
        workdir=str(workdir),
        model=dataclasses.replace(fitted.model, tokenizer_path=str(tokenizer)),
        data=dataclasses.replace(
            fitted.data, root=str(dataset), pipeline=dataclasses.replace(fitted.data.pipeline, sources=(), spec=spec)
        ),
        evaluation=dataclasses.replace(config.evaluation, task=config.task),  # evaluate the task trained on
    )
    packing = run.data.packing
    layout = (
        f", packed rows of {packing.seq_len} tokens ({run.train.batch_size} rows per step)" if packing.enabled else ""
    )
    print(f"[2/4] training {type(run.model).__name__} for {run.train.steps} steps{layout} ...", flush=True)
    t1 = time.perf_counter()
    with heartbeat("training"):  # compiles and in-training evaluations print nothing for a while
        result = train(run)
    wall["training"] = time.perf_counter() - t1
    if config.eval_envs == 0:
        print("[3/4] closed-loop evaluation skipped (--eval-envs 0)")
        print(f"checkpoints: {result.checkpoint_dir}")
        return 0
    print(f"[3/4] evaluating in batched MJX ({config.eval_envs} environments) ...", flush=True)
    from embodied_jax.evaluation.closed_loop import evaluate_policy, report_lines, summary_line

    # Image size, execute_steps and seed: the run's saved evaluation (the task trained on).
    out = workdir / "eval"
    t2 = time.perf_counter()
    with heartbeat("evaluating"):
        metrics = evaluate_policy(
            load_policy(workdir), config.task, envs=config.eval_envs, videos=config.num_videos, out_dir=out
        )
    wall["evaluation"] = time.perf_counter() - t2
    minutes = (time.perf_counter() - t0) / 60
    losses = [h["loss"] for h in result.history if "loss" in h]
    final = f"; final loss {losses[-1]:.4f}" if losses else ""
    print(f"[4/4] {summary_line(metrics)}{final}; wall time {minutes:.1f} min")
    print("\n".join(report_lines(metrics, out)))
    print(f"tensorboard: {workdir / 'tensorboard'}")
    if config.record:
        from embodied_jax.sim.seeds import COLLECTION_SEED
        from experiments import record

        seeds = {
            "training": run.train.seed,
            "collection": COLLECTION_SEED,
            "validation": run.evaluation.seed,
            "test": metrics["seed"],
        }
        row = record.success_row(
            config.name,
            run,
            result=record.closed_loop_result(metrics),
            seeds=seeds,
            wall_s=wall,
            shared_machine=config.shared_machine,
            setting=fitted,
        )
        print(record.save(row))
    return 0


CAMERA_SLOTS = {  # a built-in task's camera -> its π0.5 and GR00T image slots
    "scene": ("base_0_rgb", "ego_view"),
    "wrist": ("left_wrist_0_rgb", "wrist_view"),
    "wrist_left": ("left_wrist_0_rgb", "left_wrist_view"),
    "wrist_right": ("right_wrist_0_rgb", "right_wrist_view"),
}


def fit_to_task(config: DemoConfig) -> DemoConfig:
    """The demo config widened to its task: state and action widths (handover's two arms: 8 + 8;
    the phase adds one state entry), one image slot per camera (handover: scene and two
    wrists), its training length (``task_steps_factor``) and, for GR00T, its flow-matching draws per
    observation (``gr00t_task_flow_samples_factor``). The one-arm tasks keep the demo's widths, its
    two cameras and ``train.steps``."""
    from embodied_jax.sim.tasks import TASKS

    task = TASKS[config.task]()  # unbuilt: its widths and cameras only
    model, data = config.model, config.data
    gr00t = isinstance(model, Gr00tConfig)
    state_dim = task.state_dim + int(config.evaluation.phase_in_state)
    widths = dict(max_state_dim=max(model.max_state_dim, state_dim), action_dim=task.action_dim)
    if not gr00t:
        widths["max_action_dim"] = max(model.max_action_dim, task.action_dim)
        # Each state entry is one token of π0.5's prompt (build_tokenizer: one per bin).
        widths["max_token_len"] = model.max_token_len + widths["max_state_dim"] - model.max_state_dim
    keys = tuple(f"observation.images.{c}" for c in task.cameras)
    if tuple(k for k, _ in data.inputs.cameras) != keys:
        cameras = tuple((k, CAMERA_SLOTS[c][gr00t]) for k, c in zip(keys, task.cameras, strict=True))
        widths["camera_names"] = tuple(slot for _, slot in cameras)
        data = dataclasses.replace(
            data,
            inputs=dataclasses.replace(data.inputs, cameras=cameras),
            pipeline=dataclasses.replace(data.pipeline, spec=dataclasses.replace(data.pipeline.spec, camera_keys=keys)),
        )
    if gr00t and "camera_names" in widths:  # the prompt's image blocks grow with the cameras
        blocks = dataclasses.replace(model, camera_names=widths["camera_names"], max_token_len=10**6)
        widths["max_token_len"] = blocks.image_block_tokens + 48
    if gr00t:
        draws = dict(config.gr00t_task_flow_samples_factor).get(config.task, 1)
        widths["flow_samples_per_obs"] = model.flow_samples_per_obs * draws
    model = dataclasses.replace(model, **widths)
    factor = dict(config.task_steps_factor).get(config.task, 1.0)
    train = dataclasses.replace(config.train, steps=max(1, round(config.train.steps * factor)))
    return dataclasses.replace(config, model=model, data=data, train=train)


register_runner(DemoConfig, run_demo)


@register("demo", "default: collect MJX expert demos -> train a small π0.5 -> evaluate closed-loop (CPU)")
def demo() -> DemoConfig:
    return demo_config()


@register("demo_gr00t", "the demo with a small GR00T-N1.5-architecture policy (Eagle backbone + DiT action head)")
def demo_gr00t() -> DemoConfig:
    return demo_config(arch="gr00t")


def demo_config(image_size: int = IMAGE, arch: str = "pi05") -> DemoConfig:
    """The demo at another (square) image size, with the π0.5 or the GR00T architecture;
    dataset, model and evaluation agree on the image size."""
    if arch not in ("pi05", "gr00t"):
        raise ValueError(f"arch must be 'pi05' or 'gr00t', got {arch!r}")
    gr00t = arch == "gr00t"
    cameras = GR00T_CAMERAS if gr00t else CAMERAS
    # Quantile normalisation for both (upstream GR00T uses min-max; the demo's chunk-relative moves have
    # rare extremes twice as far out as their 1st-99th percentiles; GR00T pick_place measured best so).
    norm = "quantile"
    return DemoConfig(
        name="demo_gr00t" if gr00t else "demo",
        model=demo_gr00t_model(image_size=image_size) if gr00t else pi05_variants.demo(image_size=image_size),
        data=LeRobotData(
            DataConfig(
                sources=(),
                spec=SampleSpec(action_horizon=8, camera_keys=tuple(k for k, _ in cameras)),
                image_size=(image_size, image_size),
                norm_modes=(("observation.state", norm), ("action", norm)),
            ),
            ModelInputs(cameras=cameras),
        ),
        train=TrainConfig(steps=6000, batch_size=32, log_every=100, eval_every=1500, ema_decay=0.99),
        optimizer=OptimizerConfig(lr=1e-3, warmup_steps=100, weight_decay=1e-4, clip_norm=1.0),
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(save_every=1500, keep_last=2),
        metrics=MetricsConfig(progress_bar=True),
        # Replanning after every executed action: the policy corrects its aim as the object comes into the
        # wrist view (the chunk-length measurement: docs/manipulation.md). The state ends with the
        # episode's phase: the scripted experts switch phases (grasp, lift, release) at fixed steps.
        evaluation=SimEvaluation(
            task="reach", num_envs=32, execute_steps=1, image_size=(image_size, image_size), phase_in_state=True
        ),
        workdir="runs/demo_gr00t" if gr00t else "runs/demo",
        tokenizer="qwen3_words" if gr00t else "sentencepiece",
    )
