"""Paths read from a directory someone else made stay inside that directory.

A run, an exported policy, a LeRobot dataset and a frame store name files by paths written in
their own files (``info.json``'s ``data_path``, a parquet image cell, ``framestore.json``'s
``array_keys``, ``assets/``). ``resolve_inside`` is the one place such a path becomes a file to
open: it refuses absolute paths, ``..`` components and links that lead out of the directory,
so copying, loading or training from an untrusted directory reads nothing else on the machine.
"""

from __future__ import annotations

import os
import pathlib

from embodied_jax.errors import InputError


class UnsafePathError(InputError, ValueError):
    """A path read from a directory points outside it (absolute, ``..``, or a link leading out)."""


def resolve_inside(
    root: str | os.PathLike,
    *parts: object,
    what: str,
    error: type[Exception] = UnsafePathError,
    regular_file: bool = False,
    links: bool = True,
) -> pathlib.Path:
    """``root / parts[0] / parts[1] ...``, refused with ``error`` unless it stays inside ``root``.

    Each part must be a relative path without ``..``; after following links the result must still
    lie under ``root`` (links inside ``root`` are fine). ``what`` names the file and field the
    parts come from (``"meta/info.json: data_path"``) and starts every message.
    ``regular_file``: refuse a path that exists and is not a regular file (a device such as
    ``/dev/zero``, a FIFO, a directory); a missing path is returned for the caller to report.
    ``links=False``: refuse any symbolic link on the way from ``root`` (files copied elsewhere).
    The path is returned as joined, not resolved, so messages keep the names the user knows.
    """
    root = pathlib.Path(root)
    path = root
    for part in parts:
        if not isinstance(part, str | os.PathLike):
            raise error(f"{what}: expected a relative path, got {_shown(part)}")
        text = os.fspath(part)
        if not isinstance(text, str) or not text or "\x00" in text:
            raise error(f"{what}: {_shown(text)} is not a usable path")
        relative = pathlib.PurePath(text)
        if relative.is_absolute() or relative.drive or ".." in relative.parts:
            raise error(f"{what}: {_shown(text)} leaves {root} (absolute paths and '..' are refused)")
        path = path / relative
    if not links:
        step = root
        for name in path.relative_to(root).parts:
            step = step / name
            if step.is_symlink():
                raise error(f"{what}: {step} is a symbolic link (to {os.readlink(step)}); links are refused here")
    try:
        resolved, base = path.resolve(), root.resolve()
    except (OSError, RuntimeError) as exc:  # a link loop
        raise error(f"{what}: cannot resolve {path} ({exc})") from exc
    if not resolved.is_relative_to(base):
        raise error(f"{what}: {path} leads to {resolved}, outside {root}")
    if regular_file and resolved.exists() and not resolved.is_file():
        raise error(f"{what}: {path} is not a regular file")
    return path


def _shown(value: object) -> str:
    text = repr(value)  # a path read from a file may be megabytes long
    return text if len(text) <= 120 else text[:117] + "..."
