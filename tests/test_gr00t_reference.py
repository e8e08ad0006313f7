"""GR00T-N1.5 against an independent NumPy implementation of the upstream formulas.

A tiny checkpoint with known random weights is written in the upstream (LeRobot) naming,
imported through the GR00T importer, and the Flax policy's loss, velocity and sampled
actions (explicit noise and time) are compared with a float64 NumPy forward pass written
here from the upstream code's formulas (HF SigLIP / Qwen3, Eagle placeholder filling,
diffusers DiT blocks, GR00T's action head). ``mask_vl_padding=False`` is upstream's
behaviour; ``True`` is checked against the same reference with padded VL keys removed.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from embodied_jax.models.gr00t import Gr00tConfig
from embodied_jax.models.gr00t.variants import variant
from embodied_jax.models.gr00t.weights import import_params
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context

_TINY = variant("tiny")
_HEAD = _TINY.action_head
CFG = dataclasses.replace(
    _TINY,
    vision=dataclasses.replace(_TINY.vision, width=16, mlp_dim=24),
    llm=dataclasses.replace(_TINY.llm, width=32, head_dim=8, mlp_dim=40, vocab_size=64, rope_theta=10_000.0),
    image_token_id=63,
    camera_names=("front", "wrist"),
    max_token_len=36,
    action_head=dataclasses.replace(
        _HEAD,
        hidden_size=12,
        input_embedding_dim=16,
        max_num_embodiments=3,
        num_future_tokens=2,
        max_seq_len=8,
        dit=dataclasses.replace(_HEAD.dit, num_layers=4, head_dim=8, output_dim=12, dropout=0.0),
        vl_self_attention=dataclasses.replace(_HEAD.vl_self_attention, head_dim=8, dropout=0.0),
    ),
    action_dim=5,
    action_horizon=3,
    max_state_dim=6,
    mask_vl_padding=False,
    param_dtype="float32",
    dtype="float32",
    attention_impl="xla",
    scan_layers=True,
    synthetic_text_tokens=(2, 4),
)
P = "_groot_model."


def upstream_state_dict(cfg: Gr00tConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under upstream names and shapes (torch layouts), written out by hand."""
    rng = np.random.default_rng(seed)
    sd = {}

    def t(name, *shape, scale=0.3):
        sd[P + name] = (scale * rng.standard_normal(shape)).astype(np.float32)

    def lin(name, n_in, n_out, bias=True):
        t(name + ".weight", n_out, n_in, scale=1.0 / math.sqrt(n_in))
        if bias:
            t(name + ".bias", n_out, scale=0.1)

    def ln(name, d, bias=True):
        sd[P + name + ".weight"] = (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)
        if bias:
            t(name + ".bias", d, scale=0.1)

    v, d = "backbone.eagle_model.vision_model.vision_model.", cfg.vision.width
    t(v + "embeddings.patch_embedding.weight", d, 3, cfg.vision.patch_size, cfg.vision.patch_size, scale=0.1)
    t(v + "embeddings.patch_embedding.bias", d, scale=0.1)
    t(v + "embeddings.position_embedding.weight", cfg.vision.num_patches, d)
    for i in range(cfg.vision.depth):
        e = f"{v}encoder.layers.{i}."
        ln(e + "layer_norm1", d)
        ln(e + "layer_norm2", d)
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            lin(e + "self_attn." + n, d, d)
        lin(e + "mlp.fc1", d, cfg.vision.mlp_dim)
        lin(e + "mlp.fc2", cfg.vision.mlp_dim, d)
    ln(v + "post_layernorm", d)
    # the unused SigLIP pooling head (on the importer's ignore list)
    t(v + "head.probe", 1, 1, d)
    lin(v + "head.mlp.fc1", d, cfg.vision.mlp_dim)
    lin("backbone.eagle_model.mlp1.0", d, cfg.llm.width)
    lm, w = "backbone.eagle_model.language_model.", cfg.llm.width
    t(lm + "lm_head.weight", cfg.llm.vocab_size, w, scale=1.0)
    hd = cfg.llm.head_dim
    for i in range(cfg.select_layer):
        e = f"{lm}model.layers.{i}."
        lin(e + "self_attn.q_proj", w, cfg.llm.num_heads * hd, bias=False)
        lin(e + "self_attn.k_proj", w, cfg.llm.num_kv_heads * hd, bias=False)
        lin(e + "self_attn.v_proj", w, cfg.llm.num_kv_heads * hd, bias=False)
        lin(e + "self_attn.o_proj", cfg.llm.num_heads * hd, w, bias=False)
        ln(e + "self_attn.q_norm", hd, bias=False)
        ln(e + "self_attn.k_norm", hd, bias=False)
        lin(e + "mlp.gate_proj", w, cfg.llm.mlp_dim, bias=False)
        lin(e + "mlp.up_proj", w, cfg.llm.mlp_dim, bias=False)
        lin(e + "mlp.down_proj", cfg.llm.mlp_dim, w, bias=False)
        ln(e + "input_layernorm", w, bias=False)
        ln(e + "post_attention_layernorm", w, bias=False)
    ln(lm + "model.norm", w, bias=False)
    head, dit, vl = cfg.action_head, cfg.action_head.dit, cfg.action_head.vl_self_attention
    a, inner, emb = "action_head.", dit.num_heads * dit.head_dim, head.input_embedding_dim
    lin(a + "model.timestep_encoder.timestep_embedder.linear_1", 256, inner)
    lin(a + "model.timestep_encoder.timestep_embedder.linear_2", inner, inner)
    for i in range(dit.num_layers):
        e = f"{a}model.transformer_blocks.{i}."
        kv_in = cfg.llm.width if i % 2 == 0 else inner
        lin(e + "norm1.linear", inner, 2 * inner)
        lin(e + "attn1.to_q", inner, inner)
        lin(e + "attn1.to_k", kv_in, inner)
        lin(e + "attn1.to_v", kv_in, inner)
        lin(e + "attn1.to_out.0", inner, inner)
        lin(e + "ff.net.0.proj", inner, 4 * inner)
        lin(e + "ff.net.2", 4 * inner, inner)
    lin(a + "model.proj_out_1", inner, 2 * inner)
    lin(a + "model.proj_out_2", inner, dit.output_dim)
    vw = vl.num_heads * vl.head_dim
    for i in range(vl.num_layers):
        e = f"{a}vl_self_attention.transformer_blocks.{i}."
        ln(e + "norm1", vw)
        ln(e + "norm3", vw)
        for n in ("to_q", "to_k", "to_v", "to_out.0"):
            lin(e + "attn1." + n, vw, vw)
        lin(e + "ff.net.0.proj", vw, 4 * vw)
        lin(e + "ff.net.2", 4 * vw, vw)
    s = head.max_num_embodiments

    def cat(name, n_in, n_out):
        t(name + ".W", s, n_in, n_out, scale=1.0 / math.sqrt(n_in))
        t(name + ".b", s, n_out, scale=0.1)

    cat(a + "state_encoder.layer1", cfg.max_state_dim, head.hidden_size)
    cat(a + "state_encoder.layer2", head.hidden_size, emb)
    cat(a + "action_encoder.W1", cfg.action_dim, emb)
    cat(a + "action_encoder.W2", 2 * emb, emb)
    cat(a + "action_encoder.W3", emb, emb)
    cat(a + "action_decoder.layer1", head.hidden_size, head.hidden_size)
    cat(a + "action_decoder.layer2", head.hidden_size, cfg.action_dim)
    t(a + "future_tokens.weight", head.num_future_tokens, emb)
    ln(a + "vlln", cfg.llm.width)
    t(a + "position_embedding.weight", head.max_seq_len, emb)
    return sd


