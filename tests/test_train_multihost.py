"""Two real processes on localhost (4 CPU devices each) train like one 8-device process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train import loop
from tests.train_utils import TOY_CLI, losses, read_metrics, toy_config


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_process(tmp_path, subprocess_env):
    port = _free_port()
    env = dict(subprocess_env)
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace("device_count=8", "device_count=4")
    procs = []
    for pid in range(2):
        # Hybrid mesh: the data axis spans the two processes (DCN), fsdp=4 within each.
        args = [*TOY_CLI, "--train.steps", "3", "--mesh.data", "1", "--mesh.fsdp", "4", "--mesh.dcn-data", "2",
                "--checkpoint.no-enabled", "--workdir", str(tmp_path / f"p{pid}"),
                "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid)]
        procs.append(subprocess.Popen([sys.executable, "-m", "experiments.launch", *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outs.append(out)
        assert proc.returncode == 0, out[-3000:]
    two = read_metrics(tmp_path / "p0")
    assert not (tmp_path / "p1" / "metrics.jsonl").exists()  # only process 0 writes metrics
    one = losses(loop.train(toy_config(tmp_path / "single", steps=3, mesh=MeshConfig(data=2, fsdp=4))).history)
    assert sorted(two) == [1, 2, 3]
    for step in two:
        assert two[step] == pytest.approx(one[step], abs=1e-5, rel=1e-5), step
