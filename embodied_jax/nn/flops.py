"""Analytic matmul FLOPs of the project's layers (2 per multiply-add), for benchmarks.

Counts the weight matmuls every token goes through and the attention's two products
(q·k and p·v: 4 · heads · head_dim per query-key pair). Norms, activations and softmax
are not counted (a few per cent at most). ``Tally`` adds a module's forward FLOPs with
its training multiplier: 1 for the forward pass, +1 for its weights' gradients when it
trains, +1 for its inputs' gradients when it trains or something before it does (a
frozen module before every trainable one runs forward only).
"""

from __future__ import annotations

import dataclasses


def attention_pairs(segments, dense_length: int | None = None) -> int:
    """Query-key pairs a row computes: each segment with itself, or the whole row (dense)."""
    if dense_length is not None:
        return dense_length * dense_length
    return sum(n * n for n in segments)


def transformer_layer(
    tokens: int,
    pairs: int,
    *,
    width: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    mlp_dim: int,
    gated: bool,
    context_tokens: int = 0,
    context_width: int = 0,
) -> float:
    """One pre-norm block: q/k/v/o projections, MLP (gated: 3 matrices) and attention pairs.

    With ``context_tokens`` (cross-attention) keys/values are projected from those tokens of
    ``context_width`` instead of from the queries' own tokens."""
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    kv_tokens, kv_width = (context_tokens, context_width) if context_tokens else (tokens, width)
    projections = 2 * tokens * width * q_out * 2 + 2 * kv_tokens * kv_width * kv_out * 2
    mlp = 2 * tokens * width * mlp_dim * (3 if gated else 2)
    return float(projections + mlp + 4 * pairs * heads * head_dim)


def siglip(config, images: int) -> float:
    """A SigLIP tower on ``images`` images (patch embedding + encoder layers)."""
    tokens = config.num_patches
    patch = 2 * tokens * config.patch_size**2 * 3 * config.width
    layer = transformer_layer(
        tokens,
        tokens * tokens,
        width=config.width,
        heads=config.num_heads,
        kv_heads=config.num_heads,
        head_dim=config.width // config.num_heads,
        mlp_dim=config.mlp_dim,
        gated=False,
    )
    return float(images * (patch + config.depth * layer))


@dataclasses.dataclass
class Tally:
    """Training FLOPs of a step, module by module (forward FLOPs x training multiplier)."""

    total: float = 0.0
    upstream_trains: bool = False  # set once a trainable module has been added (inputs side first)

    def add(self, forward_flops: float, *, trains: bool, after_trainable: bool | None = None) -> None:
        upstream = self.upstream_trains if after_trainable is None else after_trainable
        multiplier = 1 + int(trains) + int(trains or upstream)
        self.total += multiplier * forward_flops
        self.upstream_trains = self.upstream_trains or trains
