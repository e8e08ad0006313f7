"""Orbax checkpoints: train state, data-iterator state, normalisation stats, config and assets.

One step directory holds six items: ``state`` (the sharded train state), ``fingerprint`` (a
checksum of each of its arrays, compared after every restore: ``fingerprint.py``), ``data``
(one JSON file per process with that process's iterator state), ``norm_stats`` and
``config`` (JSON), and ``assets`` (copies of the files the model config names, such as the
tokenizer: ``embodied_jax.assets``), so a step is complete wherever it is moved.
Saves are asynchronous; Orbax writes into a temporary directory and
renames it when complete, so a save killed half-way leaves the previous step intact.
Restoring goes through abstract target shardings, so a run saved on one mesh resumes
on another. ``damage`` tells a restore that failed on the step's own bytes (which the trainer
moves aside) from one that failed for any other reason (device memory, disk, file system),
which leaves the step where it is.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from embodied_jax.assets import copy_assets, read_assets
from embodied_jax.data.iterator import IteratorStateMismatch
from embodied_jax.errors import InputError
from embodied_jax.train import fingerprint
from embodied_jax.train.config import CheckpointConfig
from embodied_jax.train.optimizer import path_str
from embodied_jax.train.state import TrainState

log = logging.getLogger(__name__)


class StateMismatchError(InputError, ValueError):
    """A checkpoint's train state does not fit the run's (architecture, frozen set, optimizer)."""


class CheckpointRestoreError(RuntimeError):
    """A step failed to restore for a reason other than damage to its own files; nothing was moved."""

    def __init__(self, step: int, step_dir: pathlib.Path, cause: BaseException):
        super().__init__(
            f"checkpoint step {step} ({step_dir}) could not be restored: {describe_error(cause)}. This is not damage "
            f"to the checkpoint's own files, so no step was moved aside and metrics.jsonl is unchanged; fix the "
            f"cause (device memory, disk space, the file system) and launch again"
        )
        self.step = step


# TensorStore raises ``ValueError("<STATUS>: ...")``. These statuses are what it reports for a
# step's own bytes, found by damaging a saved step (tests/test_checkpoint_faults.py): DATA_LOSS (a CRC-32C
# mismatch in the manifest or a b-tree node), OUT_OF_RANGE (a byte range past the end of a
# truncated file), NOT_FOUND (a missing file), FAILED_PRECONDITION (an array chunk that does not
# decompress, or ``_sharding`` that is not JSON). An error the operating system returned (EIO,
# ENOSPC, EACCES, ...) comes with its errno in the message, whatever its status: not damage.
_DAMAGE_STATUSES = ("DATA_LOSS:", "OUT_OF_RANGE:", "NOT_FOUND:", "FAILED_PRECONDITION:")
_OS_ERROR_MARKS = ("os_error_code", "[OS error")


def _unwrap(error: BaseException) -> BaseException:
    # Orbax re-raises an array read's error as a bare ``Exception`` naming the array index.
    while type(error) is Exception and error.__cause__ is not None:
        error = error.__cause__
    return error


def describe_error(error: BaseException) -> str:
    """``"ValueError: DATA_LOSS: ..."``: the type and first line of the error behind Orbax's wrapper."""
    error = _unwrap(error)
    text = str(error).split("See full TensorStore details")[0].split(" [tensorstore_spec=")[0].strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300]}" if text else type(error).__name__


def damage(error: BaseException, step_dir: pathlib.Path) -> str | None:
    """Why ``error``, raised while restoring ``step_dir``, proves the step's own files damaged; None
    when it does not (it is then not the step's fault, and the step must stay where it is).

    Damage is: JSON that does not decode, a file of the step that is missing, a TensorStore
    status for bad bytes (``_DAMAGE_STATUSES``) about a file of the step and without an OS errno,
    or restored values that differ from the checksums saved with them.
    """
    cause = _unwrap(error)
    text = str(cause)
    inside = f"{step_dir}{os.sep}"
    if not step_dir.is_dir():  # gone meanwhile (moved, unmounted): nothing proven about its bytes
        own = False
    elif isinstance(cause, (json.JSONDecodeError, UnicodeDecodeError, fingerprint.FingerprintMismatch)):
        own = True
    elif isinstance(cause, FileNotFoundError):
        own = inside in str(cause.filename or text)
    elif type(cause) is ValueError:
        own = text.startswith(_DAMAGE_STATUSES) and inside in text and not any(m in text for m in _OS_ERROR_MARKS)
    else:
        own = False
    return describe_error(cause) if own else None


