"""Training core on the 8-device CPU mesh: mesh invariance, shardings, non-finite steps, config errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from embodied_jax.config_registry import register
from embodied_jax.data.iterator import BatchIterator
from embodied_jax.models.toy_flow import ToyFlowConfig, ToyFlowPolicy
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.parallel.sharding import global_batch
from embodied_jax.train import loop
from embodied_jax.train.config import Evaluation
from embodied_jax.train.synthetic import SyntheticData
from experiments import launch
from tests.train_utils import TOY, losses, replace_train, toy_config

MESHES = {
    "data8": MeshConfig(data=8),
    "fsdp8": MeshConfig(data=1, fsdp=8),
    "data2_fsdp4": MeshConfig(data=2, fsdp=4),
    "data2_fsdp2_tensor2": MeshConfig(data=2, fsdp=2, tensor=2, rules=("tensor_parallel",)),
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
    rt = loop.build(toy_config(tmp_path, mesh=MeshConfig(data=2, fsdp=2, tensor=2, rules=("tensor_parallel",))))
    sh = rt.shardings
    assert sh.params["blocks"][0][0]["kernel"].spec == P("fsdp", "tensor")  # ("embed", "mlp")
    assert sh.params["blocks"][0][1]["kernel"].spec == P("tensor", "fsdp")  # ("mlp", "embed")
    assert sh.params["inp"]["kernel"].spec == P(None, "fsdp")
    assert sh.params["out"]["bias"].spec == P("fsdp")  # ("channels",): spread over fsdp, which the rules leave free
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
    with rt.context():
        device_batch = global_batch(batch, rt.mesh, rt.rules)
        step = rt.step_function(device_batch)
    return rt, state, device_batch, step


def test_non_finite_batch_leaves_state_untouched(nan_setup):
    rt, state, batch, step = nan_setup
    with rt.context():
        state, _ = step(state, batch)  # compile outside the transfer guard
        before = jax.device_get(state)
        with jax.transfer_guard("disallow"):
            state, metrics = step(state, batch)
    after = jax.device_get(state)
    for a, b in zip(
        jax.tree.leaves((before.params, before.opt_state)),
        jax.tree.leaves((after.params, after.opt_state)),
        strict=True,
    ):
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

        class It(BatchIterator):
            def __next__(self):
                n = inner.get_state()["next_batch"]
                batch = next(inner)
                if n >= start:
                    batch["state"] = batch["state"] * np.nan
                return batch

            def get_state(self):
                return inner.get_state()

            def set_state(self, state):
                inner.set_state(state)

        return It()


def test_consecutive_non_finite_steps_stop_without_losing_the_good_checkpoint(tmp_path):
    """Batches turn NaN from batch 3 on: step 2's save stays the newest checkpoint (the saves at
    4 and 6 fall in the skipped streak and are not made), the stopping state goes aside
    (``checkpoints/nonfinite-<step>``), and the next launch resumes from step 2."""
    from embodied_jax.train.checkpoint import Checkpointer

    config = toy_config(tmp_path, steps=50, checkpoint=True, save_every=2, max_consecutive_skips=4)
    config = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, keep_last=1))
    with pytest.raises(loop.NonFiniteLossError, match="ending at step 7; newest good checkpoint: step 2") as info:
        loop.train(dataclasses.replace(config, data=NaNAfter(start=3)))
    aside = [p.name for p in (tmp_path / "checkpoints").glob("nonfinite-*")]
    assert len(aside) == 1 and aside[0] in str(info.value)
    ckpt = Checkpointer(tmp_path / "checkpoints", config.checkpoint, read_only=True)
    assert ckpt.all_steps() == [2]
    rt = loop.build(config)
    state, _ = ckpt.restore(rt.abstract_state, rt.shardings)
    assert int(state.total_skips) == 0
    ckpt.close()
    resumed = loop.train(replace_train(dataclasses.replace(config, data=NaNAfter(start=100)), steps=4))
    assert resumed.restored_from == 2 and resumed.final_step == 4


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


def _run_steps(config, steps=2):
    rt = loop.build(config)
    state = loop.initial_state(rt)
    it = config.data.make_iterator(
        model=config.model, process_index=0, process_count=1, batch_size=config.train.batch_size, seed=config.train.seed
    )
    with rt.context():
        step = None
        for _ in range(steps):
            batch = global_batch(next(it), rt.mesh, rt.rules)
            step = step or rt.step_function(batch)
            before = jax.device_get(state)  # the step donates its input
            state, metrics = step(state, batch)
    return rt, before, state, metrics


def test_frozen_parameters_get_no_gradient_and_no_optimizer_state(tmp_path):
    config = toy_config(tmp_path, mesh=MeshConfig(data=2, fsdp=4))
    config = dataclasses.replace(
        config,
        optimizer=dataclasses.replace(config.optimizer, freeze=(r"^blocks/", r"^time_"), frozen_dtype="bfloat16"),
    )
    rt = loop.build(config)
    assert set(rt.abstract_state.params) == {"inp", "out"}
    assert set(rt.abstract_state.frozen) == {"blocks", "time_proj", "time_out"}
    mu_leaves = jax.tree.leaves(rt.abstract_state.opt_state[1][0].mu)
    assert len(mu_leaves) == 4  # kernel and bias of inp and out only
    assert rt.abstract_state.frozen["blocks"][0][0]["kernel"].dtype == np.dtype("bfloat16")
    state = loop.initial_state(rt)
    frozen_before = jax.device_get(state.frozen)
    trainable_before = jax.device_get(state.params)
    _, _, state, _ = _run_steps(config)
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(jax.device_get(state.frozen)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(trainable_before["out"]["kernel"], np.asarray(state.params["out"]["kernel"]))


class _FixedDrawPolicy(ToyFlowPolicy):
    """Flow-matching loss with fixed noise and time: the gradient is a function of the batch only."""

    def loss(self, batch, rng, *, noise=None, time=None):
        actions = batch["actions"]
        return super().loss(batch, rng, noise=jnp.full_like(actions, 0.3), time=jnp.full(actions.shape[:1], 0.5))


@dataclasses.dataclass(frozen=True)
class _FixedDrawConfig(ToyFlowConfig):
    def make(self, rngs):
        return _FixedDrawPolicy(self, rngs)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    base = dataclasses.replace(toy_config(tmp_path, mesh=MeshConfig(data=8)), model=_FixedDrawConfig(**vars(TOY)))
    _, _, one, m1 = _run_steps(base, steps=2)
    accum = dataclasses.replace(base, train=dataclasses.replace(base.train, grad_accum_steps=2))
    _, _, two, m2 = _run_steps(accum, steps=2)
    assert float(m2["loss"]) == pytest.approx(float(m1["loss"]), rel=1e-5)
    assert float(m2["grad_norm"]) == pytest.approx(float(m1["grad_norm"]), rel=1e-4)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(one.params)), jax.tree.leaves(jax.device_get(two.params)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_schedules_and_decay_mask():
    from embodied_jax.train.config import OptimizerConfig
    from embodied_jax.train.optimizer import decay_mask, make_schedule

    cosine = make_schedule(OptimizerConfig(lr=1.0, warmup_steps=10, end_lr_factor=0.1), total_steps=110)
    assert float(cosine(0)) == 0.0 and float(cosine(5)) == pytest.approx(0.5)
    assert float(cosine(10)) == pytest.approx(1.0)
    assert float(cosine(60)) == pytest.approx(0.55, abs=1e-3)
    assert float(cosine(110)) == pytest.approx(0.1)
    constant = make_schedule(OptimizerConfig(lr=2.0, schedule="constant", warmup_steps=4), total_steps=100)
    assert [float(constant(s)) for s in (0, 2, 4, 50)] == pytest.approx([0.0, 1.0, 2.0, 2.0])
    params = {
        "layer": {"kernel": np.zeros((2, 2)), "bias": np.zeros(2)},
        "norm": {"scale": np.zeros((2, 2))},
        "embed": {"embedding": np.zeros((4, 2))},
    }
    mask = decay_mask(OptimizerConfig(), params)
    assert mask == {"layer": {"kernel": True, "bias": False}, "norm": {"scale": False}, "embed": {"embedding": False}}


@pytest.mark.hlo
def test_clipping_equals_optax_and_fuses_into_the_moment_updates():
    """The clip scales each gradient by one scalar: optax's values in both regimes, and the
    compiled AdamW step keeps no clipped copy of a gradient (three full-size fusions per
    parameter: first moment, second moment, parameter; optax's division adds a fourth)."""
    import optax

    from embodied_jax.parallel import hlo
    from embodied_jax.train.config import OptimizerConfig
    from embodied_jax.train.optimizer import clip_by_global_norm, make_optimizer

    rng = np.random.default_rng(0)
    shapes = [(96, 160 + i) for i in range(3)]
    grads = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in shapes]
    for max_norm in (0.5, 1e3):  # clipped, untouched
        ours, _ = clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        ref, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
        for a, b in zip(ours, ref, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=0)

    tx, _ = make_optimizer(OptimizerConfig(clip_norm=1.0), total_steps=10)
    params = [jnp.ones(s) for s in shapes]

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    text = jax.jit(update).lower(params, tx.init(params), grads).compile().as_text()
    full_size = [
        i.result
        for i in hlo.instructions(text)
        if i.opcode == "fusion" and any(i.result.startswith(f"f32[{a},{b}]") for a, b in shapes)
    ]
    assert len(full_size) == 3 * len(shapes), full_size


