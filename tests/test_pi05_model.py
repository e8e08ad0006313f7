"""π0.5 tiny config jitted on an 8-device mesh with FSDP sharding.

Loss, gradients and sampling run sharded; the loss is invariant to prompt padding; packed rows
(``data/packing.py``, block-sparse attention) give each sample its unpacked loss, through the
prefix cache and the joint forward; the prefix-reuse path equals upstream's joint forward at
flow_samples_per_obs=1, and K=2 draws average the two single-draw losses.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from embodied_jax.data.packing import PackingConfig, pack_samples
from embodied_jax.models.pi05.inputs import packed_sample, stack_rows, synthetic_samples
from embodied_jax.models.pi05.variants import variant
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import batch_shardings, mesh_context

BATCH = 8
_TINY = variant("tiny")
CONFIG = dataclasses.replace(
    _TINY,
    vision=dataclasses.replace(_TINY.vision, width=16, depth=1, mlp_dim=32, image_size=16),
    vlm=dataclasses.replace(_TINY.vlm, width=32, mlp_dim=64, num_heads=2, head_dim=8),
    expert=dataclasses.replace(_TINY.expert, width=16, mlp_dim=32, num_heads=2, head_dim=8),
    vocab_size=64,
    camera_names=("base", "left", "right"),
    max_token_len=16,
    action_horizon=4,
    action_dim=6,
    max_state_dim=32,
    synthetic_prompt_len=6,
    num_inference_steps=2,
    attention_impl="xla",
)
JOINT = dataclasses.replace(CONFIG, joint_forward=True)
TWO_DRAWS = dataclasses.replace(CONFIG, flow_samples_per_obs=2)


@nnx.jit
def loss_terms(model, batch, noise, time):
    loss, per_sample, _, _ = model.loss_terms(batch, jax.random.key(0), noise=noise, time=time)
    return loss, per_sample


@nnx.jit
def loss_and_grads(model, batch, rng):
    return nnx.value_and_grad(lambda m: m.loss(batch, rng)[0])(model)


@nnx.jit
def sample(model, obs, rng):
    return model.sample_actions(obs, rng)


def with_config(model, config):
    """The same parameters under another config (one that changes no parameter shape)."""
    graphdef, state = nnx.split(model)
    other = nnx.eval_shape(lambda: config.make(nnx.Rngs(0)))
    nnx.update(other, state)
    return other


def random_model(config, mesh, seed=0):
    """``config``'s model with random parameters placed with their FSDP shardings.

    Built from ``eval_shape`` + host random values: no initialiser is compiled. Every parameter,
    the AdaRMS modulation included, is non-zero (upstream zero-initialises the modulation, which
    gates every expert branch off and leaves the prefix without gradient).
    """
    rng = np.random.default_rng(seed)
    with mesh_context(mesh):
        model = nnx.eval_shape(lambda: config.make(nnx.Rngs(0)))
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        fan_in = shape[-2] if len(shape) >= 2 else 16
        value = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        var.set_value(jax.device_put(value, jax.sharding.NamedSharding(mesh, var.get_value().sharding.spec)))
    return model


@pytest.fixture(scope="module")
def env():
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    model = random_model(CONFIG, mesh)
    samples = synthetic_samples(CONFIG, BATCH, seed=3)
    batch = stack_rows(samples)
    rng = np.random.default_rng(4)
    noise = rng.standard_normal((BATCH, CONFIG.action_horizon, CONFIG.max_action_dim)).astype(np.float32)
    time = rng.uniform(0.05, 0.95, (BATCH,)).astype(np.float32)
    return dict(mesh=mesh, model=model, samples=samples, batch=batch, noise=noise, time=time)


def put(env, batch):
    return jax.device_put(batch, batch_shardings(env["mesh"], batch))


def test_params_are_fsdp_sharded(env):
    kernel = env["model"].llm.layers.experts[0].mlp.gate_proj.kernel[...]  # [layers, embed, mlp]
    assert kernel.sharding.shard_shape(kernel.shape) == (kernel.shape[0], kernel.shape[1] // 8, kernel.shape[2])
    assert len(kernel.sharding.device_set) == 8


def test_loss_and_gradients(env):
    with mesh_context(env["mesh"]):
        loss, grads = loss_and_grads(env["model"], put(env, env["batch"]), jax.random.key(1))
    assert np.isfinite(float(loss)) and float(loss) > 0
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))}
    assert all(np.isfinite(np.asarray(v[...])).all() for v in flat.values())
    for name in (
        "vision_tower.embeddings.patch_embedding.kernel",
        "multi_modal_projector.kernel",
        "llm.embed_tokens.embedding",
        "llm.layers.experts.0.mlp.down_proj.kernel",
        "llm.layers.experts.1.self_attn.q_proj.kernel",
        "time_mlp_in.kernel",
        "action_in_proj.kernel",
    ):
        assert np.abs(np.asarray(flat[name][...])).max() > 0, f"no gradient reaches {name}"


def test_loss_invariant_to_prompt_padding(env):
    b = env["batch"]
    extra = 8
    padded = dict(
        b, tokens=np.pad(b["tokens"], ((0, 0), (0, extra))), token_mask=np.pad(b["token_mask"], ((0, 0), (0, extra)))
    )
    with mesh_context(env["mesh"]):
        base, _ = loss_terms(env["model"], put(env, b), env["noise"], env["time"])
        longer, _ = loss_terms(env["model"], put(env, padded), env["noise"], env["time"])
    np.testing.assert_allclose(float(longer), float(base), rtol=1e-5)


@pytest.mark.parametrize("joint", [False, True])
def test_packed_rows_give_unpacked_losses(env, joint):
    cams = [(1, 0, 0), (1, 1, 0), (0, 1, 1), (1, 1, 1), (0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 1)]
    samples = [
        dict(s, image_masks={c: np.bool_(v) for c, v in zip(CONFIG.camera_names, m, strict=True)}, sid=np.int32(i))
        for i, (s, m) in enumerate(zip(env["samples"], cams, strict=True))
    ]
    patches = CONFIG.vision.num_patches
    packed = [packed_sample(s, CONFIG.camera_names, patches, CONFIG.image_token_id) for s in samples]
    # rows of two full samples: some rows hold three short ones, the rest pad
    config = PackingConfig(seq_len=2 * (3 * patches + 8), max_samples_per_row=3, max_images_per_row=6)
    batch = pack_samples(packed, config, num_rows=8)
    assert batch["images"].shape[1] == 6 and batch["sample_mask"].sum() == BATCH
    assert np.all(batch["sample_mask"].sum(1) <= 3) and batch["sample_mask"][:, 1].any()
    sid = np.where(batch["sample_mask"], batch.pop("sid"), 0)
    unpadded = stack_rows([{k: v for k, v in s.items() if k != "sid"} for s in samples])
    with mesh_context(env["mesh"]):
        model = with_config(env["model"], JOINT) if joint else env["model"]
        _, unpacked = loss_terms(model, put(env, unpadded), env["noise"], env["time"])
        _, per_sample = loss_terms(model, put(env, batch), env["noise"][sid], env["time"][sid])
    got = np.asarray(per_sample)[batch["sample_mask"]]
    np.testing.assert_allclose(got, np.asarray(unpacked).reshape(-1)[sid[batch["sample_mask"]]], rtol=2e-5)


def test_prefix_reuse_equals_joint_forward_and_averages_draws(env):
    b = put(env, env["batch"])
    other_noise = np.random.default_rng(5).standard_normal(env["noise"].shape).astype(np.float32)
    other_time = np.random.default_rng(6).uniform(0.05, 0.95, env["time"].shape).astype(np.float32)
    with mesh_context(env["mesh"]):
        cached, _ = loss_terms(env["model"], b, env["noise"], env["time"])
        cached_other, _ = loss_terms(env["model"], b, other_noise, other_time)
        joint, _ = loss_terms(with_config(env["model"], JOINT), b, env["noise"], env["time"])
        two = loss_terms(
            with_config(env["model"], TWO_DRAWS),
            b,
            np.stack([env["noise"], other_noise], 1),
            np.stack([env["time"], other_time], 1),
        )[0]
    np.testing.assert_allclose(float(cached), float(joint), rtol=1e-5)
    np.testing.assert_allclose(float(two), (float(cached) + float(cached_other)) / 2, rtol=1e-5)


def test_sampling_on_the_mesh(env):
    obs = {k: v for k, v in env["batch"].items() if k != "actions"}
    with mesh_context(env["mesh"]):
        first = sample(env["model"], put(env, obs), jax.random.key(7))
        again = sample(env["model"], put(env, obs), jax.random.key(7))
    assert first.shape == (BATCH, CONFIG.action_horizon, CONFIG.action_dim)
    assert np.isfinite(np.asarray(first)).all()
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))


def test_noise_scale_sets_the_spread_of_the_starting_noise(env):
    """``noise_scale`` s starts sampling from s·N(0, 1) drawn with the call's key: 0.5 gives the
    chunk of explicitly passed half-size noise, 0 the flow's centre whatever the key."""
    obs = put(env, {k: v for k, v in env["batch"].items() if k != "actions"})
    shape = (BATCH, 1, CONFIG.action_horizon, CONFIG.max_action_dim)
    key = jax.random.key(7)
    explicit = nnx.jit(lambda m, o, n: m.sample_actions(o, jax.random.key(0), noise=n))
    with mesh_context(env["mesh"]):
        half = with_config(env["model"], dataclasses.replace(CONFIG, noise_scale=0.5))
        centre = with_config(env["model"], dataclasses.replace(CONFIG, noise_scale=0.0))
        np.testing.assert_allclose(
            np.asarray(sample(half, obs, key)),
            np.asarray(explicit(env["model"], obs, 0.5 * jax.random.normal(key, shape))),
            rtol=1e-6,
            atol=1e-6,
        )
        zero = np.asarray(sample(centre, obs, key))
        np.testing.assert_array_equal(zero, np.asarray(sample(centre, obs, jax.random.key(8))))
        from_zeros = explicit(env["model"], obs, np.zeros(shape, np.float32))
        np.testing.assert_allclose(zero, np.asarray(from_zeros), atol=1e-6)
        assert not np.allclose(zero, np.asarray(sample(env["model"], obs, key)))
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="noise_scale"):
            dataclasses.replace(CONFIG, noise_scale=bad)
