"""GR00T-N1.5 policy on an 8-device CPU mesh: training step pieces, packing, embodiment slots, freezing."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx

from embodied_jax.data.packing import PackingConfig, pack_samples
from embodied_jax.models.gr00t import Gr00tConfig, freeze_regexes
from embodied_jax.models.gr00t.inputs import packed_sample
from embodied_jax.models.gr00t.variants import variant
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import batch_shardings, mesh_context

_TINY = variant("tiny")
_HEAD = _TINY.action_head
TINY = dataclasses.replace(
    _TINY,
    camera_names=("front",),
    max_token_len=40,
    action_head=dataclasses.replace(
        _HEAD,
        hidden_size=24,
        num_future_tokens=2,
        max_seq_len=8,
        dit=dataclasses.replace(_HEAD.dit, output_dim=24, dropout=0.1),
        vl_self_attention=dataclasses.replace(_HEAD.vl_self_attention, dropout=0.1),
    ),
    attention_impl="xla",
    synthetic_text_tokens=(8, 10),
)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))


@pytest.fixture(scope="module")
def model(mesh):
    with mesh_context(mesh):
        return nnx.jit(lambda: TINY.make(nnx.Rngs(0)))()


def _noise_time(batch, seed=5):
    rng = np.random.default_rng(seed)
    b = batch["actions"].shape[0]
    return rng.normal(size=batch["actions"].shape).astype(np.float32), rng.uniform(0, 1, b).astype(np.float32)


@pytest.fixture(scope="module")
def train_outputs(model, mesh):
    batch = TINY.synthetic_batch(8, seed=1)
    batch["embodiment_id"] = np.array([0, 2, 0, 2, 2, 0, 0, 2], np.int32)
    with mesh_context(mesh):
        sharded = jax.device_put(batch, batch_shardings(mesh, batch))

        @nnx.jit
        def loss_and_grad(m, b):
            return nnx.value_and_grad(lambda m: m.loss(b, jax.random.key(0)), has_aux=True)(m)

        (loss, metrics), grads = loss_and_grad(model, sharded)
        actions = nnx.jit(lambda m, b: m.sample_actions(b, jax.random.key(1)))(model, sharded)
    return batch, loss, metrics, grads, actions


def test_loss_gradients_and_sampling_on_mesh(model, train_outputs):
    batch, loss, metrics, grads, actions = train_outputs
    assert np.isfinite(float(loss)) and float(loss) > 0
    assert int(metrics["tokens"]) == int(batch["token_mask"].sum())
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.all(np.isfinite(np.asarray(g))) for g in leaves)
    for path in (
        ("backbone", "eagle_model", "vision_model", "encoder", "layers", "mlp", "fc1", "kernel"),
        ("backbone", "eagle_model", "language_model", "layers", "self_attn", "q_proj", "kernel"),
        ("action_head", "model", "transformer_blocks", "cross_block", "attn1", "to_k", "kernel"),
        ("action_head", "future_tokens", "embedding"),
    ):
        g = nnx.state(grads, nnx.Param)
        for key in path:
            g = g[key]
        assert np.abs(np.asarray(g[...])).max() > 0, path
    assert actions.shape == (8, TINY.action_horizon, TINY.action_dim)
    assert np.all(np.isfinite(np.asarray(actions)))
    # parameters really are sharded over the mesh
    kernel = model.backbone.eagle_model.language_model.layers.mlp.gate_proj.kernel[...]
    assert len(kernel.sharding.device_set) == 8


def test_noise_scale_zero_samples_the_flows_centre_whatever_the_key(model, mesh):
    batch = TINY.synthetic_batch(4, seed=1)
    with mesh_context(mesh):
        centre = nnx.eval_shape(lambda: dataclasses.replace(TINY, noise_scale=0.0).make(nnx.Rngs(0)))
        nnx.update(centre, nnx.state(model))
        sharded = jax.device_put(batch, batch_shardings(mesh, batch))
        draw = nnx.jit(lambda m, b, k: m.sample_actions(b, k))
        first, second = (np.asarray(draw(centre, sharded, jax.random.key(k))) for k in (1, 2))
    np.testing.assert_array_equal(first, second)
    with pytest.raises(ValueError, match="noise_scale"):
        dataclasses.replace(TINY, noise_scale=-1.0)


def test_embodiment_gradients_land_only_in_used_slots(train_outputs):
    _, _, _, grads, _ = train_outputs
    head = grads.action_head
    for layer in (head.state_encoder.layer1, head.action_encoder.W2, head.action_decoder.layer2):
        for name in ("W", "b"):
            g = np.asarray(getattr(layer, name)[...])
            per_slot = np.abs(g).reshape(g.shape[0], -1).max(axis=1)
            assert per_slot[0] > 0 and per_slot[2] > 0, name
            assert per_slot[1] == 0 and per_slot[3] == 0, name


def _pack(batch, row_len):
    samples = [
        packed_sample(
            {k: (v[i] if not isinstance(v, dict) else {c: x[i] for c, x in v.items()}) for k, v in batch.items()},
            TINY.camera_names,
        )
        for i in range(len(batch["tokens"]))
    ]
    config = PackingConfig(seq_len=row_len, max_samples_per_row=3, max_images_per_row=3)
    return pack_samples(samples, config, num_rows=2)


def test_packed_equals_unpacked_and_samples_are_isolated(model, mesh):
    batch = TINY.synthetic_batch(4, seed=3)
    noise, time = _noise_time(batch)
    row_len = 2 * (TINY.image_block_tokens + TINY.synthetic_text_tokens[1])  # two samples per row
    packed = _pack(batch, row_len)
    np.testing.assert_array_equal(packed["sample_mask"], [[True, True, False]] * 2)
    slots = [0, 1, 2, 3]  # sample order in the R·M = 6 slots: rows [0, 1, -], [2, 3, -]
    flat = np.array([0, 1, 0, 2, 3, 0])
    with mesh_context(mesh):
        losses = nnx.jit(lambda m, b, n, t: m.per_sample_losses(b, jax.random.key(0), noise=n, time=t, dropout=False))
        unpacked_err, counts = losses(model, batch, noise, time)
        packed_err, packed_counts = losses(model, packed, noise[flat], time[flat])
        real = np.array([0, 1, 3, 4])
        np.testing.assert_allclose(np.asarray(packed_err)[real], np.asarray(unpacked_err)[slots], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(packed_counts)[real], np.asarray(counts))
        assert not np.asarray(packed_counts)[[2, 5]].any()  # empty slots carry no loss

        # perturb sample 1 (sharing row 0 with sample 0): its prompt text and its image
        other = {k: v for k, v in batch.items()}
        other["tokens"] = batch["tokens"].copy()
        text = np.flatnonzero(batch["token_mask"][1] & (batch["tokens"][1] != TINY.image_token_id))
        other["tokens"][1, text[-3:]] = (batch["tokens"][1, text[-3:]] + 1) % TINY.image_token_id
        other["images"] = {c: v.copy() for c, v in batch["images"].items()}
        other["images"]["front"][1] *= -1
        perturbed, _ = losses(model, _pack(other, row_len), noise[flat], time[flat])
    perturbed, packed_err = np.asarray(perturbed)[real], np.asarray(packed_err)[real]
    np.testing.assert_allclose(perturbed[[0, 2, 3]], packed_err[[0, 2, 3]], rtol=1e-6, atol=1e-6)
    assert abs(perturbed[1] - packed_err[1]) > 1e-4


def test_flow_draws_per_observation_add_their_single_draw_losses(model, mesh):
    """K = 2 draws share one backbone pass: each slot's error is the sum of its two K = 1 errors,
    unpacked and packed alike (draw j of slot i sees slot i's VL tokens)."""
    batch = TINY.synthetic_batch(4, seed=3)
    rng = np.random.default_rng(7)
    noise = rng.normal(size=(4, 2, *batch["actions"].shape[1:])).astype(np.float32)
    time = rng.uniform(0, 1, (4, 2)).astype(np.float32)
    two = nnx.clone(model)
    two.config = dataclasses.replace(TINY, flow_samples_per_obs=2)
    row_len = 2 * (TINY.image_block_tokens + TINY.synthetic_text_tokens[1])
    flat, real = np.array([0, 1, 0, 2, 3, 0]), np.array([0, 1, 3, 4])
    with mesh_context(mesh):
        losses = nnx.jit(lambda m, b, n, t: m.per_sample_losses(b, jax.random.key(0), noise=n, time=t, dropout=False))
        single = [losses(model, batch, noise[:, j], time[:, j]) for j in range(2)]
        err, counts = losses(two, batch, noise, time)
        packed_err, packed_counts = losses(two, _pack(batch, row_len), noise[flat], time[flat])
    np.testing.assert_allclose(err, np.asarray(single[0][0]) + np.asarray(single[1][0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(counts, 2 * np.asarray(single[0][1]))
    np.testing.assert_allclose(np.asarray(packed_err)[real], err, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(packed_counts)[real], counts)
    assert TINY.training_flops(batch)["weights"] < two.config.training_flops(batch)["weights"]
    with pytest.raises(ValueError, match="flow_samples_per_obs"):
        dataclasses.replace(TINY, flow_samples_per_obs=0)


# upstream module sizes (reference README, GR00T N1.5 table)
VISION_AND_MLP1 = 427_680_704 - 15_238_352 + 2_361_344
LLM = 914_674_688
PROJECTOR = 52_510_720 + 228_212_736 + 34_636_800 + 1_572_864
DIT = 550_386_688
ALWAYS_TRAINED = 201_433_088 + 49_152 + 4_096


@pytest.fixture(scope="module")
def full_param_paths():
    with mesh_context(make_mesh(MeshConfig())):
        abstract = nnx.eval_shape(lambda: Gr00tConfig().make(nnx.Rngs(0)))
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    return {"/".join(str(k.key) for k in path): int(np.prod(leaf.shape)) for path, leaf in flat}


def _frozen(paths, cfg):
    patterns = freeze_regexes(cfg)
    return sum(n for p, n in paths.items() if any(re.search(r, p) for r in patterns))


@pytest.mark.parametrize(
    "switch, size",
    [("tune_visual", VISION_AND_MLP1), ("tune_llm", LLM), ("tune_projector", PROJECTOR), ("tune_diffusion_model", DIT)],
)
def test_each_freezing_switch_selects_the_upstream_set(full_param_paths, switch, size):
    all_on = dict(tune_visual=True, tune_llm=True, tune_projector=True, tune_diffusion_model=True)
    assert _frozen(full_param_paths, Gr00tConfig(**all_on)) == 0
    assert _frozen(full_param_paths, Gr00tConfig(**{**all_on, switch: False})) == size


def test_adapter_and_future_tokens_always_train(full_param_paths):
    all_off = Gr00tConfig(tune_visual=False, tune_llm=False, tune_projector=False, tune_diffusion_model=False)
    total = sum(full_param_paths.values())
    assert total == 2_398_284_528
    assert total - _frozen(full_param_paths, all_off) == ALWAYS_TRAINED
    # the default (upstream finetune): backbone frozen, action head trained
    assert _frozen(full_param_paths, Gr00tConfig()) == VISION_AND_MLP1 + LLM


def test_lora_freezes_dit_base_weights_only():
    cfg = dataclasses.replace(TINY, lora_rank=2)
    with mesh_context(make_mesh(MeshConfig())):
        abstract = nnx.eval_shape(lambda: cfg.make(nnx.Rngs(0)))
    flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
    paths = ["/".join(str(k.key) for k in path) for path, _ in flat]
    patterns = freeze_regexes(cfg)
    lora = [p for p in paths if re.search(r"lora_[ab]$", p)]
    assert lora and all(p.startswith("action_head/model/") for p in lora)
    assert not any(re.search(r, p) for r in patterns for p in lora)
    dit_base = [p for p in paths if p.startswith("action_head/model/") and p not in lora]
    assert all(any(re.search(r, p) for r in patterns) for p in dit_base)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(select_layer=4), r"Gr00tConfig\.select_layer=4 must be in \[1, llm\.num_layers=3\]"),
        (dict(image_token_id=128), r"Gr00tConfig\.image_token_id=128 >= llm\.vocab_size=128"),
        (
            dict(llm=dataclasses.replace(TINY.llm, width=48)),
            r"Gr00tConfig\.action_head\.vl_self_attention\.num_heads \* head_dim = 64 must equal llm\.width=48",
        ),
        (
            dict(action_head=dataclasses.replace(TINY.action_head, hidden_size=16)),
            r"Gr00tConfig\.action_head\.dit\.output_dim=24 must equal action_head\.hidden_size=16",
        ),
        (
            dict(action_head=dataclasses.replace(TINY.action_head, input_embedding_dim=48)),
            r"Gr00tConfig\.action_head\.dit\.num_heads \* head_dim = 32 must equal action_head\.input_embedding_dim=48",
        ),
        (dict(action_horizon=9), r"Gr00tConfig\.action_horizon=9 > action_head\.max_seq_len=8"),
    ],
)
def test_config_errors_name_the_nested_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)


