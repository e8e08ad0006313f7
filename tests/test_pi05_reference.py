"""π0.5 against an independent NumPy implementation of the upstream formulas.

A tiny checkpoint with known random weights is written in LeRobot's naming and PyTorch layouts
(Linear [out, in], Conv2d [out, in, kh, kw]) as safetensors, imported through the π0.5 importer,
and the model's loss, velocity (joint pass and KV-cached suffix) and sampled actions are compared
with the NumPy reference below, which follows openpi/LeRobot's PI05Pytorch in float64: SigLIP,
PaliGemma prefix (image tokens unscaled, text × √width), Gemma experts with one joint attention,
AdaRMS (scale, shift, gate) in the action expert, sincos time MLP, flow matching.

Sizes break the easy assumptions: heads × head_dim ≠ width in both experts, grouped KV heads,
patch 4 with 12×12 images, an empty camera slot, prompt padding, action_dim < max_action_dim.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from embodied_jax.models.pi05.variants import variant
from embodied_jax.models.pi05.weights import PI05_LAYOUT
from embodied_jax.models.weights.safetensors_io import import_checkpoint
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context

VISION = dict(width=24, depth=2, heads=3, mlp=40, patch=4, image=12)
VLM = dict(width=32, depth=2, mlp=48, heads=4, kv_heads=2, head_dim=12)
EXPERT = dict(width=16, depth=2, mlp=24, heads=4, kv_heads=2, head_dim=12)
VOCAB, TOKENS, HORIZON, MAX_ADIM, ADIM, CAMS, BATCH = 50, 7, 4, 6, 5, ("base", "left", "right"), 2

_TINY = variant("tiny")
CONFIG = dataclasses.replace(
    _TINY,
    vision=dataclasses.replace(_TINY.vision, width=24, num_heads=3, mlp_dim=40, patch_size=4, image_size=12),
    vlm=dataclasses.replace(_TINY.vlm, width=32, mlp_dim=48, num_kv_heads=2, head_dim=12),
    expert=dataclasses.replace(_TINY.expert, width=16, mlp_dim=24, num_kv_heads=2, head_dim=12),
    vocab_size=VOCAB,
    camera_names=CAMS,
    max_token_len=TOKENS,
    action_horizon=HORIZON,
    max_action_dim=MAX_ADIM,
    action_dim=ADIM,
    max_state_dim=32,
    synthetic_prompt_len=0,
    num_inference_steps=3,
    attention_impl="xla",
)

P = "model.paligemma_with_expert."
V = P + "paligemma.model.vision_tower.vision_model."
L = P + "paligemma.model.language_model."
E = P + "gemma_expert.model."


# ----------------------------------------------------------------------------- checkpoint


def upstream_checkpoint(seed=0):
    """Random weights under LeRobot's names, in PyTorch layouts."""
    rng = np.random.default_rng(seed)
    sd = {}

    def t(name, *shape, scale=0.2):
        sd[name] = (rng.standard_normal(shape) * scale).astype(np.float32)

    def linear(name, n_out, n_in, bias=True):
        t(name + ".weight", n_out, n_in, scale=1.0 / math.sqrt(n_in))
        if bias:
            t(name + ".bias", n_out, scale=0.1)

    d, p = VISION["width"], VISION["patch"]
    t(V + "embeddings.patch_embedding.weight", d, 3, p, p)
    t(V + "embeddings.patch_embedding.bias", d)
    t(V + "embeddings.position_embedding.weight", (VISION["image"] // p) ** 2, d)
    for i in range(VISION["depth"]):
        pre = f"{V}encoder.layers.{i}."
        for ln in ("layer_norm1", "layer_norm2"):
            sd[pre + ln + ".weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
            t(pre + ln + ".bias", d, scale=0.1)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear(pre + "self_attn." + proj, d, d)
        linear(pre + "mlp.fc1", VISION["mlp"], d)
        linear(pre + "mlp.fc2", d, VISION["mlp"])
    sd[V + "post_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    t(V + "post_layernorm.bias", d, scale=0.1)
    linear(P + "paligemma.model.multi_modal_projector.linear", VLM["width"], d)
    t(P + "paligemma.lm_head.weight", VOCAB, VLM["width"], scale=0.5)
    for prefix, cfg, ada in ((L, VLM, False), (E, EXPERT, True)):
        w, hd = cfg["width"], cfg["head_dim"]
        for i in range(cfg["depth"]):
            pre = f"{prefix}layers.{i}."
            linear(pre + "self_attn.q_proj", cfg["heads"] * hd, w, bias=False)
            linear(pre + "self_attn.k_proj", cfg["kv_heads"] * hd, w, bias=False)
            linear(pre + "self_attn.v_proj", cfg["kv_heads"] * hd, w, bias=False)
            linear(pre + "self_attn.o_proj", w, cfg["heads"] * hd, bias=False)
            linear(pre + "mlp.gate_proj", cfg["mlp"], w, bias=False)
            linear(pre + "mlp.up_proj", cfg["mlp"], w, bias=False)
            linear(pre + "mlp.down_proj", w, cfg["mlp"], bias=False)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                if ada:
                    linear(pre + norm + ".dense", 3 * w, w)
                else:
                    t(pre + norm + ".weight", w)
        if ada:
            linear(prefix + "norm.dense", 3 * w, w)
        else:
            t(prefix + "norm.weight", w)
    t(P + "gemma_expert.lm_head.weight", VOCAB, EXPERT["width"])  # unused upstream: on the ignore list
    we = EXPERT["width"]
    linear("model.action_in_proj", we, MAX_ADIM)
    linear("model.action_out_proj", MAX_ADIM, we)
    linear("model.time_mlp_in", we, we)
    linear("model.time_mlp_out", we, we)
    return sd


# ----------------------------------------------------------------------------- NumPy reference


def lin(sd, name, x, bias=True):
    y = x @ sd[name + ".weight"].astype(np.float64).T
    return y + sd[name + ".bias"] if bias else y


def layer_norm(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def rms(x, eps=1e-6):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu(x):
    return x / (1 + np.exp(-x))


def softmax_attention(q, k, v, mask):
    """q [B,T,N,H], k/v [B,S,K,H] (HF repeat_kv grouping), mask bool [B,T,S]."""
    rep = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    logits = np.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(mask[:, None], logits, -1e30)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


def rope(x, pos, theta=10000.0):
    h = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = pos[..., None].astype(np.float64) * inv  # [B, T, H/2]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., : h // 2], x[..., h // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def siglip(sd, img):
    b, h, w, c = img.shape
    p = VISION["patch"]
    x = img.transpose(0, 3, 1, 2).reshape(b, c, h // p, p, w // p, p)
    x = np.einsum("bchpwq,dcpq->bhwd", x, sd[V + "embeddings.patch_embedding.weight"])
    x = x.reshape(b, -1, VISION["width"]) + sd[V + "embeddings.patch_embedding.bias"]
    x = x + sd[V + "embeddings.position_embedding.weight"]
    heads = VISION["heads"]
    hd = VISION["width"] // heads
    for i in range(VISION["depth"]):
        pre = f"{V}encoder.layers.{i}."
        y = layer_norm(x, sd[pre + "layer_norm1.weight"], sd[pre + "layer_norm1.bias"])
        q, k, vv = (
            lin(sd, pre + f"self_attn.{n}", y).reshape(b, -1, heads, hd) for n in ("q_proj", "k_proj", "v_proj")
        )
        att = softmax_attention(q, k, vv, np.ones((b, x.shape[1], x.shape[1]), bool)).reshape(b, -1, VISION["width"])
        x = x + lin(sd, pre + "self_attn.out_proj", att)
        y = layer_norm(x, sd[pre + "layer_norm2.weight"], sd[pre + "layer_norm2.bias"])
        x = x + lin(sd, pre + "mlp.fc2", gelu_tanh(lin(sd, pre + "mlp.fc1", y)))
    return layer_norm(x, sd[V + "post_layernorm.weight"], sd[V + "post_layernorm.bias"])


def norm(sd, name, x, cond):
    """(normed, gate): Gemma (1 + w) RMSNorm, or AdaRMS with chunks scale, shift, gate."""
    if cond is None:
        return rms(x) * (1 + sd[name + ".weight"]), None
    mod = lin(sd, name + ".dense", cond)[:, None, :]
    scale, shift, gate = np.split(mod, 3, axis=-1)
    return rms(x) * (1 + scale) + shift, gate


def embed_prefix(sd, obs):
    embs, pads = [], []
    for cam in CAMS:
        feats = lin(sd, P + "paligemma.model.multi_modal_projector.linear", siglip(sd, obs["images"][cam]))
        embs.append(feats)
        pads.append(np.repeat(obs["image_masks"][cam][:, None], feats.shape[1], 1))
    embs.append(sd[P + "paligemma.lm_head.weight"][obs["tokens"]] * math.sqrt(VLM["width"]))
    pads.append(obs["token_mask"])
    pad = np.concatenate(pads, 1)
    return np.concatenate(embs, 1), pad, np.zeros_like(pad, dtype=np.int64)


def embed_suffix(sd, x_t, t):
    we = EXPERT["width"]
    frac = np.linspace(0.0, 1.0, we // 2)
    period = 4e-3 * (4.0 / 4e-3) ** frac
    ang = t[:, None] * (2 * math.pi / period)
    temb = np.concatenate([np.sin(ang), np.cos(ang)], 1)
    cond = silu(lin(sd, "model.time_mlp_out", silu(lin(sd, "model.time_mlp_in", temb))))
    b = x_t.shape[0]
    att = np.zeros((b, HORIZON), np.int64)
    att[:, 0] = 1
    return lin(sd, "model.action_in_proj", x_t), np.ones((b, HORIZON), bool), att, cond


def reference_velocity(sd, obs, x_t, t):
    prefix, ppad, patt = embed_prefix(sd, obs)
    suffix, spad, satt, cond = embed_suffix(sd, x_t, t)
    pad = np.concatenate([ppad, spad], 1)
    cum = np.cumsum(np.concatenate([patt, satt], 1), 1)
    mask = (cum[:, None, :] <= cum[:, :, None]) & pad[:, None, :] & pad[:, :, None]
    pos = np.cumsum(pad, 1) - 1
    xs, conds, prefixes = [prefix, suffix], [None, cond], [L, E]
    cfgs = [VLM, EXPERT]
    for i in range(VLM["depth"]):
        qs, ks, vs, gates = [], [], [], []
        for x, c, pre, cfg in zip(xs, conds, prefixes, cfgs, strict=True):
            h, g = norm(sd, f"{pre}layers.{i}.input_layernorm", x, c)
            gates.append(g)
            b, n = h.shape[:2]
            qs.append(lin(sd, f"{pre}layers.{i}.self_attn.q_proj", h, False).reshape(b, n, cfg["heads"], -1))
            ks.append(lin(sd, f"{pre}layers.{i}.self_attn.k_proj", h, False).reshape(b, n, cfg["kv_heads"], -1))
            vs.append(lin(sd, f"{pre}layers.{i}.self_attn.v_proj", h, False).reshape(b, n, cfg["kv_heads"], -1))
        q, k = rope(np.concatenate(qs, 1), pos), rope(np.concatenate(ks, 1), pos)
        att = softmax_attention(q, k, np.concatenate(vs, 1), mask)
        att = att.reshape(*att.shape[:2], -1)
        out, start = [], 0
        for x, c, g, pre in zip(xs, conds, gates, prefixes, strict=True):
            n = x.shape[1]
            y = lin(sd, f"{pre}layers.{i}.self_attn.o_proj", att[:, start : start + n], False)
            start += n
            x = x + (y if g is None else y * g)
            h, g2 = norm(sd, f"{pre}layers.{i}.post_attention_layernorm", x, c)
            m = lin(
                sd,
                f"{pre}layers.{i}.mlp.down_proj",
                gelu_tanh(lin(sd, f"{pre}layers.{i}.mlp.gate_proj", h, False))
                * lin(sd, f"{pre}layers.{i}.mlp.up_proj", h, False),
                False,
            )
            out.append(x + (m if g2 is None else m * g2))
        xs = out
    suffix_out, _ = norm(sd, E + "norm", xs[1], cond)
    return lin(sd, "model.action_out_proj", suffix_out)


def reference_loss(sd, obs, actions, noise, t):
    x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
    v = reference_velocity(sd, obs, x_t, t)
    return ((noise - actions - v) ** 2)[..., :ADIM].mean()


def reference_sample(sd, obs, noise, steps):
    x, dt = noise, -1.0 / steps
    for i in range(steps):
        t = np.float64(np.float32(1.0 + i * dt))  # upstream: a Python float made a float32 tensor
        x = x + dt * reference_velocity(sd, obs, x, np.full((x.shape[0],), t))
    return x[..., :ADIM]


# ----------------------------------------------------------------------------- fixtures


def observation(seed=1):
    rng = np.random.default_rng(seed)
    size = VISION["image"]
    tokens = rng.integers(0, VOCAB, (BATCH, TOKENS)).astype(np.int32)
    token_mask = np.arange(TOKENS)[None] < np.array([[5], [3]])
    return {
        "images": {c: rng.uniform(-1, 1, (BATCH, size, size, 3)).astype(np.float32) for c in CAMS},
        "image_masks": {
            "base": np.array([True, True]),
            "left": np.array([True, False]),
            "right": np.array([False, True]),
        },
        "tokens": np.where(token_mask, tokens, 0).astype(np.int32),
        "token_mask": token_mask,
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    sd = upstream_checkpoint()
    path = tmp_path_factory.mktemp("pi05_ref") / "model.safetensors"
    save_file(sd, str(path))
    mesh = make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))
    with mesh_context(mesh):
        model = nnx.eval_shape(lambda: CONFIG.make(nnx.Rngs(0)))  # every parameter comes from the file
        params = nnx.state(model, nnx.Param)
        loaded = import_checkpoint(path, PI05_LAYOUT, params, mesh=mesh)
        nnx.replace_by_pure_dict(params, loaded)
        nnx.update(model, params)
    sd64 = {k: v.astype(np.float64) for k, v in sd.items()}
    rng = np.random.default_rng(2)
    data = {
        "obs": observation(),
        "actions": rng.standard_normal((BATCH, HORIZON, MAX_ADIM)),
        "noise": rng.standard_normal((BATCH, HORIZON, MAX_ADIM)),
        "time": np.array([0.3, 0.85], np.float32).astype(np.float64),  # what a float32 input carries
    }

    @nnx.jit
    def loss_fn(model, batch, noise, time):
        return model.loss(batch, jax.random.key(0), noise=noise, time=time)[0]

    @nnx.jit(static_argnames="cached")
    def velocity_fn(model, obs, x_t, time, cached):
        return model.velocity(obs, x_t, time, cached=cached)

    @nnx.jit
    def sample_fn(model, obs, noise):
        return model.sample_actions(obs, jax.random.key(0), noise=noise)

    return dict(model=model, mesh=mesh, sd=sd64, loss=loss_fn, velocity=velocity_fn, sample=sample_fn, **data)


def f32(x):
    return jnp.asarray(x, jnp.float32)


def test_loss_matches_reference(setup):
    s = setup
    batch = dict(s["obs"], actions=f32(s["actions"]))
    with mesh_context(s["mesh"]):
        got = s["loss"](s["model"], batch, f32(s["noise"]), f32(s["time"]))
    want = reference_loss(s["sd"], s["obs"], s["actions"], s["noise"], s["time"])
    np.testing.assert_allclose(float(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cached", [False, True], ids=["joint", "kv_cache"])
def test_velocity_matches_reference(setup, cached):
    s = setup
    x_t = s["noise"] * 0.7 + s["actions"] * 0.3
    with mesh_context(s["mesh"]):
        got = s["velocity"](s["model"], s["obs"], f32(x_t), f32(s["time"]), cached)
    want = reference_velocity(s["sd"], s["obs"], x_t, s["time"])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_sampled_actions_match_reference(setup):
    s = setup
    with mesh_context(s["mesh"]):
        got = s["sample"](s["model"], s["obs"], f32(s["noise"]))
    want = reference_sample(s["sd"], s["obs"], s["noise"], CONFIG.num_inference_steps)
    assert got.shape == (BATCH, HORIZON, ADIM)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
