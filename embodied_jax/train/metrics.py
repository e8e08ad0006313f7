"""Training metrics to stdout (with a tqdm progress bar), ``metrics.jsonl``, TensorBoard and W&B (offline).

``metrics.jsonl`` holds one row per step. A run resumed from a checkpoint drops only the rows
after that checkpoint's step (it recomputes them); a run that restored nothing keeps an earlier
start's file as ``metrics.jsonl.<n>`` rather than erasing it.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from embodied_jax.train.config import MetricsConfig

log = logging.getLogger(__name__)


def _set_aside(path: pathlib.Path) -> None:
    """A run that restored no checkpoint begins a new history: keep the old one beside it."""
    if not path.exists() or not path.read_text().strip():
        return
    n = 1
    while (target := path.with_name(f"{path.name}.{n}")).exists():
        n += 1
    os.replace(path, target)
    log.warning("%s holds the metrics of an earlier start that no checkpoint continues: kept as %s", path, target)


def _keep_rows_through(path: pathlib.Path, step: int) -> None:
    """A resumed run recomputes the steps after its checkpoint: drop their old rows (and a line
    a hard kill cut short), so ``metrics.jsonl`` never holds two rows for one step."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


class MetricsWriter:
    """Only process 0 writes; every process may call it."""

    def __init__(
        self,
        config: MetricsConfig,
        workdir: str | pathlib.Path,
        total_steps: int,
        first_step: int = 0,
        run_config: dict | None = None,
        *,
        resumed_from: int | None = None,
    ):
        """``resumed_from``: the checkpoint step a resumed run restored (its later rows are dropped);
        None for a run that restored nothing."""
        self.enabled = jax.process_index() == 0
        self.history: list[dict[str, float]] = []
        self._bar = None
        self._tb = None
        self._wandb = None
        self._jsonl = None
        if not self.enabled:
            return
        pathlib.Path(workdir).mkdir(parents=True, exist_ok=True)
        path = pathlib.Path(workdir) / "metrics.jsonl"
        if resumed_from is None:
            _set_aside(path)
        else:
            _keep_rows_through(path, resumed_from)
        self._jsonl = open(path, "a")
        if config.progress_bar:
            self._bar = tqdm(total=total_steps, initial=first_step, dynamic_ncols=True, desc="train")
        if config.tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(pathlib.Path(workdir) / "tensorboard"))
        if config.wandb:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("metrics.wandb=True needs the wandb package (pip install wandb)") from e
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(project=config.wandb_project, dir=str(workdir), config=run_config, mode="offline")

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        values = {k: float(np.asarray(v)) for k, v in metrics.items()}
        values["step"] = step
        self.history.append(values)
        if not self.enabled:
            return
        shown = " ".join(f"{k}={_fmt(v)}" for k, v in values.items() if k != "step")
        if self._bar is not None:
            self._bar.set_postfix_str(f"loss={_fmt(values.get('loss', float('nan')))}", refresh=False)
            self._bar.write(f"step {step}: {shown}")
        else:
            print(f"step {step}: {shown}", flush=True)
        self._jsonl.write(json.dumps(values) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in values.items():
                if k != "step":
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


class Throughput:
    """Wall-clock rates between two log points (the host waits for the device only there)."""

    def __init__(self):
        self._t = time.perf_counter()
        self._steps = 0
        self._examples = 0
        self._tokens = 0.0

    def add(self, examples: int, tokens: float = 0.0) -> None:
        self._steps += 1
        self._examples += examples
        self._tokens += tokens

    def rates(self) -> dict[str, float]:
        now = time.perf_counter()
        dt = max(now - self._t, 1e-9)
        out = {"step_time": dt / max(self._steps, 1), "examples_per_s": self._examples / dt}
        if self._tokens:
            out["tokens_per_s"] = self._tokens / dt
        self._t, self._steps, self._examples, self._tokens = now, 0, 0, 0.0
        return out
