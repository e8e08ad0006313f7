"""π0.5 checkpoint import/export against LeRobot's naming (tests/data/pi05_params.tsv).

- Every TSV row (minus the ignore list) is a leaf slot of identical shape under ``eval_shape`` of
  the full config, and every leaf maps back to a row, for scanned and unscanned stacks; the
  parameter count is the published checkpoint's 3,353,433,872.
- A tiny upstream-named checkpoint round-trips bit-identically (safetensors -> NNX -> safetensors,
  and through the Orbax CKPT_DIR of ``convert``), the ignored tensor only with ``like=``.
- A renamed, a missing and a mis-shaped tensor give an error naming each one.
"""

import dataclasses
import logging
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from test_pi05_reference import CONFIG as TINY
from test_pi05_reference import upstream_checkpoint

from embodied_jax.models import convert
from embodied_jax.models.pi05 import Pi05Config
from embodied_jax.models.pi05.weights import PI05_LAYOUT
from embodied_jax.models.weights.layout import WeightMismatchError, flatten_params, plan
from embodied_jax.models.weights.safetensors_io import CheckpointReader, export_checkpoint, import_checkpoint
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context

# LeRobot PI05Policy state_dict names and shapes.
TSV = Path(__file__).resolve().parent / "data" / "pi05_params.tsv"
EXPERT_LM_HEAD = "model.paligemma_with_expert.gemma_expert.lm_head.weight"


def reference_rows():
    rows = [line.split("\t") for line in TSV.read_text().splitlines()[1:]]
    return {name: tuple(int(d) for d in shape.split(",")) if shape else () for name, shape, _ in rows}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(MeshConfig(data=1, fsdp=8, tensor=1))


def test_every_reference_tensor_maps_to_a_leaf(mesh):
    """Full size, scanned stacks (the default); the unscanned layout is covered by the tiny round trip."""
    rows = reference_rows()
    with mesh_context(mesh):
        model = nnx.eval_shape(lambda: Pi05Config().make(nnx.Rngs(0)))
    leaves, _ = flatten_params(nnx.state(model, nnx.Param))
    assert sum(int(np.prod(v.shape)) for v in leaves.values()) == 3_353_433_872
    entries = plan(PI05_LAYOUT, {k: tuple(v.shape) for k, v in leaves.items()})
    canonical = {e.upstream: e for e in entries if e.canonical}
    expected = {n: s for n, s in rows.items() if not PI05_LAYOUT.is_ignored(n)}
    assert set(rows) - set(expected) == {EXPERT_LM_HEAD}
    assert sorted(set(expected) - set(canonical)) == []  # every row has a leaf
    assert sorted(set(canonical) - set(expected)) == []  # every leaf slot has a row
    wrong = {n: (s, canonical[n].upstream_shape) for n, s in expected.items() if canonical[n].upstream_shape != s}
    assert wrong == {}
    slots = {(e.leaf, e.layer) for e in canonical.values()}
    per_leaf_layers = {k: (v.shape[0] if ".layers." in f".{k}." else 1) for k, v in leaves.items()}
    assert len(slots) == sum(per_leaf_layers.values())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    src = tmp_path_factory.mktemp("pi05_tiny_ckpt")
    sd = upstream_checkpoint(seed=7)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    return src, sd


def abstract(config, mesh):
    with mesh_context(mesh):
        return nnx.state(nnx.eval_shape(lambda: config.make(nnx.Rngs(0))), nnx.Param)


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unscanned"])
def test_tiny_round_trip_is_bit_identical(tiny, mesh, tmp_path, scan, caplog):
    src, sd = tiny
    config = dataclasses.replace(TINY, scan_layers=scan)
    with caplog.at_level(logging.INFO, logger="embodied_jax.models.weights.safetensors_io"):
        params = import_checkpoint(src, PI05_LAYOUT, abstract(config, mesh), mesh=mesh)
    ignore_lines = [r.getMessage() for r in caplog.records if "ignore list" in r.getMessage()]
    assert len(ignore_lines) == 1 and EXPERT_LM_HEAD in ignore_lines[0]
    leaf = params["llm"]["embed_tokens"]["embedding"]
    np.testing.assert_array_equal(np.asarray(leaf), sd["model.paligemma_with_expert.paligemma.lm_head.weight"])
    assert len(leaf.sharding.device_set) == 8  # placed with its FSDP sharding

    plain = export_checkpoint(params, PI05_LAYOUT, tmp_path / "plain")
    written = load_file(str(plain))
    assert set(written) == set(sd) - {EXPERT_LM_HEAD}
    for name, value in written.items():
        assert value.dtype == sd[name].dtype and value.tobytes() == sd[name].tobytes(), name

    alike = load_file(str(export_checkpoint(params, PI05_LAYOUT, tmp_path / "like", like=src)))
    assert set(alike) == set(sd)
    assert alike[EXPERT_LM_HEAD].tobytes() == sd[EXPERT_LM_HEAD].tobytes()


def test_bfloat16_checkpoint_is_cast_on_import(tiny, mesh, tmp_path):
    _, sd = tiny
    bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in sd.items()}
    save_file(bf16, str(tmp_path / "model.safetensors"))
    params = import_checkpoint(tmp_path, PI05_LAYOUT, abstract(TINY, mesh), mesh=mesh)
    got = params["action_out_proj"]["kernel"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(got), bf16["model.action_out_proj.weight"].astype(np.float32).T)
    assert CheckpointReader(tmp_path).dtype("model.action_out_proj.weight") == "BF16"


def test_convert_cli_round_trip_through_orbax(tiny, mesh, tmp_path, monkeypatch):
    src, sd = tiny
    monkeypatch.setitem(convert.ARCHS, "pi05_test", convert.Arch(lambda: TINY, lambda: PI05_LAYOUT))
    monkeypatch.setattr(convert, "_mesh", lambda: mesh)
    convert.main(["--arch", "pi05_test", "--src", str(src), "--out", str(tmp_path / "ckpt")])
    restored = convert.load_params(tmp_path / "ckpt", TINY, mesh)
    np.testing.assert_array_equal(np.asarray(restored["time_mlp_in"]["kernel"]), sd["model.time_mlp_in.weight"].T)
    convert.main(
        [
            "--arch",
            "pi05_test",
            "--src",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "back"),
            "--reverse",
            "--like",
            str(src),
        ]
    )
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(sd)
    assert all(back[k].tobytes() == sd[k].tobytes() for k in sd)


def test_renamed_missing_and_misshaped_tensors_are_named(tiny, mesh, tmp_path):
    _, sd = tiny
    broken = dict(sd)
    q = "model.paligemma_with_expert.paligemma.model.language_model.layers.1.self_attn.q_proj.weight"
    renamed = q.replace("q_proj", "query")
    broken[renamed] = broken.pop(q)
    gone = "model.time_mlp_out.bias"
    del broken[gone]
    bad = "model.action_in_proj.weight"
    broken[bad] = np.zeros((3, 3), np.float32)
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightMismatchError) as info:
        import_checkpoint(tmp_path, PI05_LAYOUT, abstract(TINY, mesh), mesh=mesh)
    message = str(info.value)
    assert f"missing (2): {q}, {gone}" in message
    assert f"unexpected (1): {renamed}" in message
    assert f"mis-shaped (1): {bad}: checkpoint (3, 3), model expects (16, 6) (leaf action_in_proj.kernel)" in message