def test_ema_tracks_parameters(tmp_path):
    config = toy_config(tmp_path, mesh=MeshConfig(data=8), ema_decay=0.5)
    _, before, after, _ = _run_steps(config, steps=2)
    expected = 0.5 * np.asarray(before.ema["out"]["kernel"]) + 0.5 * np.asarray(after.params["out"]["kernel"])
    np.testing.assert_allclose(np.asarray(after.ema["out"]["kernel"]), expected, rtol=1e-6, atol=1e-7)


_RECORDED: dict = {}


@register
@dataclasses.dataclass(frozen=True)
class RecordWeights(Evaluation):
    """An in-training evaluation that keeps the output kernel of the model it is given (in ``_RECORDED``)."""

    def start(self, model, *, config, norm_stats):
        _RECORDED["starts"] = _RECORDED.get("starts", 0) + 1

        def run(model, step):
            _RECORDED[step] = np.asarray(model.out.kernel[...])
            return {"score": float(step)}

        return run


def test_in_training_evaluation_sees_the_ema_weights(tmp_path):
    config = toy_config(tmp_path, mesh=MeshConfig(data=8), ema_decay=0.5)
    _, _, after, _ = _run_steps(config, steps=2)
    _RECORDED.clear()
    result = loop.train(dataclasses.replace(replace_train(config, steps=2, eval_every=1), evaluation=RecordWeights()))
    ema, raw = np.asarray(after.ema["out"]["kernel"]), np.asarray(after.params["out"]["kernel"])
    np.testing.assert_allclose(_RECORDED[2], ema, rtol=1e-6, atol=1e-7)
    assert not np.allclose(ema, raw)
    assert any(h.get("eval/score") == 2.0 for h in result.history)
    assert _RECORDED["starts"] == 1 and 1 in _RECORDED  # started once, kept for the run


def test_cli_shortcuts_reach_the_nested_fields(capsys):
    config = launch.parse(
        [
            "pi05_finetune",
            "--data.root",
            "/data/libero",
            "--coordinator",
            "10.0.0.1:1234",
            "--num-processes",
            "2",
            "--process-id",
            "1",
            "--train.steps",
            "7",
        ]
    )
    assert config.data.root == "/data/libero"
    assert [s.root for s in config.data.sources] == ["/data/libero"] and config.data.pipeline.sources == ()
    assert (config.distributed.coordinator, config.distributed.num_processes, config.distributed.process_id) == (
        "10.0.0.1:1234",
        2,
        1,
    )
    assert config.train.steps == 7
    with pytest.raises(SystemExit):
        launch.parse(["toy", "--help"])
    out = capsys.readouterr().out
    for flag in ("--coordinator", "--num-processes", "--process-id"):
        assert flag in out
    with pytest.raises(SystemExit):
        launch.parse(["pi05_finetune", "--help"])
    assert "--data.root" in capsys.readouterr().out
