"""`embodied_jax.data.convert` on a real Ray instance: a local head started with `ray start --head`.

The Ray store must equal the local process pool's, and a Ray worker killed (SIGKILL) in the
middle of an episode must cost only that episode: Ray retries its task (with retries off, the
conversion fails naming the episode and a re-run converts only it), and the episodes that had
finished are not rewritten.
"""

import concurrent.futures
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

from embodied_jax.data import convert as convert_module
from embodied_jax.data import framestore as fs
from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data.convert import convert
from embodied_jax.data.synthetic import make_episodes
from embodied_jax.data.writer import write_lerobot_dataset

pytest.importorskip("ray")

LENGTHS = [8, 11, 6, 9, 6]
CAMERAS = ("front", "wrist")
BLOCKED_EPISODE = 2  # test (b): its worker is killed while it reads the second camera's video
QUIET = dict(log=lambda *_: None)


def _wait_for(condition, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    # v2.1: one video file per episode and camera, so test (b) can stall exactly one episode.
    episodes = make_episodes(LENGTHS, cameras=CAMERAS, height=32, width=32)
    return write_lerobot_dataset(tmp_path_factory.mktemp("raw"), episodes, fps=10, version="v2.1", codec="av1")


@pytest.fixture(scope="module")
def local_store(raw, tmp_path_factory):
    destination = tmp_path_factory.mktemp("local") / "fs"
    convert(raw, destination, workers=2, **QUIET)
    return destination


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray head (2 CPUs, 100 MB object store) in its own process group, killed whole at the end.

    Its environment has no PYTHONPATH to the repo: workers import embodied_jax from the package
    the driver ships. `ray stop` is not used: it would stop every Ray instance on the machine.
    """
    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's unix socket paths live under it
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = pathlib.Path(temp_dir) / "ray_start.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                "--head",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--num-cpus=2",
                "--object-store-memory=100000000",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--temp-dir={temp_dir}",
            ],
            env=env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        assert head.wait(timeout=120) == 0, log.read_text()  # `ray start` returns once its daemons run
        yield f"127.0.0.1:{port}"
    finally:
        if head.poll() is None:
            head.kill()
        try:
            os.killpg(head.pid, signal.SIGKILL)  # the daemons and workers kept `ray start`'s process group
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def _assert_same_store(store: pathlib.Path, reference: pathlib.Path):
    summary, expected = (json.loads((p / fs.SUMMARY).read_text()) for p in (store, reference))
    assert {k: v for k, v in summary.items() if k != "source"} == {k: v for k, v in expected.items() if k != "source"}
    a, b = fs.FrameStore(store), fs.FrameStore(reference)
    assert sorted(a.arrays) == sorted(b.arrays)
    for key in a.arrays:
        np.testing.assert_array_equal(a.arrays[key], b.arrays[key], err_msg=key)
    for position, length in enumerate(LENGTHS):
        for key in a.camera_keys:
            np.testing.assert_array_equal(
                a.images(position, key, np.arange(length)),
                b.images(position, key, np.arange(length)),
                err_msg=f"{position} {key}",
            )
    markers = sorted(p.relative_to(reference) for p in (reference / "done").glob("*.json"))
    assert sorted(p.relative_to(store) for p in (store / "done").glob("*.json")) == markers
    for name in markers + [pathlib.Path("arrays/done.json")]:  # frame counts and checksums
        assert json.loads((store / name).read_text()) == json.loads((reference / name).read_text()), name
    assert fs.verify_store(store) == dict(enumerate(LENGTHS))


def test_ray_conversion_equals_local_pool(raw, local_store, ray_address, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # Ray puts the driver's cwd on the workers' path: keep the repo off it
    report = convert(raw, tmp_path / "fs", ray_address=ray_address, **QUIET)
    assert report.written == list(range(len(LENGTHS))) and report.frames == sum(LENGTHS)
    _assert_same_store(tmp_path / "fs", local_store)


def _readers_of(path: pathlib.Path) -> list[int]:
    """Pids of other processes with `path` open (Linux /proc)."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if any(os.readlink(fd) == str(path) for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:  # exited, or not ours to look at
            continue
    return pids


def _dead(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _stall_hook(directory: pathlib.Path, video: pathlib.Path, fifo: pathlib.Path) -> pathlib.Path:
    """A package for Ray's ``worker_process_setup_hook`` (``stall_hook.install``): a worker about to
    open ``video`` first reads ``fifo`` while it is one, and blocks there. The stall lives in the
    test, not the dataset: a dataset's FIFO is refused before it is opened."""
    package = directory / "stall_hook"
    package.mkdir()
    (package / "__init__.py").write_text(
        textwrap.dedent(
            f"""
            import os
            import stat


            def install():
                from embodied_jax.data import video

                opened = video.VideoFile.__init__

                def stalled(self, path, **kwargs):
                    if str(path) == {str(video)!r} and stat.S_ISFIFO(os.stat({str(fifo)!r}).st_mode):
                        with open({str(fifo)!r}, "rb") as held:
                            held.read()
                    opened(self, path, **kwargs)

                video.VideoFile.__init__ = stalled
            """
        )
    )
    return package


def _file_stats(destination: pathlib.Path, episode: int) -> dict[str, tuple[int, int]]:
    name = fs.episode_name(episode)
    paths = [destination / "done" / f"{name}.json"]
    paths += [p for p in (destination / "frames").glob(f"*/{name}/**/*") if p.is_file()]
    return {str(p.relative_to(destination)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in paths}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the stalled worker through /proc")
@pytest.mark.parametrize("retries", [convert_module.RAY_TASK_RETRIES, 0], ids=["retried", "not-retried"])
def test_killed_worker_resumes_without_rewriting_finished_episodes(
    raw, local_store, ray_address, tmp_path, monkeypatch, retries
):
    import ray

    monkeypatch.setattr(convert_module, "RAY_TASK_RETRIES", retries)
    source, destination = pathlib.Path(shutil.copytree(raw, tmp_path / "raw")), tmp_path / "fs"
    # The worker converting one episode writes its first camera, then blocks before opening the
    # second camera's video (a FIFO with no data, read by a setup hook) until it is killed.
    blocked = source / fmt.V21_VIDEO_PATH.format(
        episode_chunk=0, video_key=f"observation.images.{CAMERAS[1]}", episode_index=BLOCKED_EPISODE
    )
    stall = tmp_path / "stall"
    os.mkfifo(stall)
    fifo = os.open(stall, os.O_RDWR)  # a writer that never writes: readers block instead of seeing EOF
    hook = _stall_hook(tmp_path, blocked, stall)
    package = pathlib.Path(convert_module.__file__).resolve().parents[1]  # embodied_jax/, as convert ships it
    ray.init(
        address=ray_address,
        runtime_env={"py_modules": [str(package), str(hook)], "worker_process_setup_hook": "stall_hook.install"},
    )
    finished = [e for e in range(len(LENGTHS)) if e != BLOCKED_EPISODE]

    def kill_stalled_worker():
        try:
            [pid] = _wait_for(lambda: _readers_of(stall), "a worker to open the stalled video")
            _wait_for(
                lambda: all((destination / "done" / f"{fs.episode_name(e)}.json").exists() for e in finished),
                "the other episodes to finish",
            )
            name = fs.episode_name(BLOCKED_EPISODE)
            assert not (destination / "done" / f"{name}.json").exists()
            assert (destination / "frames" / f"observation.images.{CAMERAS[0]}" / name).exists()  # mid-episode
            stats = {e: _file_stats(destination, e) for e in finished}
            (tmp_path / "unstalled").write_bytes(b"")
            os.replace(tmp_path / "unstalled", stall)  # later workers go on; the killed one holds the FIFO
            os.kill(pid, signal.SIGKILL)
            _wait_for(lambda: _dead(pid), "the worker to die")  # before the FIFO's writer closes
            return stats
        finally:
            os.close(fifo)  # on a failure above, the stalled read ends (EOF) and the conversion fails fast

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            killer = pool.submit(kill_stalled_worker)
            try:
                if retries:  # Ray re-runs the task on a new worker within the same call
                    report = convert(source, destination, ray_address=ray_address, **QUIET)
                else:
                    failed = rf"episodes \[{BLOCKED_EPISODE}\] failed on the Ray cluster"
                    with pytest.raises(fs.FrameStoreError, match=failed):
                        convert(source, destination, ray_address=ray_address, **QUIET)
            finally:
                stats = killer.result()
        if retries:
            assert report.written == list(range(len(LENGTHS))) and report.frames == sum(LENGTHS)
        else:  # a second call converts only the failed episode
            report = convert(source, destination, ray_address=ray_address, **QUIET)
            assert report.skipped == finished and report.written == [BLOCKED_EPISODE]
    finally:
        ray.shutdown()
    assert {e: _file_stats(destination, e) for e in finished} == stats  # finished episodes were not rewritten
    _assert_same_store(destination, local_store)
    again = convert(source, destination, ray_address=ray_address, **QUIET)
    assert again.written == [] and again.skipped == list(range(len(LENGTHS)))
