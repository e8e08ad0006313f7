"""openpi's own JAX/Orbax π0.5 checkpoints (the ``params`` item) -> ``Pi05Policy`` parameters.

Checkpoints that fit: the ``params`` directories of openpi's ``pi05_base``, ``pi05_droid`` and
``pi05_libero`` (downloaded first: ``gs://`` is not read), and those of openpi's own full
fine-tunes of π0.5 (``<run>/<step>/params``). The norm stats under openpi's ``assets/`` are not
imported; LoRA fine-tunes (``lora_a``/``lora_b`` leaves) and π0 checkpoints are rejected as not
matching. ``--src`` may name the ``params`` directory or the directory holding it::

    python -m embodied_jax.models.convert --arch pi05 --layout openpi --src OPENPI_PARAMS_DIR --out CKPT_DIR

Layout (``tests/data/openpi_pi05_params.tsv``), a ``models.weights.layout.Layout`` like every
importer's: each leaf filled by one rule (openpi's stacks are stacked sources), two rules reading
one openpi leaf where it holds two of ours (``take``):

- Two experts: the PaliGemma Gemma's weights carry openpi's plain names (``attn/q_einsum``,
  ``mlp``, ``pre_attention_norm``, ``final_norm``), the action expert's the same names suffixed
  ``_1``; they become our ``llm.layers.experts.0`` / ``.1``. The expert's norms are adaRMS
  (``…_norm_1/Dense_0/{kernel,bias}`` -> ``….dense``; chunks scale, shift, gate on both sides).
- Scanned layers: openpi stores every stack with a leading layer axis (``PaliGemma/llm/layers/…``,
  ``PaliGemma/img/Transformer/encoderblock/…``); our scanned stacks keep it, unscanned ones take
  layer ``i`` into ``layers.i``.
- Gemma einsums: ``q_einsum`` [N, D, H] -> ``q_proj`` [D, N·H]; ``kv_einsum`` [2, K, D, H] ->
  ``k_proj``/``v_proj`` [D, K·H]; ``attn_vec_einsum`` [N, H, D] -> ``o_proj`` [N·H, D];
  ``gating_einsum`` [2, D, F] -> ``gate_proj``/``up_proj``; ``linear`` -> ``down_proj``.
- SigLIP (``PaliGemma/img``): ``embedding`` (HWIO conv, as ours), ``pos_embedding`` [1, P, W] ->
  [P, W], attention ``query``/``key``/``value`` [W, N, W/N] (bias [N, W/N]) and ``out`` [N, W/N, W]
  -> merged heads, ``MlpBlock_0/Dense_{0,1}`` -> ``fc1``/``fc2``, ``encoder_norm`` ->
  ``post_layernorm``; ``head`` is the PaliGemma projector (``multi_modal_projector``).
- ``action_in_proj``, ``action_out_proj``, ``time_mlp_in``, ``time_mlp_out``: Flax ``Linear``
  [in, out] as ours; the token embedding is ``PaliGemma/llm/embedder/input_embedding``.

On disk openpi writes the item with ``PyTreeCheckpointer`` as ``{"params": tree}`` (published
checkpoints and ``save_state``); a tree without that wrapper is accepted too, and so are leaves
ending in ``/value`` (an ``nnx.State`` saved as is). Import plans from the Orbax metadata alone
and raises ``WeightMismatchError`` listing every missing, unexpected and mis-shaped leaf before
any data is read. It then restores openpi's leaves onto the host a few at a time (Orbax partial
restores of at most ``READ_BATCH_BYTES``, a larger leaf alone) and builds each target leaf with
``jax.make_array_from_callback`` in its sharding, every device shard cast to the leaf's dtype (the
stored dtype is never checked): memory holds the model's shards plus one such batch (and a copy of
a leaf where the layout transposes it), never a second copy of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from embodied_jax.models.pi05.weights import PI05_LAYOUT
from embodied_jax.models.weights.layout import (
    LAYER,
    Layout,
    Rule,
    Slot,
    check_names,
    concrete_sharding,
    flatten_params,
    transform,
    unflatten_params,
)
from embodied_jax.models.weights.layout import assign as assign_slots
from embodied_jax.models.weights.layout import plan as plan_entries

log = logging.getLogger(__name__)

ORBAX_MARKERS = ("_METADATA", "_CHECKPOINT_METADATA")
READ_BATCH_BYTES = 1 << 30  # leaves restored per Orbax call (one call per leaf is slow for small trees)


def _rule(source: str, target: str, shape: tuple[int, ...], take: int | None = None, transpose=None) -> Rule:
    """One openpi leaf (or its part ``take``) -> one of our leaves (``{layer}``: a stack); ``shape``:
    the openpi leaf's full shape (a stack's leading layer axis included)."""
    return Rule(source, target, transpose, take=take, shape=tuple(shape))


# ----------------------------------------------------------------------------- layout


def _linear(source: str, target: str, fan_in: int, fan_out: int, layers: tuple[int, ...] = ()) -> list[Rule]:
    return [
        _rule(f"{source}/kernel", f"{target}.kernel", (*layers, fan_in, fan_out)),
        _rule(f"{source}/bias", f"{target}.bias", (*layers, fan_out)),
    ]


def _vision(config) -> list[Rule]:
    v, img = config.vision, "PaliGemma/img/"
    block, ours = img + "Transformer/encoderblock/", f"vision_tower.encoder.layers.{LAYER}."
    w, n, stack = v.width, v.num_heads, (v.depth,)
    embeddings = "vision_tower.embeddings."
    out = [
        _rule(img + "embedding/kernel", embeddings + "patch_embedding.kernel", (v.patch_size,) * 2 + (3, w)),
        _rule(img + "embedding/bias", embeddings + "patch_embedding.bias", (w,)),
        _rule(img + "pos_embedding", embeddings + "position_embedding.embedding", (1, v.num_patches, w), take=0),
        _rule(img + "Transformer/encoder_norm/scale", "vision_tower.post_layernorm.scale", (w,)),
        _rule(img + "Transformer/encoder_norm/bias", "vision_tower.post_layernorm.bias", (w,)),
    ]
    if v.num_channels != 3:
        raise ValueError(f"openpi layout: SigLIP takes RGB images, config has num_channels={v.num_channels}")
    for i, norm in enumerate(("layer_norm1", "layer_norm2")):
        out += [_rule(f"{block}LayerNorm_{i}/{p}", f"{ours}{norm}.{p}", (*stack, w)) for p in ("scale", "bias")]
    attn = block + "MultiHeadDotProductAttention_0/"
    for theirs, proj in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
        out.append(_rule(f"{attn}{theirs}/kernel", f"{ours}self_attn.{proj}.kernel", (*stack, w, n, w // n)))
        out.append(_rule(f"{attn}{theirs}/bias", f"{ours}self_attn.{proj}.bias", (*stack, n, w // n)))
    out.append(_rule(attn + "out/kernel", f"{ours}self_attn.out_proj.kernel", (*stack, n, w // n, w)))
    out.append(_rule(attn + "out/bias", f"{ours}self_attn.out_proj.bias", (*stack, w)))
    out += _linear(block + "MlpBlock_0/Dense_0", ours + "mlp.fc1", w, v.mlp_dim, stack)
    out += _linear(block + "MlpBlock_0/Dense_1", ours + "mlp.fc2", v.mlp_dim, w, stack)
    out += _linear(img + "head", "multi_modal_projector", w, config.vlm.width)
    return out


def _norm(source: str, target: str, expert, layers: tuple[int, ...] = ()) -> list[Rule]:
    if expert.use_adarms:
        cond = expert.cond_dim or expert.width
        return _linear(f"{source}/Dense_0", f"{target}.dense", cond, 3 * expert.width, layers)
    return [_rule(f"{source}/scale", f"{target}.scale", (*layers, expert.width))]


def _expert(index: int, expert) -> list[Rule]:
    """One Gemma expert: openpi names expert 0 plainly and expert i > 0 with the suffix ``_i``."""
    s = f"_{index}" if index else ""
    theirs, ours = "PaliGemma/llm/layers/", f"llm.layers.{LAYER}.experts.{index}."
    d, n, k, h, f = expert.width, expert.num_heads, expert.num_kv_heads, expert.head_dim, expert.mlp_dim
    stack = (expert.depth,)
    if n == k:
        raise ValueError("openpi layout: with num_kv_heads == num_heads openpi stores qkv_einsum, not supported")
    kv, gating = f"{theirs}attn/kv_einsum{s}/w", f"{theirs}mlp{s}/gating_einsum"
    return [
        _rule(f"{theirs}attn/q_einsum{s}/w", ours + "self_attn.q_proj.kernel", (*stack, n, d, h), transpose=(1, 0, 2)),
        _rule(kv, ours + "self_attn.k_proj.kernel", (*stack, 2, k, d, h), take=0, transpose=(1, 0, 2)),
        _rule(kv, ours + "self_attn.v_proj.kernel", (*stack, 2, k, d, h), take=1, transpose=(1, 0, 2)),
        _rule(f"{theirs}attn/attn_vec_einsum{s}/w", ours + "self_attn.o_proj.kernel", (*stack, n, h, d)),
        _rule(gating, ours + "mlp.gate_proj.kernel", (*stack, 2, d, f), take=0),
        _rule(gating, ours + "mlp.up_proj.kernel", (*stack, 2, d, f), take=1),
        _rule(f"{theirs}mlp{s}/linear", ours + "mlp.down_proj.kernel", (*stack, f, d)),
        *_norm(f"{theirs}pre_attention_norm{s}", ours + "input_layernorm", expert, stack),
        *_norm(f"{theirs}pre_ffw_norm{s}", ours + "post_attention_layernorm", expert, stack),
        *_norm(f"PaliGemma/llm/final_norm{s}", f"llm.final_norms.{index}", expert),
    ]


def rules(config) -> list[Rule]:
    """Every move of openpi's π0.5 tree into a ``Pi05Policy`` of ``config`` (openpi shapes from it)."""
    width, actions = config.expert.width, config.max_action_dim
    embed = "PaliGemma/llm/embedder/input_embedding"
    return (
        _vision(config)
        + [_rule(embed, "llm.embed_tokens.embedding", (config.vocab_size, config.vlm.width))]
        + _expert(0, config.vlm)
        + _expert(1, config.expert)
        + _linear("action_in_proj", "action_in_proj", actions, width)
        + _linear("action_out_proj", "action_out_proj", width, actions)
        + _linear("time_mlp_in", "time_mlp_in", width, width)
        + _linear("time_mlp_out", "time_mlp_out", width, width)
    )


