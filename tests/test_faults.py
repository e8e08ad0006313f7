"""Fault injection around run directories: a second trainer, stale locks, bad checkpoint settings.

Each case is set up by hand (a lock file of a live or dead process, an impossible config) and
the trainer or the launcher must refuse it by name before writing anything, or recover.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from embodied_jax.train import loop, run_lock
from embodied_jax.train.checkpoint import Checkpointer, CheckpointRestoreError
from embodied_jax.train.run_lock import (
    LOCK_NAME,
    STALE_AFTER_S,
    RunLock,
    RunLockedError,
    RunLockLostError,
    pid_start,
    stale_reason,
)
from experiments import launch
from tests.train_utils import TOY_CLI, losses, toy_config


def _write_lock(workdir, *, pid, host=None, heartbeat=None):
    workdir.mkdir(parents=True, exist_ok=True)
    record = {
        "host": host or socket.gethostname(),
        "pid": pid,
        "started": time.time(),
        "heartbeat": time.time() if heartbeat is None else heartbeat,
    }
    (workdir / LOCK_NAME).write_text(json.dumps(record))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_trainer_on_a_live_run_is_refused(tmp_path):
    workdir = tmp_path / "run"
    with RunLock(workdir):  # this very process holds it (another open file of it, as another process would)
        with pytest.raises(RunLockedError, match=f"in use by process {os.getpid()} on {socket.gethostname()}"):
            loop.train(toy_config(workdir, steps=2, checkpoint=True))
        assert sorted(p.name for p in workdir.iterdir()) == [LOCK_NAME]  # nothing else written


def test_the_launcher_names_the_holder_in_one_line(tmp_path, capsys):
    workdir = tmp_path / "run"
    with RunLock(workdir):
        code = launch.main([*TOY_CLI, "--train.steps", "2", "--workdir", str(workdir), "--metrics.no-progress-bar"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "in use by process" in err[-1] and "Traceback" not in "".join(err)


def test_a_stale_lock_is_taken_over_and_released(tmp_path, caplog):
    workdir = tmp_path / "run"
    _write_lock(workdir, pid=_dead_pid())
    result = loop.train(toy_config(workdir, steps=2, checkpoint=True))
    assert result.final_step == 2
    assert "taking over the stale lock" in caplog.text and "is gone" in caplog.text
    assert not (workdir / LOCK_NAME).exists()  # released at the end of the run


def test_staleness_rules():
    now = time.time()
    here, me = socket.gethostname(), os.getpid()

    def record(**kw):
        return {"host": here, "pid": me, "pid_start": pid_start(me), "started": now, "heartbeat": now, **kw}

    assert stale_reason(record(), now) is None
    assert stale_reason(record(heartbeat=now - 10 * STALE_AFTER_S), now) is None  # alive here, only paused
    assert "does not hold the lock" in stale_reason(record(), now, os_locked=True)
    assert "not the one that took the lock" in stale_reason(record(pid_start=pid_start(me) - 1), now)
    assert "is gone" in stale_reason(record(pid=_dead_pid()), now)
    assert "heartbeat" in stale_reason(record(host="elsewhere", heartbeat=now - STALE_AFTER_S - 1), now)
    assert stale_reason(record(host="elsewhere", pid=999_999), now) is None  # cannot tell: live
    assert stale_reason(None, now, modified=now) is None  # empty or being written: in use
    assert "unreadable" in stale_reason(None, now, modified=now - STALE_AFTER_S - 1)


def test_the_lock_is_exclusive_within_one_process(tmp_path):
    with RunLock(tmp_path), pytest.raises(RunLockedError):
        RunLock(tmp_path).acquire()
    assert not (tmp_path / LOCK_NAME).exists()


def _no_flock(fd, op):
    raise OSError(errno.ENOLCK, "No locks available")  # NFS mounted without lock support


@pytest.fixture
def without_flock(monkeypatch):
    """A file system without ``flock``: the lock relies on its record alone."""
    monkeypatch.setattr(run_lock.fcntl, "flock", _no_flock)
    monkeypatch.setattr(run_lock, "SETTLE_S", 0.05)


def test_a_lock_file_created_but_not_yet_written_is_not_taken(tmp_path):
    path = tmp_path / LOCK_NAME
    path.touch()
    fd = os.open(path, os.O_RDWR)  # another trainer between creating the file and writing its record
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunLockedError, match="being written"):
            RunLock(tmp_path).acquire()
    finally:
        os.close(fd)
    assert path.read_text() == ""  # untouched


def test_without_flock_an_empty_lock_file_counts_until_it_is_old(tmp_path, without_flock, caplog):
    path = tmp_path / LOCK_NAME
    path.touch()
    with pytest.raises(RunLockedError, match="being written"):
        RunLock(tmp_path).acquire()
    old = time.time() - STALE_AFTER_S - 1
    os.utime(path, (old, old))  # a crash between creating and writing it, long ago
    with RunLock(tmp_path):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert "unreadable and unchanged" in caplog.text


def test_a_paused_holder_keeps_its_lock(tmp_path):
    path = tmp_path / LOCK_NAME
    with RunLock(tmp_path) as holder:
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "heartbeat": time.time() - 10 * STALE_AFTER_S}))  # paused 50 min
        with pytest.raises(RunLockedError, match=f"in use by process {os.getpid()}"):
            RunLock(tmp_path).acquire()
        assert holder.heartbeat() and holder.lost is None  # resumed: still the owner
    assert not path.exists()


def test_without_flock_a_resumed_holder_whose_lock_was_taken_stops(tmp_path, without_flock, caplog):
    path = tmp_path / LOCK_NAME
    holder = RunLock(tmp_path)
    holder.acquire()
    # The holder runs on another host and is paused past the stale time: a trainer here takes over.
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "host": "node-a", "heartbeat": time.time() - STALE_AFTER_S - 1}))
    taker = RunLock(tmp_path)
    taker.acquire()
    assert "its heartbeat is" in caplog.text
    assert not holder.heartbeat()  # the holder resumes: its next heartbeat reads the record back
    with pytest.raises(RunLockLostError, match=f"taken by process {os.getpid()} on .* stopped without saving"):
        holder.check()
    holder.release()
    assert json.loads(path.read_text())["token"] == taker._record["token"]  # the holder left the taker's record
    taker.release()
    assert not path.exists()


def test_without_flock_the_same_host_and_pid_with_another_start_time_is_stale(tmp_path, without_flock, caplog):
    # A container restarted on this host name whose trainer got the same PID: its own PID, alive.
    _write_lock(tmp_path, pid=os.getpid())
    record = json.loads((tmp_path / LOCK_NAME).read_text())
    (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "pid_start": pid_start(os.getpid()) - 100}))
    with RunLock(tmp_path):
        pass
    assert "is not the one that took the lock" in caplog.text
    _write_lock(tmp_path, pid=os.getpid())
    record = json.loads((tmp_path / LOCK_NAME).read_text())
    (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "pid_start": pid_start(os.getpid())}))
    with pytest.raises(RunLockedError, match=f"in use by process {os.getpid()}"):  # the same process: alive
        RunLock(tmp_path).acquire()


def test_a_trainer_whose_lock_was_taken_stops_without_saving(tmp_path, monkeypatch):
    acquire = RunLock.acquire

    def taken_over_at_once(self):
        acquire(self)
        record = json.loads(self.path.read_text())
        self.path.write_text(json.dumps({**record, "pid": 4242, "host": "node-b", "token": "theirs"}))
        self.heartbeat()

    monkeypatch.setattr(RunLock, "acquire", taken_over_at_once)
    workdir = tmp_path / "run"
    with pytest.raises(RunLockLostError, match="taken by process 4242 on node-b"):
        loop.train(toy_config(workdir, steps=2, checkpoint=True, save_every=1))
    assert not list((workdir / "checkpoints").glob("[0-9]*"))
    assert json.loads((workdir / LOCK_NAME).read_text())["token"] == "theirs"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--checkpoint.keep-last", "0"], "checkpoint.keep_last=0 must be >= 1"),
        (["--checkpoint.keep-every", "0"], "checkpoint.keep_every=0 must be >= 1"),
        (["--init-from", "/nonexistent/ckpt"], "init_from='/nonexistent/ckpt': no such file or directory"),
        (["--dry-run", "--checkpoint.keep-last", "0"], "checkpoint.keep_last=0 must be >= 1"),
    ],
)
def test_bad_checkpoint_settings_fail_before_anything_is_written(tmp_path, capsys, flags, message):
    workdir = tmp_path / "run"
    code = launch.main([*TOY_CLI, *flags, "--workdir", str(workdir), "--metrics.no-progress-bar"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not workdir.exists()


def test_a_workdir_that_cannot_be_written_fails_before_anything_is_written(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for extra in ([], ["--dry-run"]):
        assert launch.main([*TOY_CLI, *extra, "--workdir", str(blocker / "run")]) == 2
        assert f"{blocker} is not a directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_verbose_shows_the_traceback(tmp_path, capsys):
    code = launch.main([*TOY_CLI, "--checkpoint.keep-last", "0", "--verbose", "--workdir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "error: checkpoint.keep_last=0" in err


def test_preemption_without_checkpoints_says_so():
    assert "no checkpoint" in str(loop.Preempted(15, 7, saved=False))
    assert "checkpoint saved" in str(loop.Preempted(15, 7))


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


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    from embodied_jax.data.synthetic import make_episodes
    from embodied_jax.data.writer import write_lerobot_dataset

    root = tmp_path_factory.mktemp("faults_data")
    return write_lerobot_dataset(
        root, make_episodes([5, 6], seed=1), fps=10, robot_type="synthetic", version="v3.0", codec="h264"
    )


def _edited_copy(small_dataset, tmp_path, edit):
    root = tmp_path / "dataset"
    shutil.copytree(small_dataset, root)
    info = json.loads((root / "meta" / "info.json").read_text())
    edit(info["features"])
    (root / "meta" / "info.json").write_text(json.dumps(info))
    return root


def test_a_wrong_feature_shape_in_info_json_names_the_file_and_feature(small_dataset, tmp_path):
    from embodied_jax.data.lerobot import LeRobotDataset
    from embodied_jax.data.lerobot_meta import DatasetError

    root = _edited_copy(small_dataset, tmp_path, lambda f: f["observation.state"].update(shape=[7]))
    with pytest.raises(
        DatasetError,
        match=r"feature 'observation.state': meta/info.json gives shape \[7\], but the "
        r"data holds 4 values per frame",
    ):
        LeRobotDataset(root)


def test_an_image_shape_that_disagrees_with_the_video_is_refused(small_dataset, tmp_path):
    from embodied_jax.data.lerobot import LeRobotDataset
    from embodied_jax.data.lerobot_meta import DatasetError

    def wider(features):
        shape = features["observation.images.front"]["shape"]
        shape[1] = shape[1] * 2  # [H, W, C]: twice the width the video has

    dataset = LeRobotDataset(_edited_copy(small_dataset, tmp_path, wider))
    with pytest.raises(DatasetError, match="camera observation.images.front decodes to .* but meta/info.json gives"):
        dataset.images(0, "observation.images.front", [0])


def test_the_demo_does_not_collect_over_a_directory_that_is_not_a_dataset(tmp_path, capsys):
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "notes.txt").write_text("mine")
    assert launch.main(["demo", "--workdir", str(tmp_path), "--episodes", "2"]) == 2
    assert "holds no LeRobot dataset (no meta/info.json)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]


@pytest.mark.parametrize(
    "module, argv, names",
    [
        ("embodied_jax.data.inspect", ["{missing}"], "no_such_dataset"),
        ("embodied_jax.data.convert", ["{missing}", "{out}"], "no_such_dataset"),
        ("embodied_jax.sim.collect", ["reach", "--episodes", "0", "--out", "{out}"], "episodes must be >= 1"),
        ("experiments.benchmarks.train_step", ["toy", "--mesh.fsdp", "64"], "64"),
        ("experiments.benchmarks.compare_steps", ["toy", "--variant", ""], "at least two --variant"),
    ],
)
def test_clis_print_one_line_unless_verbose(tmp_path, capsys, module, argv, names):
    """Every command line, the benchmarks' included: bad input is one line and status 2."""
    import importlib

    from embodied_jax.cli import run_main

    main = importlib.import_module(module).main
    if module.startswith("experiments.benchmarks"):  # their mains return a report, not a status
        main = functools.partial(run_main, main)
    argv = [a.format(missing=tmp_path / "no_such_dataset", out=tmp_path / "store") for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0], err
    assert main([*argv, "--verbose"]) == 2
    assert "Traceback" in capsys.readouterr().err


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
