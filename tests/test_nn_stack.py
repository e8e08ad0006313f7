"""Scanned vs unrolled layer stacks and remat policies: same outputs and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embodied_jax.nn.dense import Dense
from embodied_jax.nn.stack import PerLayer, build_stack, run_stack

LAYERS, WIDTH = 3, 8


class Block(nnx.Module):
    def __init__(self, rngs):
        self.proj = Dense(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x, scale, *, shift):
        y = x + scale * jnp.tanh(self.proj(x)) + shift
        return y, jnp.sum(y)


@pytest.fixture(scope="module")
def stacks():
    with nnx.use_eager_sharding(False):
        unrolled = build_stack(Block, LAYERS, scan=False, rngs=nnx.Rngs(0))
        scanned = build_stack(Block, LAYERS, scan=True, rngs=nnx.Rngs(1))
    per_layer = [nnx.to_pure_dict(nnx.state(layer, nnx.Param)) for layer in unrolled]
    scanned_state = nnx.state(scanned, nnx.Param)
    nnx.replace_by_pure_dict(scanned_state, jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer))
    nnx.update(scanned, scanned_state)
    return unrolled, scanned


def numpy_stack(unrolled, x, scale, shift):
    outs = []
    for i, layer in enumerate(unrolled):
        w, b = np.asarray(layer.proj.kernel[...]), np.asarray(layer.proj.bias[...])
        x = x + scale * np.tanh(x @ w + b) + shift[i]
        outs.append(x.sum())
    return x, np.array(outs)


def test_scanned_params_have_layers_axis(stacks):
    _, scanned = stacks
    kernel = scanned.proj.kernel
    assert kernel.shape == (LAYERS, WIDTH, WIDTH)
    assert kernel.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")


@pytest.mark.parametrize("remat_policy", ["none", "dots_saveable", "full"])
def test_scan_unrolled_and_remat_agree(stacks, remat_policy):
    unrolled, scanned = stacks
    x = np.random.default_rng(0).standard_normal((2, 3, WIDTH)).astype(np.float32)
    shift = np.random.default_rng(1).standard_normal((LAYERS, WIDTH)).astype(np.float32) * 0.1
    want_out, want_aux = numpy_stack(unrolled, x, 0.5, shift)

    def loss(stack, x, scan):
        out, aux = run_stack(
            stack, x, 0.5, scan=scan, remat_policy=remat_policy, with_outputs=True, shift=PerLayer(jnp.asarray(shift))
        )
        return jnp.sum(out**2), (out, aux)

    results = {}
    for scan, stack in ((False, unrolled), (True, scanned)):
        grad_fn = nnx.jit(nnx.grad(loss, has_aux=True), static_argnums=2)
        grads, (out, aux) = grad_fn(stack, jnp.asarray(x), scan)
        np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(aux), want_aux, rtol=1e-5, atol=1e-4)
        pure = nnx.to_pure_dict(grads)
        if not scan:  # stack per-layer grads into the scanned layout
            pure = jax.tree.map(lambda *xs: np.stack(xs), *[pure[i] for i in range(LAYERS)])
        results[scan] = [np.asarray(v) for v in jax.tree.leaves(pure)]
        assert len(results[scan]) == 2
    reference = reference_grads(unrolled, x, 0.5, shift)
    for scan in (False, True):
        for got, want in zip(results[scan], reference, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def reference_grads(unrolled, x, scale, shift):
    """Gradients of the same loss written directly in jnp (no run_stack, no remat), stacked."""
    params = [(layer.proj.bias[...], layer.proj.kernel[...]) for layer in unrolled]

    def loss(params):
        h = jnp.asarray(x)
        for i, (b, w) in enumerate(params):
            h = h + scale * jnp.tanh(h @ w + b) + shift[i]
        return jnp.sum(h**2)

    grads = jax.grad(loss)(params)
    return [np.stack([np.asarray(g[j]) for g in grads]) for j in range(2)]  # leaves order: bias, kernel


def test_bad_arguments(stacks):
    unrolled, scanned = stacks
    x = jnp.zeros((1, 2, WIDTH))
    with pytest.raises(ValueError, match="remat_policy='some'"):
        run_stack(unrolled, x, 1.0, scan=False, remat_policy="some", shift=0.0)
    with pytest.raises(TypeError, match="scan=True"):
        run_stack(unrolled, x, 1.0, scan=True, shift=0.0)
    with pytest.raises(ValueError, match="num_layers"):
        build_stack(Block, 0, scan=True, rngs=nnx.Rngs(0))
