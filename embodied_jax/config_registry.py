"""Saved configs: a run's config dataclasses as versioned JSON, restored through a registry.

Every config class the library ships is decorated with ``@register``; the registry maps
its class name to the class. ``to_dict`` writes ``{"format_version": 1, "config": ...}``
where each dataclass is ``{"__config__": name, <fields>}``; ``from_dict`` rebuilds it
from the registry alone, so a checkpoint loads in any process that has the library,
whatever code launched the run. An instance of an unregistered subclass of a registered
class (an experiment's own ``ExperimentConfig`` subclass with steps around training) is
saved as that registered base: its own fields only drive its launcher.

Reading is strict: an unknown name, an unknown field or a missing field is a
``ConfigFormatError`` naming it with its path in the config. The one exception: a field a class
gained after configs were saved, named in its ``ADDED_FIELDS`` (a tuple; the field has a
default that keeps the old behaviour), takes that default when a saved config lacks it; and a
field renamed since, named in its ``RENAMED_FIELDS`` (``{"old": "new"}``), reads from its old name.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from embodied_jax.errors import InputError

FORMAT_VERSION = 1

# The library modules that define registered configs; imported before a saved config is read.
_CONFIG_MODULES = (
    "embodied_jax.parallel.mesh",
    "embodied_jax.parallel.distributed",
    "embodied_jax.nn.lora",
    "embodied_jax.train.config",
    "embodied_jax.rl.config",
    "embodied_jax.rl.steering",
    "embodied_jax.data.samples",
    "embodied_jax.data.transforms",
    "embodied_jax.data.packing",
    "embodied_jax.data.pipeline",
    "embodied_jax.data.sample_transform",
    "embodied_jax.data.sources",
    "embodied_jax.models.siglip",
    "embodied_jax.models.gemma",
    "embodied_jax.models.qwen3",
    "embodied_jax.models.dit",
    "embodied_jax.models.gr00t.action_head",
    "embodied_jax.models.eagle",
    "embodied_jax.models.pi05",
    "embodied_jax.models.gr00t",
    "embodied_jax.models.toy_flow",
    "embodied_jax.evaluation.in_training",
)

_REGISTRY: dict[str, type] = {}


class ConfigFormatError(InputError, ValueError):
    """A saved config that cannot be read back (or a config that cannot be saved)."""


def register(cls: type) -> type:
    """Class decorator: make a config dataclass savable and restorable by its name."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__qualname__}: only dataclasses can be registered configs")
    name = cls.__name__
    if _REGISTRY.get(name, cls) is not cls:
        raise ValueError(f"config name {name!r} registered twice ({_REGISTRY[name].__module__} and {cls.__module__})")
    _REGISTRY[name] = cls
    return cls


def registered() -> dict[str, type]:
    """Every registered config class by name (after importing the library's config modules)."""
    _import_config_modules()
    return dict(_REGISTRY)


def _import_config_modules() -> None:
    for module in _CONFIG_MODULES:
        importlib.import_module(module)


def _saved_class(cls: type) -> type | None:
    for base in cls.__mro__:
        if _REGISTRY.get(base.__name__) is base:
            return base
    return None


def _encode(value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = _saved_class(type(value))
        if cls is None:
            raise ConfigFormatError(
                f"{path}: {type(value).__qualname__} is not a registered config (decorate it with "
                f"embodied_jax.config_registry.register)"
            )
        out: dict[str, Any] = {"__config__": cls.__name__}
        for field in dataclasses.fields(cls):
            out[field.name] = _encode(getattr(value, field.name), f"{path}.{field.name}")
        return out
    if isinstance(value, (list, tuple)):
        return [_encode(x, f"{path}[{i}]") for i, x in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _encode(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    raise ConfigFormatError(f"{path}: a {type(value).__qualname__} value cannot be saved in a config")


def to_dict(config: Any) -> dict[str, Any]:
    """The JSON form of a config (see the module docstring)."""
    return {"format_version": FORMAT_VERSION, "config": _encode(config, "config")}


def _decode(payload: Any, path: str) -> Any:
    if isinstance(payload, dict) and "__config__" in payload:
        name = payload["__config__"]
        cls = _REGISTRY.get(name)
        if cls is None:
            raise ConfigFormatError(f"{path}: unknown config {name!r} (known: {', '.join(sorted(_REGISTRY))})")
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        renamed = getattr(cls, "RENAMED_FIELDS", {})
        payload = {renamed.get(key, key): value for key, value in payload.items()}
        unknown = sorted(set(payload) - set(fields) - {"__config__"})
        if unknown:
            raise ConfigFormatError(f"{path}: {name} has no field {', '.join(map(repr, unknown))}")
        missing = sorted(set(fields) - set(payload) - set(getattr(cls, "ADDED_FIELDS", ())))
        if missing:
            raise ConfigFormatError(
                f"{path}: {name} field {', '.join(map(repr, missing))} missing from the saved config"
            )
        kwargs = {key: _decode(payload[key], f"{path}.{key}") for key in fields if key in payload}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigFormatError(f"{path}: {name}: {e}") from e
    if isinstance(payload, list):
        return tuple(_decode(x, f"{path}[{i}]") for i, x in enumerate(payload))
    if isinstance(payload, dict):
        return {k: _decode(v, f"{path}.{k}") for k, v in payload.items()}
    return payload


def from_dict(saved: Any) -> Any:
    """Inverse of ``to_dict``: registered dataclasses are re-created, JSON lists become tuples."""
    if not isinstance(saved, dict) or "format_version" not in saved:
        raise ConfigFormatError(
            "not a saved config: no 'format_version' (written by a version of embodied_jax "
            "before configs were versioned; re-save it with this version)"
        )
    version = saved["format_version"]
    if version != FORMAT_VERSION:
        raise ConfigFormatError(
            f"saved config format_version={version!r}; this version of embodied_jax reads {FORMAT_VERSION}"
        )
    if set(saved) != {"format_version", "config"}:
        raise ConfigFormatError(f"saved config has keys {sorted(saved)}; expected 'format_version' and 'config'")
    _import_config_modules()
    return _decode(saved["config"], "config")
