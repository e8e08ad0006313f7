"""optax AdamW with schedules, global-norm clipping, weight-decay masks and freezing.

The parameter-path regexes of a config (``optimizer.freeze``, ``optimizer.no_decay``, a model's
``freeze_regexes``) come back from saved configs, so each is checked before it is matched: at
most ``MAX_PATTERN_LENGTH`` characters, no backreferences, no quantifier over something that can
itself match in several ways (``(a*)*``, ``(a|ab)+``: exponential backtracking), and a bounded
number of choices overall (``a.*b.*c.*x`` is polynomial but slow; leading and trailing ``.*`` are
dropped first, which changes no search result). Matching one such regex against a
parameter path then explores at most ``MATCH_BUDGET`` alternatives, a field's regexes together
``TOTAL_BUDGET`` (well under a second over a model's ~1000 parameters).
"""

from __future__ import annotations

import functools
import re
import re._constants as sre  # the parser re.compile itself uses (no public API exposes the tree)
import re._parser as sre_parse
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import optax

from embodied_jax.errors import InputError
from embodied_jax.train.config import OptimizerConfig

MAX_PATTERN_LENGTH = 256
PATH_LENGTH = 256  # the longest parameter path the budget assumes (real ones are about half that)
MATCH_BUDGET = 2**18  # 2 x 257^2: two free quantifiers in an anchored regex (nn.lora's freeze regex)
TOTAL_BUDGET = 2 * MATCH_BUDGET  # all regexes of one field together
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)


class PatternError(InputError, ValueError):
    """A config regex that is invalid, too long, or could backtrack for too long on a parameter path."""


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


def _choices(items: Any, refuse: Any) -> int:
    """An upper bound on the alternatives a backtracking match of parsed ``items`` explores."""
    total = 1
    for op, arg in items:
        if op in _REPEATS:
            low, high, body = arg
            inner = _choices(body, refuse)
            if high > 1 and inner > 1:
                refuse("a quantifier over a part that can match in several ways backtracks exponentially")
            total *= (min(high, PATH_LENGTH) - min(low, PATH_LENGTH) + 1) * inner
        elif op is sre.BRANCH:
            total *= sum(_choices(branch, refuse) for branch in arg[1])
        elif op is sre.SUBPATTERN:
            total *= _choices(arg[3], refuse)
        elif op in (sre.ASSERT, sre.ASSERT_NOT):
            total *= _choices(arg[1], refuse)
        elif op is sre.ATOMIC_GROUP:
            total *= _choices(arg, refuse)
        elif op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
            refuse("backreferences are not supported")
    return total


def _search_core(pattern: str) -> str:
    """``pattern`` without leading or trailing ``.*``: whether ``re.search`` finds a match does not
    change, only the work, so ``.*lora.*`` is matched (and costed) as ``lora``."""
    core = pattern
    while core.startswith((".*?", ".*")):
        core = core[3:] if core.startswith(".*?") else core[2:]
    while core.endswith(".*") and not core.endswith("\\.*"):
        core = core[:-2]
    return core


@functools.lru_cache(maxsize=4096)
def _checked(pattern: str, field: str) -> tuple[re.Pattern, int]:
    def refuse(why: str) -> NoReturn:
        shown = pattern if len(pattern) <= 80 else pattern[:77] + "..."
        raise PatternError(f"{field}: regex {shown!r}: {why}")

    if len(pattern) > MAX_PATTERN_LENGTH:
        refuse(f"{len(pattern)} characters, at most {MAX_PATTERN_LENGTH}")
    try:
        re.compile(pattern)
        core = _search_core(pattern)
        parsed = sre_parse.parse(core)
    except re.error as exc:
        refuse(f"not a regex ({exc})")
    choices = _choices(parsed, refuse)
    if not (parsed and parsed[0] in ((sre.AT, sre.AT_BEGINNING), (sre.AT, sre.AT_BEGINNING_STRING))):
        choices *= PATH_LENGTH  # a search tries every start position
    if choices > MATCH_BUDGET:
        refuse(
            f"up to {choices:.2g} alternatives to try on a {PATH_LENGTH}-character path (at most {MATCH_BUDGET}): "
            "anchor it with ^ or use fewer quantifiers"
        )
    return re.compile(core), choices


@functools.lru_cache(maxsize=256)
def compile_patterns(patterns: tuple[str, ...], field: str = "optimizer.freeze") -> tuple[re.Pattern, ...]:
    """``patterns`` compiled, once checked that matching them against a parameter path stays cheap
    (each, and all together within ``TOTAL_BUDGET``); a ``PatternError`` naming ``field`` otherwise."""
    checked = [_checked(p, field) for p in patterns]
    total = sum(choices for _, choices in checked)
    if total > TOTAL_BUDGET:
        raise PatternError(
            f"{field}: {len(patterns)} regexes with up to {total:.2g} alternatives to try per parameter path "
            f"together (at most {TOTAL_BUDGET}): merge them or anchor them with ^"
        )
    return tuple(compiled for compiled, _ in checked)


def matches_any(patterns: tuple[str, ...], path: str, *, field: str = "optimizer.freeze") -> bool:
    """Whether any of ``patterns`` (the config field ``field``) matches the parameter path ``path``."""
    patterns = tuple(patterns)
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise PatternError(f"{field}: expected regex strings, got {type(pattern).__name__} {pattern!r:.60}")
    return _matches(patterns, path, field)


@functools.lru_cache(maxsize=65536)  # a model's paths are matched again by every split of its state
def _matches(patterns: tuple[str, ...], path: str, field: str) -> bool:
    return any(p.search(path) for p in compile_patterns(patterns, field))


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
        lambda path, x: bool(
            np.ndim(x) >= 2 and not matches_any(config.no_decay, path_str(path), field="optimizer.no_decay")
        ),
        params,
    )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` as one product per gradient: ``g · min(1, max_norm / norm)``.

    optax's form, ``select(norm < max_norm, g, g / norm · max_norm)``, holds a division per
    element, which XLA does not duplicate into its two readers (the first and second moment
    updates): it writes ``g / norm`` out for every parameter and reads it back twice. A product
    with one scalar fuses into both, so AdamW reads and writes each parameter's arrays ten
    times instead of fourteen. Same state (none), same result up to rounding (a scale of
    exactly 1 below the threshold)."""

    def clip(updates, params):
        del params
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(optax.global_norm(updates), jnp.finfo(jnp.float32).tiny))
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates)

    return optax.stateless(clip)


def make_optimizer(config: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The transformation applied to the *trainable* parameters (frozen ones never reach it)."""
    schedule = make_schedule(config, total_steps)
    parts = []
    if config.clip_norm is not None:
        parts.append(clip_by_global_norm(config.clip_norm))
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
