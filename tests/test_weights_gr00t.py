"""GR00T-N1.5 weight import/export: the full-size table, both layouts, sharded files, errors."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from embodied_jax.models.gr00t import Gr00tConfig
from embodied_jax.models.gr00t.variants import variant
from embodied_jax.models.gr00t.weights import detect_layout, export_params, import_params, make_layout
from embodied_jax.models.weights.layout import WeightMismatchError, flatten_params, plan, unflatten_params
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context

# LeRobot GrootPolicy state_dict names and shapes (N1.5 architecture)
TSV = Path(__file__).resolve().parent / "data" / "groot_n15_params.tsv"
_TINY = variant("tiny")
_HEAD = _TINY.action_head
TINY = dataclasses.replace(
    _TINY,
    vision=dataclasses.replace(_TINY.vision, width=16, mlp_dim=24),
    llm=dataclasses.replace(_TINY.llm, width=32, head_dim=8, mlp_dim=40, vocab_size=64),
    image_token_id=63,
    max_token_len=40,
    action_head=dataclasses.replace(
        _HEAD,
        hidden_size=12,
        input_embedding_dim=16,
        max_num_embodiments=3,
        num_future_tokens=2,
        max_seq_len=8,
        dit=dataclasses.replace(_HEAD.dit, num_layers=4, head_dim=8, output_dim=12),
        vl_self_attention=dataclasses.replace(_HEAD.vl_self_attention, num_layers=2, head_dim=8),
    ),
    action_dim=5,
    action_horizon=3,
    max_state_dim=6,
    dtype="bfloat16",
    synthetic_text_tokens=(2, 4),
)


def _tsv_rows() -> dict[str, tuple[int, ...]]:
    rows = {}
    for line in TSV.read_text().splitlines()[1:]:
        name, shape, _ = line.split("\t")
        rows[name] = tuple(int(s) for s in shape.split(",")) if shape else ()
    return rows


MESH = make_mesh(MeshConfig())


def _abstract_params(cfg):
    with mesh_context(MESH):
        abstract = nnx.eval_shape(lambda: cfg.make(nnx.Rngs(0)))
    return nnx.state(abstract, nnx.Param)


@functools.cache
def _full_leaf_shapes(scan: bool):
    flat, _ = flatten_params(_abstract_params(dataclasses.replace(Gr00tConfig(), scan_layers=scan)))
    return {k: tuple(v.shape) for k, v in flat.items()}


def _import(path, abstract):
    return import_params(path, abstract, mesh=MESH)


@pytest.mark.parametrize("layout", ["lerobot", "nvidia"])
def test_every_reference_tensor_maps_to_a_leaf_of_the_full_model(layout):
    """Scanned stacks (the unscanned per-layer form is checked on the tiny model below)."""
    rows = _tsv_rows()
    lay = make_layout(layout)
    if layout == "nvidia":  # same tensors without the prefix, tied embedding kept as embed_tokens
        rows = {k.removeprefix("_groot_model."): v for k, v in rows.items()}
        lm = "backbone.eagle_model.language_model."
        rows[lm + "model.embed_tokens.weight"] = rows.pop(lm + "lm_head.weight")
    wanted = {k: v for k, v in rows.items() if not lay.is_ignored(k)}
    assert len(rows) - len(wanted) == 11  # the SigLIP pooling head
    entries = [e for e in plan(lay, _full_leaf_shapes(True)) if e.canonical]
    produced = {e.upstream: e.upstream_shape for e in entries}
    assert sorted(produced) == sorted(wanted)
    assert {k: v for k, v in produced.items() if wanted[k] != v} == {}


def _random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)
    flat, keys = flatten_params(_abstract_params(cfg))
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in flat.items()}, keys


def _assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]), err_msg=k)


def _nest(flat, keys):
    return unflatten_params(flat, keys)


def test_both_layouts_round_trip_bit_identically(tmp_path):
    flat, keys = _random_params(TINY)
    params = _nest(flat, keys)
    abstract = _abstract_params(TINY)
    lerobot = export_params(params, tmp_path / "lerobot", layout="lerobot")
    nvidia = export_params(params, tmp_path / "nvidia", layout="nvidia")
    assert detect_layout(lerobot) == "lerobot" and detect_layout(nvidia) == "nvidia"
    lm = "backbone.eagle_model.language_model."
    le_names, nv_names = set(load_file(str(lerobot))), set(load_file(str(nvidia)))
    assert "_groot_model." + lm + "lm_head.weight" in le_names
    assert "_groot_model." + lm + "model.embed_tokens.weight" not in le_names
    assert lm + "model.embed_tokens.weight" in nv_names and lm + "lm_head.weight" not in nv_names
    assert {"_groot_model." + n for n in nv_names} - le_names == {"_groot_model." + lm + "model.embed_tokens.weight"}

    for path in (lerobot, nvidia):
        _assert_same(flatten_params(_import(path, abstract))[0], flat)

    # checkpoint -> model -> checkpoint keeps every tensor bit for bit (ignored head copied via like=)
    original = load_file(str(nvidia))
    original["backbone.eagle_model.vision_model.vision_model.head.probe"] = np.ones((1, 1, 16), np.float32)
    save_file(original, str(tmp_path / "with_head.safetensors"))
    again = export_params(
        _import(tmp_path / "with_head.safetensors", abstract),
        tmp_path / "again",
        layout="nvidia",
        like=tmp_path / "with_head.safetensors",
    )
    _assert_same(load_file(str(again)), original)

    # NVIDIA's sharded form: two files and model.safetensors.index.json
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(original)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: original[n] for n in part}, str(sharded / fname))
        weight_map.update({n: fname for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _assert_same(flatten_params(_import(sharded, abstract))[0], flat)

    # the unscanned model reads the same file: layer i of each stack = slice i of the scanned leaf
    unscanned = _import(lerobot, _abstract_params(dataclasses.replace(TINY, scan_layers=False)))
    flat_un = flatten_params(unscanned)[0]
    np.testing.assert_array_equal(
        flat_un["action_head.model.transformer_blocks.1.self_block.attn1.to_q.kernel"],
        flat["action_head.model.transformer_blocks.self_block.attn1.to_q.kernel"][1],
    )
    np.testing.assert_array_equal(
        flat_un["backbone.eagle_model.language_model.layers.1.mlp.up_proj.kernel"],
        flat["backbone.eagle_model.language_model.layers.mlp.up_proj.kernel"][1],
    )


def test_either_tied_embedding_name_is_accepted(tmp_path):
    flat, keys = _random_params(TINY, seed=1)
    path = export_params(_nest(flat, keys), tmp_path / "ckpt", layout="lerobot")
    tensors = load_file(str(path))
    lm = "_groot_model.backbone.eagle_model.language_model."
    tensors[lm + "model.embed_tokens.weight"] = tensors.pop(lm + "lm_head.weight")
    save_file(tensors, str(tmp_path / "renamed.safetensors"))
    got = flatten_params(_import(tmp_path / "renamed.safetensors", _abstract_params(TINY)))[0]
    np.testing.assert_array_equal(
        got["backbone.eagle_model.language_model.embed_tokens.embedding"],
        flat["backbone.eagle_model.language_model.embed_tokens.embedding"],
    )


def test_missing_misshaped_and_unexpected_tensors_are_named(tmp_path):
    flat, keys = _random_params(TINY, seed=2)
    tensors = load_file(str(export_params(_nest(flat, keys), tmp_path / "ok", layout="nvidia")))
    abstract = _abstract_params(TINY)
    dit = "action_head.model.transformer_blocks."
    broken = dict(tensors)
    del broken[dit + "3.attn1.to_v.bias"]
    broken["action_head.action_decoder.layer2.W"] = np.zeros((3, 12, 7), np.float32)
    broken["action_head.surprise.weight"] = np.zeros((2,), np.float32)
    save_file(broken, str(tmp_path / "broken.safetensors"))
    with pytest.raises(WeightMismatchError) as err:
        _import(tmp_path / "broken.safetensors", abstract)
    text = str(err.value)
    assert "missing (1): " + dit + "3.attn1.to_v.bias" in text
    assert "action_head.action_decoder.layer2.W: checkpoint (3, 12, 7), model expects (3, 12, 5)" in text
    assert "unexpected (1): action_head.surprise.weight" in text
    mixed = {("_groot_model." + k if i % 2 else k): v for i, (k, v) in enumerate(tensors.items())}
    save_file(mixed, str(tmp_path / "mixed.safetensors"))
    with pytest.raises(ValueError, match="_groot_model"):
        detect_layout(tmp_path / "mixed.safetensors")
