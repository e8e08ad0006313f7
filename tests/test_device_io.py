"""``bundle.device_io``: a bundle's pre- and post-processing as jnp functions, checked against the
host's own (``PolicyBundle.preprocess(raw, resize=True)`` and ``postprocess``) for both families.

The bundles are the demo's π0.5 and GR00T configs fitted to the reach task, with statistics made
up here and abstract weights (``nnx.eval_shape``: device_io never reads a weight). States are drawn
inside and far outside the statistics' range and on the π0.5 state bins' edges; one image of each
batch is bright (every pixel >= 128: π0.5's builder reads such a float image as [0, 1]).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embodied_jax.bundle import ObservationError, PolicyBundle
from embodied_jax.bundle.device_io import DeviceIOError, device_io
from embodied_jax.data.stats import unnormalize
from embodied_jax.sim.tasks import TASKS
from experiments import demo

IMAGE = 16
TASK = TASKS["reach"]
BATCH = 6


def _stats(width: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    mean, std = rng.normal(size=width), rng.uniform(0.3, 2.0, width)
    low, high = mean - 2 * std, mean + 2 * std
    quantiles = {"q01": low, "q10": mean - std, "q50": mean, "q90": mean + std, "q99": high}
    return {"mean": mean, "std": std, "min": low - 1, "max": high + 1, "count": 100, **quantiles}


def _bundle(arch: str, norm: str, delta: bool, tokenizer) -> PolicyBundle:
    config = demo.fit_to_task(demo.demo_config(image_size=IMAGE, arch=arch))
    spec = config.data.pipeline.spec
    if delta:
        spec = dataclasses.replace(spec, delta_action_mask=tuple(bool(m) for m in TASK.position_mask()))
    data = dataclasses.replace(
        config.data.pipeline, spec=spec, norm_modes=(("observation.state", norm), ("action", norm))
    )
    model = dataclasses.replace(config.model, tokenizer_path=str(tokenizer))
    config = dataclasses.replace(config, model=model, data=dataclasses.replace(config.data, pipeline=data))
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: model.make(nnx.Rngs(0)))
    task = TASK()
    stats = {"observation.state": _stats(task.state_dim + 1, 0), "action": _stats(task.action_dim, 1)}  # + phase
    return PolicyBundle(config, abstract, stats, step=0)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenizers")
    vocab = demo.demo_config(arch="pi05").model.vocab_size
    instructions = [TASK.instruction, "below -1 -1; the range"]  # "-1": a state bin below the range
    return {
        "pi05": demo.build_tokenizer(tmp / "sp" / "tokenizer.model", vocab),
        "pi05_minus": demo.build_tokenizer(tmp / "sp_minus" / "tokenizer.model", vocab, instructions),
        "gr00t": demo.build_gr00t_tokenizer(tmp / "tokenizer.json"),
    }


CASES = {  # name: (family, normalisation, delta actions, tokenizer)
    "pi05": ("pi05", "quantile", False, "pi05"),
    "pi05_mean_std": ("pi05", "mean_std", True, "pi05_minus"),
    "gr00t": ("gr00t", "quantile", False, "gr00t"),
    "gr00t_mean_std": ("gr00t", "mean_std", True, "gr00t"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tokenizers):
    arch, norm, delta, tokenizer = CASES[request.param]
    bundle = _bundle(arch, norm, delta, tokenizers[tokenizer])
    return request.param, bundle, device_io(bundle, TASK.instruction)


def _cameras(bundle) -> list[str]:
    return [key.removeprefix("observation.images.") for key in bundle.inputs.camera_keys]


def _observation(bundle, seed: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Raw states (within, beyond the statistics and on π0.5's bin edges) and uint8 images."""
    rng = np.random.default_rng(seed)
    stats = bundle.stats[bundle.inputs.state_key]
    width = len(stats.mean)
    mode = dict(bundle.config.data.pipeline.norm_modes)[bundle.inputs.state_key]
    inside = unnormalize(rng.uniform(-1, 1, (2, width)), stats, mode)
    beyond = stats.mean + stats.std * rng.choice([-1, 1], (2, width)) * rng.uniform(3, 30, (2, width))
    edges = np.linspace(-1, 1, 257)[:-1][rng.integers(0, 256, (2, width))]  # the bins' edges, normalised
    on_edges = np.stack([unnormalize(e, stats, mode) for e in edges])
    state = np.concatenate([inside, beyond, on_edges]).astype(np.float32)
    images = {c: rng.integers(0, 256, (BATCH, IMAGE, IMAGE, 3), dtype=np.uint8) for c in _cameras(bundle)}
    first = _cameras(bundle)[0]
    images[first][1] = rng.integers(128, 256, (IMAGE, IMAGE, 3), dtype=np.uint8)
    images[first][2, 0, 0] = 255  # a bright image holding 255 (1.0 exactly on the host)
    images[first][2] |= 128
    return state, images


def _raw(bundle, state, images) -> dict:
    return {
        bundle.inputs.state_key: state,
        "task": TASK.instruction,
        **{f"observation.images.{c}": image for c, image in images.items()},
    }


