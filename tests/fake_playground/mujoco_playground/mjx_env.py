"""Playground's environment state and where it expects menagerie assets."""

import dataclasses
import pathlib
from typing import Any

import jax
from flax import struct
from mujoco import mjx

MENAGERIE_PATH = pathlib.Path(__file__).parent / "external_deps" / "mujoco_menagerie"


@struct.dataclass
class State:
    data: mjx.Data
    obs: jax.Array
    reward: jax.Array
    done: jax.Array  # float 0/1, as in Playground
    metrics: dict[str, jax.Array]
    info: dict[str, Any]


@dataclasses.dataclass
class Config:
    ctrl_dt: float = 0.04
    sim_dt: float = 0.01
    episode_length: int = 25
    impl: str = "jax"

    def update(self, overrides: dict):
        for key, value in overrides.items():
            if not hasattr(self, key):  # Playground's locked ConfigDict rejects unknown keys too
                raise KeyError(f"unknown config key {key!r}")
            setattr(self, key, value)
        return self
