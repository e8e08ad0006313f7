"""The analytic training FLOPs of GR00T-N1.5 (``PolicyConfig.training_flops``): what the MFU of a
step is measured against (``nn/flops.py`` counts the layers)."""

from __future__ import annotations

import numpy as np

from embodied_jax.models.gr00t.config import Gr00tConfig
from embodied_jax.nn import flops
from embodied_jax.policy import implements


@implements(Gr00tConfig, "training_flops")
def training_flops(config: Gr00tConfig, batch) -> dict[str, float]:
    """Analytic training FLOPs of one step on ``batch`` (NumPy; unpacked or packed rows):
    ``weights`` (weight matmuls of every token the batch carries, padding included) and
    ``attention`` (q·k and p·v: dense over an unpacked row, per sample in packed rows;
    the DiT cross-attends its sample's window). Frozen modules before every trainable
    one run forward only (``tune_*``)."""
    llm, head = config.llm, config.action_head
    dit, vl = head.dit, head.vl_self_attention
    tokens = np.asarray(batch["tokens"])
    rows, length = tokens.shape
    patches = config.vision.num_patches
    if "segment_ids" in batch:
        seg = np.asarray(batch["segment_ids"])
        images = rows * int(np.asarray(batch["images"]).shape[1])
        slots = int(np.asarray(batch["sample_mask"]).size)
        pairs = sum(flops.attention_pairs(np.bincount(r[r > 0])[1:].tolist()) for r in seg)
        window = min(length, config.max_token_len)
    else:
        images, slots = rows * len(config.camera_names), rows
        pairs = rows * flops.attention_pairs((), dense_length=length)
        window = length
    vl_tokens = rows * length
    dit_tokens = 1 + head.num_future_tokens + config.action_horizon
    inner = dit.inner_dim
    weights, attention = flops.Tally(), flops.Tally()
    weights.add(
        flops.siglip(config.vision, images) + 2 * images * patches * config.vision.width * llm.width,
        trains=config.tune_visual,
    )
    attention.add(0.0, trains=config.tune_visual)
    llm_dims = dict(width=llm.width, heads=llm.num_heads, kv_heads=llm.num_kv_heads, head_dim=llm.head_dim)
    weights.add(
        config.select_layer * flops.transformer_layer(vl_tokens, 0, mlp_dim=llm.mlp_dim, gated=True, **llm_dims),
        trains=config.tune_llm,
    )
    attention.add(config.select_layer * 4 * pairs * llm.num_heads * llm.head_dim, trains=config.tune_llm)
    vl_dims = dict(width=llm.width, heads=vl.num_heads, kv_heads=vl.num_heads, head_dim=vl.head_dim)
    weights.add(
        vl.num_layers * flops.transformer_layer(vl_tokens, 0, mlp_dim=4 * llm.width, gated=False, **vl_dims),
        trains=True,
    )
    attention.add(vl.num_layers * 4 * pairs * vl.num_heads * vl.head_dim, trains=True)
    dit_dims = dict(
        width=inner,
        heads=dit.num_heads,
        kv_heads=dit.num_heads,
        head_dim=dit.head_dim,
        mlp_dim=4 * inner,
        gated=False,
    )
    cross = dit.num_layers // 2 if dit.interleave_self_attention else dit.num_layers
    draws = slots * config.flow_samples_per_obs  # the DiT runs once per (slot, flow draw)
    tokens_dit = draws * dit_tokens
    # cross-attention keys/values are projected once per VL token of a row (upstream: per sample);
    # with several flow draws, once per draw of each sample's tokens (its window when packed)
    if config.flow_samples_per_obs == 1:
        context_tokens = vl_tokens
    else:
        context_tokens = draws * window if "segment_ids" in batch else vl_tokens * config.flow_samples_per_obs
    dit_flops = cross * flops.transformer_layer(
        tokens_dit, 0, context_tokens=context_tokens, context_width=llm.width, **dit_dims
    ) + (dit.num_layers - cross) * flops.transformer_layer(tokens_dit, 0, **dit_dims)
    hidden, emb = head.hidden_size, head.input_embedding_dim
    head_flops = 2 * slots * (config.max_state_dim * hidden + hidden * emb)  # state encoder, once per slot
    head_flops += (
        2
        * draws
        * config.action_horizon
        * (config.action_dim * emb + 3 * emb**2 + hidden * hidden + hidden * config.action_dim)
    )
    head_flops += 2 * draws * inner * 2 * inner * (dit.num_layers + 1)  # AdaLayerNorms and proj_out_1, per draw
    weights.add(dit_flops + head_flops, trains=config.tune_diffusion_model or config.tune_projector)
    attention.add(
        4
        * draws
        * dit_tokens
        * (cross * window + (dit.num_layers - cross) * dit_tokens)
        * dit.num_heads
        * dit.head_dim,
        trains=config.tune_diffusion_model,
    )
    return {"weights": weights.total, "attention": attention.total}
