"""The GR00T-N1.5 sizes, named once: ``tiny`` (tests), ``bench`` (CPU benchmarks, LeRobot's anchor
sizes), ``full`` (the published model). ``variant(name)`` returns a fresh config; tests and benchmarks
adjust one with ``dataclasses.replace``. (The demo's own size is ``experiments/demo.py:demo_gr00t_model``.)"""

from __future__ import annotations

from embodied_jax.models.dit import DiTConfig, VLSelfAttentionConfig
from embodied_jax.models.gr00t.config import Gr00tConfig
from embodied_jax.models.gr00t_action_head import ActionHeadConfig
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


VARIANTS = {"tiny": tiny, "bench": bench, "full": full}


def variant(name: str) -> Gr00tConfig:
    """The named GR00T-N1.5 size (``VARIANTS``)."""
    if name not in VARIANTS:
        raise KeyError(f"GR00T variant {name!r}; known: {', '.join(VARIANTS)}")
    return VARIANTS[name]()
