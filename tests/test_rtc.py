"""Real-time chunking (``nn/rtc.py``) in the π0.5 and GR00T samplers, on tiny random models.

Zero weights sample exactly the plain chunk; guidance pulls the chunk onto the prefix (and the
frozen steps are the prefix exactly); and executed across a chunk boundary, an RTC chunk joins the
previous one more smoothly than a plainly sampled chunk, with or without its frozen steps copied in.

Untrained models turn white noise into white-noise chunks, which have no smooth motion for a
boundary to break, so every chunk here is sampled from explicit temporally smooth noise (a
Gaussian-filtered draw): the chunks then move smoothly, as a trained policy's do.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embodied_jax.nn import rtc
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context

HORIZON, EXECUTED, DELAY = 8, 3, 2  # the previous chunk ran 3 steps before inference, which takes 2
ROWS = 16


def tiny(family):
    """The family's tiny config with an 8-step horizon; unscanned layer stacks compile faster here."""
    if family == "pi05":
        from experiments.pi05 import tiny_model

        config = tiny_model()
    else:
        from experiments.gr00t import TINY_MODEL as config
    return dataclasses.replace(config, action_horizon=HORIZON, num_inference_steps=5, scan_layers=False)


def random_model(config, mesh, seed=0):
    """Every parameter random and non-zero (the zero-initialised output layers and modulations of
    a fresh model would make the velocity nearly constant in x, and the vjp trivial)."""
    rng = np.random.default_rng(seed)
    with mesh_context(mesh):
        model = nnx.eval_shape(lambda: config.make(nnx.Rngs(0)))
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var.get_value().shape
        fan_in = shape[-2] if len(shape) >= 2 else 16
        value = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        var.set_value(jax.device_put(value, jax.sharding.NamedSharding(mesh, var.get_value().sharding.spec)))
    return model


def smooth_noise(seed, shape, width=2.0):
    """Standard-normal per step, correlated over ~``width`` steps (unit variance)."""
    rows, steps, dims = shape
    kernel = np.exp(-0.5 * (np.arange(-4, 5) / width) ** 2)
    kernel /= np.sqrt((kernel**2).sum())
    white = np.random.default_rng(seed).standard_normal((rows, steps + len(kernel) - 1, dims))
    windows = np.lib.stride_tricks.sliding_window_view(white, len(kernel), axis=1)
    return (windows @ kernel).astype(np.float32)


def sampler(name):
    """``sample(seed, prefix=None, weights=None)``: a chunk [ROWS, HORIZON, A] of family ``name``
    from smooth noise ``seed``, plain or guided."""
    config = tiny(name)
    mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:1])
    model = random_model(config, mesh)
    obs = {k: v for k, v in config.synthetic_batch(ROWS, seed=0).items() if k not in ("actions", "action_mask")}
    width = config.max_action_dim if name == "pi05" else config.action_dim

    @nnx.jit
    def plain_and_guided(model, obs, noise, prefix, weights):  # one compilation per family
        rng = jax.random.key(0)
        plain = model.sample_actions(obs, rng, noise=noise)
        return plain, model.sample_actions(obs, rng, noise=noise, prefix_actions=prefix, prefix_weights=weights)

    def sample(seed, prefix=None, weights=None):
        noise = smooth_noise(seed, (ROWS, HORIZON, width))
        guided = prefix is not None
        if not guided:
            prefix, weights = np.zeros((ROWS, HORIZON, config.action_dim), np.float32), 0.0
        weights = np.broadcast_to(np.asarray(weights, np.float32), (ROWS, HORIZON))  # [H] weights: below
        with mesh_context(mesh):
            chunks = plain_and_guided(model, obs, noise, prefix, weights)
        return np.asarray(chunks[guided])

    return sample


@pytest.fixture(scope="module", params=["pi05", "gr00t"])
def family(request):
    return sampler(request.param)


