"""The fine-tuning recipe of docs/finetune.md at laptop size: a collected dataset, converted weights, two flags.

The weights are converted as published ones would be (a random tiny model written in the
upstream safetensors layout, then ``models.convert.to_orbax`` and the tokenizer copied in as
``--tokenizer`` does); the launcher gets only ``--data.root`` and ``--init-from`` (and
``--workdir``): cameras, widths, horizon and tokenizer come from the dataset and the weights.
GR00T's run also checks upstream's fine-tuning freezing (backbone unchanged, action head trained).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from embodied_jax.assets import write_assets
from embodied_jax.models import convert
from embodied_jax.models.weights.safetensors_io import export_checkpoint
from embodied_jax.parallel.mesh import MESH_AXES
from experiments import launch


def _converted_weights(model_config, layout, tokenizer, out):
    mesh = jax.make_mesh((1, 1, 1), MESH_AXES, devices=jax.devices()[:1])
    abstract, _ = convert.abstract_params(model_config, mesh)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)
    export_checkpoint(params, layout, out / "upstream")
    weights = convert.to_orbax(out / "upstream", out / "weights", model_config, layout, mesh=mesh)
    write_assets({"tokenizer_path": tokenizer}, weights)
    return weights, _leaves(params)


def _leaves(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(jax.device_get(v)) for path, v in flat}


@pytest.mark.parametrize("arch", ["pi05", "gr00t"])
def test_finetune_tiny_needs_only_the_dataset_and_the_weights(demo_run, tmp_path, arch):
    from embodied_jax import load_policy

    if arch == "pi05":
        from embodied_jax.models.pi05.weights import PI05_LAYOUT as layout
        from experiments.pi05 import pi05_finetune_tiny as experiment

        tokenizer = demo_run / "tokenizer.model"
    else:
        from embodied_jax.models.gr00t.weights import make_layout
        from experiments.demo import build_gr00t_tokenizer
        from experiments.gr00t import gr00t_finetune_tiny as experiment

        layout = make_layout("lerobot")
        tokenizer = build_gr00t_tokenizer(tmp_path / "tokenizer.json")
    weights, converted = _converted_weights(experiment().model, layout, tokenizer, tmp_path)
    run = tmp_path / "run"
    argv = [experiment.__name__, "--data.root", str(demo_run / "dataset"), "--init-from", str(weights)]
    assert launch.main([*argv, "--workdir", str(run)]) == 0
    bundle = load_policy(run)
    assert bundle.step == experiment().train.steps
    assert bundle.config.model.tokenizer_path.startswith(str(run))  # the weights' tokenizer, copied into the run
    cameras = dict(bundle.config.data.inputs.cameras)
    assert set(cameras) == {"observation.images.scene", "observation.images.wrist"}
    if arch == "gr00t":  # upstream's finetune freezing: the backbone keeps the converted weights exactly
        from flax import nnx

        trained = _leaves(nnx.state(bundle.model, nnx.Param).to_pure_dict())
        assert set(trained) == set(converted)
        backbone = {k for k in converted if k.startswith("backbone/")}
        assert backbone and all(np.array_equal(trained[k], converted[k]) for k in backbone)
        head = set(converted) - backbone
        moved = [k for k in head if not np.array_equal(trained[k], converted[k])]
        assert len(moved) > len(head) // 2, f"only {len(moved)} of {len(head)} action-head leaves trained"
