"""openpi's own Orbax π0.5 params (names and shapes: tests/data/openpi_pi05_params.tsv) -> our parameters.

- Full size, abstractly (eval_shape only): the mapping expects exactly the table's paths and shapes,
  fills every leaf of ``Pi05Config()`` and its transforms give each leaf's shape.
- A tiny tree with the table's paths, saved with Orbax as openpi saves its ``params`` item, converts
  through ``convert.main`` (layout detected) into our CKPT_DIR; restored leaves equal the source
  under the transforms, and a few are checked against openpi's einsum semantics. Also: no
  ``{"params": ...}`` wrapper, ``/value`` leaves, a bfloat16 source, unscanned stacks.
- Missing, unexpected and mis-shaped leaves are all named before any data is read.
"""

import dataclasses
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from embodied_jax.models import convert
from embodied_jax.models.pi05 import Pi05Config, openpi_weights
from embodied_jax.models.pi05.variants import variant
from embodied_jax.models.weights.layout import WeightMismatchError, flatten_params
from embodied_jax.parallel.mesh import MeshConfig, make_mesh

TSV = Path(__file__).resolve().parent / "data" / "openpi_pi05_params.tsv"

TINY = variant("tiny")


def table() -> dict[str, tuple[tuple[int, ...], str]]:
    lines = [line for line in TSV.read_text().splitlines() if not line.startswith("#")]
    assert lines[0] == "path\tshape\tdtype"
    rows = [line.split("\t") for line in lines[1:]]
    return {p: (tuple(int(d) for d in s.split(",")) if s else (), dtype) for p, s, dtype in rows}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))


@pytest.fixture(scope="module")
def tiny_abstract(mesh):
    return convert.abstract_params(TINY, mesh)


def test_full_size_mapping_accounts_for_every_path_and_leaf(mesh):
    """Scanned stacks (the default); the unscanned layout is covered by the tiny import below."""
    config = Pi05Config()
    rows = {p: shape for p, (shape, _) in table().items()}
    assert openpi_weights.source_shapes(config) == rows  # every path, every shape, nothing else
    abstract, _ = convert.abstract_params(config, mesh)
    leaves = {k: tuple(v.shape) for k, v in flatten_params(abstract)[0].items()}
    assert sum(math.prod(s) for s in rows.values()) == sum(math.prod(s) for s in leaves.values()) == 3_353_433_872
    planned = openpi_weights.plan(config, leaves)
    targets = [(move, slot) for move, slots in planned for slot in slots]
    assert sorted(slot.leaf for _, slot in targets) == sorted(leaves)  # every leaf exactly once
    sources = {p: jax.ShapeDtypeStruct(s, np.float32) for p, s in rows.items()}
    moved = jax.eval_shape(
        lambda tree: [openpi_weights.transform(m, tree[m.source], s, leaves[s.leaf]) for m, s in targets], sources
    )
    assert {s.leaf: out.shape for (_, s), out in zip(targets, moved, strict=True)} == leaves


def openpi_tree(config, seed=0, dtype=None) -> dict[str, np.ndarray]:
    rows = table()
    shapes = openpi_weights.source_shapes(config)
    assert set(shapes) == set(rows)  # the table's paths, shrunk
    rng = np.random.default_rng(seed)
    return {p: rng.standard_normal(s).astype(dtype or rows[p][1]) for p, s in shapes.items()}


def save_openpi(tree, directory: Path, *, wrap=True, value=False) -> Path:
    """Write ``tree`` as openpi writes a ``params`` item: PyTreeCheckpointer, ``{"params": nested}``."""
    nested: dict = {}
    for path, array in tree.items():
        *parents, last = path.split("/")
        node = nested
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = {"value": array} if value else array
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(directory / "params", {"params": nested} if wrap else nested)
    return directory


def expected_leaves(config, tree, leaves) -> dict[str, np.ndarray]:
    out = {}
    for move, slots in openpi_weights.plan(config, {k: tuple(v.shape) for k, v in leaves.items()}):
        for slot in slots:
            out[slot.leaf] = openpi_weights.transform(move, tree[move.source], slot, tuple(leaves[slot.leaf].shape))
    return out


