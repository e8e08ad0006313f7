"""Export a trained policy as a small self-contained directory to copy to a robot's computer.

    python -m embodied_jax.export RUN DIR [--step N] [--no-ema]

``RUN`` is a run directory (or its ``checkpoints/``); ``DIR`` receives::

    policy.json       format version, the step, which weights ("ema" or "params"), the run's name
    config.json       the run's saved config (config_registry format)
    norm_stats.json   the normalisation statistics the policy was trained with
    weights/          the model's parameters as one nested dict (the format of models.convert,
                      so ``--init-from DIR`` fine-tunes from it)
    model_state/      non-parameter model state (FP8 scales), when the model has any
    assets/           the files the model config names (the tokenizer)

No optimizer state, no data-iterator state, no path outside ``DIR``: ``load_policy(DIR)`` and
the policy server read it wherever it is moved. The weights are the EMA by default.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
from collections.abc import Sequence
from typing import Annotated

import jax
import numpy as np
import orbax.checkpoint as ocp
import tyro
from flax import nnx

from embodied_jax.assets import read_assets, write_assets
from embodied_jax.cli import INPUT_ERRORS, parse_flags, run_main
from embodied_jax.config_registry import to_dict
from embodied_jax.errors import InputError
from embodied_jax.loading import MODEL_STATE, load_policy
from embodied_jax.train import pretrained
from embodied_jax.variables import Fp8Meta

FORMAT_VERSION = 1


class ExportError(InputError, ValueError):
    """The export cannot be written where asked."""


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def export_policy(
    run: str | pathlib.Path, out: str | pathlib.Path, *, step: int | None = None, use_ema: bool = True
) -> pathlib.Path:
    """Write the policy of ``run`` at ``step`` (default: the latest) to ``out`` (a new directory)."""
    out = pathlib.Path(out).absolute()
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: export into a new directory")
    bundle = load_policy(run, step=step, use_ema=use_ema)
    model = bundle.model
    weights = _host(nnx.state(model, nnx.Param).to_pure_dict())
    model_state = {
        "fp8": _host(nnx.state(model, Fp8Meta).to_pure_dict()),
        "other": _host(nnx.state(model, nnx.Not(nnx.Any(nnx.Param, Fp8Meta))).to_pure_dict()),
    }
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with ocp.StandardCheckpointer() as writer:
        writer.save(tmp / "weights", weights)
        if jax.tree.leaves(model_state):
            writer.save(tmp / MODEL_STATE, model_state)
    run_dir = pathlib.Path(run).absolute()
    step_dir = (run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir) / str(bundle.step)
    write_assets(read_assets(step_dir), tmp)
    (tmp / "config.json").write_text(json.dumps(to_dict(bundle.config), indent=1))
    (tmp / "norm_stats.json").write_text(json.dumps({k: v.to_json() for k, v in bundle.stats.items()}))
    has_ema = bundle.config.train.ema_decay is not None
    info = {
        "format_version": FORMAT_VERSION,
        "step": bundle.step,
        "weights": "ema" if use_ema and has_ema else "params",
        "run": run_dir.parent.name if run_dir.name == "checkpoints" else run_dir.name,
    }
    (tmp / pretrained.POLICY_FILE).write_text(json.dumps(info, indent=1))  # written last: marks it complete
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


PROG = "python -m embodied_jax.export"


@dataclasses.dataclass(frozen=True)
class ExportFlags:
    """``python -m embodied_jax.export``'s command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]]
    """a run directory (or its checkpoints/ directory)"""
    out: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="DIR")]]
    """the policy directory to create"""
    step: int | None = None
    """checkpoint step (default: the latest)"""
    no_ema: bool = False
    """export the trained parameters, not their EMA"""


def main(argv: Sequence[str] | None = None) -> int:
    def run(args: list[str]) -> None:
        flags = parse_flags(
            ExportFlags, args=args, prog="python -m embodied_jax.export", description=__doc__.splitlines()[0]
        )
        out = export_policy(flags.run, flags.out, step=flags.step, use_ema=not flags.no_ema)
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        print(f"exported {out} ({size / 2**20:.1f} MiB)")

    return run_main(run, argv, INPUT_ERRORS + (ValueError, KeyError))


if __name__ == "__main__":
    sys.exit(main())
