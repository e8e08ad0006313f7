"""Playground's registry: ``manipulation.ALL_ENVS`` and ``load``."""

from mujoco_playground import manipulation

ALL_ENVS = manipulation.ALL_ENVS


def load(env_name: str, config=None, config_overrides: dict | None = None):
    if env_name not in ALL_ENVS:
        raise ValueError(f"env {env_name!r} not found")
    return manipulation.load(env_name, config, config_overrides)
