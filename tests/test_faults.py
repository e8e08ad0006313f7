"""Fault injection around run directories: a second trainer, stale locks, bad checkpoint settings.

Each case is set up by hand (a lock file of a live or dead process, an impossible config) and
the trainer or the launcher must refuse it by name before writing anything, or recover.
"""

from __future__ import annotations

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
from tests.train_utils import TOY_CLI, toy_config


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
