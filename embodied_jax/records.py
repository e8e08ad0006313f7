"""Result rows with their provenance: one JSON line per measured figure, appended to
``<results>/<name>.jsonl`` (``experiments/benchmarks/results/`` in a checkout).

A row holds what an outsider needs to rerun and judge the figure: the commit of the checkout it
ran from (``-dirty`` and ``"clean": false`` when the tree had uncommitted changes outside the
results directory; the docs' tables take clean rows only), the hash of the run's whole saved
config, the command, the seeds, the result, the wall time and the machine (whether other work
shared it is the recorder's word). ``experiments/record.py`` (the experiments' ``--record``),
the benchmarks' harness and ``python -m embodied_jax.evaluate --record`` all write these rows.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform
import subprocess
from collections.abc import Mapping
from typing import Any

import embodied_jax.config_registry as config_registry

RESULTS = pathlib.Path("experiments") / "benchmarks" / "results"  # relative to a checkout's root


def commit(root: str | os.PathLike, outputs: str | os.PathLike | None = None) -> str | None:
    """The checkout at ``root``'s commit (12 hex digits), ``-dirty`` with uncommitted changes to
    tracked files outside ``outputs`` (rows appended there are outputs, not what ran); None
    outside a git checkout."""
    root = pathlib.Path(root)
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True)
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", "."]
        if outputs is not None:
            status.append(f":(exclude){pathlib.Path(outputs).resolve().relative_to(root.resolve())}")
        dirty = subprocess.run(status, cwd=root, capture_output=True)
    except (OSError, ValueError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The machine a result was measured on: CPU, cores, JAX backend and devices."""
    import jax

    devices = jax.devices()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
    }


def config_hash(config: Any) -> str:
    """sha256 (first 16 hex digits) of the config as it is saved (``config_registry.to_dict``)."""
    return _digest(config_registry.to_dict(config))


# Fields that differ between repeated runs of one setting (seed, run directory) or only say how a
# run is kept and shown.
PER_RUN_FIELDS = ("workdir", "train.seed", "checkpoint.save_every", "checkpoint.keep_last", "metrics.progress_bar")


def setting_hash(config: Any) -> str:
    """:func:`config_hash` less :data:`PER_RUN_FIELDS`: equal for the runs of one setting whatever
    their seeds, and different when a default the setting relies on has changed since a run."""
    tree = config_registry.to_dict(config)
    for path in PER_RUN_FIELDS:
        *parents, leaf = path.split(".")
        node = tree.get("config", tree)
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return _digest(tree)


def _digest(tree: Any) -> str:
    payload = json.dumps(tree, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def row(
    name: str,
    *,
    root: str | os.PathLike,
    command: str,
    result: Any,
    config: Any = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One row: ``name`` (its file), the commit of the checkout at ``root``, the date, the command,
    the config's hash (when given), ``extra`` fields and the result."""
    at = commit(root, pathlib.Path(root) / RESULTS)
    out = {
        "benchmark": name,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": at,
        "clean": bool(at) and not at.endswith("-dirty"),
    }
    if config is not None:
        out["config_hash"] = config_hash(config)
    out.update(extra or {})
    out["command"] = command
    out["result"] = result
    return out


def append(entry: Mapping[str, Any], results: str | os.PathLike) -> pathlib.Path:
    """Append ``entry`` to ``<results>/<benchmark>.jsonl``; returns the file."""
    results = pathlib.Path(results)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{entry['benchmark']}.jsonl"
    with path.open("a") as f:
        f.write(json.dumps(entry, default=float) + "\n")
    return path


def read(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (a results file or a run's ``metrics.jsonl``); [] when it is absent."""
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def closed_loop_result(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The figures a row keeps of one closed-loop evaluation (built-in task or Meta-World): task,
    success with its interval, episodes, episode length, step and seed; Meta-World's groups, their
    average and each task's rate when present."""
    keys = ("task", "success_rate", "success_ci95", "episodes", "mean_episode_length", "step", "seed")
    keys += ("group_average", "mean_task_success", "per_difficulty")
    out = {k: metrics[k] for k in keys if k in metrics}
    if "per_task" in metrics:
        out["per_task"] = {task: entry["success_rate"] for task, entry in metrics["per_task"].items()}
    return out
