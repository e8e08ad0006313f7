"""The LeRobot π0.5 checkpoint layout (``model.safetensors`` of ``PI05Policy``) <-> ``Pi05Policy``.

Upstream names are listed in ``tests/data/pi05_params.tsv``. PyTorch ``Linear`` weights are
[out, in] (ours: [in, out]), ``Conv2d`` is [out, in, kh, kw] (ours: [kh, kw, in, out]). The token
embedding is tied to ``paligemma.lm_head.weight``, which is what ``save_model`` keeps; a file
holding ``language_model.embed_tokens.weight`` instead is accepted too. The action expert's
``lm_head`` is never used in forward and is on the ignore list.
"""

from __future__ import annotations

from embodied_jax.models.weights.layout import Layout, Rule

T = (1, 0)  # torch Linear [out, in] -> our kernel [in, out]
CONV = (2, 3, 1, 0)  # torch Conv2d [out, in, kh, kw] -> our [kh, kw, in, out]

ROOT = "model.paligemma_with_expert."
VISION = ROOT + "paligemma.model.vision_tower.vision_model."
LANGUAGE = ROOT + "paligemma.model.language_model."
EXPERT = ROOT + "gemma_expert.model."


def _linear(upstream: str, target: str, bias: bool = True) -> list[Rule]:
    rules = [Rule(f"{upstream}.weight", f"{target}.kernel", T)]
    if bias:
        rules.append(Rule(f"{upstream}.bias", f"{target}.bias"))
    return rules


def _gemma_layers(upstream: str, expert: int, adarms: bool) -> list[Rule]:
    ours = f"llm.layers.{{layer}}.experts.{expert}"
    theirs = f"{upstream}layers.{{layer}}"
    rules = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rules += _linear(f"{theirs}.self_attn.{proj}", f"{ours}.self_attn.{proj}", bias=False)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        rules += _linear(f"{theirs}.mlp.{proj}", f"{ours}.mlp.{proj}", bias=False)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if adarms:
            rules += _linear(f"{theirs}.{norm}.dense", f"{ours}.{norm}.dense")
        else:
            rules.append(Rule(f"{theirs}.{norm}.weight", f"{ours}.{norm}.scale"))
    if adarms:
        rules += _linear(f"{upstream}norm.dense", f"llm.final_norms.{expert}.dense")
    else:
        rules.append(Rule(f"{upstream}norm.weight", f"llm.final_norms.{expert}.scale"))
    return rules


def _vision() -> list[Rule]:
    layer_ours, layer_theirs = "vision_tower.encoder.layers.{layer}", VISION + "encoder.layers.{layer}"
    rules = [
        Rule(VISION + "embeddings.patch_embedding.weight", "vision_tower.embeddings.patch_embedding.kernel", CONV),
        Rule(VISION + "embeddings.patch_embedding.bias", "vision_tower.embeddings.patch_embedding.bias"),
        Rule(VISION + "embeddings.position_embedding.weight", "vision_tower.embeddings.position_embedding.embedding"),
        Rule(VISION + "post_layernorm.weight", "vision_tower.post_layernorm.scale"),
        Rule(VISION + "post_layernorm.bias", "vision_tower.post_layernorm.bias"),
    ]
    for norm in ("layer_norm1", "layer_norm2"):
        rules.append(Rule(f"{layer_theirs}.{norm}.weight", f"{layer_ours}.{norm}.scale"))
        rules.append(Rule(f"{layer_theirs}.{norm}.bias", f"{layer_ours}.{norm}.bias"))
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        rules += _linear(f"{layer_theirs}.self_attn.{proj}", f"{layer_ours}.self_attn.{proj}")
    for fc in ("fc1", "fc2"):
        rules += _linear(f"{layer_theirs}.mlp.{fc}", f"{layer_ours}.mlp.{fc}")
    return rules


PI05_LAYOUT = Layout(
    name="pi05",
    rules=tuple(
        _vision()
        + _linear(ROOT + "paligemma.model.multi_modal_projector.linear", "multi_modal_projector")
        + [
            Rule(ROOT + "paligemma.lm_head.weight", "llm.embed_tokens.embedding"),
            Rule(LANGUAGE + "embed_tokens.weight", "llm.embed_tokens.embedding"),  # alias (tied)
        ]
        + _gemma_layers(LANGUAGE, expert=0, adarms=False)
        + _gemma_layers(EXPERT, expert=1, adarms=True)
        + _linear("model.action_in_proj", "action_in_proj")
        + _linear("model.action_out_proj", "action_out_proj")
        + _linear("model.time_mlp_in", "time_mlp_in")
        + _linear("model.time_mlp_out", "time_mlp_out")
    ),
    ignore=(r"model\.paligemma_with_expert\.gemma_expert\.lm_head\.weight",),
    model_only=(r".*\.lora_[ab]",),
)
