"""The GR00T-N1.5 sizes, named once: ``tiny`` (tests), ``bench`` (CPU benchmarks, LeRobot's anchor
sizes), ``demo`` (the ``demo_gr00t`` policy, trained from scratch on a CPU), ``full`` (the published
model). ``variant(name)`` returns a fresh config; tests and benchmarks adjust one with
``dataclasses.replace``."""

from __future__ import annotations

import dataclasses

from embodied_jax.models.dit import DiTConfig, VLSelfAttentionConfig
from embodied_jax.models.gr00t.action_head import ActionHeadConfig
from embodied_jax.models.gr00t.config import Gr00tConfig
from embodied_jax.models.qwen3 import Qwen3Config
from embodied_jax.models.siglip import SiglipConfig


# Layers unrolled, as in π0.5's benchmark model: scanned, XLA:CPU spends the trainable step's
# time on per-layer slices and updates of the stacked residuals and gradients (unrolled, the
# trainable step ran 1.64 s against 2.03 s scanned, steps alternating in one process)
def bench() -> Gr00tConfig:
    """The CPU benchmark sizes (LeRobot's anchor runs), float32."""
    return Gr00tConfig(
        vision=SiglipConfig(width=256, depth=4, num_heads=4, mlp_dim=1024, patch_size=14, image_size=224),
        llm=Qwen3Config(
            width=512, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, mlp_dim=1536, vocab_size=2048
        ),
        select_layer=4,
        image_token_id=2047,
        camera_names=("ego_view",),
        max_token_len=258 + 38,
        action_head=ActionHeadConfig(
            hidden_size=256,
            input_embedding_dim=256,
            max_num_embodiments=32,
            num_future_tokens=32,
            dit=DiTConfig(num_layers=4, num_heads=8, head_dim=32, output_dim=256),
            vl_self_attention=VLSelfAttentionConfig(num_layers=1, num_heads=8, head_dim=64),
        ),
        action_dim=32,
        action_horizon=16,
        max_state_dim=64,
        param_dtype="float32",
        dtype="float32",
        synthetic_text_tokens=(24, 38),
        scan_layers=False,
    )


def tiny() -> Gr00tConfig:
    """A small GR00T-N1.5 for tests (seconds per step on a CPU)."""
    return Gr00tConfig(
        vision=SiglipConfig(width=32, depth=2, num_heads=2, mlp_dim=64, patch_size=14, image_size=28),
        llm=Qwen3Config(width=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96, vocab_size=128),
        select_layer=2,
        image_token_id=127,
        max_token_len=24,
        action_head=ActionHeadConfig(
            hidden_size=32,
            input_embedding_dim=32,
            max_num_embodiments=4,
            num_future_tokens=4,
            max_seq_len=16,
            dit=DiTConfig(num_layers=2, num_heads=2, head_dim=16, output_dim=32),
            vl_self_attention=VLSelfAttentionConfig(num_layers=1, num_heads=4, head_dim=16),
        ),
        action_dim=6,
        action_horizon=4,
        max_state_dim=8,
        dtype="float32",
        synthetic_text_tokens=(6, 12),
    )


def full() -> Gr00tConfig:
    """The published GR00T-N1.5 (``Gr00tConfig``'s defaults)."""
    return Gr00tConfig()


def demo(
    action_dim: int = 4, horizon: int = 8, image_size: int = 32, vocab_size: int = 43, image_token_id: int = 41
) -> Gr00tConfig:
    """The ``demo_gr00t`` policy: the architecture at small width (Eagle: SigLIP with patch 8 and a
    2-layer Qwen3; VL adapter; DiT), 4 flow draws per observation; ``action_dim``, ``horizon`` and the
    (square) ``image_size`` are the task's, ``vocab_size`` and ``image_token_id`` the demo's word-level
    tokenizer's (``experiments/demo.py:gr00t_vocabulary``; the defaults are the built-in tasks').

    Trained from scratch, so nothing is frozen (upstream fine-tuning freezes the backbone).
    """
    config = Gr00tConfig(
        vision=SiglipConfig(width=64, depth=2, num_heads=4, mlp_dim=128, patch_size=8, image_size=image_size),
        llm=Qwen3Config(
            width=64, num_layers=2, num_heads=4, num_kv_heads=1, head_dim=16, mlp_dim=128, vocab_size=vocab_size
        ),
        select_layer=2,
        image_token_id=image_token_id,
        camera_names=("ego_view", "wrist_view"),
        action_head=ActionHeadConfig(
            hidden_size=64,
            input_embedding_dim=64,
            num_future_tokens=4,
            max_seq_len=32,
            # No dropout (upstream's 0.2 regularises fine-tuning; from scratch it held the loss at 0.10
            # where it reaches 0.038 without, on pick_place at step 3000).
            dit=DiTConfig(num_layers=2, num_heads=4, head_dim=16, output_dim=64, dropout=0.0),
            vl_self_attention=VLSelfAttentionConfig(num_layers=1, num_heads=4, head_dim=16, dropout=0.0),
        ),
        action_dim=action_dim,
        action_horizon=horizon,
        max_state_dim=8,
        num_inference_steps=10,
        flow_samples_per_obs=4,  # as the π0.5 demo: with 1 draw per observation π0.5 fell from 43.8% to 3.1%
        dtype="float32",
        tune_visual=True,
        tune_llm=True,
        synthetic_text_tokens=(24, 38),
    )
    return dataclasses.replace(config, max_token_len=config.image_block_tokens + 48)  # + chat template and task


VARIANTS = {"tiny": tiny, "bench": bench, "demo": demo, "full": full}


def variant(name: str) -> Gr00tConfig:
    """The named GR00T-N1.5 size (``VARIANTS``)."""
    if name not in VARIANTS:
        raise KeyError(f"GR00T variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]()