class _FilesHandler(ocp.CheckpointHandler):
    """An item of plain files written by this project: no tree structure or metadata for Orbax."""

    def structure(self, directory):  # required by the interface
        return None

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
        pass


class IteratorStateHandler(_FilesHandler):
    """Each process writes and reads its own data-iterator state (``process_i-of-n.json``).

    A data pipeline's position is per process (its shard of the data), so it restores only
    with the process count that wrote it; anything else is an error. An iterator whose
    ``layout_independent_state`` is true (the synthetic one: its state is the step) writes
    the same state on every process and restores under any number of processes.
    """

    def save(self, directory: epath.Path, args: IteratorSave) -> None:
        state = args.iterator.get_state()
        if isinstance(state, bytes):
            state = {"__bytes__": base64.b64encode(state).decode()}
        (directory / _state_file(jax.process_index(), jax.process_count())).write_text(json.dumps(state))

    def restore(self, directory: epath.Path, args: IteratorRestore) -> Any:
        path = directory / _state_file(jax.process_index(), jax.process_count())
        if path.exists():
            state = json.loads(path.read_text())
        else:
            written = sorted(p.name for p in directory.glob("process_*-of-*.json"))
            if not written:
                raise FileNotFoundError(f"{directory}: the checkpoint holds no data-iterator state")
            if not args.iterator.layout_independent_state:
                counts = sorted({n.rsplit("-of-", 1)[1].removesuffix(".json") for n in written})
                raise IteratorStateMismatch(
                    f"{path}: no data-iterator state for this process; the checkpoint was written by "
                    f"{' and '.join(counts)} processes, not the {jax.process_count()} running now, and a data "
                    f"pipeline's position is per process: it resumes only with the same number of processes"
                )
            states = [json.loads((directory / n).read_text()) for n in written]
            if any(s != states[0] for s in states):
                raise ValueError(
                    f"{directory}: the processes saved different iterator states, "
                    f"which a layout-independent iterator never does: {dict(zip(written, states, strict=True))}"
                )
            state = states[0]
        if isinstance(state, dict) and set(state) == {"__bytes__"}:
            state = base64.b64decode(state["__bytes__"])
        args.iterator.set_state(state)
        return args.iterator


class AssetsHandler(_FilesHandler):
    """Copies the model config's files into ``<step>/assets/<field>/<name>`` (process 0 writes)."""

    def save(self, directory: epath.Path, args: AssetsSave) -> None:
        if jax.process_index() == 0:  # ``directory``: the item's temporary folder, renamed to ``assets``
            copy_assets(args.files, pathlib.Path(directory))

    def restore(self, directory: epath.Path, args: AssetsRestore | None = None) -> dict[str, pathlib.Path]:
        return read_assets(pathlib.Path(directory).parent)


@ocp.args.register_with_handler(AssetsHandler, for_save=True)
class AssetsSave(ocp.args.CheckpointArgs):
    def __init__(self, files: dict[str, pathlib.Path]):
        self.files = files


@ocp.args.register_with_handler(AssetsHandler, for_restore=True)
class AssetsRestore(ocp.args.CheckpointArgs):
    pass


def _state_file(process_index: int, process_count: int) -> str:
    return f"process_{process_index}-of-{process_count}.json"


@ocp.args.register_with_handler(IteratorStateHandler, for_save=True)
class IteratorSave(ocp.args.CheckpointArgs):
    def __init__(self, iterator: Any):
        self.iterator = iterator


@ocp.args.register_with_handler(IteratorStateHandler, for_restore=True)
class IteratorRestore(ocp.args.CheckpointArgs):
    def __init__(self, iterator: Any):
        self.iterator = iterator


