"""The registry of named experiments: ``name -> (description, config factory)``.

Experiment modules call ``register`` at import; ``experiments()`` imports them all.
To add a family, write ``experiments/<family>.py`` with decorated factories returning an
``ExperimentConfig`` and add the module to ``_MODULES``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from embodied_jax.train.config import ExperimentConfig

DEFAULT = "demo"

_MODULES = ("experiments.toy", "experiments.pi05", "experiments.gr00t", "experiments.demo", "experiments.metaworld")
_REGISTRY: dict[str, tuple[str, Callable[[], ExperimentConfig]]] = {}


def register(name: str, description: str):
    def wrap(factory: Callable[[], ExperimentConfig]):
        if name in _REGISTRY:
            raise ValueError(f"experiment {name!r} registered twice")
        _REGISTRY[name] = (description, factory)
        return factory

    return wrap


def experiments() -> dict[str, tuple[str, Callable[[], ExperimentConfig]]]:
    for module in _MODULES:
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    return dict(_REGISTRY)


def get(name: str) -> ExperimentConfig:
    known = experiments()
    if name not in known:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(sorted(known))}")
    return known[name][1]()
