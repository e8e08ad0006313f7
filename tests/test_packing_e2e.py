"""Packing through the real pipeline, for both models, on one small collected (MJX expert) dataset.

- the same samples, read with packing off and on (``LeRobotData.packing``), give each sample
  the same loss under the same noise and time: packed rows hold several samples, and
  attention (block-sparse on CPU) keeps them apart;
- ``python -m experiments.launch demo[_gr00t] --data.packing.seq-len N`` trains packed.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from embodied_jax.data.packing import PackingConfig
from embodied_jax.data.pipeline import SourceConfig
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.parallel.sharding import mesh_context
from experiments import demo

IMAGE = 32  # the demo's size: the expert rollout compiles once for the sim tests, the demo and this


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    from embodied_jax.sim.collect import collect

    root = tmp_path_factory.mktemp("packing_e2e")
    collect("reach", 4, root / "dataset", image_size=(IMAGE, IMAGE))
    return root


def _setup(arch, root):
    config = demo.demo_config(image_size=IMAGE, arch=arch)
    if arch == "gr00t":
        tokenizer = demo.build_gr00t_tokenizer(root / "tokenizer.json")
        head = config.model.action_head
        head = dataclasses.replace(
            head,
            dit=dataclasses.replace(head.dit, dropout=0.0),
            vl_self_attention=dataclasses.replace(head.vl_self_attention, dropout=0.0),
        )
        model = dataclasses.replace(
            config.model, tokenizer_path=str(tokenizer), action_head=head, flow_samples_per_obs=1
        )
    else:
        tokenizer = demo.build_tokenizer(root / "tokenizer.model", vocab_size=config.model.vocab_size)
        model = dataclasses.replace(config.model, tokenizer_path=str(tokenizer), flow_samples_per_obs=1)
    data = dataclasses.replace(
        config.data, pipeline=dataclasses.replace(config.data.pipeline, sources=(SourceConfig(str(root / "dataset")),))
    )
    return model, data


def _per_sample_losses(model_config, batch, noise, time):
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])
    with mesh_context(mesh):
        model = model_config.make(nnx.Rngs(0))
        if hasattr(model, "per_sample_losses"):  # GR00T: squared-error sums and counts per sample slot
            errors, counts = nnx.jit(
                lambda m: m.per_sample_losses(batch, jax.random.key(0), noise=noise, time=time, dropout=False)
            )(model)
            return np.asarray(errors) / np.maximum(np.asarray(counts), 1)
        per_sample = nnx.jit(lambda m: m.loss_terms(batch, jax.random.key(0), noise=noise, time=time)[1])(model)
        return np.asarray(per_sample).reshape(-1)


@pytest.mark.parametrize("arch", ["pi05", "gr00t"])
def test_packed_pipeline_gives_each_sample_its_unpacked_loss(collected, arch):
    model, data = _setup(arch, collected)
    kwargs = dict(model=model, process_index=0, process_count=1, seed=3)
    with data.make_iterator(batch_size=12, **kwargs) as it:
        unpacked = next(it)
    longest = max(int(m.sum()) for m in unpacked["token_mask"])
    if arch == "pi05":
        longest += len(model.camera_names) * model.vision.num_patches
    packing = PackingConfig(seq_len=2 * longest + 8, max_samples_per_row=3, num_packing_bins=2)
    with dataclasses.replace(data, packing=packing).make_iterator(batch_size=2, **kwargs) as it:
        packed = next(it)
    present = packed["sample_mask"]
    assert present.sum() > 2 and present.sum(1).max() >= 2  # rows really hold several samples
    assert packed["tokens"].shape == (2, packing.seq_len) and packed["images"].ndim == 5
    assert not any(k in packed for k in ("token_mask", "image_masks"))

    # each packed sample slot is one of the unpacked samples (the same frame: the same action chunk)
    actions = unpacked["actions"].reshape(12, -1)
    match = np.zeros(present.shape, int)
    for r, m in zip(*np.nonzero(present), strict=True):
        hits = np.flatnonzero(np.all(actions == packed["actions"][r, m].reshape(-1), axis=1))
        assert len(hits) >= 1
        match[r, m] = hits[0]
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(unpacked["actions"].shape).astype(np.float32)
    time = rng.uniform(0.05, 0.95, 12).astype(np.float32)
    if arch == "pi05":
        want = _per_sample_losses(model, unpacked, noise[:, None, None], time[:, None, None])
        got = _per_sample_losses(model, packed, noise[match][:, None], time[match][:, None])
    else:
        want = _per_sample_losses(model, unpacked, noise, time)
        got = _per_sample_losses(model, packed, noise[match.reshape(-1)], time[match.reshape(-1)])
    got = got.reshape(present.shape)
    np.testing.assert_allclose(got[present], want[match[present]], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["demo", "demo_gr00t"])
def test_launcher_trains_packed(collected, name, tmp_path):
    from experiments.launch import main

    shutil.copytree(collected / "dataset", tmp_path / "dataset")
    argv = [
        name,
        "--workdir",
        str(tmp_path),
        "--episodes",
        "4",
        "--eval-envs",
        "0",
        "--train.steps",
        "2",
        "--train.batch-size",
        "8",
        "--train.log-every",
        "1",
        "--data.packing.seq-len",
        "160",
        "--data.packing.max-samples-per-row",
        "4",
        "--checkpoint.save-every",
        "2",
        "--metrics.no-progress-bar",
        "--metrics.no-tensorboard",
        "--model.num-inference-steps",
        "2",
    ]
    assert main(argv) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [1, 2] and all(np.isfinite(r["loss"]) for r in logged)
    assert all(r["examples"] > 8 for r in logged)  # 8 rows per step carry more than 8 samples
    assert (tmp_path / "checkpoints" / "2").is_dir()
