"""GR00T-N1.5 checkpoints <-> ``Gr00tPolicy`` parameters (both published layouts).

- ``lerobot``: ``GrootPolicy.save_pretrained``: every key prefixed ``_groot_model.``, the tied
  Qwen3 embedding stored as ``…language_model.lm_head.weight``.
- ``nvidia``: ``GR00TN15.save_pretrained`` (nvidia/GR00T-N1.5-3B): no prefix, the tied embedding
  stored as ``…language_model.model.embed_tokens.weight``; one file or sharded with
  ``model.safetensors.index.json``.

Import accepts either name of the tied embedding in either layout (the other is an alias).
``detect_layout`` picks the layout from the checkpoint's key prefix. The SigLIP MAP pooling
head (``vision_model.vision_model.head.*``) is unused by Eagle and is on the ignore list.
Torch ``Linear`` weights [out, in] become our kernels [in, out]; the SigLIP patch convolution
[D, C, P, P] becomes [P, P, C, D]; ``CategorySpecificLinear`` weights are [slots, in, out] on
both sides. DiT blocks: upstream block 2i is our ``transformer_blocks[i].cross_block`` and
2i+1 our ``.self_block`` (interleaved; otherwise ``transformer_blocks[i].block``).
LoRA adapters have no upstream tensor and are left out of import and export.
"""

from __future__ import annotations

import re
from typing import Any

from embodied_jax.models.weights.layout import LAYER, Layout, Rule
from embodied_jax.models.weights.safetensors_io import CheckpointReader, export_checkpoint, import_checkpoint

LAYOUTS = ("lerobot", "nvidia")
PREFIXES = {"lerobot": "_groot_model.", "nvidia": ""}
T = (1, 0)  # torch Linear [out, in] -> kernel [in, out]


def _linear(upstream: str, target: str, bias: bool = True, layer_map=None) -> list[Rule]:
    rules = [Rule(upstream + ".weight", target + ".kernel", T, layer_map)]
    if bias:
        rules.append(Rule(upstream + ".bias", target + ".bias", None, layer_map))
    return rules


def _norm(upstream: str, target: str, bias: bool = True, layer_map=None) -> list[Rule]:
    rules = [Rule(upstream + ".weight", target + ".scale", None, layer_map)]
    if bias:
        rules.append(Rule(upstream + ".bias", target + ".bias", None, layer_map))
    return rules


def _vision(p: str) -> list[Rule]:
    u, t = p + "backbone.eagle_model.vision_model.vision_model.", "backbone.eagle_model.vision_model."
    layer_u, layer_t = u + f"encoder.layers.{LAYER}.", t + f"encoder.layers.{LAYER}."
    rules = [
        Rule(u + "embeddings.patch_embedding.weight", t + "embeddings.patch_embedding.kernel", (2, 3, 1, 0)),
        Rule(u + "embeddings.patch_embedding.bias", t + "embeddings.patch_embedding.bias"),
        Rule(u + "embeddings.position_embedding.weight", t + "embeddings.position_embedding.embedding"),
        *_norm(layer_u + "layer_norm1", layer_t + "layer_norm1"),
        *_norm(layer_u + "layer_norm2", layer_t + "layer_norm2"),
        *[
            r
            for n in ("q_proj", "k_proj", "v_proj", "out_proj")
            for r in _linear(layer_u + "self_attn." + n, layer_t + "self_attn." + n)
        ],
        *_linear(layer_u + "mlp.fc1", layer_t + "mlp.fc1"),
        *_linear(layer_u + "mlp.fc2", layer_t + "mlp.fc2"),
        *_norm(u + "post_layernorm", t + "post_layernorm"),
    ]
    return rules + _linear(p + "backbone.eagle_model.mlp1.0", "backbone.eagle_model.mlp1")


def _language(p: str, layout: str) -> list[Rule]:
    u, t = p + "backbone.eagle_model.language_model.", "backbone.eagle_model.language_model."
    head = Rule(u + "lm_head.weight", t + "embed_tokens.embedding")
    table = Rule(u + "model.embed_tokens.weight", t + "embed_tokens.embedding")
    layer_u, layer_t = u + f"model.layers.{LAYER}.", t + f"layers.{LAYER}."
    return [
        *((head, table) if layout == "lerobot" else (table, head)),  # first = written by export
        *[
            r
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
            for r in _linear(layer_u + "self_attn." + n, layer_t + "self_attn." + n, bias=False)
        ],
        *_norm(layer_u + "self_attn.q_norm", layer_t + "self_attn.q_norm", bias=False),
        *_norm(layer_u + "self_attn.k_norm", layer_t + "self_attn.k_norm", bias=False),
        *[
            r
            for n in ("gate_proj", "up_proj", "down_proj")
            for r in _linear(layer_u + "mlp." + n, layer_t + "mlp." + n, bias=False)
        ],
        *_norm(layer_u + "input_layernorm", layer_t + "input_layernorm", bias=False),
        *_norm(layer_u + "post_attention_layernorm", layer_t + "post_attention_layernorm", bias=False),
        *_norm(u + "model.norm", t + "norm", bias=False),
    ]