def test_prefix_weights_schedules():
    h, d, s = 10, 2, 3  # frozen 0..1, overlap 2..6 (c = 5/6 .. 1/6), past the previous chunk from 7
    c = (h - s - np.arange(h)) / (h - s - d + 1)
    exp = np.asarray(rtc.prefix_weights(h, d, s, "exp"))
    np.testing.assert_allclose(exp[:d], 1.0)
    np.testing.assert_allclose(exp[d : h - s], (c * np.expm1(c) / (math.e - 1))[d : h - s], rtol=1e-6)
    np.testing.assert_array_equal(exp[h - s :], 0.0)
    assert np.all(np.diff(exp) <= 0) and 0 < exp[h - s - 1] < exp[d] < 1
    np.testing.assert_allclose(rtc.prefix_weights(h, d, s, "linear")[d : h - s], c[d : h - s], rtol=1e-6)
    np.testing.assert_array_equal(rtc.prefix_weights(h, d, s, "ones"), [1] * (h - s) + [0] * s)
    np.testing.assert_array_equal(rtc.prefix_weights(h, d, s, "zeros"), [1] * d + [0] * (h - d))
    # a delay past the overlap freezes the whole overlap; traced arguments compile once
    np.testing.assert_array_equal(rtc.prefix_weights(h, 9, s), [1] * (h - s) + [0] * s)
    traced = jax.jit(rtc.prefix_weights, static_argnums=(0, 3))
    np.testing.assert_allclose(traced(h, d, s, "exp"), exp, rtol=1e-6)
    with pytest.raises(ValueError, match="schedule"):
        rtc.prefix_weights(h, d, s, "cosine")


def test_guidance_scale_is_the_papers_clipped_weight():
    tau = np.asarray([0.2, 0.5, 0.8])
    r2 = (1 - tau) ** 2 / (tau**2 + (1 - tau) ** 2)
    paper = (1 - tau) / (tau * r2)  # 4.25, 2, 4.25
    np.testing.assert_allclose(rtc.guidance_scale(tau, 5.0), paper, rtol=1e-6)
    np.testing.assert_allclose(rtc.guidance_scale(jnp.asarray([0.0, 0.2, 0.5, 1.0]), 3.0), [3, 3, 2, 3], rtol=1e-6)


def test_guidance_inputs_pad_and_broadcast():
    prefix = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    weights = np.asarray([1.0, 0.5, 0.0], np.float32)
    y, w = rtc.guidance_inputs(prefix, weights, batch=2, horizon=3, width=4, real_width=3)
    np.testing.assert_array_equal(y, np.pad(prefix, ((0, 0), (0, 0), (0, 2))))
    np.testing.assert_array_equal(w, np.broadcast_to(weights[None, :, None] * [1, 1, 0, 0], (2, 3, 4)))
    _, per_row = rtc.guidance_inputs(prefix, np.stack([weights, weights]), batch=2, horizon=3, width=4, real_width=3)
    np.testing.assert_array_equal(per_row, w)
    with pytest.raises(ValueError, match="prefix_weights"):
        rtc.guidance_inputs(prefix, weights[:2], batch=2, horizon=3, width=4)
    with pytest.raises(ValueError, match="prefix_actions"):
        rtc.guidance_inputs(prefix[:, :2], weights, batch=2, horizon=3, width=4)
    with pytest.raises(ValueError, match="prefix_weights"):
        rtc.guidance_inputs(prefix, None, batch=2, horizon=3, width=4)
    with pytest.raises(ValueError, match="without prefix_actions"):
        rtc.check_unguided(weights)


def test_zero_weights_sample_the_plain_chunk_exactly(family):
    plain = family(seed=1)
    prefix = family(seed=2)
    np.testing.assert_array_equal(family(seed=1, prefix=prefix, weights=np.zeros(HORIZON, np.float32)), plain)


def test_guidance_pulls_the_chunk_onto_the_prefix(family):
    prefix = rtc.shift_prefix(family(seed=2), EXECUTED)
    plain = family(seed=1)
    # Weights just under 1 (no step frozen): guidance alone. Clipped at β = 5 over 5 steps (dt·β = 1),
    # each step corrects the one-jump estimate x̂ fully only where x̂ is linear in x_t: GR00T's tiny
    # model ends within 1% of plain sampling's distance to the prefix, π0.5's (x̂ far from linear)
    # about 5% (mean 0.07-0.09 in normalised units, the worst element 0.4-0.6).
    near = family(seed=1, prefix=prefix, weights=np.full(HORIZON, 0.999, np.float32))
    far = np.abs(plain - prefix).mean()
    err = np.abs(near - prefix)
    assert err.mean() < 0.1 * far and err.max() < 0.5 * far, (err.mean(), err.max(), far)
    # The paper's schedule: the frozen steps are the prefix; over the overlap (weights 0.49, 0.19,
    # 0.04) the chunk is closer to it than plain sampling, the closer the larger the weight.
    weights = np.asarray(rtc.prefix_weights(HORIZON, DELAY, EXECUTED, "exp"))
    chunk = family(seed=1, prefix=prefix, weights=weights)
    np.testing.assert_array_equal(chunk[:, :DELAY], np.asarray(prefix)[:, :DELAY])
    overlap = slice(DELAY, HORIZON - EXECUTED)
    ratio = (np.abs(chunk - prefix).mean((0, 2)) / np.abs(plain - prefix).mean((0, 2)))[overlap]
    assert ratio[0] < 0.3 and np.all(ratio < 0.95) and np.all(np.diff(ratio) > 0), ratio
    # per-row weights: a row of zeros is that row's plain chunk
    rows = np.stack([weights if i % 2 else np.zeros_like(weights) for i in range(ROWS)])
    mixed = family(seed=1, prefix=prefix, weights=rows)
    np.testing.assert_array_equal(mixed[0::2], plain[0::2])
    np.testing.assert_array_equal(mixed[1::2], chunk[1::2])