def layout(config) -> Layout:
    """openpi's π0.5 tree for ``config`` as a layout (LoRA leaves are ours only, as in LeRobot's)."""
    return Layout("openpi", tuple(rules(config)), model_only=PI05_LAYOUT.model_only)


def source_shapes(config) -> dict[str, tuple[int, ...]]:
    """openpi's params tree for ``config``: path -> shape (``tests/data/openpi_pi05_params.tsv`` at full size)."""
    return {m.source: m.shape for m in rules(config)}


def plan(config, leaf_shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[Rule, list[Slot]]]:
    """Each rule with the slots it fills in a tree with these leaves (LoRA leaves excluded);
    ``ValueError`` when a leaf is reached by none or a transform does not give its leaf's shape."""
    return assign_slots(layout(config), leaf_shapes)


# ----------------------------------------------------------------------------- reading


def _is_orbax_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in ORBAX_MARKERS)


def params_dir(src) -> Path:
    """The Orbax params item: ``src/params`` when that is one (a checkpoint or step dir), else ``src``."""
    path = Path(src)
    if _is_orbax_dir(path / "params"):
        return (path / "params").absolute()
    if _is_orbax_dir(path):
        return path.absolute()
    hint = " (download gs:// checkpoints first)" if str(src).startswith("gs:/") else ""
    raise FileNotFoundError(f"{src}: no Orbax checkpoint here or in params/ ({' or '.join(ORBAX_MARKERS)}){hint}")


