"""A run fits its model and data to the dataset's metadata, and ``--dry-run`` checks them against it.

Small PNG datasets written by the data writer (no video, no training): ``LeRobotData.fit`` maps
the dataset's cameras onto the model's image slots and takes its widths, ``check`` names the first
thing the model needs that the dataset lacks, and the launcher reports it in one line with
status 2 before anything is compiled. The sim collector's ``modality.json`` reads back.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.data.lerobot_meta import DatasetError
from embodied_jax.data.modality import Modality
from embodied_jax.data.sample_transform import ModelInputs
from embodied_jax.data.samples import SampleLoader
from embodied_jax.data.sources import DataConfigError
from embodied_jax.data.synthetic import make_episodes
from embodied_jax.data.writer import write_lerobot_dataset
from embodied_jax.models.pi05 import variants as pi05_variants
from embodied_jax.sim.collect import task_modality
from embodied_jax.sim.tasks import TASKS
from embodied_jax.train.loop import prepare
from experiments import launch
from experiments.gr00t import gr00t_finetune_tiny
from experiments.pi05 import pi05_finetune_tiny

SIZE = 32
CAMERAS = ("observation.images.scene", "observation.images.wrist")


def _dataset(root, *, cameras=("scene", "wrist"), state_dim=4, action_dim=4, modality=None):
    episodes = make_episodes(
        [4, 5], cameras=cameras, state_dim=state_dim, action_dim=action_dim, height=SIZE, width=SIZE
    )
    return str(write_lerobot_dataset(root, episodes, fps=10, image_storage="png", modality=modality))


def _reach_modality() -> dict:
    return task_modality(TASKS["reach"]()).to_json()


def _on(config, root, **data_fields):
    return dataclasses.replace(config, data=dataclasses.replace(config.data, root=root, **data_fields))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from experiments import demo

    tmp = tmp_path_factory.mktemp("tokenizers")
    spm = demo.build_tokenizer(tmp / "tokenizer.model", vocab_size=pi05_variants.demo().vocab_size)
    return {"pi05": str(spm), "gr00t": str(demo.build_gr00t_tokenizer(tmp / "tokenizer.json"))}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """Two cameras (``scene``, ``wrist``: a collected reach dataset's), 4-dim state and actions."""
    return _dataset(tmp_path_factory.mktemp("good") / "ds", modality=_reach_modality())


def test_fit_maps_the_dataset_cameras_onto_the_slots_in_order_and_logs_it(good, caplog):
    config = pi05_finetune_tiny()
    assert config.data.inputs.cameras == () and config.data.pipeline.spec.action_horizon is None
    with caplog.at_level(logging.INFO, logger="embodied_jax"):
        data, model = _on(config, good).data.fit(config.model)
    assert data.inputs.cameras == ((CAMERAS[0], "base_0_rgb"), (CAMERAS[1], "left_wrist_0_rgb"))
    assert data.pipeline.spec.camera_keys == CAMERAS  # only the mapped cameras are decoded
    assert data.pipeline.spec.action_horizon == model.action_horizon == config.model.action_horizon
    assert model.action_dim == 4 and model.camera_names == config.model.camera_names
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cameras: ")]
    assert logged == [
        f"cameras: {CAMERAS[0]} -> base_0_rgb, {CAMERAS[1]} -> left_wrist_0_rgb "
        "(override with --data.inputs.cameras KEY SLOT ...)"
    ]


def test_gr00t_takes_its_slots_from_the_modality_videos(good):
    config = gr00t_finetune_tiny()
    data, model = _on(config, good).data.fit(config.model)
    assert model.camera_names == ("scene", "wrist")
    assert data.inputs.cameras == ((CAMERAS[0], "scene"), (CAMERAS[1], "wrist"))
    text_room = config.model.max_token_len - config.model.image_block_tokens
    assert model.max_token_len - model.image_block_tokens == text_room


def test_an_explicit_camera_mapping_is_kept(good, caplog):
    config = pi05_finetune_tiny()
    mapping = ((CAMERAS[1], "base_0_rgb"),)
    with caplog.at_level(logging.INFO, logger="embodied_jax"):
        data, _ = _on(config, good, inputs=ModelInputs(cameras=mapping)).data.fit(config.model)
    assert data.inputs.cameras == mapping and data.pipeline.spec.camera_keys == (CAMERAS[1],)
    assert not [r for r in caplog.records if r.getMessage().startswith("cameras: ")]


def test_too_many_cameras_and_too_wide_actions_are_named(tmp_path):
    config = pi05_finetune_tiny()
    three = _dataset(tmp_path / "three", cameras=("front", "left", "right"))
    with pytest.raises(DatasetError, match=r"3 cameras \(observation.images.front, .*right\).*--data.inputs.cameras"):
        _on(config, three).data.fit(config.model)
    wide = _dataset(tmp_path / "wide", cameras=("front",), action_dim=6)
    with pytest.raises(DatasetError, match=r"wide: the action has 6 dims, more than .*max_action_dim=4"):
        _on(config, wide).data.fit(config.model)


def test_the_data_follows_the_model_horizon_and_refuses_a_second_one(good):
    config = pi05_finetune_tiny()
    model = dataclasses.replace(config.model, action_horizon=5)
    data, _ = _on(config, good).data.fit(model)
    assert data.pipeline.spec.action_horizon == 5
    data = _on(config, good).data
    both = dataclasses.replace(
        data,
        pipeline=dataclasses.replace(data.pipeline, spec=dataclasses.replace(data.pipeline.spec, action_horizon=6)),
    )
    with pytest.raises(
        DataConfigError, match="--data.pipeline.spec.action-horizon 6 differs from --model.action-horizon 5"
    ):
        both.fit(model)


def test_a_missing_state_feature_names_the_features_and_the_flag(good):
    config = pi05_finetune_tiny()
    data = _on(config, good).data
    spec = dataclasses.replace(data.pipeline.spec, state_keys=("observation.joints",))
    with pytest.raises(
        DatasetError, match=r"no state feature 'observation.joints'; the dataset has \['observation.state', 'action'\]"
    ) as error:
        dataclasses.replace(data, pipeline=dataclasses.replace(data.pipeline, spec=spec)).fit(config.model)
    assert "--data.pipeline.spec.state-keys" in str(error.value)


def test_prepare_resolves_everything_loading_needs(good, tokenizers):
    config = _on(pi05_finetune_tiny(), good)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer_path=tokenizers["pi05"]))
    prepared = prepare(config)
    assert prepared.data.inputs.cameras and prepared.data.pipeline.spec.action_horizon == prepared.model.action_horizon
    assert prepare(prepared) == prepared  # a saved (prepared) config fits unchanged


