"""Fault injection around checkpoints: damaged steps, restores that fail for other reasons, resuming
with another model or schedule, and ``--init-from`` a run of this project (a saved toy run shared
by the module)."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil

import pytest

from embodied_jax.train import loop
from embodied_jax.train.checkpoint import Checkpointer, CheckpointRestoreError
from embodied_jax.train.run_lock import (
    LOCK_NAME,
)
from experiments import launch
from tests.train_utils import TOY_CLI, losses, toy_config


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A toy run of 4 steps with checkpoints at 2 and 4 (and its losses)."""
    workdir = tmp_path_factory.mktemp("saved") / "run"
    result = loop.train(toy_config(workdir, steps=4, checkpoint=True, save_every=2))
    return workdir, losses(result.history)


def _truncate_largest_array_file(step_dir):
    files = sorted((p for p in (step_dir / "state" / "d").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[: len(data) // 2])


def _largest_chunk_file(step_dir):
    """The biggest file of array chunks (zstd-compressed values in the OCDBT store)."""
    files = (p for p in (step_dir / "state" / "ocdbt.process_0" / "d").iterdir() if p.is_file())
    return max(files, key=lambda p: p.stat().st_size)


def _flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_one_bit(path):
    """One bit in the middle of the chunk file: the chunk still decompresses, into other values."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _invert(path):
    path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _btree_node(step_dir):
    return next((step_dir / "state" / "d").iterdir())


# Each damage and what it is seen as: ``Checkpointer.problem`` (before reading), or the error the
# restore raises (TensorStore's status, or Python's type).
DAMAGE = {
    "truncated array": (_truncate_largest_array_file, "OUT_OF_RANGE"),
    "emptied _METADATA": (lambda d: (d / "state" / "_METADATA").write_text(""), "not valid JSON"),
    "missing state/": (lambda d: shutil.rmtree(d / "state"), "is missing"),
    "garbage iterator JSON": (lambda d: (d / "data" / "process_0-of-1.json").write_text("{not json"), "not valid JSON"),
    "no commit marker": (lambda d: (d / "commit_success.txt").unlink(), "is missing"),
    "truncated array chunks": (lambda d: _truncate(_largest_chunk_file(d)), "OUT_OF_RANGE"),
    "byte-flipped array chunks": (lambda d: _invert(_largest_chunk_file(d)), "FAILED_PRECONDITION"),
    "one bit flipped in array chunks": (lambda d: _flip_one_bit(_largest_chunk_file(d)), "differ from the checksums"),
    "garbage fingerprint JSON": (lambda d: (d / "fingerprint" / "metadata").write_text("{not"), "not valid JSON"),
    "byte-flipped array index": (lambda d: _flip_one_byte(_btree_node(d)), "DATA_LOSS"),
    "byte-flipped manifest": (lambda d: _flip_one_byte(d / "state" / "manifest.ocdbt"), "DATA_LOSS"),
    "missing array chunks": (lambda d: _largest_chunk_file(d).unlink(), "FAILED_PRECONDITION"),
    "missing array index": (lambda d: _btree_node(d).unlink(), "NOT_FOUND"),
    "missing norm_stats metadata": (lambda d: (d / "norm_stats" / "metadata").unlink(), "FileNotFoundError"),
    "unreadable _sharding": (lambda d: (d / "state" / "_sharding").write_bytes(b"\xff\x00"), "FAILED_PRECONDITION"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_latest_step_is_moved_aside_and_the_run_resumes_from_the_previous(
    saved_run, tmp_path, caplog, damage
):
    source, reference = saved_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    do, seen_as = DAMAGE[damage]
    do(workdir / "checkpoints" / "4")
    result = loop.train(toy_config(workdir, steps=4, checkpoint=True, save_every=2))
    assert result.restored_from == 2
    assert losses(result.history) == {3: reference[3], 4: reference[4]}  # the same steps, bit for bit
    assert (workdir / "checkpoints" / "corrupt-4").is_dir()
    warning = [r.getMessage() for r in caplog.records if "moved to" in r.getMessage()]
    assert len(warning) == 1 and "step 4 is unusable" in warning[0] and seen_as in warning[0], warning
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # the rows through step 2 kept; 3 and 4 once, from the resumed run


def _os_error_inside_an_array_read(*args, **kwargs):
    """What Orbax raises for an I/O error while it reads an array: TensorStore's error (its status
    from the errno, the errno attached), wrapped in a bare Exception."""
    try:
        raise ValueError(
            'UNKNOWN: Error reading "params.out.kernel/0.0" in OCDBT database at local file "/ckpt/4/state/": '
            "Input/output error [os_error_code='5']"
        )
    except ValueError as e:
        raise Exception("Encountered error while reading array index: (slice(0, 64, 1),).") from e


def _raise(error):
    def restore(*args, **kwargs):
        raise error

    return restore


FAILURES = {
    "device out of memory": (_raise(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1.2GiB")), "Out of"),
    "disk full": (_raise(OSError(errno.ENOSPC, "No space left on device")), "No space left"),
    "I/O error": (_raise(OSError(errno.EIO, "Input/output error")), "Input/output error"),
    "I/O error inside an array read": (_os_error_inside_an_array_read, "UNKNOWN: Error reading"),
    "Ctrl-C": (_raise(KeyboardInterrupt()), ""),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_restore_failure_that_is_not_the_checkpoints_moves_nothing(saved_run, tmp_path, monkeypatch, failure):
    source, _ = saved_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    metrics = (workdir / "metrics.jsonl").read_bytes()
    restore, cause = FAILURES[failure]
    monkeypatch.setattr(Checkpointer, "restore", restore)
    argv = [*TOY_CLI, "--train.steps", "4", "--checkpoint.save-every", "2", "--workdir", str(workdir)]
    expected = KeyboardInterrupt if failure == "Ctrl-C" else CheckpointRestoreError
    with pytest.raises(expected) as raised:  # not an input error: the launcher lets it end the process (status 1)
        launch.main(argv)
    message = "\n".join([str(raised.value), *getattr(raised.value, "__notes__", [])])
    assert f"checkpoint step 4 ({workdir / 'checkpoints' / '4'})" in message and cause in message
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]
    assert (workdir / "metrics.jsonl").read_bytes() == metrics  # every row kept
    assert not (workdir / LOCK_NAME).exists()  # released


def test_resuming_with_another_model_is_refused_naming_the_leaves(saved_run, tmp_path):
    source, _ = saved_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    config = toy_config(workdir, steps=6, checkpoint=True, save_every=2)
    wider = dataclasses.replace(config, model=dataclasses.replace(config.model, hidden=64))
    with pytest.raises(
        loop.ConfigError, match=r"leaves differ: .*blocks/0/0/kernel: saved \(64, 128\) float32, now \(64, 64\)"
    ):
        loop.train(wider)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]  # nothing moved
    with pytest.raises(loop.ConfigError, match="changed: model.hidden 128 -> 64"):
        loop.train(wider)


def test_resuming_with_more_steps_says_what_the_schedule_does(saved_run, tmp_path, caplog):
    source, _ = saved_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    config = toy_config(workdir, steps=6, checkpoint=True, save_every=2)
    config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, decay_steps=None))
    assert loop.train(config).restored_from == 4
    assert "train.steps 4 -> 6: the learning-rate schedule now spans 6 steps" in caplog.text
    assert "--optimizer.decay-steps 4" in caplog.text


@pytest.mark.parametrize("where", ["run", "checkpoints", "step"])
def test_init_from_a_run_of_this_project_reads_its_weights(saved_run, tmp_path, caplog, where):
    """A run dir, its checkpoints/ or a step dir: the newest (or named) step's parameters, a fresh schedule."""
    import jax
    import numpy as np

    from embodied_jax.train.checkpoint import Checkpointer
    from embodied_jax.train.config import CheckpointConfig

    source, _ = saved_run
    path = {"run": source, "checkpoints": source / "checkpoints", "step": source / "checkpoints" / "2"}[where]
    config = dataclasses.replace(toy_config(tmp_path / "new", steps=1), init_from=str(path))
    rt = loop.build(config)
    state = loop.initial_state(rt)
    ckpt = Checkpointer(source / "checkpoints", CheckpointConfig(async_save=False), read_only=True)
    saved, _ = ckpt.restore(rt.abstract_state, rt.shardings, step=2 if where == "step" else 4)
    ckpt.close()
    assert int(state.step) == 0
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), state.params, saved.params)
    assert all(jax.tree.leaves(same))
    step = "2" if where == "step" else "4"
    assert f"init_from: training checkpoint, step {step}" in caplog.text and "(reading params)" in caplog.text


def test_init_from_something_else_is_named_before_anything_is_written(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    workdir = tmp_path / "run"
    assert launch.main([*TOY_CLI, "--init-from", str(tmp_path / "empty"), "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds neither converted weights" in err[0], err
    assert not workdir.exists()