def assert_same(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        g = np.asarray(g)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), path
        if g.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(path))


def test_observe_equals_the_host_preprocessing(case):
    name, bundle, io = case
    state, images = _observation(bundle)
    want = bundle.preprocess(_raw(bundle, state, images), resize=True)
    assert io.host_tokens is False  # the demo tokenizers: the prompt is assembled in the program
    assert_same(io.observe(jnp.asarray(state), images), want)
    assert_same(jax.jit(io.observe)(state, images), want)
    assert_same(jax.jit(io.observe)({"state": state, "images": images, "time_step": np.zeros(BATCH, np.int32)}), want)
    # A batch of batches (vmap over a leading axis) gives each batch's observation.
    stacked = jax.vmap(io.observe)(
        np.stack([state, state[::-1]]), {c: np.stack([x, x[::-1]]) for c, x in images.items()}
    )
    assert_same(jax.tree.map(lambda x: x[1], stacked), jax.tree.map(lambda x: x[::-1], want))
    if name.startswith("pi05"):
        bins = (want["tokens"] != want["tokens"][:1]).any(axis=0)
        assert bins.sum() >= 3, "the states should reach several bins"


def test_act_equals_the_host_postprocessing(case):
    _, bundle, io = case
    state, _ = _observation(bundle, seed=1)
    horizon = bundle.config.model.action_horizon
    width = getattr(bundle.config.model, "max_action_dim", bundle.config.model.action_dim)
    model_actions = np.random.default_rng(2).normal(scale=1.5, size=(BATCH, horizon, width)).astype(np.float32)
    want = bundle.postprocess(model_actions, state)
    for act in (io.act, jax.jit(io.act)):
        got = np.asarray(act(model_actions, state))
        assert got.dtype == np.float32 and got.shape == want.shape == (BATCH, horizon, bundle.action_dim)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-6)
    # to_model inverts act (inside the quantile range, which unnormalising clips to).
    inside = np.clip(model_actions[..., : bundle.action_dim], -0.99, 0.99)
    np.testing.assert_allclose(jax.jit(io.to_model)(io.act(inside, state), state), inside, atol=1e-5)


def test_a_tokenizer_merging_across_the_prompt_pieces_falls_back_to_the_host(tokenizers, caplog):
    """The demo's word-level SentencePiece model has no "-1": SentencePiece joins consecutive
    unknown words into one <unk>, so a mean_std run's states below the range (bin -1) do not
    tokenise piece by piece; the tokens come from the host and still equal preprocess's."""
    bundle = _bundle("pi05", "mean_std", False, tokenizers["pi05"])
    with caplog.at_level(logging.WARNING, logger="embodied_jax.models.pi05.inputs"):
        io = device_io(bundle, TASK.instruction)
    assert io.host_tokens is True
    assert "jax.pure_callback" in caplog.text and "merges text across" in caplog.text
    state, images = _observation(bundle, seed=3)
    state[0] = bundle.stats[bundle.inputs.state_key].mean - 40 * bundle.stats[bundle.inputs.state_key].std
    want = bundle.preprocess(_raw(bundle, state, images), resize=True)
    assert (want["tokens"][0] == 3).any()  # <unk>: the merged "-1 -1 ..." of the first row
    assert_same(jax.jit(io.observe)(state, images), want)
    stacked = jax.jit(jax.vmap(io.observe))(state[None], {c: x[None] for c, x in images.items()})
    assert_same(jax.tree.map(lambda x: x[0], stacked), want)


def test_camera_mapping_and_named_errors(case):
    _, bundle, io = case
    state, images = _observation(bundle)
    first, *rest = _cameras(bundle)
    renamed = device_io(bundle, TASK.instruction, camera_keys={"cam0": f"observation.images.{first}"})
    moved = {"cam0": images[first], **{c: images[c] for c in rest}, "extra": images[first]}  # extra: ignored
    assert_same(jax.jit(renamed.observe)(state, moved), jax.jit(io.observe)(state, images))
    with pytest.raises(ObservationError, match=f"lack the dataset cameras \\['observation.images.{first}'\\]"):
        io.observe(state, {c: images[c] for c in rest})
    with pytest.raises(DeviceIOError, match="device_io does not resize"):
        io.observe(state, {c: np.zeros((BATCH, 2 * IMAGE, 2 * IMAGE, 3), np.uint8) for c in images})
    with pytest.raises(ObservationError, match="expected uint8 images"):
        io.observe(state, {c: x.astype(np.float32) for c, x in images.items()})
    with pytest.raises(ObservationError, match="values per state"):
        io.observe(state[:, :-1], images)


def test_a_builder_without_an_in_program_form_is_named(case):
    _, bundle, _ = case
    real = bundle.transform.builder
    bundle.transform.builder = lambda sample: real(sample)
    try:
        with pytest.raises(DeviceIOError, match="no in-program form of the input builder function"):
            device_io(bundle, TASK.instruction)
    finally:
        bundle.transform.builder = real
