"""Training core on the 8-device CPU mesh: mesh invariance, shardings, non-finite steps, config errors."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.parallel.sharding import global_batch, mesh_context
from embodied_jax.train import loop
from embodied_jax.train.config import SyntheticData
from embodied_jax.train.step import jit_train_step, make_train_step
from experiments import launch
from tests.train_utils import losses, toy_config

MESHES = {
    "data8": MeshConfig(data=8),
    "fsdp8": MeshConfig(data=1, fsdp=8),
    "data2_fsdp4": MeshConfig(data=2, fsdp=4),
    "data2_fsdp2_tensor2": MeshConfig(data=2, fsdp=2, tensor=2),
}


@pytest.fixture(scope="module")
def mesh_losses(tmp_path_factory):
    out = {}
    for name, mesh in MESHES.items():
        result = loop.train(toy_config(tmp_path_factory.mktemp(name), steps=3, mesh=mesh))
        out[name] = losses(result.history)
    return out


def test_same_losses_on_every_mesh(mesh_losses):
    reference = mesh_losses["data8"]
    assert sorted(reference) == [1, 2, 3]
    assert reference[3] < reference[1] * 1.5  # sane values, not NaN
    for name, values in mesh_losses.items():
        for step in (1, 2, 3):
            assert values[step] == pytest.approx(reference[step], abs=1e-5, rel=1e-5), (name, step)


def test_parameter_shardings_follow_the_rules(tmp_path):
    rt = loop.build(toy_config(tmp_path, mesh=MeshConfig(data=2, fsdp=2, tensor=2)))
    sh = rt.shardings
    assert sh.params["blocks"][0][0]["kernel"].spec == P("fsdp", "tensor")  # ("embed", "mlp")
    assert sh.params["blocks"][0][1]["kernel"].spec == P("tensor", "fsdp")  # ("mlp", "embed")
    assert sh.params["inp"]["kernel"].spec == P(None, "fsdp")
    assert sh.params["out"]["bias"].spec == P(None)
    # Adam moments are sharded like their parameters.
    mu = rt.shardings.opt_state[1][0].mu
    assert mu["blocks"][0][0]["kernel"].spec == P("fsdp", "tensor")
    state = loop.initial_state(rt)
    kernel = state.params["blocks"][0][0]["kernel"]
    assert kernel.sharding.spec == P("fsdp", "tensor")
    assert kernel.addressable_shards[0].data.shape == (64 // 2, 128 // 2)


@pytest.fixture(scope="module")
def nan_setup(tmp_path_factory):
    config = toy_config(tmp_path_factory.mktemp("nan"), mesh=MeshConfig(data=2, fsdp=4))
    rt = loop.build(config)
    state = loop.initial_state(rt)
    batch = config.model.synthetic_batch(16)
    batch["state"][3, 0] = np.nan
    with mesh_context(rt.mesh):
        device_batch = global_batch(batch, rt.mesh)
        step = jit_train_step(make_train_step(rt.parts, rt.tx, rt.schedule, config.train, rt.mesh),
                              rt.shardings, device_batch, rt.mesh)
    return rt, state, device_batch, step


def test_non_finite_batch_leaves_state_untouched(nan_setup):
    rt, state, batch, step = nan_setup
    with mesh_context(rt.mesh):
        state, _ = step(state, batch)  # compile outside the transfer guard
        before = jax.device_get(state)
        with jax.transfer_guard("disallow"):
            state, metrics = step(state, batch)
    after = jax.device_get(state)
    for a, b in zip(jax.tree.leaves((before.params, before.opt_state)), jax.tree.leaves((after.params, after.opt_state))):
        np.testing.assert_array_equal(a, b)
    assert int(after.step) == int(before.step) + 1
    assert int(after.skips) == 2 and int(after.total_skips) == 2
    assert int(metrics["skipped"]) == 1
    assert not np.isfinite(float(metrics["loss"]))


@dataclasses.dataclass(frozen=True)
class NaNAfter(SyntheticData):
    """Synthetic batches that turn NaN from batch ``start`` on."""

    start: int = 3

    def make_iterator(self, **kw):
        inner = super().make_iterator(**kw)
        start = self.start

        class It:
            def __iter__(self):
                return self

            def __next__(self):
                n = inner.get_state()["next_batch"]
                batch = next(inner)
                if n >= start:
                    batch["state"] = batch["state"] * np.nan
                return batch

            get_state = inner.get_state
            set_state = inner.set_state

        return It()


def test_consecutive_non_finite_steps_stop_with_checkpoint(tmp_path):
    config = toy_config(tmp_path, steps=50, checkpoint=True, max_consecutive_skips=4)
    config = dataclasses.replace(config, data=NaNAfter(start=3))
    with pytest.raises(loop.NonFiniteLossError, match="4 consecutive non-finite steps ending at step 7"):
        loop.train(config)
    from embodied_jax.train.checkpoint import Checkpointer

    ckpt = Checkpointer(tmp_path / "checkpoints", config.checkpoint)
    saved = ckpt.latest_step()
    assert saved is not None and saved >= 7
    rt = loop.build(config)
    state, _ = ckpt.restore(rt.abstract_state, rt.shardings)
    assert int(state.total_skips) >= 4
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))
    ckpt.close()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["toy", "--mesh.data", "3"], "mesh.data=3"),
        (["toy", "--train.batch-size", "12"], "train.batch_size=12"),
        (["toy", "--train.steps", "0"], "train.steps=0"),
        (["toy", "--optimizer.schedule", "linear", "--train.steps", "2"], "optimizer.schedule='linear'"),
    ],
)
def test_bad_config_fails_before_anything_is_written(tmp_path, capsys, argv, message):
    workdir = tmp_path / "run"
    code = launch.main([*argv, "--workdir", str(workdir), "--metrics.no-progress-bar"])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not workdir.exists()


def test_bad_override_names_the_field(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["toy", "--train.stepz", "3", "--workdir", str(tmp_path / "run")])
    assert exit_info.value.code != 0
    assert "--train.stepz" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_help_lists_experiments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "toy", "toy_large"):
        assert name in out
