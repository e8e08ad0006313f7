"""The registry of named experiments: ``name -> (description, config factory)``, and what runs them.

Configs are data; running is here. Experiment modules call ``register`` at import;
``experiments()`` imports them all. A config runs through the runner registered for its class
(``register_runner``: the demo's collect -> train -> evaluate pipeline, Meta-World's), or by
default ``train_and_report``. To add a family, write ``experiments/<family>.py`` with
decorated factories returning an ``ExperimentConfig`` and add the module to ``_MODULES``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

from embodied_jax.train.config import ExperimentConfig

DEFAULT = "demo"

_MODULES = (
    "experiments.toy",
    "experiments.pi05",
    "experiments.gr00t",
    "experiments.demo",
    "experiments.metaworld",
    "experiments.rl",
)
_REGISTRY: dict[str, tuple[str, Callable[[], ExperimentConfig]]] = {}
Runner = Callable[[ExperimentConfig], int]  # runs a config; returns the exit status
_RUNNERS: dict[type, Runner] = {}


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


def register_runner(config_type: type, run: Runner) -> None:
    """Run configs of ``config_type`` (and its subclasses) with ``run`` instead of plain training."""
    if config_type in _RUNNERS:
        raise ValueError(f"a runner for {config_type.__name__} is registered twice")
    _RUNNERS[config_type] = run


def runner(config: ExperimentConfig) -> Runner:
    """The runner registered for the config's class (nearest in its MRO), or ``train_and_report``."""
    for cls in type(config).__mro__:
        if cls in _RUNNERS:
            return _RUNNERS[cls]
    return train_and_report


def train_and_report(config: ExperimentConfig) -> int:
    """Train; print the loss curve and where the outputs are. Returns the exit status."""
    from embodied_jax.train.loop import train

    result = train(config)
    curve = [(h["step"], h["loss"]) for h in result.history if "loss" in h]
    if curve:
        print("loss curve: " + ", ".join(f"{s}:{loss:.4f}" for s, loss in curve))
    print(f"finished at step {result.final_step}; outputs in {result.workdir}")
    return 0
