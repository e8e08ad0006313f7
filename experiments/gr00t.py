"""GR00T-N1.5 experiments: full size, the CPU benchmark model (two freezing variants), a tiny one.

Freezing follows the model config's ``tune_*`` switches (upstream finetune default: vision
tower, ``mlp1`` and LLM frozen; projector, DiT, adapter and future tokens trained); frozen
parameters are stored in the compute dtype and get no optimizer state.
"""
from __future__ import annotations

import dataclasses

from embodied_jax.data.pipeline import DataConfig, SourceConfig
from embodied_jax.data.samples import SampleSpec
from embodied_jax.models.gr00t import Gr00tConfig
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train.config import CheckpointConfig, ExperimentConfig, OptimizerConfig, TrainConfig
from experiments.data_sources import LeRobotData, ModelInputs
from experiments.registry import register

# upstream finetune optimiser (Isaac-GR00T / LeRobot): AdamW lr 1e-4, betas (0.95, 0.999),
# weight decay 1e-5, cosine schedule with 5% warmup
_UPSTREAM_OPT = dict(lr=1e-4, b1=0.95, b2=0.999, eps=1e-8, weight_decay=1e-5, schedule="warmup_cosine")

BENCH_MODEL = Gr00tConfig(
    image_size=224, patch_size=14, vision_width=256, vision_layers=4, vision_heads=4, vision_mlp_dim=1024,
    cameras=("ego_view",),
    llm_width=512, llm_layers=4, select_layer=4, llm_heads=8, llm_kv_heads=4, llm_head_dim=64, llm_mlp_dim=1536,
    vocab_size=2048, image_token_id=2047, max_token_len=258 + 38,
    action_dim=32, action_horizon=16, max_state_dim=64, hidden_size=256, input_embedding_dim=256,
    max_num_embodiments=32, num_future_tokens=32,
    dit_layers=4, dit_heads=8, dit_head_dim=32, dit_output_dim=256, vl_layers=1, vl_heads=8, vl_head_dim=64,
    param_dtype="float32", compute_dtype="float32", synthetic_text_tokens=(24, 38),
)

TINY_MODEL = Gr00tConfig(
    image_size=28, patch_size=14, vision_width=32, vision_layers=2, vision_heads=2, vision_mlp_dim=64,
    llm_width=64, llm_layers=3, select_layer=2, llm_heads=4, llm_kv_heads=2, llm_head_dim=16, llm_mlp_dim=96,
    vocab_size=128, image_token_id=127, max_token_len=24, action_dim=6, action_horizon=4, max_state_dim=8,
    hidden_size=32, input_embedding_dim=32, max_num_embodiments=4, num_future_tokens=4, max_seq_len=16,
    dit_layers=2, dit_heads=2, dit_head_dim=16, dit_output_dim=32, vl_layers=1, vl_heads=4, vl_head_dim=16,
    compute_dtype="float32", synthetic_text_tokens=(6, 12),
)


def _experiment(name: str, model: Gr00tConfig, *, train: TrainConfig, optimizer: dict, mesh: MeshConfig,
                checkpoint: CheckpointConfig = CheckpointConfig()) -> ExperimentConfig:
    frozen_dtype = None if model.compute_dtype == model.param_dtype else model.compute_dtype
    return ExperimentConfig(
        name=name,
        model=model,
        train=train,
        optimizer=OptimizerConfig(**optimizer, frozen_dtype=frozen_dtype),  # freezing: model.tune_*
        mesh=mesh,
        checkpoint=checkpoint,
        workdir=f"runs/{name}",
    )


# Full size: layer stacks keep only each attention's q, k, v and output for the backward pass
# (``nn.stack``); under FSDP a stack without remat would keep every layer's gathered weights.
FULL_MODEL = Gr00tConfig(remat_policy="save_attention")