def is_openpi_checkpoint(src) -> bool:
    """Whether ``src`` is an Orbax directory (or holds one as ``params/``), i.e. openpi's layout."""
    path = Path(src)
    return _is_orbax_dir(path) or _is_orbax_dir(path / "params")


class OpenpiCheckpoint:
    """An openpi params item: leaf paths and shapes from the Orbax metadata, leaves restored on demand."""

    def __init__(self, src):
        import orbax.checkpoint as ocp

        self.path = params_dir(src)
        self._checkpointer = ocp.PyTreeCheckpointer()
        metadata = self._checkpointer.metadata(self.path)
        tree = getattr(metadata, "item_metadata", metadata)  # StepMetadata (newer Orbax) or the tree itself
        tree = dict(getattr(tree, "tree", tree))
        flat, keys = flatten_params(tree)
        paths = {d: keys[d] for d in flat}
        if all(k[0] == "params" and len(k) > 1 for k in paths.values()):
            paths = {d: k[1:] for d, k in paths.items()}  # openpi's {"params": ...} wrapper
        if all(k[-1] == "value" and len(k) > 1 for k in paths.values()):
            paths = {d: k[:-1] for d, k in paths.items()}  # an nnx.State saved as is
        self._keys = {"/".join(str(k) for k in paths[d]): keys[d] for d in flat}  # openpi path -> stored keys
        self._meta = {"/".join(str(k) for k in paths[d]): flat[d] for d in flat}

    def names(self) -> list[str]:
        return list(self._meta)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._meta[name].shape)

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * np.dtype(self._meta[name].dtype).itemsize

    def read(self, names: list[str]) -> dict[str, np.ndarray]:
        """These leaves on the host, in their stored dtypes (one partial restore: nothing else is read)."""
        import orbax.checkpoint as ocp

        keys = {name: self._keys[name] for name in names}
        item = unflatten_params({name: self._meta[name] for name in names}, keys)
        restore_args = unflatten_params({name: ocp.RestoreArgs(restore_type=np.ndarray) for name in names}, keys)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        restored = self._checkpointer.restore(self.path, args=args)
        out = {}
        for name, key in keys.items():
            node = restored
            for k in key:
                node = node[k]
            out[name] = np.asarray(node)
        return out

    def batches(self, names: list[str], max_bytes: int = READ_BATCH_BYTES) -> list[list[str]]:
        """``names`` in order, grouped into reads of at most ``max_bytes`` (a larger leaf alone)."""
        batches, size = [[]], 0
        for name in names:
            if batches[-1] and size + self.nbytes(name) > max_bytes:
                batches.append([])
                size = 0
            batches[-1].append(name)
            size += self.nbytes(name)
        return [b for b in batches if b]