def _launch(capsys, *argv) -> tuple[int, list[str]]:
    code = launch.main([*argv, "--metrics.no-progress-bar"])
    return code, capsys.readouterr().err.strip().splitlines()


def test_dry_run_names_a_missing_camera_in_one_line(good, tmp_path, capsys):
    code, err = _launch(
        capsys,
        "pi05_finetune_tiny",
        "--data.root",
        good,
        "--dry-run",
        "--workdir",
        str(tmp_path / "run"),
        "--data.inputs.cameras",
        "observation.images.front",
        "base_0_rgb",
    )
    assert code == 2
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and "no camera 'observation.images.front'" in errors[0] and good in errors[0]
    assert not (tmp_path / "run").exists()


def test_dry_run_passes_on_a_good_dataset_with_the_tokenizer_of_the_weights(good, tmp_path, tokenizers, capsys):
    weights = tmp_path / "weights"  # converted weights (an Orbax directory) with their tokenizer
    (weights / "assets" / "tokenizer_path").mkdir(parents=True)
    (weights / "_CHECKPOINT_METADATA").write_text("{}")
    (weights / "assets" / "tokenizer_path" / "tokenizer.model").write_bytes(open(tokenizers["pi05"], "rb").read())
    code, err = _launch(
        capsys,
        "pi05_finetune_tiny",
        "--data.root",
        good,
        "--init-from",
        str(weights),
        "--dry-run",
        "--workdir",
        str(tmp_path / "run"),
    )
    assert code == 0, err
    assert not (tmp_path / "run").exists()


def test_gr00t_dry_run_without_modality_json_is_named(tmp_path, tokenizers, capsys):
    bare = _dataset(tmp_path / "bare")
    code, err = _launch(
        capsys,
        "gr00t_finetune_tiny",
        "--data.root",
        bare,
        "--model.tokenizer-path",
        tokenizers["gr00t"],
        "--dry-run",
        "--workdir",
        str(tmp_path / "run"),
    )
    assert code == 2 and err[-1].startswith("error: ") and "meta/modality.json" in err[-1] and bare in err[-1]


def test_gr00t_dry_run_passes_with_the_collectors_modality(good, tmp_path, tokenizers, capsys):
    code, err = _launch(
        capsys,
        "gr00t_finetune_tiny",
        "--data.root",
        good,
        "--model.tokenizer-path",
        tokenizers["gr00t"],
        "--dry-run",
        "--workdir",
        str(tmp_path / "run"),
    )
    assert code == 0, err


def test_the_collectors_modality_json_reads_back(good):
    task = TASKS["reach"]()
    written = task_modality(task)
    assert Modality.from_json(written.to_json()) == written
    dataset = LeRobotDataset(good)
    assert dataset.modality == written
    assert dict(dataset.modality.state) == {"hand": (0, 3), "gripper": (3, 4)}
    assert dict(dataset.modality.video) == {"scene": CAMERAS[0], "wrist": CAMERAS[1]}
    sample = SampleLoader(dataset)(3)
    np.testing.assert_array_equal(sample["state.hand"], sample["observation.state"][:3])
    np.testing.assert_array_equal(sample["action.gripper"], sample["action"][:, 3:4])
    assert sample["annotation.human.task_description"] == sample["task"]
    assert sample["video.wrist"] is sample[CAMERAS[1]]
