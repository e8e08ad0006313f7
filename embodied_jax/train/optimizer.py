"""optax AdamW with schedules, global-norm clipping, weight-decay masks and freezing."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
import optax

from embodied_jax.train.config import OptimizerConfig


def path_str(path: tuple) -> str:
    """``("a", 0, "kernel")`` or a jax key path -> ``"a/0/kernel"``."""
    parts = []
    for p in path:
        for attr in ("key", "name", "idx"):
            if hasattr(p, attr):
                p = getattr(p, attr)
                break
        parts.append(str(p))
    return "/".join(parts)


def matches_any(patterns: tuple[str, ...], path: str) -> bool:
    return any(re.search(p, path) for p in patterns)


def make_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = max(int(config.warmup_steps), 0)
    if config.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(config.lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, config.lr, warmup), optax.constant_schedule(config.lr)], [warmup]
        )
    if config.schedule == "warmup_cosine":
        decay = config.decay_steps or total_steps
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=config.lr,
            warmup_steps=warmup,
            decay_steps=max(decay, warmup + 1),
            end_value=config.lr * config.end_lr_factor,
        )
    raise ValueError(f"optimizer.schedule={config.schedule!r}: expected 'warmup_cosine' or 'constant'")


def decay_mask(config: OptimizerConfig, params: Any) -> Any:
    """True where weight decay applies: matrices whose path matches none of ``no_decay``."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: bool(np.ndim(x) >= 2 and not matches_any(config.no_decay, path_str(path))), params
    )


def make_optimizer(config: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The transformation applied to the *trainable* parameters (frozen ones never reach it)."""
    schedule = make_schedule(config, total_steps)
    parts = []
    if config.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(config.clip_norm))
    parts.append(
        optax.adamw(
            schedule,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=lambda params: decay_mask(config, params),
        )
    )
    return optax.chain(*parts), schedule