def import_params(src, config, abstract_params: Any, shardings: Any = None, *, mesh=None) -> dict:
    """Read openpi's params item at ``src`` into a nested dict of ``jax.Array`` like ``abstract_params``.

    ``config``: the ``Pi05Config`` the tree belongs to (openpi's shapes follow from it).
    ``abstract_params``/``shardings``: as for ``safetensors_io.import_checkpoint`` (nested dict or
    ``nnx.State`` of ``ShapeDtypeStruct``s; default sharding: each leaf's own, else the first
    device; shardings over an abstract mesh are placed on ``mesh``). LoRA leaves are left out.
    """
    lay = layout(config)
    flat, keys = flatten_params(abstract_params)
    flat = {k: v for k, v in flat.items() if not lay.is_model_only(k)}
    flat_shardings = flatten_params(shardings)[0] if shardings is not None else {}
    entries = plan_entries(lay, {k: tuple(v.shape) for k, v in flat.items()})
    ckpt = OpenpiCheckpoint(src)
    names = {name: ckpt.shape(name) for name in ckpt.names()}
    chosen, _ = check_names(f"openpi checkpoint {ckpt.path}", names, entries, lay)
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    by_source: dict[str, list] = {}
    for entry in chosen.values():
        by_source.setdefault(entry.upstream, []).append(entry)
    out = {}
    for batch in ckpt.batches(list(by_source)):
        sources = ckpt.read(batch)
        for name in batch:
            for entry in by_source[name]:
                abstract = flat[entry.leaf]
                shape, dtype = tuple(abstract.shape), np.dtype(abstract.dtype)
                value = transform(entry.rule, sources[name], entry.slot, shape)  # a view where the layout allows
                sharding = flat_shardings.get(entry.leaf) or getattr(abstract, "sharding", None) or default
                out[entry.leaf] = jax.make_array_from_callback(
                    shape,
                    concrete_sharding(sharding, mesh),
                    lambda index, v=value, t=dtype: np.ascontiguousarray(v[index], t),
                )
        del sources, value
    log.info("openpi import: %d leaves from %s", len(out), ckpt.path)
    return unflatten_params(out, keys)


@dataclasses.dataclass(frozen=True)
class OpenpiLayout:
    """``convert``'s ``--layout openpi`` of ``--arch pi05``: forward import only (no safetensors rules)."""

    name: str = "openpi"

    def import_params(self, src, config, abstract_params, shardings=None, *, mesh=None) -> dict:
        return import_params(src, config, abstract_params, shardings, mesh=mesh)


OPENPI_LAYOUT = OpenpiLayout()