def _state_dict(state: TrainState) -> dict:
    return {k: v for k, v in vars(state).items() if v is not None}


def _abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _single_process_array_writes() -> None:
    """With one process, write each array whole: replica-parallel saving splits replicated
    arrays across local devices (one small compile per leaf shape) to spread the writes over
    hosts, which only pays off with several processes."""
    if jax.process_count() == 1:
        ocp.type_handlers.register_type_handler(
            jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
        )


class Checkpointer:
    """The run's checkpoint directory. ``read_only``: a reader (``load_policy``, evaluation) that
    never creates, deletes or cleans up anything, so it cannot disturb a live run's save."""

    def __init__(self, directory: str | pathlib.Path, config: CheckpointConfig, *, read_only: bool = False):
        _single_process_array_writes()
        self.directory = pathlib.Path(directory).absolute()
        self.read_only = read_only
        if read_only and not self.directory.is_dir():
            raise FileNotFoundError(f"{self.directory}: no such checkpoint directory")
        self.keep_last, self.keep_every = config.keep_last, config.keep_every
        # Rotation is ``prune``'s, called by the trainer once a save's weights proved finite: a
        # save that turns out non-finite never rotates out a good one.
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,
            enable_async_checkpointing=config.async_save and not read_only,
            # A writer removes the temporary directories its own killed saves left behind.
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": IteratorStateHandler(),
                "norm_stats": ocp.JsonCheckpointHandler(),
                "fingerprint": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler(),
                "assets": AssetsHandler(),
            },
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(
        self,
        step: int,
        state: TrainState,
        *,
        iterator: Any = None,
        norm_stats: dict | None = None,
        config: dict | None = None,
        assets: dict[str, pathlib.Path] | None = None,
        force: bool = False,
    ) -> bool:
        values = _state_dict(state)
        sums = {"algorithm": fingerprint.ALGORITHM, "leaves": fingerprint.fingerprint(values, path_str)}
        items = {"state": ocp.args.StandardSave(values), "fingerprint": ocp.args.JsonSave(sums)}
        if assets:
            items["assets"] = AssetsSave(assets)
        if iterator is not None:
            items["data"] = IteratorSave(iterator)
        items["norm_stats"] = ocp.args.JsonSave(norm_stats or {})
        if config is not None:
            items["config"] = ocp.args.JsonSave(config)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(
        self, abstract_state: TrainState, shardings: TrainState, *, step: int | None = None, iterator: Any = None
    ) -> tuple[TrainState, dict]:
        """Restore onto the shardings given (any mesh); returns (state, norm_stats).

        A state tree that differs from the saved one (another architecture, frozen set or
        optimizer) is a ``StateMismatchError`` naming the leaves, raised before anything is read.
        Restored values that differ from the checksums saved with them are a
        ``fingerprint.FingerprintMismatch`` (steps saved before checksums existed are not checked).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = _abstract(_state_dict(abstract_state), _state_dict(shardings))
        self._check_tree(step, target)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), norm_stats=ocp.args.JsonRestore())
        )
        if iterator is not None:
            self.manager.restore(step, args=ocp.args.Composite(data=IteratorRestore(iterator)))
        values = dict(restored["state"])
        if (self.step_directory(step) / "fingerprint" / "metadata").is_file():
            fingerprint.verify(values, self.read_json(step, "fingerprint"), path_str, str(self.step_directory(step)))
        state = TrainState(**{k: values.get(k) for k in vars(abstract_state)})
        return state, dict(restored["norm_stats"] or {})

    def _check_tree(self, step: int, target: dict) -> None:
        # Saved metadata names NamedTuple fields as dict keys: compare paths as "a/b/0/c".
        saved = {
            path_str(path): (tuple(m.shape), str(m.dtype))
            for path, m in jax.tree_util.tree_flatten_with_path(self.manager.item_metadata(step)["state"])[0]
        }
        wanted = {
            path_str(path): (tuple(x.shape), str(x.dtype))
            for path, x in jax.tree_util.tree_flatten_with_path(target)[0]
        }
        if saved == wanted:
            return
        lines = [
            f"{k}: saved {saved[k][0]} {saved[k][1]}, now {wanted[k][0]} {wanted[k][1]}"
            for k in sorted(saved.keys() & wanted.keys())
            if saved[k] != wanted[k]
        ]
        lines += [f"{k}: saved, not in this run's state" for k in sorted(saved.keys() - wanted.keys())]
        lines += [f"{k}: in this run's state, not saved" for k in sorted(wanted.keys() - saved.keys())]
        shown = "; ".join(lines[:6]) + (f"; ... {len(lines) - 6} more" if len(lines) > 6 else "")
        raise StateMismatchError(
            f"{self.directory / str(step)} holds another train state ({len(lines)} leaves differ: {shown}); "
            f"the model, its frozen set or the optimizer changed since it was saved: restore the saved config "
            f"or choose another --workdir"
        )

    def problem(self, step: int) -> str | None:
        """Why step ``step`` cannot be restored (a missing commit marker, item or iterator state,
        unreadable JSON), or None when it looks complete."""
        root = self.directory / str(step)
        # Orbax writes ``commit_success.txt`` into a step (and each item) as the last thing before
        # the rename that publishes it: without it the save never finished.
        for marker in ("commit_success.txt", "_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt"):
            if not (root / marker).is_file():
                return f"{marker} is missing"
        for item in (
            "norm_stats/metadata",
            "config/metadata",
            "fingerprint/metadata",
            "state/_METADATA",
            "_CHECKPOINT_METADATA",
        ):
            path = root / item
            if path.is_file():
                try:
                    json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    return f"{item} is not valid JSON ({e})"
        data = root / "data"
        if data.is_dir():
            if not list(data.glob("process_*-of-*.json")):
                return "data/ holds no iterator state"
            for path in data.glob("process_*-of-*.json"):
                try:
                    json.loads(path.read_text())
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    return f"data/{path.name} is not valid JSON ({e})"
        return None

    def damage(self, step: int, error: BaseException) -> str | None:
        """``damage(error, <step directory>)``: the reason to move ``step`` aside, or None."""
        return damage(error, self.step_directory(step))

    def move_aside(self, step: int, reason: str) -> pathlib.Path:
        """Rename a step that cannot be restored to ``corrupt-<step>`` (kept for inspection)."""
        self.manager.wait_until_finished()
        target = self.directory / f"corrupt-{step}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"corrupt-{step}.{n}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        multihost_utils.sync_global_devices(f"checkpoint move aside {step}")
        self.manager.reload()
        log.warning("checkpoint step %d is unusable (%s): moved to %s", step, reason, target)
        return target

    def prune(self) -> list[int]:
        """Delete all but the newest ``keep_last`` steps (and every ``keep_every``-th); returns the deleted."""
        steps = self.all_steps()
        keep = set(steps[-self.keep_last :]) | {s for s in steps if self.keep_every and s % self.keep_every == 0}
        doomed = [s for s in steps if s not in keep]
        if doomed:
            self.manager.wait_until_finished()
            for step in doomed:
                self.manager.delete(step)
        return doomed

    def discard(self, step: int) -> None:
        """Delete one step (a save whose weights gave a non-finite loss)."""
        self.manager.wait_until_finished()
        self.manager.delete(step)

    def save_aside(self, name: str, state: TrainState) -> pathlib.Path:
        """The train state alone, in ``<directory>/<name>`` outside the steps (never restored or rotated)."""
        path = self.directory / name
        if path.exists():
            raise FileExistsError(f"{path} exists")
        writer = ocp.StandardCheckpointer()
        writer.save(path, _state_dict(state))
        writer.wait_until_finished()
        writer.close()
        return path

    def step_directory(self, step: int) -> pathlib.Path:
        return self.directory / str(step)

    def read_json(self, step: int, item: str) -> dict:
        return json.loads((self.directory / str(step) / item / "metadata").read_text())

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        return self.manager.reached_preemption(step)

    def close(self) -> None:
        if not self.read_only:
            self.manager.wait_until_finished()
        self.manager.close()
