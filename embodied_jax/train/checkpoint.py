"""Orbax checkpoints: train state, data-iterator state, normalisation stats and config.

One step directory holds four items: ``state`` (the sharded train state), ``data``
(one JSON file per process with that process's iterator state), ``norm_stats`` and
``config`` (JSON). Saves are asynchronous; Orbax writes into a temporary directory and
renames it when complete, so a save killed half-way leaves the previous step intact.
Restoring goes through abstract target shardings, so a run saved on one mesh resumes
on another.
"""

from __future__ import annotations

import base64
import json
import logging
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from embodied_jax.train.config import CheckpointConfig
from embodied_jax.train.state import TrainState

log = logging.getLogger(__name__)


class IteratorStateHandler(ocp.CheckpointHandler):
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
                raise FileNotFoundError(
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

    def structure(self, directory):  # required by the interface
        return None

    def metadata(self, directory):
        return None

    def finalize(self, directory):
        pass

    def close(self):
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
    def __init__(self, directory: str | pathlib.Path, config: CheckpointConfig):
        _single_process_array_writes()
        self.directory = pathlib.Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_last,
            keep_period=config.keep_every,
            enable_async_checkpointing=config.async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": IteratorStateHandler(),
                "norm_stats": ocp.JsonCheckpointHandler(),
                "config": ocp.JsonCheckpointHandler(),
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
        force: bool = False,
    ) -> bool:
        items = {"state": ocp.args.StandardSave(_state_dict(state))}
        if iterator is not None:
            items["data"] = IteratorSave(iterator)
        items["norm_stats"] = ocp.args.JsonSave(norm_stats or {})
        if config is not None:
            items["config"] = ocp.args.JsonSave(config)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=force)

    def restore(
        self, abstract_state: TrainState, shardings: TrainState, *, step: int | None = None, iterator: Any = None
    ) -> tuple[TrainState, dict]:
        """Restore onto the shardings given (any mesh); returns (state, norm_stats)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        target = _abstract(_state_dict(abstract_state), _state_dict(shardings))
        items = {"state": ocp.args.StandardRestore(target), "norm_stats": ocp.args.JsonRestore()}
        if iterator is not None:
            items["data"] = IteratorRestore(iterator)
        restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        values = dict(restored["state"])
        state = TrainState(**{k: values.get(k) for k in vars(abstract_state)})
        return state, dict(restored["norm_stats"] or {})

    def read_json(self, step: int, item: str) -> dict:
        return json.loads((self.directory / str(step) / item / "metadata").read_text())

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def reached_preemption(self, step: int) -> bool:
        return self.manager.reached_preemption(step)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
