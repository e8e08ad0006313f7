"""Which weights reinforcement learning trains: the model's action expert by default, or all.

The policy's weights (a nested dict of arrays, ``TrainState.params``' form) are split by path
into the part the PPO update differentiates and moves and the part it leaves bit-identical;
``combine`` puts them back together for the rollout, the evaluation and the checkpoints. The
model family names its action expert (``PolicyConfig.action_expert_regexes``); with
``RLConfig.train="all"`` every weight trains, vision tower included.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from embodied_jax.train.optimizer import matches_any

SCOPES = ("action_expert", "all")


@dataclasses.dataclass(frozen=True)
class Scope:
    patterns: tuple[str, ...]  # regexes on "a/b/c" parameter paths: the weights that train

    @classmethod
    def of(cls, model_config: Any, scope: str) -> Scope:
        if scope not in SCOPES:
            raise ValueError(f"RLConfig.train must be one of {SCOPES}, got {scope!r}")
        return cls((r".*",) if scope == "all" else tuple(model_config.action_expert_regexes()))

    def partition(self, params: dict) -> tuple[dict, dict]:
        """``(trainable, fixed)``: two nested dicts holding each leaf of ``params`` once."""
        trainable, fixed = _split(params, "", self.patterns)
        if not trainable:
            raise ValueError(f"no parameter matches the trainable patterns {self.patterns}")
        return trainable, fixed

    @staticmethod
    def combine(trainable: dict, fixed: dict) -> dict:
        """The full nested dict again (``partition``'s inverse)."""
        return _merge(trainable, fixed)


def _split(tree: dict, prefix: str, patterns: tuple[str, ...]) -> tuple[dict, dict]:
    trainable, fixed = {}, {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, dict):
            t, f = _split(value, path, patterns)
            if t:
                trainable[key] = t
            if f:
                fixed[key] = f
        elif matches_any(patterns, path, field="RL trainable patterns"):
            trainable[key] = value
        else:
            fixed[key] = value
    return trainable, fixed


def _merge(a: dict, b: dict) -> dict:
    out = dict(b)
    for key, value in a.items():
        out[key] = _merge(value, b[key]) if key in b and isinstance(value, dict) else value
    return out