# ----------------------------------------------------------------------------- NumPy reference


def layer_norm(x, w=None, b=None, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w + b


def rms_norm(x, w, eps=1e-6):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x):
    return x / (1.0 + np.exp(-x))


def mha(q, k, v, mask):
    """q [T, N, H], k/v [S, K, H] (K divides N), mask bool [T, S] -> [T, N*H]."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    logits = np.einsum("tnh,snh->nts", q, k) / math.sqrt(q.shape[-1])
    logits = np.where(mask[None], logits, -np.inf)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    return np.einsum("nts,snh->tnh", probs, v).reshape(q.shape[0], -1)


class Reference:
    def __init__(self, sd, cfg: Gr00tConfig, mask_vl_padding: bool):
        self.sd = {k[len(P) :]: v.astype(np.float64) for k, v in sd.items()}
        self.cfg, self.mask = cfg, mask_vl_padding

    def lin(self, name, x):
        y = x @ self.sd[name + ".weight"].T
        return y + self.sd[name + ".bias"] if name + ".bias" in self.sd else y

    def ln(self, name, x, eps=1e-5):
        return layer_norm(x, self.sd[name + ".weight"], self.sd[name + ".bias"], eps)

    def siglip(self, image):
        cfg, v = self.cfg, "backbone.eagle_model.vision_model.vision_model."
        p, g = cfg.vision.patch_size, cfg.vision.image_size // cfg.vision.patch_size
        patches = image.reshape(g, p, g, p, 3).transpose(0, 2, 4, 1, 3).reshape(g * g, -1)  # (c, a, b) order
        w = self.sd[v + "embeddings.patch_embedding.weight"].reshape(cfg.vision.width, -1)
        x = patches @ w.T + self.sd[v + "embeddings.patch_embedding.bias"]
        x = x + self.sd[v + "embeddings.position_embedding.weight"]
        heads, hd = cfg.vision.num_heads, cfg.vision.width // cfg.vision.num_heads
        full = np.ones((len(x), len(x)), bool)
        for i in range(cfg.vision.depth):
            e = f"{v}encoder.layers.{i}."
            h = self.ln(e + "layer_norm1", x, 1e-6)
            q, k, vv = (self.lin(e + f"self_attn.{n}_proj", h).reshape(len(x), heads, hd) for n in "qkv")
            x = x + self.lin(e + "self_attn.out_proj", mha(q, k, vv, full))
            h = self.ln(e + "layer_norm2", x, 1e-6)
            x = x + self.lin(e + "mlp.fc2", gelu_tanh(self.lin(e + "mlp.fc1", h)))
        return self.ln(v + "post_layernorm", x, 1e-6)

    def rope(self, x, positions):
        hd = x.shape[-1]
        inv = 1.0 / self.cfg.llm.rope_theta ** (np.arange(0, hd, 2) / hd)
        ang = positions[:, None] * inv[None]
        cos, sin = np.concatenate([np.cos(ang)] * 2, -1)[:, None], np.concatenate([np.sin(ang)] * 2, -1)[:, None]
        rotated = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
        return x * cos + rotated * sin

    def qwen3(self, emb, token_mask):
        cfg, lm = self.cfg, "backbone.eagle_model.language_model.model."
        n = len(emb)
        causal = np.tril(np.ones((n, n), bool)) & token_mask[None, :]
        pos = np.arange(n, dtype=np.float64)
        x = emb
        for i in range(cfg.select_layer):
            e = f"{lm}layers.{i}."
            h = rms_norm(x, self.sd[e + "input_layernorm.weight"])
            q = self.lin(e + "self_attn.q_proj", h).reshape(n, cfg.llm.num_heads, -1)
            k = self.lin(e + "self_attn.k_proj", h).reshape(n, cfg.llm.num_kv_heads, -1)
            vv = self.lin(e + "self_attn.v_proj", h).reshape(n, cfg.llm.num_kv_heads, -1)
            q = self.rope(rms_norm(q, self.sd[e + "self_attn.q_norm.weight"]), pos)
            k = self.rope(rms_norm(k, self.sd[e + "self_attn.k_norm.weight"]), pos)
            x = x + self.lin(e + "self_attn.o_proj", mha(q, k, vv, causal))
            h = rms_norm(x, self.sd[e + "post_attention_layernorm.weight"])
            gated = silu(self.lin(e + "mlp.gate_proj", h)) * self.lin(e + "mlp.up_proj", h)
            x = x + self.lin(e + "mlp.down_proj", gated)
        return rms_norm(x, self.sd[lm + "norm.weight"])

    def block(self, e, x, heads, key_mask, temb=None, context=None):
        t = len(x)
        if temb is not None:
            scale, shift = np.split(self.lin(e + "norm1.linear", silu(temb)), 2)
            h = layer_norm(x) * (1 + scale) + shift
        else:
            h = self.ln(e + "norm1", x)
        src = h if context is None else context
        q = self.lin(e + "attn1.to_q", h).reshape(t, heads, -1)
        k = self.lin(e + "attn1.to_k", src).reshape(len(src), heads, -1)
        vv = self.lin(e + "attn1.to_v", src).reshape(len(src), heads, -1)
        x = x + self.lin(e + "attn1.to_out.0", mha(q, k, vv, np.broadcast_to(key_mask, (t, len(src)))))
        h = layer_norm(x) if temb is not None else self.ln(e + "norm3", x)
        return x + self.lin(e + "ff.net.2", gelu_tanh(self.lin(e + "ff.net.0.proj", h)))

    def vl_features(self, obs):
        cfg = self.cfg
        side = cfg.vision.image_size
        images = np.stack([obs["images"][c] for c in cfg.camera_names], 1).reshape(-1, side, side, 3)
        vit = np.stack([self.siglip(im.astype(np.float64)) for im in images])
        vit = self.lin("backbone.eagle_model.mlp1.0", vit).reshape(-1, cfg.llm.width)
        tokens = obs["tokens"]
        emb = self.sd["backbone.eagle_model.language_model.lm_head.weight"][tokens].reshape(-1, cfg.llm.width)
        emb[tokens.reshape(-1) == cfg.image_token_id] = vit  # upstream Eagle: fill placeholders in order
        emb = emb.reshape(*tokens.shape, -1)
        out = []
        for b in range(len(tokens)):
            mask = obs["token_mask"][b]
            f = self.ln("action_head.vlln", self.qwen3(emb[b], mask))
            keys = mask if self.mask else np.ones_like(mask)
            vl = cfg.action_head.vl_self_attention
            for i in range(vl.num_layers):
                f = self.block(f"action_head.vl_self_attention.transformer_blocks.{i}.", f, vl.num_heads, keys)
            out.append((f, keys))
        return out

    def cat_linear(self, name, x, slot):
        return x @ self.sd[name + ".W"][slot] + self.sd[name + ".b"][slot]

    def velocity(self, vl, obs, x_t, buckets):
        cfg, a = self.cfg, "action_head."
        out = []
        for b, (features, keys) in enumerate(vl):
            slot = obs["embodiment_id"][b]
            st = np.maximum(self.cat_linear(a + "state_encoder.layer1", obs["state"][b][None], slot), 0)
            st = self.cat_linear(a + "state_encoder.layer2", st, slot)
            bucket = float(buckets[b])
            half = cfg.action_head.input_embedding_dim // 2
            freqs = bucket * np.exp(-np.arange(half) * math.log(10000.0) / half)
            tau = np.broadcast_to(np.concatenate([np.sin(freqs), np.cos(freqs)]), (cfg.action_horizon, 2 * half))
            act = self.cat_linear(a + "action_encoder.W1", x_t[b], slot)
            act = silu(self.cat_linear(a + "action_encoder.W2", np.concatenate([act, tau], -1), slot))
            act = self.cat_linear(a + "action_encoder.W3", act, slot)
            act = act + self.sd[a + "position_embedding.weight"][: cfg.action_horizon]
            x = np.concatenate([st, self.sd[a + "future_tokens.weight"], act])
            exponent = -math.log(10000.0) * np.arange(128) / (128 - 1.0)  # diffusers, flip_sin_to_cos, shift 1
            proj = np.concatenate([np.cos(bucket * np.exp(exponent)), np.sin(bucket * np.exp(exponent))])
            te = a + "model.timestep_encoder.timestep_embedder."
            temb = self.lin(te + "linear_2", silu(self.lin(te + "linear_1", proj)))
            dit = cfg.action_head.dit
            for i in range(dit.num_layers):
                e = f"{a}model.transformer_blocks.{i}."
                if i % 2 == 0:
                    x = self.block(e, x, dit.num_heads, keys, temb, context=features)
                else:
                    x = self.block(e, x, dit.num_heads, np.ones(len(x), bool), temb)
            shift, scale = np.split(self.lin(a + "model.proj_out_1", silu(temb)), 2)
            x = self.lin(a + "model.proj_out_2", layer_norm(x, eps=1e-6) * (1 + scale) + shift)
            h = np.maximum(self.cat_linear(a + "action_decoder.layer1", x, slot), 0)
            out.append(self.cat_linear(a + "action_decoder.layer2", h, slot)[-cfg.action_horizon :])
        return np.stack(out)

    def loss(self, batch, noise, t):
        vl = self.vl_features(batch)
        x_t = (1 - t[:, None, None]) * noise + t[:, None, None] * batch["actions"]
        buckets = np.floor(t.astype(np.float32) * np.float32(1000)).astype(np.int64)
        pred = self.velocity(vl, batch, x_t, buckets)
        mask = batch["action_mask"].astype(np.float64)
        return ((pred - (batch["actions"] - noise)) ** 2 * mask).sum() / mask.sum(), pred

    def sample(self, obs, noise, steps):
        vl = self.vl_features(obs)
        x = noise.astype(np.float64)
        for k in range(steps):
            buckets = np.full(len(x), int(k / steps * 1000))
            x = x + (1.0 / steps) * self.velocity(vl, obs, x, buckets)
        return x


# ----------------------------------------------------------------------------- fixtures


def make_batch(cfg: Gr00tConfig, seed: int = 1):
    rng = np.random.default_rng(seed)
    b, length = 3, cfg.max_token_len
    tokens = np.zeros((b, length), np.int32)
    mask = np.zeros((b, length), bool)
    for i, n_text in enumerate((3, 7, 1)):
        row = [*rng.integers(0, 60, 2)]
        for _ in cfg.camera_names:
            row += [60, *[cfg.image_token_id] * cfg.vision.num_patches, 61]
        row += [*rng.integers(0, 60, n_text)]
        tokens[i, : len(row)] = row
        tokens[i, len(row) :] = 62  # the pad token (attended by upstream's adapter/DiT)
        mask[i, : len(row)] = True
    side = cfg.vision.image_size
    action_mask = np.ones((b, cfg.action_horizon, cfg.action_dim), bool)
    action_mask[1, :, 3:] = False
    return {
        "images": {c: rng.uniform(-1, 1, (b, side, side, 3)).astype(np.float32) for c in cfg.camera_names},
        "tokens": tokens,
        "token_mask": mask,
        "state": rng.normal(size=(b, cfg.max_state_dim)).astype(np.float32),
        "embodiment_id": np.array([2, 0, 2], np.int32),
        "actions": rng.normal(size=(b, cfg.action_horizon, cfg.action_dim)).astype(np.float32),
        "action_mask": action_mask,
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    sd = upstream_state_dict(CFG)
    path = tmp_path_factory.mktemp("gr00t_ref") / "model.safetensors"
    save_file(sd, str(path))
    models = {}
    mesh = make_mesh(MeshConfig())
    with mesh_context(mesh):
        for mask_vl in (False, True):
            cfg = dataclasses.replace(CFG, mask_vl_padding=mask_vl)
            abstract = nnx.eval_shape(lambda cfg=cfg: cfg.make(nnx.Rngs(0)))
            graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
            models[mask_vl] = nnx.merge(graphdef, import_params(path, params, mesh=mesh), rest)
    rng = np.random.default_rng(7)
    batch = make_batch(CFG)
    noise = rng.normal(size=batch["actions"].shape).astype(np.float32)
    time = np.array([0.05, 0.5, 0.9993], np.float32)
    return sd, models, batch, noise, time


def test_loss_velocity_and_sampling_match_numpy_reference(setup):
    sd, models, batch, noise, time = setup
    model = models[False]
    ref = Reference(sd, CFG, mask_vl_padding=False)
    want_loss, _ = ref.loss(batch, noise.astype(np.float64), time.astype(np.float64))
    loss, _ = nnx.jit(lambda m, b, n, t: m.loss(b, jax.random.key(0), noise=n, time=t))(model, batch, noise, time)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-5)

    x_t = np.random.default_rng(3).normal(size=noise.shape).astype(np.float32)
    buckets = np.floor(time * np.float32(1000)).astype(np.int64)
    want_v = ref.velocity(ref.vl_features(batch), batch, x_t.astype(np.float64), buckets)
    got_v = nnx.jit(lambda m, b, x, t: m.velocity(b, x, t))(model, batch, x_t, time)
    np.testing.assert_allclose(np.asarray(got_v), want_v, rtol=1e-5, atol=1e-5)

    want_a = ref.sample(batch, noise, CFG.num_inference_steps)
    got_a = nnx.jit(lambda m, b, n: m.sample_actions(b, jax.random.key(0), noise=n))(model, batch, noise)
    np.testing.assert_allclose(np.asarray(got_a), want_a, rtol=1e-4, atol=1e-4)


def test_masked_vl_padding_matches_reference_without_padded_keys(setup):
    sd, models, batch, noise, time = setup
    ref = Reference(sd, CFG, mask_vl_padding=True)
    want_loss, _ = ref.loss(batch, noise.astype(np.float64), time.astype(np.float64))
    loss_fn = nnx.jit(lambda m, b, n, t: m.loss(b, jax.random.key(0), noise=n, time=t))
    loss, _ = loss_fn(models[True], batch, noise, time)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-5)
    # the padding matters: upstream's (unmasked) loss differs from the masked one
    unmasked, _ = Reference(sd, CFG, mask_vl_padding=False).loss(
        batch, noise.astype(np.float64), time.astype(np.float64)
    )
    assert abs(unmasked - want_loss) > 1e-4
