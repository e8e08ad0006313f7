"""Files a model config names by path (a tokenizer), carried inside weights and checkpoints.

A policy must load on another machine, so every directory that holds weights (a converted
checkpoint, a training checkpoint's step, an exported policy) also holds copies of the files
its model config reads: ``<dir>/assets/<field>/<file name>``, one folder per config field
(``assets/tokenizer_path/tokenizer.model``). ``PolicyConfig.asset_fields`` names the fields.
Reading a config back points those fields at the copies (``with_assets``), so nothing depends
on where the run was made, and nothing outside the directory is read: a field without its copy
and a link anywhere under ``assets/`` are errors (``embodied_jax.paths``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
from collections.abc import Mapping
from typing import Any

from embodied_jax.errors import InputError
from embodied_jax.paths import resolve_inside

ASSETS = "assets"


class AssetError(InputError, FileNotFoundError):
    """A file a model config names does not exist, or a directory's copy of it is missing or a link."""


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
    """``{field: path}`` of the files under ``directory/assets`` (empty when it has none).

    A symbolic link anywhere under ``assets/`` is an ``AssetError`` naming it: the copies are
    read and copied again (an export), so a link would carry in a file from outside."""
    directory = pathlib.Path(directory)
    root = directory / ASSETS
    if not (root.is_dir() or root.is_symlink()):
        return {}

    def checked(path: pathlib.Path) -> pathlib.Path:
        return resolve_inside(
            directory, path.relative_to(directory), what="assets of a run or export", error=AssetError, links=False
        )

    checked(root)
    found = {}
    for folder in sorted(root.iterdir()):
        if checked(folder).is_dir():
            files = [p for p in sorted(folder.iterdir()) if checked(p).is_file()]
            if len(files) == 1:
                found[folder.name] = files[0]
    return found


def with_assets(model: Any, directory: str | pathlib.Path, *, only_unset: bool = False) -> Any:
    """``model`` with its asset fields pointing at the copies in ``directory``.

    A directory read back (a run's step, an export) must hold a copy of every file its config
    names: a field set without one is an ``AssetError`` (its saved path may lie anywhere).
    ``only_unset``: fill only fields that are None, from whatever copies ``directory`` holds (a
    fine-tuning run that names its own tokenizer keeps it; one that names none takes the weights')."""
    fields = getattr(model, "asset_fields", ())
    found = {f: str(p) for f, p in read_assets(directory).items() if f in fields}
    if only_unset:
        found = {f: p for f, p in found.items() if getattr(model, f) is None}
    else:
        for field in fields:
            value = getattr(model, field)
            if value is not None and field not in found:
                raise AssetError(
                    f"{directory}: its config names model.{field}={str(value)!r} but "
                    f"{pathlib.Path(directory) / ASSETS / field} holds no copy; a run or an exported policy "
                    "reads its files from inside itself only"
                )
    return dataclasses.replace(model, **found) if found else model
