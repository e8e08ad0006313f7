"""Two real processes on localhost (4 CPU devices each) train like one 8-device process.

Hybrid meshes put the data or the fsdp axis across the two processes (``--mesh.dcn-*``);
checkpoints move between the two layouts; each process reads only its shard of a dataset.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from etils import epath

from embodied_jax.data.pipeline import DataConfig, SourceConfig, make_data_iterator
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.synthetic import make_episodes
from embodied_jax.data.writer import write_lerobot_dataset
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train import loop
from embodied_jax.train.checkpoint import IteratorRestore, IteratorStateHandler
from embodied_jax.train.synthetic import SyntheticIterator
from tests.train_utils import TOY, TOY_CLI, losses, read_metrics, toy_config

STEPS, SAVE_EVERY = 4, 2  # checkpoints at steps 2 and 4
DCN_DATA = ["--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.dcn-data", "2"]  # data 2 (across) × fsdp 4 (within)
DCN_FSDP = ["--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.dcn-fsdp", "2"]  # fsdp 8 = 2 (across) × 4 (within)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(commands: list[list[str]], env: dict, logs: pathlib.Path, timeout: float = 300) -> list[str]:
    """Run one command per process of a 2-process JAX cluster; the first failure (or the
    timeout) kills the others, which would otherwise wait for their peer until XLA gives up."""
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i, command in enumerate(commands):
        files.append(open(logs / f"process_{i}.log", "w+"))
        procs.append(subprocess.Popen(command, env=env, stdout=files[-1], stderr=subprocess.STDOUT, text=True))
    deadline, timed_out = time.monotonic() + timeout, False
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                break
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    outs = []
    for f in files:
        f.seek(0)
        outs.append(f.read())
        f.close()
    failed = [
        f"process {i} exited with {p.returncode}:\n{out[-2000:]}"
        for i, (p, out) in enumerate(zip(procs, outs, strict=True))
        if p.returncode
    ]
    assert not failed, (f"killed after {timeout} s\n" if timed_out else "") + "\n".join(failed)
    return outs


def _two_process_env(subprocess_env: dict) -> dict:
    env = dict(subprocess_env)
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("device_count=8", "device_count=4")
    return env


def _launch_two(tmp: pathlib.Path, args: list[str], env: dict, checkpoints: pathlib.Path | None) -> list[str]:
    """``experiments.launch`` in 2 processes; separate workdirs, one checkpoint directory (a shared filesystem)."""
    port = _free_port()
    ckpt = (
        ["--checkpoint.directory", str(checkpoints), "--checkpoint.save-every", str(SAVE_EVERY)]
        if checkpoints
        else ["--checkpoint.no-enabled"]
    )
    commands = [
        [
            sys.executable,
            "-m",
            "experiments.launch",
            *TOY_CLI,
            "--train.steps",
            str(STEPS),
            *args,
            *ckpt,
            "--workdir",
            str(tmp / f"p{pid}"),
            "--coordinator",
            f"127.0.0.1:{port}",
            "--num-processes",
            "2",
            "--process-id",
            str(pid),
        ]
        for pid in range(2)
    ]
    return _run_processes(commands, _two_process_env(env), tmp / "logs")


def _assert_losses(got: dict[int, float], expected: dict[int, float], steps) -> None:
    assert sorted(got) == list(steps)
    for step in got:
        assert got[step] == pytest.approx(expected[step], abs=1e-5, rel=1e-5), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 8 devices (data=2 × fsdp=4): losses and checkpoints at steps 2 and 4."""
    workdir = tmp_path_factory.mktemp("single")
    result = loop.train(
        toy_config(workdir, steps=STEPS, mesh=MeshConfig(data=2, fsdp=4), checkpoint=True, save_every=SAVE_EVERY)
    )
    return losses(result.history), result.checkpoint_dir


@pytest.fixture(scope="module")
def dcn_data_run(tmp_path_factory, subprocess_env):
    """Two processes, the data axis across them: process 0's losses and the checkpoint directory."""
    tmp = tmp_path_factory.mktemp("dcn_data")
    _launch_two(tmp, DCN_DATA, subprocess_env, tmp / "checkpoints")
    assert not (tmp / "p1" / "metrics.jsonl").exists()  # only process 0 writes metrics
    return read_metrics(tmp / "p0"), tmp / "checkpoints"


def test_dcn_data_two_processes_match_one_process(dcn_data_run, reference):
    _assert_losses(dcn_data_run[0], reference[0], range(1, STEPS + 1))


def test_dcn_fsdp_two_processes_match_one_process(tmp_path, subprocess_env, reference):
    # Parameters and optimizer state are sharded over all 8 devices of both processes.
    _launch_two(tmp_path, DCN_FSDP, subprocess_env, None)
    _assert_losses(read_metrics(tmp_path / "p0"), reference[0], range(1, STEPS + 1))


def test_two_process_checkpoint_restores_in_one_process(tmp_path, dcn_data_run, reference):
    data = dcn_data_run[1] / str(SAVE_EVERY) / "data"
    assert {p.name for p in data.glob("*.json")} == {"process_0-of-2.json", "process_1-of-2.json"}
    shutil.copytree(dcn_data_run[1] / str(SAVE_EVERY), tmp_path / "checkpoints" / str(SAVE_EVERY))
    # Another mesh as well (fsdp=8): the restore reshards the state.
    result = loop.train(
        toy_config(tmp_path, steps=STEPS, mesh=MeshConfig(data=1, fsdp=8), checkpoint=True, save_every=SAVE_EVERY)
    )
    assert result.restored_from == SAVE_EVERY
    # The continued losses equal the uninterrupted run's: parameters, optimizer state and data position restored.
    _assert_losses(losses(result.history), reference[0], range(SAVE_EVERY + 1, STEPS + 1))


