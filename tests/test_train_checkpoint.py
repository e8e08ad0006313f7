"""Orbax checkpoints: cross-mesh resume, retention, SIGTERM final save, SIGKILL during a save."""

from __future__ import annotations

import json
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
from embodied_jax.train.checkpoint import Checkpointer, damage
from embodied_jax.train.config import MetricsConfig
from embodied_jax.train.metrics import MetricsWriter
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


def test_metrics_rows_are_dropped_only_after_the_step_a_restore_resumes_from(tmp_path):
    path = tmp_path / "metrics.jsonl"
    old = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo'
    config = MetricsConfig(progress_bar=False, tensorboard=False)
    path.write_text(old)  # five rows and one a kill cut short
    MetricsWriter(config, tmp_path, 10, 3, resumed_from=3).close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    path.write_text(old)
    MetricsWriter(config, tmp_path, 10, 0).close()  # restored nothing: a new history, the old one kept beside it
    assert path.read_text() == "" and (tmp_path / "metrics.jsonl.1").read_text() == old


def test_only_errors_about_the_steps_own_bytes_count_as_damage(tmp_path):
    step = tmp_path / "checkpoints" / "4"
    (step / "state").mkdir(parents=True)
    sharding = f'Error reading local file "{step}/state/_sharding"'
    assert "FAILED_PRECONDITION" in damage(ValueError(f"FAILED_PRECONDITION: {sharding}: Invalid JSON"), step)
    busy = ValueError(f"FAILED_PRECONDITION: {sharding}: Device or resource busy [os_error_code='16']")
    assert damage(busy, step) is None  # what the OS returned (EBUSY), not what the file holds
    elsewhere = f'Error reading local file "{tmp_path}/checkpoints/40/state/_sharding"'
    assert damage(ValueError(f"DATA_LOSS: {elsewhere}: checksum"), step) is None  # another step's file
    assert damage(ValueError(f"RESOURCE_EXHAUSTED: {sharding}"), step) is None
    assert damage(FileNotFoundError(f"File {step}/norm_stats/metadata not found."), step)
    assert damage(FileNotFoundError(f"File {tmp_path}/elsewhere not found."), step) is None
    assert damage(KeyError("tree_metadata"), step) is None  # well-formed JSON of another shape: not proven
    step.joinpath("state").rmdir()
    step.rmdir()  # the step is gone (moved, unmounted): nothing proven about its bytes
    assert damage(ValueError(f"DATA_LOSS: {sharding}: checksum"), step) is None


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
