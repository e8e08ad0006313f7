"""Dense/Einsum, norms, RoPE, MLPs, embeddings and LoRA vs NumPy formulas; fsdp-sharded jit; modules in
raw JAX loops (nn.traced) vs the forms they replaced."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embodied_jax.nn import dense as dense_module
from embodied_jax.nn import embeddings, lora, mlp, norms, rope, traced
from embodied_jax.nn.dense import Dense, Einsum
from embodied_jax.parallel import hlo
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.partition import describe_spec
from embodied_jax.parallel.rules import ShardingRules
from embodied_jax.parallel.sharding import mesh_context


@pytest.fixture(autouse=True)
def no_eager_sharding():
    with nnx.use_eager_sharding(False):
        yield


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def set_param(var, value):
    var[...] = jnp.asarray(value, var.dtype)


def np_rms(x, eps):
    return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps)


def np_ln(x, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)


def np_gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def test_dense_einsum_and_axes():
    d = Dense(6, 5, rngs=nnx.Rngs(0))
    set_param(d.bias, rand((5,), 1))
    x = rand((2, 3, 6), 2)
    np.testing.assert_allclose(
        np.asarray(d(x)), x @ np.asarray(d.kernel[...]) + np.asarray(d.bias[...]), rtol=1e-5, atol=1e-5
    )
    assert d.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
    assert d.bias.get_metadata()["out_sharding"] == ("mlp",)
    e = Einsum("btd,ndh->btnh", (3, 6, 4), axes=("heads", "embed", "head_dim"), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(
        np.asarray(e(x)), np.einsum("btd,ndh->btnh", x, np.asarray(e.kernel[...])), rtol=1e-5, atol=1e-5
    )
    bf = Dense(6, 5, use_bias=False, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    assert bf.bias is None and bf(x).dtype == jnp.bfloat16 and bf.kernel.dtype == jnp.float32
    with pytest.raises(ValueError, match="fp8='int4'"):
        Dense(6, 5, fp8="int4", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features 6"):
        d(rand((2, 5)))


def test_fp8_te_falls_back_to_flax_on_cpu(caplog):
    dense_module._LOGGED.clear()
    with caplog.at_level("WARNING"):
        d = Dense(8, 8, fp8="te", rngs=nnx.Rngs(0))
        Dense(8, 8, fp8="te", rngs=nnx.Rngs(1))
    assert d.fp8 == "flax" and d.fp8_scaling is not None
    lines = [r.getMessage() for r in caplog.records if "fp8='te' unavailable" in r.getMessage()]
    assert len(lines) == 1 and "fp8='flax'" in lines[0] and "GPU" in lines[0]
    x = rand((4, 8), 3)
    ref = x @ np.asarray(d.kernel[...])
    np.testing.assert_allclose(np.asarray(d(x)), ref, atol=0.15 * np.abs(ref).max())


def test_rmsnorm_variants():
    x = rand((2, 3, 8), 4) * 3
    n = norms.RMSNorm(8, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(n(x)), np_rms(x, 1e-6), rtol=1e-5, atol=1e-5)
    w = rand((8,), 5)
    set_param(n.scale, w)
    np.testing.assert_allclose(np.asarray(n(x)), np_rms(x, 1e-6) * (1 + w), rtol=1e-5, atol=1e-5)
    q = norms.RMSNorm(8, zero_centered=False, eps=1e-5, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(q.scale[...]), 1.0)
    set_param(q.scale, w)
    np.testing.assert_allclose(np.asarray(q(x)), np_rms(x, 1e-5) * w, rtol=1e-5, atol=1e-5)
    assert n(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_ada_rmsnorm():
    x, cond = rand((2, 3, 8), 6), rand((2, 5), 7)
    n = norms.AdaRMSNorm(8, 5, rngs=nnx.Rngs(0))
    y, gate = n(x, cond)
    np.testing.assert_allclose(np.asarray(y), np_rms(x, 1e-6), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(gate), 0.0)
    kernel, bias = rand((5, 24), 8), rand((24,), 9)
    set_param(n.dense.kernel, kernel)
    set_param(n.dense.bias, bias)
    mod = (cond @ kernel + bias)[:, None, :]
    scale, shift, g = mod[..., :8], mod[..., 8:16], mod[..., 16:]
    y, gate = n(x, cond)
    np.testing.assert_allclose(np.asarray(y), np_rms(x, 1e-6) * (1 + scale) + shift, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(gate), np.broadcast_to(g, gate.shape), rtol=1e-5, atol=1e-5)


def test_layernorm_and_adaln():
    x = rand((2, 3, 8), 10) * 2 + 1
    ln = norms.LayerNorm(8, rngs=nnx.Rngs(0))
    s, b = rand((8,), 11), rand((8,), 12)
    set_param(ln.scale, s)
    set_param(ln.bias, b)
    np.testing.assert_allclose(np.asarray(ln(x)), np_ln(x, 1e-5) * s + b, rtol=1e-5, atol=1e-5)
    plain = norms.LayerNorm(8, use_scale=False, use_bias=False, eps=1e-6)
    assert not nnx.state(plain, nnx.Param)
    np.testing.assert_allclose(np.asarray(plain(x)), np_ln(x, 1e-6), rtol=1e-5, atol=1e-5)
    cond = rand((2, 4), 13)
    for order in (("scale", "shift"), ("shift", "scale")):
        ada = norms.AdaLayerNorm(8, 4, chunk_order=order, eps=1e-6, rngs=nnx.Rngs(1))
        mod = (cond * (1 / (1 + np.exp(-cond)))) @ np.asarray(ada.linear.kernel[...]) + np.asarray(ada.linear.bias[...])
        chunks = dict(zip(order, (mod[:, None, :8], mod[:, None, 8:]), strict=True))
        want = np_ln(x, 1e-6) * (1 + chunks["scale"]) + chunks["shift"]
        np.testing.assert_allclose(np.asarray(ada(x, cond)), want, rtol=1e-4, atol=1e-4)


def test_rope_rotate_half():
    x = rand((2, 5, 3, 8), 14)
    pos = np.array([[0, 1, 2, 3, 4], [7, 0, 1, 2, 100]], np.int32)
    got = np.asarray(rope.apply_rope(x, pos, theta=500.0))
    want = np.empty_like(x)
    half = 4
    for k in range(half):
        angle = pos[:, :, None] * 500.0 ** (-2 * k / 8)
        a, b = x[..., k], x[..., k + half]
        want[..., k] = a * np.cos(angle) - b * np.sin(angle)
        want[..., k + half] = b * np.cos(angle) + a * np.sin(angle)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert rope.apply_rope(jnp.asarray(x, jnp.bfloat16), pos).dtype == jnp.bfloat16


def _fusions_with(hlo_text: str, opcode: str) -> list[int]:
    """Output element counts of the fusions in compiled HLO whose body holds ``opcode``."""
    return [i.elements for i in hlo.instructions(hlo_text) if i.opcode == "fusion" and opcode in i.body]


@pytest.mark.hlo
def test_rope_tables_are_computed_once_per_position():
    """XLA:CPU would fuse sin/cos into each consumer and evaluate them per element of
    [B, T, N, H] (heads and both halves: 16x the tables here); they stay [B, T, H/2]."""
    b, t, n, h = 1, 64, 8, 16
    x = jnp.asarray(rand((b, t, n, h), 15))
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    text = jax.jit(lambda x, p: rope.apply_rope(x, p)[:, ::2] * 2.0).lower(x, pos).compile().as_text()
    sizes = _fusions_with(text, "sine") + _fusions_with(text, "cosine")
    assert sizes and max(sizes) <= b * t * h, sizes


def _reduced_axes(hlo_text: str) -> list[tuple[list[int], list[int]]]:
    """(operand shape, reduced dimensions) of every reduce in compiled HLO."""
    listed = hlo.instructions(hlo_text)
    results = {i.name: i.result for i in listed}
    found = []
    for i in listed:
        if i.opcode == "reduce":
            operand = results.get(re.match(r"%?([\w.\-]+)", i.rest).group(1), "")
            shape = [int(d) for d in re.search(r"\[([\d,]*)\]", operand or "[]").group(1).split(",") if d]
            dims = re.search(r"dimensions=\{([\d,]*)\}", i.rest).group(1)
            found.append((shape, [int(d) for d in dims.split(",") if d]))
    return found


@pytest.mark.hlo
@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norm_parameter_gradients_reduce_a_token_major_view(kind):
    """The parameters' gradients over one packed row [1, T, D] reduce [T, D] over its first axis:
    XLA:CPU reduced the middle axis of [1, T, D] about ten times slower."""
    x = jnp.asarray(rand((1, 64, 8), 16))
    graphdef, params = nnx.split(getattr(norms, kind)(8))
    text = jax.jit(jax.grad(lambda p: jnp.sum(jnp.tanh(nnx.merge(graphdef, p)(x))))).lower(params).compile().as_text()
    reduces = _reduced_axes(text)
    assert reduces and all(shape for shape, _ in reduces), reduces
    middle = [
        (shape, dims) for shape, dims in reduces if shape[:1] == [1] and 0 not in dims and len(shape) - 1 not in dims
    ]
    assert not middle, middle


@pytest.mark.hlo
def test_patch_embedding_is_a_convolution_whose_kernel_gradient_reads_the_output_gradient_as_is():
    """SigLIP's patch embedding equals a stride-P convolution; its kernel's gradient takes the
    output gradient [B·N, D] as it is: the 6-D einsum it replaced had XLA:CPU write that gradient
    transposed ([D, B·N], fused with every layer's residual gradient: 21 ms of a pi05_bench step)."""
    from embodied_jax.models.siglip import PatchEmbedding

    b, side, p, c, d = 2, 112, 14, 3, 64
    embed = PatchEmbedding(p, c, d, dtype=None, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    images = jnp.asarray(np.random.default_rng(3).uniform(-1, 1, (b, side, side, c)), jnp.float32)
    conv = jax.lax.conv_general_dilated(
        images, embed.kernel[...], (p, p), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    want = (conv + embed.bias[...]).reshape(b, -1, d)
    np.testing.assert_allclose(embed(images), want, rtol=1e-5, atol=1e-5)

    graphdef, params = nnx.split(embed)
    grad = jax.grad(lambda p_: jnp.sum(jnp.sin(nnx.merge(graphdef, p_)(images))))
    text = jax.jit(grad).lower(params).compile().as_text()
    rows = b * (side // p) ** 2
    transposed = [
        (i.name, i.result)
        for i in hlo.instructions(text)
        if i.opcode != "parameter" and i.result.startswith((f"f32[{d},{rows}]", f"f32[{d},{b},"))
    ]
    assert not transposed, transposed


def test_time_embeddings():
    t = np.array([0.0, 0.25, 0.999, 0.6180339], np.float32)
    got = np.asarray(embeddings.sincos_embedding(t, 8, min_period=4e-3, max_period=4.0))
    assert got.dtype == np.float32
    frac = np.linspace(0, 1, 4)
    period = 4e-3 * (4.0 / 4e-3) ** frac
    ang = 2 * np.pi * t.astype(np.float64)[:, None] / period  # upstream: float64 angles up to ~1.6e3 rad
    # float32-accurate result (a float32 angle product would be off by ~1e-4)
    np.testing.assert_allclose(got, np.concatenate([np.sin(ang), np.cos(ang)], -1), atol=1e-6)
    with pytest.raises(ValueError, match="even"):
        embeddings.sincos_embedding(t, 7)
    steps = np.array([0, 3, 999], np.float32)
    got = np.asarray(embeddings.timestep_embedding(steps, 6))
    freqs = np.exp(-math.log(10000) * np.arange(3) / (3 - 1.0))
    ang = steps[:, None] * freqs
    np.testing.assert_allclose(got, np.concatenate([np.cos(ang), np.sin(ang)], -1), rtol=1e-5, atol=1e-4)
    got = np.asarray(embeddings.timestep_embedding(steps, 7, flip_sin_to_cos=False, downscale_freq_shift=0.0))
    ang = steps[:, None] * np.exp(-math.log(10000) * np.arange(3) / 3)
    want = np.concatenate([np.sin(ang), np.cos(ang), np.zeros((3, 1))], -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_embed_and_positions():
    emb = embeddings.Embed(11, 4, rngs=nnx.Rngs(0))
    assert emb.embedding.get_metadata()["out_sharding"] == ("vocab", "embed")
    table = np.asarray(emb.embedding[...])
    tok = np.array([[1, 10, 0]])
    np.testing.assert_array_equal(np.asarray(emb(tok)), table[tok])
    x = rand((2, 4), 15)
    np.testing.assert_allclose(np.asarray(emb.attend(x)), x @ table.T, rtol=1e-5, atol=1e-5)
    lp = embeddings.LearnedPositions(6, 4, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(lp(np.array([[2, 5]]))), np.asarray(lp.embedding[...])[[[2, 5]]])
    assert lp().shape == (6, 4)


def test_mlps():
    x = rand((2, 3, 6), 16)
    g = mlp.GatedMLP(6, 10, activation="gelu_tanh", rngs=nnx.Rngs(0))
    k = {n: np.asarray(getattr(g, n).kernel[...]) for n in ("gate_proj", "up_proj", "down_proj")}
    want = (np_gelu_tanh(x @ k["gate_proj"]) * (x @ k["up_proj"])) @ k["down_proj"]
    np.testing.assert_allclose(np.asarray(g(x)), want, rtol=1e-4, atol=1e-5)
    assert g.gate_proj.bias is None
    s = mlp.GatedMLP(6, 10, activation="silu", rngs=nnx.Rngs(0))
    want = ((x @ k["gate_proj"]) / (1 + np.exp(-(x @ k["gate_proj"]))) * (x @ k["up_proj"])) @ k["down_proj"]
    np.testing.assert_allclose(np.asarray(s(x)), want, rtol=1e-4, atol=1e-5)
    m = mlp.MLP(6, 10, activation="gelu_tanh", out_features=3, names=("linear_1", "linear_2"), rngs=nnx.Rngs(1))
    l1, l2 = m.linear_1, m.linear_2
    want = np_gelu_tanh(x @ np.asarray(l1.kernel[...]) + np.asarray(l1.bias[...])) @ np.asarray(l2.kernel[...])
    np.testing.assert_allclose(np.asarray(m(x)), want + np.asarray(l2.bias[...]), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="activation='tanhh'"):
        mlp.MLP(6, 10, activation="tanhh", rngs=nnx.Rngs(0))


def test_lora_starts_at_base_and_adds_low_rank_update():
    cfg = lora.LoRAConfig(rank=2, alpha=4.0)
    x = rand((2, 3, 6), 17)
    base = Dense(6, 5, rngs=nnx.Rngs(0))
    adapted = Dense(6, 5, lora=cfg, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(np.asarray(adapted.kernel[...]), np.asarray(base.kernel[...]))
    np.testing.assert_allclose(np.asarray(adapted(x)), np.asarray(base(x)), rtol=1e-6, atol=1e-6)
    assert adapted.lora_a.shape == (6, 2) and adapted.lora_b.shape == (2, 5)
    b = rand((2, 5), 18)
    set_param(adapted.lora_b, b)
    want = np.asarray(base(x)) + 2.0 * (x @ np.asarray(adapted.lora_a[...])) @ b
    np.testing.assert_allclose(np.asarray(adapted(x)), want, rtol=1e-4, atol=1e-5)
    e = Einsum("btd,ndh->btnh", (3, 6, 4), axes=("heads", "embed", "head_dim"), lora=cfg, rngs=nnx.Rngs(0))
    set_param(e.lora_b, rand((2, 3, 4), 19))
    want = np.einsum("btd,ndh->btnh", x, np.asarray(e.kernel[...])) + 2.0 * np.einsum(
        "btd,dr,rnh->btnh", x, np.asarray(e.lora_a[...]), np.asarray(e.lora_b[...])
    )
    np.testing.assert_allclose(np.asarray(e(x)), want, rtol=1e-4, atol=1e-5)
    # freeze rule: only lora_a / lora_b train
    model = mlp.GatedMLP(6, 8, lora=cfg, rngs=nnx.Rngs(0))
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    trainable = sorted(p for p in paths if lora.is_lora_path(p.split("/")))
    assert trainable == sorted(f"{n}/lora_{ab}" for n in ("down_proj", "gate_proj", "up_proj") for ab in "ab")
    import re

    assert sorted(p for p in paths if re.match(lora.LORA_FREEZE_REGEX, p)) == sorted(set(paths) - set(trainable))


@pytest.mark.parametrize("sizes", [dict(data=1, fsdp=8, tensor=1), dict(data=2, fsdp=2, tensor=2)])
def test_gated_mlp_jit_on_sharded_mesh(sizes):
    mesh = make_mesh(MeshConfig(**sizes))
    x = rand((8, 4, 16), 20)
    rules = ShardingRules.from_config(["tensor_parallel"])
    with mesh_context(mesh, rules), nnx.use_eager_sharding(True):
        model = nnx.jit(lambda: mlp.GatedMLP(16, 32, rngs=nnx.Rngs(0)))()
        spec = model.gate_proj.kernel[...].sharding.spec
        want_spec = "(fsdp, tensor)" if sizes["tensor"] > 1 else "(fsdp)"  # Flax drops trailing Nones
        assert describe_spec(spec, mesh) == want_spec, spec
        out = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(x))
    k = {n: np.asarray(getattr(model, n).kernel[...]) for n in ("gate_proj", "up_proj", "down_proj")}
    want = (np_gelu_tanh(x @ k["gate_proj"]) * (x @ k["up_proj"])) @ k["down_proj"]
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- nn.traced


class _Counting(nnx.Module):
    """A linear map whose forward pass also updates state (what NNX refuses across trace levels)."""

    def __init__(self):
        self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
        self.calls = nnx.BatchStat(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return self.lin(x)


def test_module_fori_loop_runs_the_module_in_the_loop():
    module = _Counting()
    x = rand((2, 3), 3)
    want = x
    for i in range(4):
        want = 0.5 * np.asarray(module.lin(want)) + i

    def body(i, m, c):
        return 0.5 * m(c) + i

    eager = traced.module_fori_loop(module, 4, body, jnp.asarray(x))
    jitted = nnx.jit(lambda m, c: traced.module_fori_loop(m, 4, body, c))(module, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(eager), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(jitted), want, rtol=1e-5, atol=1e-5)
    assert int(module.calls[...]) == 0  # mutations inside the loop are not carried out
    with pytest.raises(Exception, match="trace level"):  # what the helper avoids
        jax.lax.fori_loop(0, 2, lambda i, c: module(c), jnp.asarray(x))


def test_merge_in_trace_inside_a_scan_of_a_jitted_state():
    # The policy-bundle pattern: state as a jit argument, the module rebuilt inside a scan body.
    module = _Counting()
    graphdef, state = nnx.split(module)
    x = rand((2, 3), 4)

    @jax.jit
    def run(state, x):
        def body(c, _):
            return traced.merge_in_trace(graphdef, state)(c), None

        return jax.lax.scan(body, x, None, length=3)[0]

    want = x
    for _ in range(3):
        want = np.asarray(module.lin(want))
    np.testing.assert_allclose(np.asarray(run(state, jnp.asarray(x))), want, rtol=1e-5, atol=1e-5)