def boundary_jerk(previous, chunk):
    """Mean squared third difference of the commanded actions around the switch.

    Commanded: the previous chunk's first ``EXECUTED`` actions, then the new chunk from its step 0
    (the time its observation was taken; under RTC its frozen steps are what the previous chunk
    executed during inference). The window holds the third differences whose four steps straddle
    the switch at inference start (step ``EXECUTED``) or at its end (``EXECUTED + DELAY``): a plain
    chunk jumps at the first, one with the frozen steps copied in at the second. A jump δ adds 6 δ²
    (third differences δ, -2δ, δ) while smooth motion adds little: the third difference rather than
    the step, so that either chunk's own smooth motion does not count as a discontinuity.
    """
    executed = np.concatenate([previous[:, :EXECUTED], chunk], axis=1)
    jerk = np.diff(executed, n=3, axis=1)[:, EXECUTED - 3 : EXECUTED + DELAY]
    return float(np.mean(np.sum(jerk**2, axis=-1)))


def test_rtc_lowers_jerk_at_chunk_boundaries(family):
    weights = np.asarray(rtc.prefix_weights(HORIZON, DELAY, EXECUTED, "exp"))
    jerks = {"naive": [], "prefix copied": [], "rtc": []}
    for seed in (10, 20, 30):
        previous = family(seed=seed)
        prefix = np.asarray(rtc.shift_prefix(previous, EXECUTED))
        plain = family(seed=seed + 1)
        copied = np.concatenate([prefix[:, :DELAY], plain[:, DELAY:]], axis=1)
        chunk = family(seed=seed + 1, prefix=prefix, weights=weights)
        for name, new in (("naive", plain), ("prefix copied", copied), ("rtc", chunk)):
            jerks[name].append(boundary_jerk(previous, new))
    mean = {name: float(np.mean(v)) for name, v in jerks.items()}
    assert mean["rtc"] < 0.5 * mean["naive"] and mean["rtc"] < 0.5 * mean["prefix copied"], mean


@pytest.mark.parametrize("name", ["pi05", "gr00t"])
def test_both_families_sample_through_the_one_flow_sampler_with_a_trace(name):
    from embodied_jax.nn import flow

    config = tiny(name)
    mesh = make_mesh(MeshConfig(data=-1), jax.devices()[:1])
    model = random_model(config, mesh)
    obs = {k: v for k, v in config.synthetic_batch(2, seed=0).items() if k not in ("actions", "action_mask")}
    width = config.max_action_dim if name == "pi05" else config.action_dim
    noise = smooth_noise(0, (2, HORIZON, width))

    @nnx.jit
    def both(model, obs, noise):
        rng = jax.random.key(0)
        return model.sample_actions(obs, rng, noise=noise), model.sample_actions(obs, rng, noise=noise, trace=True)

    with mesh_context(mesh):
        plain, traced = both(model, obs, noise)
    assert isinstance(traced, flow.FlowTrace)
    np.testing.assert_allclose(traced.actions, plain, rtol=1e-5, atol=1e-5)
    steps = config.num_inference_steps
    assert traced.states.shape == (steps + 1, 2, HORIZON, width) and traced.velocities.shape[0] == steps
    np.testing.assert_array_equal(traced.states[0], noise)
    dt = -1.0 / steps if name == "pi05" else 1.0 / steps  # π0.5 integrates from t=1 to 0, GR00T from 0 to 1
    np.testing.assert_allclose(traced.states[1:], traced.states[:-1] + dt * traced.velocities, rtol=1e-5, atol=1e-5)
