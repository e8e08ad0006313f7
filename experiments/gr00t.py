"""GR00T-N1.5 experiments: full size, the CPU benchmark model (two freezing variants), a tiny one.

Freezing follows the model config's ``tune_*`` switches (upstream finetune default: vision
tower, ``mlp1`` and LLM frozen; projector, DiT, adapter and future tokens trained); frozen
parameters are stored in the compute dtype and get no optimizer state.
"""

from __future__ import annotations

import dataclasses

from embodied_jax.data.sources import LeRobotData
from embodied_jax.models.gr00t import Gr00tConfig, variants
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, OptimizerConfig, TrainConfig
from experiments.common import BENCH_TRAIN, DATASET, experiment, full_size, lerobot_data
from experiments.registry import register

# upstream finetune optimiser (Isaac-GR00T / LeRobot): AdamW lr 1e-4, betas (0.95, 0.999),
# weight decay 1e-5, cosine schedule with 5% warmup
_UPSTREAM_OPT = dict(lr=1e-4, b1=0.95, b2=0.999, eps=1e-8, weight_decay=1e-5, schedule="warmup_cosine")

BENCH_MODEL, TINY_MODEL = variants.bench(), variants.tiny()  # the sizes: models/gr00t/variants.py


def _optimizer(model: Gr00tConfig, **overrides) -> OptimizerConfig:
    """Upstream's optimiser; frozen parameters (``model.tune_*``) stored in the compute dtype."""
    frozen_dtype = None if model.dtype == model.param_dtype else model.dtype
    return OptimizerConfig(**dict(_UPSTREAM_OPT, **overrides), frozen_dtype=frozen_dtype)


# Full size: layer stacks keep only each attention's q, k, v and output for the backward pass
# (``nn.stack``); under FSDP a stack without remat would keep every layer's gathered weights.
FULL_MODEL = Gr00tConfig(remat_policy="save_attention")


@register("gr00t_n15", "GR00T-N1.5-3B at full size (bf16 compute, upstream finetune freezing); use --init-from")
def gr00t_n15() -> ExperimentConfig:
    steps = 10_000
    return full_size("gr00t_n15", FULL_MODEL, optimizer=_optimizer(FULL_MODEL, warmup_steps=steps // 20), steps=steps)


@register(
    "gr00t_bench", "small GR00T for CPU benchmarks (LeRobot's anchor sizes), backbone frozen as upstream's finetune"
)
def gr00t_bench() -> ExperimentConfig:
    return experiment("gr00t_bench", BENCH_MODEL, train=BENCH_TRAIN, optimizer=_optimizer(BENCH_MODEL, warmup_steps=5))


@register("gr00t_bench_trainable", "gr00t_bench with every parameter trained")
def gr00t_bench_trainable() -> ExperimentConfig:
    model = dataclasses.replace(BENCH_MODEL, tune_visual=True, tune_llm=True)
    return experiment("gr00t_bench_trainable", model, train=BENCH_TRAIN, optimizer=_optimizer(model, warmup_steps=5))


@register("gr00t_tiny", "tiny GR00T on synthetic data (seconds on a CPU; smoke tests)")
def gr00t_tiny() -> ExperimentConfig:
    return experiment(
        "gr00t_tiny",
        TINY_MODEL,
        train=TrainConfig(steps=20, batch_size=8, log_every=5),
        optimizer=_optimizer(TINY_MODEL, lr=1e-3, warmup_steps=2),
    )


def finetune_data(root: str | None, *, image_size: int) -> LeRobotData:
    """A LeRobot dataset with ``meta/modality.json`` → the GR00T input builder, state and actions
    min-max normalised to [-1, 1] as upstream; cameras (modality.json's videos), widths and the
    action horizon come from the dataset and the model at the start of a run."""
    return lerobot_data(root, image_size=image_size, norm="min_max", use_modality=True)


@register(
    "gr00t_finetune",
    "GR00T-N1.5 on a LeRobot dataset with meta/modality.json: --data.root DIR --init-from WEIGHTS",
)
def gr00t_finetune() -> ExperimentConfig:
    """Finetune GR00T-N1.5 on a new embodiment (slot ``--model.embodiment-id``, default 31 =
    upstream's ``new_embodiment``), with upstream's default freezing (vision tower, ``mlp1`` and
    LLM frozen; projector, DiT, VL adapter and future tokens trained; ``--model.tune-visual`` etc.).

        python -m experiments.launch gr00t_finetune --data.root DATASET_DIR --init-from WEIGHTS \\
            [--workdir RUN_DIR] [--dry-run]

    ``WEIGHTS`` is ``python -m embodied_jax.models.convert --arch gr00t_n15`` output (or a run, a
    step or an exported policy); it also supplies the tokenizer unless ``--model.tokenizer-path``
    names one. The image slots are the videos of the dataset's ``meta/modality.json`` under their
    names (the mapping is logged; ``--data.inputs.cameras DATASET_KEY SLOT ...`` overrides it), the
    prompt grown by their image blocks; state and actions must fit ``max_state_dim``/``action_dim``;
    the action horizon is ``--model.action-horizon``. ``--dry-run`` checks all of it.
    """
    steps = 10_000
    model = FULL_MODEL
    data = finetune_data(DATASET, image_size=model.vision.image_size)
    return full_size(
        "gr00t_finetune", model, optimizer=_optimizer(model, warmup_steps=steps // 20), steps=steps, data=data
    )


@register(
    "gr00t_finetune_tiny",
    "gr00t_finetune with the demo's small GR00T (20 steps on a laptop): --data.root DIR --init-from WEIGHTS",
)
def gr00t_finetune_tiny() -> ExperimentConfig:
    """``gr00t_finetune`` at the demo's size (``variants.demo`` with the demo's vocabulary: 32² images,
    4-dim actions, horizon 8; backbone frozen as upstream's finetune), so a ``demo_gr00t`` run's
    checkpoint is its ``WEIGHTS`` (tokenizer included)::

        python -m embodied_jax.sim.collect reach --episodes 20 --out DATASET_DIR
        python -m experiments.launch gr00t_finetune_tiny --data.root DATASET_DIR --init-from runs/demo_gr00t/reach
    """
    from experiments.demo import demo_gr00t_model  # the demo pulls in the simulator: only when asked for

    model = dataclasses.replace(demo_gr00t_model(), tune_visual=False, tune_llm=False)
    return experiment(
        "gr00t_finetune_tiny",
        model,
        data=finetune_data(DATASET, image_size=model.vision.image_size),
        train=TrainConfig(steps=20, batch_size=8, log_every=5),
        optimizer=_optimizer(model, warmup_steps=2),
        checkpoint=CheckpointConfig(save_every=20, keep_last=1),
    )