def test_dropout_masks_realise_each_sites_rate_and_keep_the_mean():
    from embodied_jax.models.dit import dropout, dropout_masks

    sites = ((0.36, 64), (0.2, 256), (0.0, 8), (0.2, 63))
    masks = dropout_masks(jax.random.key(3), (16, 128), sites)
    assert masks[2] is None  # rate 0: no mask
    for (rate, features), keep in zip(sites, masks, strict=True):
        if keep is None:
            continue
        mask, kept = keep
        assert mask.shape == (16, 128, features)
        assert abs(kept - (1 - rate)) < 2**-16
        assert abs(1 - float(mask.mean()) - rate) < 0.01  # 2048 x features draws
        x = np.full(mask.shape, 2.0, np.float32)
        assert abs(float(dropout(x, keep).mean()) - 2.0) < 0.03  # inverted dropout: same expectation
    first, second = (dropout_masks(jax.random.key(s), (16, 128), sites)[1][0] for s in (3, 4))
    assert 0.3 < float((first != second).mean()) < 0.34  # keys give independent masks (2p(1-p) = 0.32)
    assert dropout_masks(None, (2,), sites) == (None,) * 4
    with pytest.raises(ValueError, match="dropout rate"):
        dropout_masks(jax.random.key(0), (2,), ((1.0, 4),))