def test_one_process_checkpoint_restores_in_two_processes(tmp_path, subprocess_env, reference):
    shutil.copytree(reference[1] / str(SAVE_EVERY), tmp_path / "checkpoints" / str(SAVE_EVERY))
    outs = _launch_two(tmp_path, DCN_FSDP, subprocess_env, tmp_path / "checkpoints")
    for out in outs:
        assert f"resumed from step {SAVE_EVERY}" in out, out[-3000:]
    _assert_losses(read_metrics(tmp_path / "p0"), reference[0], range(SAVE_EVERY + 1, STEPS + 1))


# ----- data: iterator state across process counts, per-host shards ------------------------------------------------
LENGTHS = [8, 11, 6, 9, 6]  # 40 frames


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    episodes = make_episodes(LENGTHS, cameras=("front",), height=32, width=32)
    return write_lerobot_dataset(tmp_path_factory.mktemp("lerobot"), episodes, fps=10)


def _data_config(root) -> DataConfig:
    # No read-ahead: a process loads exactly the samples it yields.
    return DataConfig(
        sources=(SourceConfig(str(root)),),
        spec=SampleSpec(action_horizon=2),
        image_size=None,
        read_threads=0,
        read_buffer=0,
    )


def test_iterator_state_and_process_count(tmp_path, dataset):
    """A pipeline's per-process position restores only with the process count that saved it;
    the synthetic iterator's state (the step) restores under any."""
    handler = IteratorStateHandler()
    saved = epath.Path(tmp_path)
    for index in range(2):
        with make_data_iterator(
            _data_config(dataset), process_index=index, process_count=2, batch_size=2, seed=0
        ) as it:
            next(it)
            (saved / f"process_{index}-of-2.json").write_text(json.dumps(it.get_state()))
    with make_data_iterator(_data_config(dataset), process_index=0, process_count=1, batch_size=4, seed=0) as it:
        with pytest.raises(ValueError, match="written by 2 processes, not the 1 running now"):
            handler.restore(saved, IteratorRestore(it))
    for index in range(2):
        (saved / f"process_{index}-of-2.json").write_text(json.dumps({"next_batch": 7}))
    synthetic = SyntheticIterator(TOY, 0, 1, 16, 0)
    handler.restore(saved, IteratorRestore(synthetic))
    assert synthetic.get_state() == {"next_batch": 7}
    (saved / "process_1-of-2.json").write_text(json.dumps({"next_batch": 8}))
    with pytest.raises(ValueError, match="different iterator states"):
        handler.restore(saved, IteratorRestore(synthetic))


# Builds the training data iterator as ``loop.train`` does, reads one epoch, and records the frames
# it yielded (decoded from the self-identifying video frames) and every sample it loaded.
_DATA_WORKER = """
import json, sys
import numpy as np
import jax
from embodied_jax.data import samples
from embodied_jax.data.pipeline import DataConfig, SourceConfig
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.synthetic import decode_frame_id
from embodied_jax.parallel import distributed
from embodied_jax.data.sample_transform import ModelInputs
from embodied_jax.data.sources import LeRobotData

root, coordinator, pid, out, batch_size, batches = sys.argv[1:]
distributed.initialize(distributed.DistributedConfig(coordinator=coordinator, num_processes=2, process_id=int(pid)))
loaded = []
load = samples.SampleLoader.__call__
def counting_load(self, index):
    loaded.append(int(index))
    return load(self, index)
samples.SampleLoader.__call__ = counting_load

class Model:  # stands in for a model config: its input builder keeps the camera image
    def input_builder(self):
        return lambda sample: {"image": sample["images"]["front"], "state": sample["state"]}

data = LeRobotData(DataConfig(sources=(SourceConfig(root),), spec=SampleSpec(action_horizon=2), image_size=None,
                              read_threads=0, read_buffer=0),
                   ModelInputs(cameras=(("observation.images.front", "front"),)))
it = data.make_iterator(model=Model(), process_index=jax.process_index(), process_count=jax.process_count(),
                        batch_size=int(batch_size), seed=0)
frames = []
for _ in range(int(batches)):
    images = next(it)["image"]
    frames += [decode_frame_id(np.rint((image + 1) * 127.5).astype(np.uint8))[:2] for image in images]
it.close()
json.dump({"process": [jax.process_index(), jax.process_count()], "frames": frames, "loaded": loaded},
          open(out, "w"))
"""


def test_each_process_reads_only_its_shard(tmp_path, dataset, subprocess_env):
    batch_size, epoch = 8, sum(LENGTHS)  # 4 samples per process per batch
    batches = epoch // batch_size
    port = _free_port()
    commands = [
        [
            sys.executable,
            "-c",
            _DATA_WORKER,
            str(dataset),
            f"127.0.0.1:{port}",
            str(pid),
            str(tmp_path / f"p{pid}.json"),
            str(batch_size),
            str(batches),
        ]
        for pid in range(2)
    ]
    _run_processes(commands, _two_process_env(subprocess_env), tmp_path / "logs", timeout=180)
    starts = np.concatenate([[0], np.cumsum(LENGTHS)])
    shards = []
    for pid in range(2):
        report = json.loads((tmp_path / f"p{pid}.json").read_text())
        assert report["process"] == [pid, 2]
        frames = [int(starts[episode] + frame) for episode, frame in report["frames"]]
        assert len(frames) == len(set(frames)) == epoch // 2
        # Nothing but its own samples was loaded (and decoded) by this process.
        assert sorted(report["loaded"]) == sorted(frames)
        shards.append(set(frames))
    assert not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(range(epoch))
