"""``--record`` for learning results: one JSON row per run in ``experiments/benchmarks/results/<name>.jsonl``
(the row format is ``embodied_jax/records.py``'s).

A row holds what an outsider needs to rerun and judge the figure: the commit (``-dirty`` and
``"clean": false`` when the tree had uncommitted changes outside ``results/``; the docs' tables take clean rows only),
the hash of the run's whole config and the command-line overrides, the seeds (training and each
evaluation's), the episodes, success with its 95% interval, the wall time split into collection,
training and evaluation, and the machine (whether other work shared it is the recorder's word:
``--shared-machine``, a field of the row).
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Mapping
from typing import Any

from embodied_jax import records
from experiments.benchmarks.harness import RESULTS, ROOT

config_hash = records.config_hash
setting_hash = records.setting_hash


def command_overrides(argv: list[str]) -> list[str]:
    """The launcher's arguments after the experiment's name (none given: the default experiment's)."""
    return argv[1:] if argv and not argv[0].startswith("-") else list(argv)


# Overrides that name how a run is recorded, not what it measures.
_BOOKKEEPING = ("--record", "--shared-machine", "--metrics.no-progress-bar")
# Flags whose value differs between repeated runs (seed, run directory) or only says how often a run
# checkpoints; each is dropped with its value.
_PER_RUN = ("--train.seed", "--workdir", "--checkpoint.save-every", "--checkpoint.keep-last")


def setting(overrides: list[str]) -> tuple[str, ...]:
    """A learning row's overrides without its training seed, run directory, checkpoint cadence and
    bookkeeping flags."""
    out, skip = [], False
    for flag in overrides:
        if skip:
            skip = False
            continue
        name = flag.split("=", 1)[0]
        if name in _PER_RUN:
            skip = "=" not in flag
            continue
        if name not in _BOOKKEEPING:
            out.append(flag)
    return tuple(out)


def launched_experiment(argv: list[str], default: str) -> str:
    """The experiment's name as the launcher was given it (``default`` when none was given)."""
    return argv[0] if argv and not argv[0].startswith("-") else default


def success_row(
    name: str,
    config: Any,
    *,
    result: Mapping[str, Any],
    seeds: Mapping[str, Any],
    wall_s: Mapping[str, float],
    overrides: list[str] | None = None,
    experiment: str | None = None,
    shared_machine: bool = False,
    setting: Any = None,
) -> dict[str, Any]:
    """A learning result's row in ``<name>.jsonl``. The command names ``experiment``, by default the one
    launched, which differs from ``name`` when ``--name`` files a run apart (``metaworld --name
    metaworld_levers``). ``setting``: the experiment's config as launched (before its run directory
    and data paths are filled in), whose ``setting_hash`` tells a later run of the same command
    whether its defaults are still the ones this row ran with (``experiments/progress.py``)."""
    overrides = list(command_overrides(sys.argv[1:]) if overrides is None else overrides)
    experiment = experiment or launched_experiment(sys.argv[1:], name)
    return records.row(
        name,
        root=ROOT,
        command=" ".join([f"python -m experiments.launch {experiment}", *overrides]),
        result=dict(result),
        config=config,
        extra={
            **({} if setting is None else {"setting_hash": records.setting_hash(setting)}),
            "overrides": overrides,
            "seeds": dict(seeds),
            "wall_s": {k: round(float(v), 1) for k, v in wall_s.items()},
            "machine": {**records.machine(), "shared": bool(shared_machine)},
        },
    )


def append(row: Mapping[str, Any], results: pathlib.Path = RESULTS) -> pathlib.Path:
    """Append ``row`` to ``<results>/<benchmark>.jsonl``; returns the file."""
    return records.append(row, results)


def save(row: Mapping[str, Any]) -> str:
    """Append ``row`` (:func:`append`) and say where, and whether it is marked dirty."""
    return f"recorded: {append(row)}" + ("" if row["clean"] else " (uncommitted changes: marked dirty)")


closed_loop_result = records.closed_loop_result
