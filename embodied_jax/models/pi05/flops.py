"""The analytic training FLOPs of π0.5 (``PolicyConfig.training_flops``): what the MFU of a
step is measured against (``nn/flops.py`` counts the layers)."""

from __future__ import annotations

import numpy as np

from embodied_jax.models.pi05.config import Pi05Config
from embodied_jax.nn import flops
from embodied_jax.policy import implements


@implements(Pi05Config, "training_flops")
def training_flops(config: Pi05Config, batch) -> dict[str, float]:
    """Analytic training FLOPs of one step on ``batch`` (NumPy; unpacked or packed rows):
    ``weights`` (every weight matmul of every token the batch carries, padding included)
    and ``attention`` (q·k and p·v: dense over an unpacked row's prefix, per sample in
    packed rows). Everything trains unless LoRA is on (then only activations flow back)."""
    vlm, expert, patches = config.vlm, config.expert, config.vision.num_patches
    k, hzn = config.flow_samples_per_obs, config.action_horizon
    if "segment_ids" in batch:
        seg = np.asarray(batch["segment_ids"])
        rows, length = seg.shape
        slots = int(np.asarray(batch["sample_mask"]).size)
        images = rows * int(np.asarray(batch["images"]).shape[1])
        lengths = [np.bincount(r[r > 0], minlength=1)[1:] for r in seg]
        prefix_pairs = sum(flops.attention_pairs(row.tolist()) for row in lengths)
        keys = sum(int(n) + hzn for row in lengths for n in row)  # per present sample: its prefix + suffix
        prefix_tokens = rows * length
    else:
        rows, text = np.asarray(batch["tokens"]).shape
        length = len(config.camera_names) * patches + text
        slots, images, prefix_tokens = rows, rows * len(config.camera_names), rows * length
        prefix_pairs = rows * flops.attention_pairs((), dense_length=length)
        keys = rows * (length + hzn)
    suffix_tokens = slots * k * hzn
    suffix_pairs = k * hzn * keys
    common = dict(heads=vlm.num_heads, kv_heads=vlm.num_kv_heads, head_dim=vlm.head_dim, gated=True)
    weights, attention = flops.Tally(), flops.Tally()
    trains = not config.lora_rank
    weights.add(
        flops.siglip(config.vision, images) + 2 * images * patches * config.vision.width * vlm.width, trains=trains
    )
    per_layer = flops.transformer_layer(prefix_tokens, 0, width=vlm.width, mlp_dim=vlm.mlp_dim, **common)
    suffix_layer = flops.transformer_layer(suffix_tokens, 0, width=expert.width, mlp_dim=expert.mlp_dim, **common)
    head = 2 * suffix_tokens * config.max_action_dim * expert.width * 2 + 2 * slots * k * 2 * expert.width**2
    weights.add(vlm.depth * (per_layer + suffix_layer) + head, trains=trains)
    attention.add(
        vlm.depth * 4 * (prefix_pairs + suffix_pairs) * vlm.num_heads * vlm.head_dim,
        trains=trains,
        after_trainable=True,
    )
    # The prefix's last-layer output projection and MLP feed nothing (only its keys and
    # values are read); upstream computes them, XLA removes them from an unrolled stack.
    dead = flops.Tally(upstream_trains=True)
    dead.add(
        flops.transformer_layer(prefix_tokens, 0, width=vlm.width, mlp_dim=vlm.mlp_dim, **common)
        - 2 * prefix_tokens * vlm.width * (vlm.num_heads + 2 * vlm.num_kv_heads) * vlm.head_dim,
        trains=trains,
    )
    return {"weights": weights.total, "attention": attention.total, "unused": dead.total}
