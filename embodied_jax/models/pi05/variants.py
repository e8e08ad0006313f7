"""The π0.5 sizes, named once: ``tiny`` (tests), ``bench`` (CPU benchmarks, LeRobot's anchor
sizes), ``demo`` (the demo's policy, trained from scratch on a CPU), ``full`` (the published model).
``variant(name)`` returns a fresh config; tests and benchmarks adjust one with ``dataclasses.replace``
(the demo fits its widths and image slots to its task: ``experiments/demo.py:fit_to_task``)."""

from __future__ import annotations

from embodied_jax.models.gemma import GemmaConfig
from embodied_jax.models.pi05.config import Pi05Config
from embodied_jax.models.siglip import SiglipConfig


def full() -> Pi05Config:
    """The published π0.5 (3,353,433,872 parameters): float32 master weights, bfloat16 compute;
    the layer stacks keep only each attention's q, k, v and output for the backward pass (32
    examples per device then fit an H200 with room to spare, see docs/scaling.md's memory table)."""
    return Pi05Config(dtype="bfloat16", remat_policy="save_attention")


def bench() -> Pi05Config:
    """The CPU benchmark sizes (LeRobot's anchor runs), float32 throughout. Layers are unrolled:
    on XLA:CPU the scanned 4-layer stacks spend about 45% of the step outside the matmuls
    (per-layer slices and updates of the stacked residuals and gradients, transposed copies)."""
    return Pi05Config(
        vision=SiglipConfig(width=256, depth=4, num_heads=4, mlp_dim=1024, patch_size=14, image_size=224),
        vlm=GemmaConfig(width=512, depth=4, mlp_dim=2048, num_heads=8, num_kv_heads=1, head_dim=64),
        expert=GemmaConfig(width=256, depth=4, mlp_dim=1024, num_heads=8, num_kv_heads=1, head_dim=64, use_adarms=True),
        vocab_size=1024,
        camera_names=("base_0_rgb", "left_wrist_0_rgb"),
        max_token_len=48,
        action_horizon=50,
        max_action_dim=32,
        action_dim=32,
        synthetic_prompt_len=24,
        dtype="float32",
        scan_layers=False,
    )


def tiny() -> Pi05Config:
    """A few-hundred-thousand-parameter π0.5 for tests (seconds per step on a CPU)."""
    return Pi05Config(
        vision=SiglipConfig(width=32, depth=2, num_heads=2, mlp_dim=64, patch_size=8, image_size=32),
        vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
        expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16, use_adarms=True),
        vocab_size=1024,
        camera_names=("base_0_rgb", "left_wrist_0_rgb"),
        max_token_len=64,
        action_horizon=8,
        max_action_dim=8,
        action_dim=8,
        max_state_dim=8,
        synthetic_prompt_len=24,
        num_inference_steps=5,
        dtype="float32",
    )


def demo(action_dim: int = 4, horizon: int = 8, image_size: int = 32) -> Pi05Config:
    """The demo's π0.5 (``python -m experiments.launch``): the architecture at small width (SigLIP
    with patch 8, VLM and action expert 64 wide), 4 flow draws per observation; ``action_dim``,
    ``horizon`` and the (square) ``image_size`` are the task's."""
    return Pi05Config(
        vision=SiglipConfig(width=64, depth=2, num_heads=4, mlp_dim=128, patch_size=8, image_size=image_size),
        vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
        expert=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16, use_adarms=True),
        vocab_size=640,
        camera_names=("base_0_rgb", "left_wrist_0_rgb"),
        max_token_len=32,
        action_horizon=horizon,
        max_action_dim=action_dim,
        action_dim=action_dim,
        max_state_dim=8,
        num_inference_steps=10,
        flow_samples_per_obs=4,
        dtype="float32",
    )


VARIANTS = {"tiny": tiny, "bench": bench, "demo": demo, "full": full}


def variant(name: str) -> Pi05Config:
    """The named π0.5 size (``VARIANTS``)."""
    if name not in VARIANTS:
        raise KeyError(f"π0.5 variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]()