def test_tiny_openpi_checkpoint_converts_through_the_cli(mesh, tiny_abstract, tmp_path, monkeypatch):
    tree = openpi_tree(TINY, seed=1)
    src = save_openpi(tree, tmp_path / "pi05_tiny")  # the checkpoint dir; its params/ is the Orbax item
    monkeypatch.setitem(
        convert.ARCHS, "pi05_tiny", dataclasses.replace(convert.ARCHS["pi05"], make_config=lambda: TINY)
    )
    monkeypatch.setattr(convert, "_mesh", lambda: mesh)
    assert convert.main(["--arch", "pi05_tiny", "--src", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    restored = convert.load_params(tmp_path / "ckpt", TINY, mesh)
    leaves = flatten_params(restored)[0]
    abstract = flatten_params(tiny_abstract[0])[0]
    assert {k: v.shape for k, v in leaves.items()} == {k: v.shape for k, v in abstract.items()}
    for leaf, value in expected_leaves(TINY, tree, leaves).items():
        np.testing.assert_array_equal(np.asarray(leaves[leaf]), value, err_msg=leaf)

    # openpi's semantics, independently of the transforms: einsums against our x @ kernel.
    g, e = TINY.vlm, TINY.expert
    layer = 1
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((2, g.width)), rng.standard_normal((e.num_heads, e.head_dim))
    got = lambda name: np.asarray(leaves[name])[layer]  # noqa: E731
    q = tree["PaliGemma/llm/layers/attn/q_einsum/w"][layer]
    np.testing.assert_allclose(
        x @ got("llm.layers.experts.0.self_attn.q_proj.kernel"), np.einsum("bd,ndh->bnh", x, q).reshape(2, -1), 1e-5
    )
    kv = tree["PaliGemma/llm/layers/attn/kv_einsum_1/w"][layer]
    xe = x[:, : e.width]
    for i, proj in enumerate(("k_proj", "v_proj")):
        ours = xe @ got(f"llm.layers.experts.1.self_attn.{proj}.kernel")
        np.testing.assert_allclose(ours, np.einsum("bd,kdh->bkh", xe, kv[i]).reshape(2, -1), 1e-5)
    o = tree["PaliGemma/llm/layers/attn/attn_vec_einsum_1/w"][layer]
    np.testing.assert_allclose(
        y.reshape(-1) @ got("llm.layers.experts.1.self_attn.o_proj.kernel"), np.einsum("nh,nhd->d", y, o), 1e-5
    )
    gating = tree["PaliGemma/llm/layers/mlp/gating_einsum"][layer]
    np.testing.assert_array_equal(got("llm.layers.experts.0.mlp.gate_proj.kernel"), gating[0])
    np.testing.assert_array_equal(got("llm.layers.experts.0.mlp.up_proj.kernel"), gating[1])
    xv = x[:, : TINY.vision.width]
    attn = "PaliGemma/img/Transformer/encoderblock/MultiHeadDotProductAttention_0/"
    query = np.einsum("bd,dnh->bnh", xv, tree[attn + "query/kernel"][layer]) + tree[attn + "query/bias"][layer]
    ours = xv @ got("vision_tower.encoder.layers.self_attn.q_proj.kernel") + got(
        "vision_tower.encoder.layers.self_attn.q_proj.bias"
    )
    np.testing.assert_allclose(ours, query.reshape(2, -1), 1e-5)
    np.testing.assert_array_equal(
        np.asarray(leaves["vision_tower.embeddings.position_embedding.embedding"]),
        tree["PaliGemma/img/pos_embedding"][0],
    )
    np.testing.assert_array_equal(
        got("llm.layers.experts.1.input_layernorm.dense.kernel"),
        tree["PaliGemma/llm/layers/pre_attention_norm_1/Dense_0/kernel"][layer],
    )
    np.testing.assert_array_equal(
        np.asarray(leaves["llm.embed_tokens.embedding"]), tree["PaliGemma/llm/embedder/input_embedding"]
    )
    np.testing.assert_array_equal(np.asarray(leaves["multi_modal_projector.kernel"]), tree["PaliGemma/img/head/kernel"])


def test_unwrapped_value_leaves_bfloat16_unscanned(mesh, tmp_path):
    config = dataclasses.replace(TINY, scan_layers=False)
    tree = openpi_tree(config, seed=4, dtype=ml_dtypes.bfloat16)
    src = save_openpi(tree, tmp_path, wrap=False, value=True) / "params"  # the params dir itself
    abstract, shardings = convert.abstract_params(config, mesh)
    params = openpi_weights.import_params(src, config, abstract, shardings, mesh=mesh)
    leaves = flatten_params(params)[0]
    assert set(leaves) == set(flatten_params(abstract)[0])
    for leaf, value in expected_leaves(config, tree, leaves).items():
        assert leaves[leaf].dtype == np.float32
        np.testing.assert_array_equal(np.asarray(leaves[leaf]), value.astype(np.float32), err_msg=leaf)
    down = leaves["llm.layers.1.experts.1.mlp.down_proj.kernel"]
    assert len(down.sharding.device_set) == 8  # placed with its FSDP sharding


def test_mismatched_leaves_are_named(mesh, tiny_abstract, tmp_path):
    tree = openpi_tree(TINY)
    q = "PaliGemma/llm/layers/attn/q_einsum/w"
    tree["PaliGemma/llm/layers/attn/query/w"] = tree.pop(q)
    del tree["time_mlp_out/bias"]
    tree["action_in_proj/kernel"] = np.zeros((3, 3), np.float32)
    src = save_openpi(tree, tmp_path)
    abstract, shardings = tiny_abstract
    with pytest.raises(WeightMismatchError) as info:
        openpi_weights.import_params(src, TINY, abstract, shardings, mesh=mesh)
    message = str(info.value)
    assert f"missing (2): {q}, time_mlp_out/bias" in message
    assert "unexpected (1): PaliGemma/llm/layers/attn/query/w" in message
    assert "mis-shaped (1): action_in_proj/kernel: checkpoint (3, 3), model expects (8, 32)" in message


def test_layout_detection_and_forward_only(tmp_path, capsys):
    assert convert._pi05_detect(tmp_path) == "lerobot"  # e.g. a model.safetensors directory
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "_METADATA").write_text("{}")
    assert convert._pi05_detect(tmp_path) == "openpi" and convert._pi05_detect(tmp_path / "params") == "openpi"
    argv = ["--arch", "pi05", "--src", str(tmp_path), "--out", str(tmp_path / "x"), "--reverse", "--layout", "openpi"]
    assert convert.main(argv) == 2
    assert "error: --layout openpi: forward conversion only" in capsys.readouterr().err
