"""The training loop: build, restore or initialise, step, log, checkpoint, evaluate.

The host reads each step's metrics one step late, while the next step runs, so the
device never waits for the host. SIGTERM/SIGINT end the run at the next step
boundary with a final checkpoint (exit status 128 + signal number, so schedulers
requeue it); ``train.max_consecutive_skips`` non-finite steps in a row end it with a
checkpoint and ``NonFiniteLossError``. A restore that fails for any reason but damage to the
checkpoint's own files ends it with ``CheckpointRestoreError`` and nothing moved; a run lock
that another trainer took over ends it with ``RunLockLostError`` and nothing saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import signal
from typing import Any

import jax

from embodied_jax.assets import asset_files
from embodied_jax.config_registry import to_dict
from embodied_jax.data.iterator import BatchIterator, IteratorStateMismatch
from embodied_jax.parallel import distributed
from embodied_jax.parallel.mesh import describe_mesh
from embodied_jax.parallel.sharding import global_batch
from embodied_jax.train.checkpoint import Checkpointer, CheckpointRestoreError, StateMismatchError
from embodied_jax.train.config import ExperimentConfig
from embodied_jax.train.metrics import MetricsWriter, Throughput
from embodied_jax.train.optimizer import make_optimizer
from embodied_jax.train.run_lock import RunLock
from embodied_jax.train.runtime import ConfigError, Runtime, build, initial_state, prepare, validate_outputs
from embodied_jax.train.state import (
    TrainState,
)

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


class Preempted(Exception):
    def __init__(self, signum: int, step: int, saved: bool = True):
        outcome = "checkpoint saved" if saved else "no checkpoint (checkpoint.enabled=False)"
        super().__init__(f"received {signal.Signals(signum).name} at step {step}: {outcome}")
        self.signum = signum
        self.step = step


class SignalFlag:
    """``with SignalFlag() as stop:`` records SIGTERM/SIGINT in ``stop.signum`` (the run ends at its next boundary)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts without waiting for the save
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _stats_json(data_it: BatchIterator) -> dict | None:
    """Normalisation statistics of the data iterator as JSON (saved with every checkpoint)."""
    if data_it.stats is None:
        return None
    return {key: value.to_json() for key, value in data_it.stats.items()}


