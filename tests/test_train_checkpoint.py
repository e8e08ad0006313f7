"""Orbax checkpoints: cross-mesh resume, retention, SIGTERM final save, SIGKILL during a save."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.train import loop
from embodied_jax.train.checkpoint import Checkpointer
from tests.train_utils import TOY_CLI, losses, read_metrics, replace_train, toy_config


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Ten steps on data=2 × fsdp=4 without a break."""
    result = loop.train(toy_config(tmp_path_factory.mktemp("full"), steps=10, mesh=MeshConfig(data=2, fsdp=4)))
    return losses(result.history)


def test_restore_on_a_different_mesh_continues_identically(tmp_path, uninterrupted):
    first = toy_config(tmp_path, steps=5, mesh=MeshConfig(data=1, fsdp=8), checkpoint=True, save_every=5)
    loop.train(first)
    second = replace_train(
        toy_config(tmp_path, steps=10, mesh=MeshConfig(data=2, fsdp=4), checkpoint=True, save_every=5)
    )
    result = loop.train(second)
    assert result.restored_from == 5
    resumed = losses(result.history)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    for step in resumed:
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-5, rel=1e-5), step


def test_checkpoint_holds_state_iterator_stats_and_config(tmp_path):
    config = toy_config(tmp_path, steps=10, checkpoint=True, save_every=1)
    config = config.__class__(
        **{
            **vars(config),
            "checkpoint": config.checkpoint.__class__(enabled=True, save_every=1, keep_last=2, keep_every=4),
        }
    )
    loop.train(config)
    ckpt = Checkpointer(tmp_path / "checkpoints", config.checkpoint)
    assert ckpt.all_steps() == [4, 8, 9, 10]  # keep-last-2 plus every 4th
    step_dir = tmp_path / "checkpoints" / "10"
    assert {p.name for p in step_dir.iterdir()} >= {"state", "data", "norm_stats", "config"}
    assert (step_dir / "data" / "process_0-of-1.json").read_text() == '{"next_batch": 10}'
    assert ckpt.read_json(10, "config")["config"]["train"]["steps"] == 10
    ckpt.close()


def _launch(args, env, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.launch", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def _wait_for_step(proc, step: int, timeout: float = 240.0) -> list[str]:
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.match(r"step (\d+):", line)
        if m and int(m.group(1)) >= step:
            return lines
    proc.kill()
    raise AssertionError(f"training subprocess did not reach step {step}:\n" + "".join(lines[-30:]))


def test_sigterm_saves_and_resume_continues_identically(tmp_path, subprocess_env):
    workdir = tmp_path / "run"
    proc = _launch(
        [*TOY_CLI, "--train.steps", "100000", "--checkpoint.save-every", "100000", "--workdir", str(workdir)],
        subprocess_env,
    )
    _wait_for_step(proc, 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    m = re.search(r"received SIGTERM at step (\d+): checkpoint saved", out)
    assert m, out
    stopped = int(m.group(1))
    config = toy_config(workdir, steps=stopped + 3, checkpoint=True, save_every=100000)
    resumed = loop.train(config)
    assert resumed.restored_from == stopped
    after = losses(resumed.history)
    assert sorted(after) == [stopped + 1, stopped + 2, stopped + 3]
    straight = losses(loop.train(toy_config(tmp_path / "straight", steps=stopped + 3)).history)
    logged = read_metrics(workdir)
    for step in range(1, stopped + 1):
        assert logged[step] == pytest.approx(straight[step], abs=1e-6), step
    for step in after:
        assert after[step] == pytest.approx(straight[step], abs=1e-6), step


def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path, subprocess_env):
    """A state saved every step, asynchronously: the kill lands while a save is being written."""
    workdir = tmp_path / "run"
    args = [
        "toy",
        "--model.width",
        "256",
        "--model.hidden",
        "1024",
        "--model.depth",
        "2",
        "--train.batch-size",
        "16",
        "--train.steps",
        "100000",
        "--train.log-every",
        "1",
        "--checkpoint.save-every",
        "1",
        "--checkpoint.keep-last",
        "2",
        "--metrics.no-progress-bar",
        "--metrics.no-tensorboard",
        "--workdir",
        str(workdir),
    ]
    proc = _launch(args, subprocess_env)
    _wait_for_step(proc, 4)
    proc.kill()
    proc.wait(timeout=60)
    ckpt_dir = workdir / "checkpoints"
    leftovers = [p.name for p in ckpt_dir.iterdir() if "tmp" in p.name]
    from embodied_jax.train.config import CheckpointConfig

    ckpt = Checkpointer(ckpt_dir, CheckpointConfig())
    latest = ckpt.latest_step()
    assert latest is not None and latest >= 1, (leftovers, sorted(p.name for p in ckpt_dir.iterdir()))
    from embodied_jax.models.toy_flow import ToyFlowConfig

    config = toy_config(workdir, steps=latest + 1, checkpoint=True)
    config = config.__class__(**{**vars(config), "model": ToyFlowConfig(width=256, hidden=1024, depth=2)})
    rt = loop.build(config)
    state, _ = ckpt.restore(rt.abstract_state, rt.shardings)
    assert int(state.step) == latest
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    ckpt.close()
