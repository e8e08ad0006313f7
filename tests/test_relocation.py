"""Policies that travel: a moved run directory and an exported policy load and act as the original.

The original's tokenizer is hidden while the copies load, so a copy that still read a file of
the run it came from would fail.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import jax
import numpy as np
import pytest


@contextlib.contextmanager
def _hidden(path):
    """``path`` renamed away for the duration (the original run's files must not be needed)."""
    hidden = path.with_name(path.name + ".hidden")
    path.rename(hidden)
    try:
        yield
    finally:
        hidden.rename(path)


@pytest.fixture(scope="module")
def observation(demo_run):
    from embodied_jax.data.lerobot import LeRobotDataset

    frame = LeRobotDataset(demo_run / "dataset").frame(0, 0)
    raw = {k: v for k, v in frame.items() if k.startswith("observation.")}
    raw["task"] = frame["task"]
    return raw


@pytest.fixture(scope="module")
def reference(demo_run, observation):
    from embodied_jax import load_policy

    return load_policy(demo_run).predict(observation, rng=jax.random.key(3))


def test_a_moved_run_loads_and_predicts_as_the_original(demo_run, observation, reference, tmp_path):
    from embodied_jax import load_policy

    moved = tmp_path / "elsewhere"
    shutil.copytree(demo_run, tmp_path / "copy", ignore=shutil.ignore_patterns("dataset", "eval"))
    (tmp_path / "copy").rename(moved)
    with _hidden(demo_run / "tokenizer.model"), _hidden(demo_run / "dataset"):
        bundle = load_policy(moved)
        assert bundle.config.model.tokenizer_path.startswith(str(moved))
        np.testing.assert_array_equal(bundle.predict(observation, rng=jax.random.key(3)), reference)


def test_an_exported_policy_is_small_self_contained_and_acts_as_the_run(
    demo_run, observation, reference, tmp_path, monkeypatch
):
    from embodied_jax import load_policy
    from embodied_jax.export import main

    assert main([str(demo_run), str(tmp_path / "export")]) == 0
    moved = tmp_path / "robot" / "policy"
    moved.parent.mkdir()
    (tmp_path / "export").rename(moved)
    info = json.loads((moved / "policy.json").read_text())
    assert info["step"] == 4 and info["weights"] == "params"  # the test run keeps no EMA
    assert sorted(p.name for p in moved.iterdir()) == [
        "assets",
        "config.json",
        "norm_stats.json",
        "policy.json",
        "weights",
    ]
    exported = sum(p.stat().st_size for p in moved.rglob("*") if p.is_file())
    checkpoint = sum(p.stat().st_size for p in (demo_run / "checkpoints" / "4").rglob("*") if p.is_file())
    assert exported < checkpoint / 2  # no optimizer state, no second copy of the weights
    with _hidden(demo_run / "tokenizer.model"), _hidden(demo_run / "dataset"):
        monkeypatch.chdir(moved.parent)
        bundle = load_policy("policy")  # a relative path, as on a robot's command line
        assert bundle.step == 4
        np.testing.assert_array_equal(bundle.predict(observation, rng=jax.random.key(3)), reference)


def test_export_refuses_a_non_empty_destination_in_one_line(demo_run, tmp_path, capsys):
    from embodied_jax.export import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main([str(demo_run), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty" in err[0]
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_init_from_an_exported_policy_reads_its_weights(demo_run, tmp_path, caplog):
    """``--init-from`` an export: the run starts from the exported (EMA) weights."""
    import dataclasses

    from flax import nnx

    from embodied_jax import load_policy
    from embodied_jax.export import export_policy
    from embodied_jax.train import pretrained
    from embodied_jax.train.loop import build

    out = export_policy(demo_run, tmp_path / "export")
    source = pretrained.locate(out)
    assert source.kind == "exported policy"
    bundle = load_policy(demo_run)
    rt = build(dataclasses.replace(bundle.config, init_from=str(out)), jax.local_devices()[:1])
    params, adapters = pretrained.read_params(source, rt.abstract_state, rt.shardings)
    assert adapters == []
    expected = nnx.state(bundle.model, nnx.Param).to_pure_dict()
    same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), params, expected)
    assert all(jax.tree.leaves(same))
