"""FP8 (flax delayed scaling): a small MLP tracks the float32 loss curve; scaling state updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from embodied_jax.nn.dense import Dense
from embodied_jax.nn.mlp import GatedMLP
from embodied_jax.variables import Fp8Meta

STEPS, WIDTH, HIDDEN = 50, 16, 64


class Regressor(nnx.Module):
    def __init__(self, fp8, rngs):
        self.mlp = GatedMLP(WIDTH, HIDDEN, activation="silu", fp8=fp8, rngs=rngs)
        self.head = Dense(WIDTH, 1, fp8=fp8, rngs=rngs)

    def __call__(self, x):
        return self.head(x + self.mlp(x))


def train(fp8):
    """Our own loop: optax on Params, Fp8Meta replaced by its gradient (as the trainer does)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, WIDTH)).astype(np.float32)
    teacher = rng.standard_normal((WIDTH, 1)).astype(np.float32)
    # label noise keeps the loss floor well above FP8's quantisation error
    y = np.tanh(x @ teacher) + 0.3 * rng.standard_normal((1024, 1)).astype(np.float32)
    with nnx.use_eager_sharding(False):
        model = Regressor(fp8, nnx.Rngs(0))
    graphdef, params, meta = nnx.split(model, nnx.Param, Fp8Meta)
    tx = optax.adam(3e-3)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, meta, opt_state):
        def loss_fn(params, meta):
            return jnp.mean((nnx.merge(graphdef, params, meta)(x) - y) ** 2)

        loss, (g_params, g_meta) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, meta)
        updates, opt_state = tx.update(g_params, opt_state, params)
        return optax.apply_updates(params, updates), g_meta, opt_state, loss

    initial_meta = jax.tree.map(np.asarray, meta)
    losses = []
    for _ in range(STEPS):
        params, meta, opt_state, loss = step(params, meta, opt_state)
        losses.append(float(loss))
    return np.array(losses), initial_meta, meta


@pytest.fixture(scope="module")
def runs():
    return train("none"), train("flax")


def test_fp8_tracks_float32_loss_curve(runs):
    (ref, _, _), (fp8, _, _) = runs
    assert ref[-1] < 0.5 * ref[0]  # the task is actually learned
    rel = np.abs(fp8 - ref) / ref
    assert rel.max() <= 0.05, f"max relative loss gap {rel.max():.3f} at step {rel.argmax()}"


def test_fp8_scaling_state_updates(runs):
    _, (_, initial, final) = runs
    flat_initial = dict(nnx.to_flat_state(initial))
    flat_final = dict(nnx.to_flat_state(final))
    assert len(flat_final) == 4 * 6  # gate/up/down/head x (3 histories + 3 scales)
    for path, var in flat_final.items():
        value, start = np.asarray(var[...]), np.asarray(flat_initial[path][...])
        assert np.isfinite(value).all(), path
        if path[-1].endswith("amax_history"):
            assert value.shape == (16,) and (value > 0).all(), path  # history full after 50 > 16 steps
        else:
            assert value.shape == (1,) and value[0] != start[0] and value[0] > 0, path