@register("gr00t_n15", "GR00T-N1.5-3B at full size (bf16 compute, upstream finetune freezing); use --init-from")
def gr00t_n15() -> ExperimentConfig:
    steps = 10_000
    return _experiment(
        "gr00t_n15", FULL_MODEL,
        train=TrainConfig(steps=steps, batch_size=32, log_every=10),
        optimizer=dict(_UPSTREAM_OPT, warmup_steps=steps // 20),
        mesh=MeshConfig(data=1, fsdp=-1),
        checkpoint=CheckpointConfig(save_every=1000, keep_last=3),
    )


@register("gr00t_bench", "small GR00T for CPU benchmarks (issue spec), backbone frozen as upstream's finetune")
def gr00t_bench() -> ExperimentConfig:
    return _experiment(
        "gr00t_bench", BENCH_MODEL,
        train=TrainConfig(steps=50, batch_size=4, log_every=5),
        optimizer=dict(_UPSTREAM_OPT, warmup_steps=5),
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(enabled=False),
    )


@register("gr00t_bench_trainable", "gr00t_bench with every parameter trained")
def gr00t_bench_trainable() -> ExperimentConfig:
    model = dataclasses.replace(BENCH_MODEL, tune_visual=True, tune_llm=True)
    base = gr00t_bench()
    return dataclasses.replace(
        base, name="gr00t_bench_trainable", model=model, workdir="runs/gr00t_bench_trainable",
        optimizer=base.optimizer,
    )


@register("gr00t_tiny", "tiny GR00T on synthetic data (seconds on a CPU; smoke tests)")
def gr00t_tiny() -> ExperimentConfig:
    return _experiment(
        "gr00t_tiny", TINY_MODEL,
        train=TrainConfig(steps=20, batch_size=8, log_every=5),
        optimizer=dict(_UPSTREAM_OPT, lr=1e-3, warmup_steps=2),
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(enabled=False),
    )


# modality.json's default video name "ego_view" -> observation.images.ego_view; others: --data.inputs.cameras
FINETUNE_CAMERAS = (("observation.images.ego_view", "ego_view"),)


def finetune_data(root: str, *, action_horizon: int, image_size: int,
                  cameras: tuple[tuple[str, str], ...] = FINETUNE_CAMERAS) -> LeRobotData:
    """A LeRobot dataset with ``meta/modality.json`` → the GR00T input builder, state and actions
    min-max normalised to [-1, 1] as upstream."""
    return LeRobotData(
        DataConfig(sources=(SourceConfig(root),),
                   spec=SampleSpec(action_horizon=action_horizon, use_modality=True),
                   image_size=(image_size, image_size),
                   norm_modes=(("observation.state", "min_max"), ("action", "min_max"))),
        ModelInputs(cameras=cameras),
    )


@register("gr00t_finetune", "GR00T-N1.5 on a LeRobot dataset with meta/modality.json: --data.data.sources.0.root "
                            "DIR --model.tokenizer-path FILE --init-from CKPT_DIR")
def gr00t_finetune() -> ExperimentConfig:
    """Finetune GR00T-N1.5 on a new embodiment (slot ``--model.embodiment-id``, default 31 =
    upstream's ``new_embodiment``), with upstream's default freezing (vision tower, ``mlp1`` and
    LLM frozen; projector, DiT, VL adapter and future tokens trained; ``--model.tune-visual`` etc.).

        python -m experiments.launch gr00t_finetune --data.data.sources.0.root DATASET_DIR \\
            --model.tokenizer-path QWEN3_TOKENIZER_JSON --init-from CKPT_DIR \\
            [--data.inputs.cameras DATASET_KEY SLOT ...]

    ``CKPT_DIR`` is ``python -m embodied_jax.models.convert --arch gr00t_n15`` output. Camera slots
    are ``--model.cameras``; ``--data.data.spec.camera-keys`` limits decoding to the cameras used.
    """
    steps = 10_000
    model = FULL_MODEL
    return dataclasses.replace(
        _experiment(
            "gr00t_finetune", model,
            train=TrainConfig(steps=steps, batch_size=32, log_every=10),
            optimizer=dict(_UPSTREAM_OPT, warmup_steps=steps // 20),
            mesh=MeshConfig(data=1, fsdp=-1),
            checkpoint=CheckpointConfig(save_every=1000, keep_last=3),
        ),
        data=finetune_data("data/lerobot_dataset", action_horizon=model.action_horizon, image_size=model.image_size),
    )