def _block(u: str, t: str, layer_map=None, *, ada: bool) -> list[Rule]:
    rules = [r for n in ("to_q", "to_k", "to_v") for r in _linear(u + "attn1." + n, t + "attn1." + n, True, layer_map)]
    rules += _linear(u + "attn1.to_out.0", t + "attn1.to_out", True, layer_map)
    rules += _linear(u + "ff.net.0.proj", t + "ff.proj_in", True, layer_map)
    rules += _linear(u + "ff.net.2", t + "ff.proj_out", True, layer_map)
    if ada:
        rules += _linear(u + "norm1.linear", t + "norm1.linear", True, layer_map)
    else:
        rules += _norm(u + "norm1", t + "norm1", True, layer_map) + _norm(u + "norm3", t + "norm3", True, layer_map)
    return rules


def _action_head(p: str) -> list[Rule]:
    u, t = p + "action_head.", "action_head."
    dit_u, dit_t = u + "model.", t + "model."
    block_u = dit_u + f"transformer_blocks.{LAYER}."
    embedder = "timestep_encoder.timestep_embedder."
    rules = [
        *_linear(dit_u + embedder + "linear_1", dit_t + embedder + "linear_1"),
        *_linear(dit_u + embedder + "linear_2", dit_t + embedder + "linear_2"),
        # interleaved DiT: scan step i = upstream blocks 2i (cross) and 2i+1 (self)
        *_block(block_u, dit_t + f"transformer_blocks.{LAYER}.cross_block.", lambda i: 2 * i, ada=True),
        *_block(block_u, dit_t + f"transformer_blocks.{LAYER}.self_block.", lambda i: 2 * i + 1, ada=True),
        *_block(block_u, dit_t + f"transformer_blocks.{LAYER}.block.", ada=True),  # non-interleaved DiT
        *_linear(dit_u + "proj_out_1", dit_t + "proj_out_1"),
        *_linear(dit_u + "proj_out_2", dit_t + "proj_out_2"),
        *_block(
            u + f"vl_self_attention.transformer_blocks.{LAYER}.",
            t + f"vl_self_attention.transformer_blocks.{LAYER}.",
            ada=False,
        ),
        *_norm(u + "vlln", t + "vlln"),
        Rule(u + "future_tokens.weight", t + "future_tokens.embedding"),
        Rule(u + "position_embedding.weight", t + "position_embedding.embedding"),
    ]
    for name, layers in (
        ("state_encoder", ("layer1", "layer2")),
        ("action_encoder", ("W1", "W2", "W3")),
        ("action_decoder", ("layer1", "layer2")),
    ):
        for layer in layers:
            rules += [
                Rule(f"{u}{name}.{layer}.W", f"{t}{name}.{layer}.W"),
                Rule(f"{u}{name}.{layer}.b", f"{t}{name}.{layer}.b"),
            ]
    return rules


def make_layout(layout: str = "lerobot") -> Layout:
    """The renaming table of one published layout (``lerobot`` or ``nvidia``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"GR00T layout {layout!r} is not one of {LAYOUTS}")
    p = PREFIXES[layout]
    rules = _vision(p) + _language(p, layout) + _action_head(p)
    ignore = (re.escape(p + "backbone.eagle_model.vision_model.vision_model.head.") + ".*",)
    return Layout(name=f"gr00t_n15[{layout}]", rules=tuple(rules), ignore=ignore, model_only=(r".*\.lora_[ab]",))


def detect_layout(src) -> str:
    """``lerobot`` if the checkpoint's keys carry the ``_groot_model.`` prefix, else ``nvidia``."""
    names = CheckpointReader(src).names()
    prefixed = sum(n.startswith(PREFIXES["lerobot"]) for n in names)
    if prefixed and prefixed != len(names):
        raise ValueError(
            f"{src}: {prefixed} of {len(names)} tensors carry the '_groot_model.' prefix; "
            "a GR00T checkpoint has it on all (lerobot) or none (nvidia)"
        )
    return "lerobot" if prefixed else "nvidia"


def import_params(src, abstract_params: Any, shardings: Any = None, *, mesh=None, layout: str | None = None) -> dict:
    """Checkpoint ``src`` (file, sharded index json or directory) -> nested dict of arrays.

    ``abstract_params``: the model's ``nnx.Param`` state (abstract or concrete); LoRA leaves
    are left out of the result (they keep their initial values). ``layout`` None = detect it
    from the key prefix. ``mesh`` places shardings recorded over an abstract mesh.
    """
    layout = layout or detect_layout(src)
    return import_checkpoint(src, make_layout(layout), abstract_params, shardings, mesh=mesh)


def export_params(params: Any, dst, *, layout: str = "lerobot", like=None, dtype=None):
    """Write the model's parameters (LoRA excluded) in a published layout; returns the file."""
    return export_checkpoint(params, make_layout(layout), dst, like=like, dtype=dtype)
