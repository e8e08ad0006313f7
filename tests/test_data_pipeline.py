"""Grain pipeline (sharding, mixtures, iterator state, packing) and the TensorStore frame store."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from embodied_jax.data import framestore as fs
from embodied_jax.data.convert import convert
from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.data.packing import PackingConfig
from embodied_jax.data.pipeline import DataConfig, SourceConfig, make_data_iterator, mixture_weights
from embodied_jax.data.samples import SampleSpec
from embodied_jax.data.synthetic import decode_frame_id, make_episodes
from embodied_jax.data.transforms import AugmentConfig
from embodied_jax.data.writer import write_lerobot_dataset

FPS = 10
LENGTHS = [8, 11, 6, 9, 6]  # 40 frames


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    episodes = make_episodes(LENGTHS, cameras=("front", "wrist"), height=32, width=32)
    root = write_lerobot_dataset(
        tmp_path_factory.mktemp("raw"), episodes, fps=FPS, version="v3.0", codec="av1", episodes_per_file=2
    )
    return root, episodes


@pytest.fixture(scope="module")
def store(raw, tmp_path_factory):
    destination = tmp_path_factory.mktemp("store") / "fs"
    report = convert(raw[0], destination, workers=1, log=lambda *_: None)
    assert report.written == list(range(len(LENGTHS))) and report.frames == sum(LENGTHS)
    return destination


def _config(root, **kwargs):
    base = dict(sources=(SourceConfig(str(root)),), spec=SampleSpec(action_horizon=4), image_size=(16, 16))
    base.update(kwargs)
    return DataConfig(**base)


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def test_process_shards_disjoint_and_cover_epoch(raw):
    config = _config(raw[0], spec=SampleSpec(action_horizon=4, camera_keys=()))
    seen = []
    for process_index in range(2):
        with make_data_iterator(config, process_index=process_index, process_count=2, batch_size=4, seed=3) as it:
            # 40 frames / 2 processes / batch 4 = 5 batches per process per epoch
            seen.append(np.concatenate([b["index"] for b in _take(it, 5)]).tolist())
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(sum(LENGTHS)))
    assert seen[0] != sorted(seen[0])  # shuffled


def test_batch_contents(raw):
    root, episodes = raw
    config = _config(root, norm_modes=())
    with make_data_iterator(config, process_index=0, process_count=1, batch_size=5, seed=0) as it:
        batch = next(it)
    assert batch["observation.images.front"].shape == (5, 16, 16, 3)
    assert batch["observation.images.front"].dtype == np.float32
    assert batch["action"].shape == (5, 4, 3) and batch["action_is_pad"].shape == (5, 4)
    ds = LeRobotDataset(root)
    for i in range(5):
        position = ds.position_of(int(batch["episode_index"][i]))
        frame = int(batch["frame_index"][i])
        np.testing.assert_array_equal(batch["observation.state"][i], episodes[position]["observation.state"][frame])
        assert batch["task"][i] == episodes[position]["task"]


def test_iterator_state_restore(raw):
    config = _config(raw[0], augment=AugmentConfig())
    kwargs = dict(process_index=1, process_count=2, batch_size=3, seed=11)
    with make_data_iterator(config, **kwargs) as it:
        _take(it, 4)
        state = json.loads(json.dumps(it.get_state()))
        expected = _take(it, 3)
    with make_data_iterator(config, **kwargs) as restored:
        restored.set_state(state)
        _assert_same_batches(_take(restored, 3), expected)
    with (
        make_data_iterator(config, **dict(kwargs, seed=12)) as other,
        pytest.raises(ValueError, match="different pipeline"),
    ):
        other.set_state(state)


def test_iterator_state_restore_with_workers(raw):
    config = _config(
        raw[0], num_workers=2, spec=SampleSpec(action_horizon=4, camera_keys=("observation.images.front",))
    )
    kwargs = dict(process_index=0, process_count=1, batch_size=2, seed=5)
    with make_data_iterator(config, **kwargs) as it:
        _take(it, 3)
        state = json.loads(json.dumps(it.get_state()))
        expected = _take(it, 3)
    with make_data_iterator(config, **kwargs) as restored:
        restored.set_state(state)
        _assert_same_batches(_take(restored, 3), expected)


def test_mixture_weights_follow_weight_times_length(raw, tmp_path):
    other = write_lerobot_dataset(tmp_path / "other", make_episodes([10, 10], cameras=()), fps=FPS, version="v2.1")
    sources = (SourceConfig(str(raw[0]), weight=1.0), SourceConfig(str(other), weight=3.0))
    assert mixture_weights(sources, [40, 20]) == pytest.approx([0.4, 0.6])
    config = _config(raw[0], sources=sources, spec=SampleSpec(action_horizon=2, camera_keys=()))
    with make_data_iterator(config, process_index=0, process_count=1, batch_size=10, seed=0) as it:
        source_index = np.concatenate([b["source_index"] for b in _take(it, 10)])
    assert np.mean(source_index == 1) == pytest.approx(0.6, abs=0.05)


def test_packing_in_pipeline(raw):
    def builder(sample):  # a stand-in model input builder: a prompt whose length varies per frame
        length = 2 + int(sample["frame_index"]) % 5
        return {
            "tokens": np.arange(1, length + 1, dtype=np.int32),
            "token_mask": np.ones(length, bool),
            "state": sample["observation.state"],
            "actions": sample["action"],
        }

    config = _config(raw[0], spec=SampleSpec(action_horizon=4, camera_keys=()))
    packing = PackingConfig(seq_len=12, max_samples_per_row=3, num_packing_bins=4, token_keys=("tokens", "token_mask"))
    with make_data_iterator(
        config, process_index=0, process_count=1, batch_size=2, seed=0, builder=builder, packing=packing
    ) as it:
        batch = next(it)
    assert batch["tokens"].shape == batch["segment_ids"].shape == batch["positions"].shape == (2, 12)
    assert batch["token_mask"].dtype == np.bool_
    assert batch["actions"].shape == (2, 3, 4, 3) and batch["sample_mask"].shape == (2, 3)
    assert np.all(batch["sample_mask"].sum(1) == batch["segment_ids"].max(1))
    assert batch["padding_fraction"].shape == (2,)


# ----- frame store ---------------------------------------------------------------------------------------------------
def test_frame_store_equals_raw_decode(raw, store):
    ds, frames = LeRobotDataset(raw[0]), fs.FrameStore(store)
    assert frames.num_frames == ds.num_frames and frames.tasks == ds.tasks
    for key in ds.arrays:
        np.testing.assert_array_equal(frames.arrays[key], ds.arrays[key])
    for position, length in enumerate(LENGTHS):
        for c, key in enumerate(ds.camera_keys):
            decoded = ds.images(position, key, np.arange(length))
            np.testing.assert_array_equal(frames.images(position, key, np.arange(length)), decoded)
            assert [decode_frame_id(f) for f in decoded] == [(position, t, c) for t in range(length)]
    assert fs.verify_store(store) == dict(enumerate(LENGTHS))


def test_pipeline_same_samples_from_frame_store(raw, store):
    raw_config = _config(raw[0])
    store_config = dataclasses.replace(raw_config, sources=(SourceConfig(str(raw[0]), frame_store=str(store)),))
    kwargs = dict(process_index=0, process_count=1, batch_size=4, seed=2)
    with make_data_iterator(raw_config, **kwargs) as a, make_data_iterator(store_config, **kwargs) as b:
        _assert_same_batches(_take(a, 3), _take(b, 3))


def test_interrupted_conversion_resumes(raw, tmp_path):
    destination = tmp_path / "fs"
    first = convert(raw[0], destination, workers=1, episodes=[0, 3], log=lambda *_: None)
    assert first.written == [0, 3]
    with pytest.raises(fs.FrameStoreError, match=r"episodes \[1, 2, 4\] were not converted"):
        fs.FrameStore(destination)
    # a crash mid-episode leaves frames without a done marker: they are rewritten
    fs.write_array(
        destination / "frames/observation.images.front/episode_000001", np.zeros((2, 4, 4, 3), np.uint8), frames=True
    )
    second = convert(raw[0], destination, workers=2, log=lambda *_: None)
    assert second.skipped == [0, 3] and second.written == [1, 2, 4]
    assert fs.verify_store(destination) == dict(enumerate(LENGTHS))


def test_corrupted_chunk_is_detected(store, tmp_path):
    import shutil

    copy = pathlib.Path(shutil.copytree(store, tmp_path / "fs"))
    shard = next(
        p
        for p in (copy / "frames/observation.images.wrist/episode_000002").rglob("*")
        if p.is_file() and p.name != "zarr.json"
    )
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(
        fs.FrameStoreError, match=r"episode_000002: episode 2, camera observation\.images\.wrist: corrupted"
    ):
        fs.verify_store(copy)


def test_convert_cli_with_resize(raw, tmp_path, subprocess_env):
    destination = tmp_path / "fs"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "embodied_jax.data.convert",
            str(raw[0]),
            str(destination),
            "--image-size",
            "24",
            "20",
            "--workers",
            "2",
            "--verify",
        ],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"verified {len(LENGTHS)} episodes, {sum(LENGTHS)} frames" in result.stdout
    image = fs.read_array(destination / "frames/observation.images.front/episode_000001")
    assert image.shape == (LENGTHS[1], 24, 20, 3)


def test_a_blind_state_is_zeros_for_the_model_and_old_configs_read_back_with_it_off():
    from embodied_jax import config_registry
    from embodied_jax.data.sample_transform import ModelInputs

    sample = {"observation.state": np.array([0.5, -0.2, 0.1, 1.0], np.float32), "task": "t", "cam": np.zeros((2, 2, 3))}
    inputs = ModelInputs(cameras=(("cam", "base_0_rgb"),))
    np.testing.assert_array_equal(inputs.rename(sample)["state"], sample["observation.state"])
    blind = dataclasses.replace(inputs, blind_state=True)
    out = blind.rename(sample)
    assert out["state"].shape == (4,) and not out["state"].any() and out["images"]["base_0_rgb"] is sample["cam"]
    saved = config_registry.to_dict(inputs)
    saved["config"].pop("blind_state")
    assert config_registry.from_dict(saved) == inputs  # a run saved before the field existed
    assert config_registry.from_dict(config_registry.to_dict(blind)) == blind


def test_balanced_tasks_are_drawn_equally_whatever_their_frames(tmp_path):
    # one "pick" episode of 5 frames against three "place" episodes of 12: 12% of the frames are pick's
    episodes = make_episodes([5, 12, 12, 12], cameras=(), tasks=("pick", "place", "place", "place"))
    root = write_lerobot_dataset(tmp_path / "ds", episodes, fps=FPS, version="v3.0")
    spec = SampleSpec(action_horizon=2, camera_keys=())

    def pick_share(balance: bool) -> tuple[float, set]:
        config = _config(root, spec=spec, norm_modes=(), balance_tasks=balance)
        with make_data_iterator(config, process_index=0, process_count=1, batch_size=20, seed=1) as it:
            batches = _take(it, 20)
        tasks = np.concatenate([b["task"] for b in batches])
        frames = {(int(e), int(f)) for b in batches for e, f in zip(b["episode_index"], b["frame_index"], strict=True)}
        return float(np.mean(tasks == "pick")), frames

    share, frames = pick_share(True)
    assert share == pytest.approx(0.5, abs=0.02)
    assert {(0, f) for f in range(5)} <= frames  # every pick frame drawn, in turn
    assert len({f for f in frames if f[0] != 0}) == 36  # and every place frame
    plain, _ = pick_share(False)
    assert plain == pytest.approx(5 / 41, abs=0.05)
    config = _config(root, spec=spec, norm_modes=(), balance_tasks=True)  # a resumed run goes on where it was
    with make_data_iterator(config, process_index=0, process_count=1, batch_size=4, seed=2) as it:
        _take(it, 3)
        state = json.loads(json.dumps(it.get_state()))
        expected = _take(it, 3)
    with make_data_iterator(config, process_index=0, process_count=1, batch_size=4, seed=2) as restored:
        restored.set_state(state)
        _assert_same_batches(_take(restored, 3), expected)


def test_configs_saved_before_balance_and_shift_load_with_their_defaults():
    from embodied_jax.config_registry import from_dict, to_dict

    saved = to_dict(DataConfig(sources=(SourceConfig("r"),), augment=AugmentConfig()))
    del saved["config"]["balance_tasks"], saved["config"]["augment"]["shift"]  # as runs saved them before
    loaded = from_dict(saved)
    assert loaded.balance_tasks is False and loaded.augment.shift == 0