def _flat(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            if k != "__config__":
                out.update(_flat(v, f"{prefix}.{k}"))
        return out
    return {prefix: tree}


def _changed_fields(ckpt: Checkpointer, step: int, config: ExperimentConfig, fields: tuple[str, ...]) -> str:
    """``"model.hidden 128 -> 64, ..."``: what differs between a step's saved config and ``config``."""
    try:
        saved = _flat(ckpt.read_json(step, "config")["config"], "")
    except (OSError, KeyError, ValueError):
        return ""
    now = _flat(to_dict(config)["config"], "")
    keys = sorted(k for k in saved.keys() | now.keys() if any(k[1:].startswith(f) for f in fields))
    return ", ".join(f"{k[1:]} {saved.get(k)!r} -> {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k))


def _warn_on_schedule_change(ckpt: Checkpointer, step: int, rt: Runtime) -> None:
    """Resuming with another ``train.steps`` (and no fixed ``optimizer.decay_steps``) rescales the
    schedule: say what the learning rate does at the resumed step."""
    try:
        saved_steps = int(ckpt.read_json(step, "config")["config"]["train"]["steps"])
    except (OSError, KeyError, ValueError):
        return
    config = rt.config
    if saved_steps == config.train.steps or config.optimizer.decay_steps is not None:
        return
    _, before = make_optimizer(config.optimizer, saved_steps)
    log.warning(
        "train.steps %d -> %d: the learning-rate schedule now spans %d steps, so at step %d the rate is %.3g "
        "(it was %.3g); set --optimizer.decay-steps %d to keep the old schedule",
        saved_steps,
        config.train.steps,
        config.train.steps,
        step,
        float(rt.schedule(step)),
        float(before(step)),
        saved_steps,
    )


def restore_newest_good(ckpt: Checkpointer, rt: Runtime, data_it: BatchIterator) -> tuple[int, TrainState, dict] | None:
    """(step, state, norm_stats) of the newest step that restores; None when there is none.

    Only proven damage moves a step: one that is incomplete (``Checkpointer.problem``) or whose
    own files fail to decode (``Checkpointer.damage``) is moved to ``corrupt-<step>`` with a
    warning and the next older one is tried. Any other failure (device memory, a full disk, an
    I/O error, Ctrl-C) propagates naming the step, as ``CheckpointRestoreError`` for an
    ``Exception``, and nothing is moved. A state tree that no longer fits the run
    (``StateMismatchError``) is a ``ConfigError``: nothing is moved either.
    """
    while (step := ckpt.latest_step()) is not None:
        try:
            reason = ckpt.problem(step)
            if reason is None:
                state, stats = ckpt.restore(rt.abstract_state, rt.shardings, step=step, iterator=data_it)
                _warn_on_schedule_change(ckpt, step, rt)
                return step, state, stats
        except StateMismatchError as e:  # the run changed, not the step
            changed = _changed_fields(ckpt, step, rt.config, ("model", "optimizer.freeze", "optimizer.frozen_dtype"))
            raise ConfigError(f"{e}{'; changed: ' + changed if changed else ''}") from e
        except IteratorStateMismatch as e:
            raise ConfigError(str(e)) from e
        except Exception as e:
            reason = ckpt.damage(step, e)
            if reason is None:
                raise CheckpointRestoreError(step, ckpt.step_directory(step), e) from e
        except BaseException as e:  # KeyboardInterrupt, SystemExit: keep their meaning
            e.add_note(f"while restoring checkpoint step {step} ({ckpt.step_directory(step)}); nothing was moved")
            raise
        ckpt.move_aside(step, reason)
    return None


@dataclasses.dataclass
class RunResult:
    final_step: int
    history: list[dict[str, float]]
    workdir: pathlib.Path
    checkpoint_dir: pathlib.Path | None
    restored_from: int | None


def train(config: ExperimentConfig) -> RunResult:
    distributed.initialize(config.distributed)
    config = prepare(config)  # the config the run trains and its checkpoints save
    rt = build(config)
    validate_outputs(config)
    assets = asset_files(config.model)  # copied into every checkpoint: a step loads wherever it is moved
    workdir = pathlib.Path(config.workdir)
    t = config.train
    if jax.process_index() == 0:
        log.info("mesh: %s", describe_mesh(rt.mesh))
    with contextlib.ExitStack() as cleanup:
        data_it = config.data.make_iterator(
            model=config.model,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
            batch_size=t.batch_size,
            seed=t.seed,
        )
        if not isinstance(data_it, BatchIterator):
            made = type(data_it).__name__
            raise ConfigError(
                f"data: {type(config.data).__name__}.make_iterator returned a {made}, not a BatchIterator"
            )
        cleanup.callback(data_it.close)
        norm_stats = _stats_json(data_it)
        lock = None
        if jax.process_index() == 0:  # one owner per run directory; the job's other processes follow it
            lock = cleanup.enter_context(RunLock(workdir))
        ckpt = None
        restored_from = None
        if config.checkpoint.enabled:
            ckpt = Checkpointer(config.checkpoint.directory or workdir / "checkpoints", config.checkpoint)
        try:
            restored = restore_newest_good(ckpt, rt, data_it) if ckpt is not None else None
        except BaseException:
            if ckpt is not None:
                ckpt.close()
            raise
        if restored is not None:
            restored_from, state, saved_stats = restored
            norm_stats = saved_stats or norm_stats
            log.info("resumed from step %d of %s", restored_from, ckpt.directory)
        else:
            state = initial_state(rt)
        first = int(jax.device_get(state.step))
        config_dict = to_dict(config)
        writer = MetricsWriter(config.metrics, workdir, t.steps, first, config_dict, resumed_from=restored_from)
        step_fn = None
        evaluation = None  # started at the first evaluation, kept for the run
        throughput = Throughput()
        pending: tuple[int, dict] | None = None
        # A save is good only once the loss computed from its weights (the next step's) is finite;
        # until then it is ``unconfirmed`` and rotates nothing out (``Checkpointer.prune``).
        unconfirmed: int | None = None
        skipping = False  # the newest step read was skipped (non-finite)
        eval_rows: dict[int, dict] = {}  # in-training evaluation scores waiting for their step's row

        def save(step: int, force: bool = False) -> None:
            nonlocal unconfirmed
            if lock is not None:
                lock.check()  # never write into a run directory another trainer took over
            if ckpt is not None:
                ckpt.save(
                    step, state, iterator=data_it, norm_stats=norm_stats, config=config_dict, assets=assets, force=force
                )
                unconfirmed = step

        def confirm(step: int) -> None:
            """Step ``step``'s loss came from the weights saved at ``step - 1``: keep or discard that save."""
            nonlocal unconfirmed
            if ckpt is None or unconfirmed is None or step != unconfirmed + 1:
                return
            if skipping:
                log.warning("checkpoint %d discarded: the loss of its weights is not finite", unconfirmed)
                ckpt.discard(unconfirmed)
            else:
                ckpt.prune()
            unconfirmed = None

        def handle(step: int, metrics: dict) -> None:
            nonlocal skipping
            values = jax.device_get(metrics)
            tokens = float(values.get("tokens", 0.0))
            throughput.add(int(values.get("examples", t.batch_size)), tokens)  # packed rows hold several
            skipping = int(values["consecutive_skips"]) > 0
            confirm(step)
            if int(values["consecutive_skips"]) >= t.max_consecutive_skips:
                stopped = int(jax.device_get(state.step))
                where = "not saved (checkpoint.enabled=False)"
                good = None
                if ckpt is not None:
                    if unconfirmed is not None:  # saved during the streak: its weights gave no finite loss
                        ckpt.discard(unconfirmed)
                    where = f"saved aside in {ckpt.save_aside(f'nonfinite-{stopped}', state)}"
                    good = ckpt.latest_step()
                writer.close()
                resume = "no good checkpoint"
                if good is not None:
                    resume = f"newest good checkpoint: step {good}, where the next launch resumes"
                raise NonFiniteLossError(
                    f"{t.max_consecutive_skips} consecutive non-finite steps ending at step {step}; {resume}; "
                    f"the state at step {stopped} is {where}"
                )
            if step % t.log_every == 0 or step == t.steps:
                writer.write(step, {**values, **throughput.rates(), **eval_rows.pop(step, {})})
            elif step in eval_rows:
                writer.write(step, eval_rows.pop(step))

        with SignalFlag() as stop, rt.context():
            try:
                for step in range(first, t.steps):
                    if lock is not None:
                        lock.check()
                    batch = global_batch(next(data_it), rt.mesh, rt.rules)
                    if step_fn is None:
                        step_fn = rt.step_function(batch)
                    state, metrics = step_fn(state, batch)
                    if pending is not None:
                        handle(*pending)
                    pending = (step + 1, metrics)
                    writer.advance()
                    done = step + 1
                    if config.evaluation is not None and t.eval_every and done % t.eval_every == 0:
                        # The weights a policy bundle serves: the EMA when the run keeps one.
                        params = state.params if state.ema is None else state.ema
                        model = rt.parts.merge(params, state.frozen, state.fp8, state.other)
                        if evaluation is None:
                            evaluation = config.evaluation.start(model, config=config, norm_stats=norm_stats)
                        scores = evaluation(model, done)
                        # written with this step's training metrics: one row per step
                        eval_rows[done] = {f"eval/{k}": v for k, v in scores.items()}
                    preempted = stop.signum is not None or (ckpt is not None and ckpt.reached_preemption(done))
                    if ckpt is not None and (done % config.checkpoint.save_every == 0 or done == t.steps or preempted):
                        handle(*pending)  # this step's outcome decides whether its weights are worth a save
                        pending = None
                        if skipping and not preempted:
                            log.warning("step %d not saved: its update was skipped (non-finite loss)", done)
                        else:
                            save(done, force=preempted or done == t.steps)
                    if preempted:
                        if pending is not None:
                            handle(*pending)
                            pending = None
                        if ckpt is not None:
                            ckpt.wait()
                        raise Preempted(stop.signum or signal.SIGTERM, done, saved=ckpt is not None)
                if pending is not None:
                    handle(*pending)
                if ckpt is not None and unconfirmed is not None:
                    ckpt.prune()  # the final save: no later loss to check it against
            finally:
                if ckpt is not None:
                    ckpt.close()
                writer.close()
    return RunResult(
        int(jax.device_get(state.step)), writer.history, workdir, ckpt.directory if ckpt else None, restored_from
    )
