"""π0.5's training-only privileged head: it reads the image tokens, regresses a per-frame feature
the policy never sees, adds its weighted error to the flow loss and nothing else; the data layer
loads, normalises and hands over that feature in training only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embodied_jax import config_registry
from embodied_jax.data.lerobot_meta import DatasetError
from embodied_jax.data.sample_transform import ModelInputs
from embodied_jax.data.sources import DataConfigError
from embodied_jax.data.synthetic import make_episodes
from embodied_jax.data.writer import write_lerobot_dataset
from embodied_jax.models.pi05.inputs import stack_rows, synthetic_samples
from embodied_jax.models.pi05.model import PRIVILEGED_CHANNELS
from embodied_jax.models.pi05.variants import variant
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context
from embodied_jax.train.loop import prepare
from experiments.pi05 import pi05_finetune_tiny

ENV_KEY = "observation.environment_state"
WIDTH, WEIGHT, BATCH = 5, 0.5, 4
_TINY = variant("tiny")
PLAIN = dataclasses.replace(
    _TINY,
    vision=dataclasses.replace(_TINY.vision, width=16, depth=1, mlp_dim=32, image_size=16),
    vlm=dataclasses.replace(_TINY.vlm, width=32, mlp_dim=64, num_heads=2, head_dim=8),
    expert=dataclasses.replace(_TINY.expert, width=16, mlp_dim=32, num_heads=2, head_dim=8),
    vocab_size=64,
    camera_names=("base", "left"),
    max_token_len=16,
    action_horizon=4,
    action_dim=6,
    max_state_dim=8,
    synthetic_prompt_len=6,
    num_inference_steps=2,
    attention_impl="xla",
)
HEADED = dataclasses.replace(PLAIN, privileged_weight=WEIGHT, privileged_state_dim=WIDTH)


@nnx.jit
def _loss(model, batch, noise, time):
    loss, metrics = model.loss(batch, jax.random.key(0), noise=noise, time=time)
    return loss, metrics


@nnx.jit
def _sample(model, obs):
    return model.sample_actions(obs, jax.random.key(2))


@pytest.fixture(scope="module")
def models():
    with mesh_context(make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))):
        yield _models()


def _models():
    plain, headed = PLAIN.make(nnx.Rngs(0)), HEADED.make(nnx.Rngs(0))
    batch = stack_rows(synthetic_samples(PLAIN, BATCH, seed=3))
    batch["images"]["left"][1:] = 0.0  # one row's second camera is the only one present there
    batch["image_masks"]["left"] = np.array([True, False, False, False])
    batch["privileged_state"] = np.random.default_rng(5).normal(size=(BATCH, WIDTH)).astype(np.float32)
    rng = np.random.default_rng(4)
    noise = rng.standard_normal((BATCH, PLAIN.flow_samples_per_obs, PLAIN.action_horizon, PLAIN.max_action_dim))
    time = rng.uniform(0.05, 0.95, (BATCH, PLAIN.flow_samples_per_obs))
    return plain, headed, batch, noise.astype(np.float32), time.astype(np.float32)


def test_the_head_adds_its_weighted_error_and_changes_no_flow_number(models):
    plain, headed, batch, noise, time = models
    shared = dict(nnx.to_flat_state(nnx.state(plain, nnx.Param)))
    head = {k: v for k, v in nnx.to_flat_state(nnx.state(headed, nnx.Param)) if k not in shared}
    assert sorted({k[0] for k in head}) == ["privileged_head", "privileged_token_proj"]
    plain_loss, plain_metrics = _loss(plain, {k: v for k, v in batch.items() if k != "privileged_state"}, noise, time)
    loss, metrics = _loss(headed, batch, noise, time)
    assert "privileged_loss" not in plain_metrics
    np.testing.assert_allclose(metrics["flow_loss"], plain_loss, rtol=1e-6)
    np.testing.assert_allclose(loss, metrics["flow_loss"] + WEIGHT * metrics["privileged_loss"], rtol=1e-6)

    # The head's reading, by hand: a few channels per image token (absent cameras zeroed),
    # flattened in token order, one linear map.
    tokens = np.asarray(headed.embed_images(jnp.stack([batch["images"][c] for c in PLAIN.camera_names], axis=1)))
    per_camera = tokens.shape[1] // len(PLAIN.camera_names)
    present = np.stack([batch["image_masks"][c] for c in PLAIN.camera_names], axis=1)
    keep = np.repeat(present, per_camera, axis=1)[..., None]
    proj, out = headed.privileged_token_proj, headed.privileged_head
    channels = (tokens @ np.asarray(proj.kernel[...]) + np.asarray(proj.bias[...])) * keep
    assert channels.shape[-1] == PRIVILEGED_CHANNELS
    guess = channels.reshape(BATCH, -1) @ np.asarray(out.kernel[...]) + np.asarray(out.bias[...])
    expected = np.mean((guess - batch["privileged_state"]) ** 2)
    np.testing.assert_allclose(metrics["privileged_loss"], expected, rtol=1e-4)


def test_the_heads_error_trains_the_vision_tower_and_sampling_never_runs_it(models):
    plain, headed, batch, _, _ = models

    @nnx.jit
    def privileged_grads(model):
        def error(m):
            inputs = m._inputs(batch)
            m.prefix_cache(inputs)  # the prefix leaves the image tokens for the head
            return m.privileged_loss(batch, inputs)

        return nnx.grad(error)(model)

    grads = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(privileged_grads(headed), nnx.Param))}
    assert np.abs(np.asarray(grads["vision_tower.embeddings.patch_embedding.kernel"][...])).max() > 0
    assert np.abs(np.asarray(grads["multi_modal_projector.kernel"][...])).max() > 0
    assert not np.asarray(grads["action_out_proj.kernel"][...]).any()  # the action path plays no part

    observation = {k: v for k, v in batch.items() if k not in ("actions", "privileged_state")}
    np.testing.assert_array_equal(_sample(headed, observation), _sample(plain, observation))
    with pytest.raises(KeyError, match="no 'privileged_state'.*--data.inputs.privileged-key"):
        headed.loss({k: v for k, v in batch.items() if k != "privileged_state"}, jax.random.key(0))
    with pytest.raises(ValueError, match="privileged_weight > 0 needs privileged_state_dim"):
        nnx.eval_shape(lambda: dataclasses.replace(PLAIN, privileged_weight=1.0).make(nnx.Rngs(0)))


def test_the_feature_is_handed_over_in_training_only_and_old_configs_read_back_without_it():
    sample = {"observation.state": np.ones(4, np.float32), "task": "t", "cam": np.zeros((2, 2, 3)), ENV_KEY: [1.0, 2.0]}
    inputs = ModelInputs(cameras=(("cam", "base_0_rgb"),), privileged_key=ENV_KEY)
    np.testing.assert_array_equal(inputs.rename(sample)["privileged_state"], [1.0, 2.0])
    served = {k: v for k, v in sample.items() if k != ENV_KEY}  # a robot's observation has none
    assert "privileged_state" not in inputs.rename(served)
    assert "privileged_state" not in dataclasses.replace(inputs, privileged_key=None).rename(sample)
    saved = config_registry.to_dict(PLAIN)
    for field in ("privileged_weight", "privileged_state_dim"):
        saved["config"].pop(field)
    assert config_registry.from_dict(saved) == PLAIN  # a run saved before the head existed


@pytest.fixture(scope="module")
def with_env_state(tmp_path_factory):
    """A 32 px two-camera dataset whose frames carry a 7-wide ``observation.environment_state``."""
    episodes = make_episodes([4, 5], cameras=("scene", "wrist"), state_dim=4, action_dim=4, height=32, width=32)
    rng = np.random.default_rng(0)
    for episode in episodes:
        episode[ENV_KEY] = rng.normal(3.0, 2.0, (len(episode["action"]), 7)).astype(np.float32)
    root = write_lerobot_dataset(tmp_path_factory.mktemp("env") / "ds", episodes, fps=10, image_storage="png")
    return str(root), np.concatenate([e[ENV_KEY] for e in episodes])


def _run(root, tokenizer, *, weight, key):
    config = pi05_finetune_tiny()
    model = dataclasses.replace(config.model, privileged_weight=weight, tokenizer_path=tokenizer)
    data = dataclasses.replace(
        config.data, root=root, inputs=dataclasses.replace(config.data.inputs, privileged_key=key)
    )
    return dataclasses.replace(config, model=model, data=data)


def test_a_run_loads_normalises_and_batches_the_feature_and_names_what_is_missing(with_env_state, tmp_path):
    from experiments import demo

    root, frames = with_env_state
    tokenizer = str(demo.build_tokenizer(tmp_path / "tokenizer.model", vocab_size=variant("demo").vocab_size))
    prepared = prepare(_run(root, tokenizer, weight=2.0, key=ENV_KEY))
    assert prepared.model.privileged_state_dim == 7
    assert ENV_KEY in prepared.data.pipeline.spec.extra_keys
    assert dict(prepared.data.pipeline.norm_modes)[ENV_KEY] == "mean_std"
    iterator = prepared.data.make_iterator(model=prepared.model, process_index=0, process_count=1, batch_size=4, seed=0)
    try:
        batch = next(iterator)
        stats = iterator.stats[ENV_KEY]
    finally:
        iterator.close()
    normalised = (frames - np.asarray(stats.mean)) / np.asarray(stats.std)
    assert batch["privileged_state"].shape == (4, 7)
    for row in np.asarray(batch["privileged_state"]):  # each row is one frame's feature, normalised
        assert np.abs(normalised - row).max(axis=1).min() < 1e-4

    with pytest.raises(DataConfigError, match="trains no head on it.*--model.privileged-weight"):
        prepare(_run(root, tokenizer, weight=0.0, key=ENV_KEY))
    with pytest.raises(DatasetError, match="the head needs a feature.*--data.inputs.privileged-key"):
        prepare(_run(root, tokenizer, weight=1.0, key=None))
    with pytest.raises(DatasetError, match="no feature 'observation.goal'.*--data.inputs.privileged-key"):
        prepare(_run(root, tokenizer, weight=1.0, key="observation.goal"))
