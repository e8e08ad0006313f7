"""Files a model config names by path (a tokenizer), carried inside weights and checkpoints.

A policy must load on another machine, so every directory that holds weights (a converted
checkpoint, a training checkpoint's step, an exported policy) also holds copies of the files
its model config reads: ``<dir>/assets/<field>/<file name>``, one folder per config field
(``assets/tokenizer_path/tokenizer.model``). ``PolicyConfig.asset_fields`` names the fields.
Reading a config back points those fields at the copies (``with_assets``), so nothing depends
on where the run was made.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

from embodied_jax.errors import InputError

ASSETS = "assets"


class AssetError(InputError, FileNotFoundError):
    """A file a model config names does not exist."""


def asset_files(model: Any) -> dict[str, pathlib.Path]:
    """``{field: path}`` of the files ``model`` names (its ``asset_fields`` that are set)."""
    files = {}
    for field in getattr(model, "asset_fields", ()):
        value = getattr(model, field)
        if value is None:
            continue
        path = pathlib.Path(value)
        if not path.is_file():
            raise AssetError(f"model.{field}={str(value)!r}: no such file")
        files[field] = path
    return files


def write_assets(files: Mapping[str, str | pathlib.Path], directory: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Copy each file to ``directory/assets/<field>/<name>``; returns the copies."""
    return copy_assets(files, pathlib.Path(directory) / ASSETS)


def copy_assets(files: Mapping[str, str | pathlib.Path], root: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """Copy each file to ``root/<field>/<name>`` (``root``: an ``assets`` folder)."""
    root = pathlib.Path(root)
    copies = {}
    for field, path in files.items():
        path = pathlib.Path(path)
        target = root / field / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.resolve() != path.resolve():
            shutil.copyfile(path, target)
        copies[field] = target
    return copies


def read_assets(directory: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """``{field: path}`` of the files under ``directory/assets`` (empty when it has none)."""
    root = pathlib.Path(directory) / ASSETS
    found = {}
    if root.is_dir():
        for folder in sorted(p for p in root.iterdir() if p.is_dir()):
            files = sorted(p for p in folder.iterdir() if p.is_file())
            if len(files) == 1:
                found[folder.name] = files[0]
    return found


def with_assets(model: Any, directory: str | pathlib.Path, *, only_unset: bool = False) -> Any:
    """``model`` with its asset fields pointing at the copies in ``directory`` (those it holds).

    ``only_unset``: fill only fields that are None (a fine-tuning run that names its own
    tokenizer keeps it; one that names none takes the weights' own)."""
    fields = set(getattr(model, "asset_fields", ()))
    found = {f: str(p) for f, p in read_assets(directory).items() if f in fields}
    if only_unset:
        found = {f: p for f, p in found.items() if getattr(model, f) is None}
    return dataclasses.replace(model, **found) if found else model
