"""Writer -> reader round trips (v2.1, v3.0, hard cases), malformed datasets, modality.json, inspect CLI."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embodied_jax.data import inspect as inspect_cli
from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.data.lerobot_meta import DatasetError
from embodied_jax.data.synthetic import decode_frame_id, make_episodes
from embodied_jax.data.video import encode_video
from embodied_jax.data.writer import write_lerobot_dataset

FPS = 10
CAMERAS = ("observation.images.front", "observation.images.wrist")

# name -> (lengths, writer kwargs)
LAYOUTS = {
    # one mp4 per camera per episode; chunk_size=2 rolls episode 2 over into chunk-001
    "v21_h264": ([9, 12, 7], dict(version="v2.1", codec="h264", chunk_size=2)),
    # several episodes per mp4 (non-zero from_timestamp) and file/chunk rollover: 3 files over 2 chunks
    "v30_av1": ([8, 11, 6, 9, 5], dict(version="v3.0", codec="av1", episodes_per_file=2, chunk_size=2)),
    "v30_h264": ([6, 7], dict(version="v3.0", codec="h264")),
    "v30_png": ([5, 7, 4], dict(version="v3.0", image_storage="png", episodes_per_file=2)),
    "v21_png": ([4, 6], dict(version="v2.1", image_storage="png")),
    # files rolled over by size (LeRobot's data_files_size_in_mb), not by episode count
    "v30_png_by_size": ([5, 7, 4, 6], dict(version="v3.0", image_storage="png", data_files_size_in_mb=0.005)),
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = {}
    for name, (lengths, kwargs) in LAYOUTS.items():
        episodes = make_episodes(lengths, seed=len(name))
        root = write_lerobot_dataset(tmp_path_factory.mktemp(name), episodes, fps=FPS, robot_type="synthetic", **kwargs)
        out[name] = (root, episodes)
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_round_trip_frames_states_timestamps(written, name):
    root, episodes = written[name]
    ds = LeRobotDataset(root)
    assert ds.version == LAYOUTS[name][1]["version"]
    assert ds.num_episodes == len(episodes)
    assert ds.num_frames == sum(len(e["action"]) for e in episodes)
    assert set(ds.camera_keys) == set(CAMERAS)
    assert ds.tasks == ["pick", "place"]
    for position, episode in enumerate(episodes):
        length = len(episode["action"])
        np.testing.assert_array_equal(ds.episode_array(position, "observation.state"), episode["observation.state"])
        np.testing.assert_array_equal(ds.episode_array(position, "action"), episode["action"])
        np.testing.assert_allclose(ds.episode_array(position, "timestamp"), np.arange(length) / FPS, atol=1e-6)
        np.testing.assert_array_equal(ds.episode_array(position, "frame_index"), np.arange(length))
        for c, camera in enumerate(CAMERAS):
            # whole episode in one sequential decode
            frames = ds.images(position, camera, np.arange(length))
            assert frames.dtype == np.uint8 and frames.shape == (length, 48, 64, 3)
            assert [decode_frame_id(f) for f in frames] == [(position, t, c) for t in range(length)]
        # single frames in reverse order exercise the seek path
        for t in reversed(range(length)):
            frame = ds.frame(position, t)
            assert frame["task"] == episode["task"]
            assert int(frame["episode_index"]) == position and int(frame["frame_index"]) == t
            assert decode_frame_id(frame["observation.images.wrist"]) == (position, t, 1)
    # the global index runs over all episodes
    np.testing.assert_array_equal(ds.arrays["index"], np.arange(ds.num_frames))


def test_v30_layout_hard_cases(written):
    root, episodes = written["v30_av1"]
    ds = LeRobotDataset(root)
    spans = [r.videos["observation.images.front"] for r in ds.episodes]
    # episodes 0,1 share file-000; 2,3 file-001; 4 lands in chunk-001 (chunk_size=2)
    assert spans[0].path == spans[1].path and spans[2].path == spans[3].path
    assert "chunk-001" in str(spans[4].path) and "chunk-001" in str(ds.episodes[4].data_path)
    assert spans[1].from_timestamp == pytest.approx(len(episodes[0]["action"]) / FPS)
    assert spans[3].from_timestamp == pytest.approx(len(episodes[2]["action"]) / FPS)
    info = json.loads((root / "meta/info.json").read_text())
    assert info["data_path"] == "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
    assert info["features"]["observation.images.front"]["info"]["video.codec"] == "av1"
    tasks = pq.read_table(root / "meta/tasks.parquet")
    assert set(tasks.column_names) >= {"task_index"}


def test_v30_files_roll_over_by_size_and_read_back_by_batches_when_pyarrow_cannot_read_them_whole(written, monkeypatch):
    from embodied_jax.data import lerobot_meta

    root, episodes = written["v30_png_by_size"]
    files = sorted(root.glob("data/chunk-*/file-*.parquet"))
    tables = [pq.read_table(f) for f in files]
    per_file = [sorted(set(t.column("episode_index").to_pylist())) for t in tables]
    assert 1 < len(files) < len(episodes) and sum(per_file, []) == list(range(len(episodes)))
    # whole episodes per file, each file within the limit unless it holds a single episode
    assert all(t.nbytes <= 0.005 * 2**20 or len(e) == 1 for t, e in zip(tables, per_file, strict=True))
    assert json.loads((root / "meta/info.json").read_text())["data_files_size_in_mb"] == 0.005

    # a column chunk pyarrow will not read whole (PNG frames of over 2 GB in one row group): by batches
    whole = lerobot_meta.read_parquet(files[0], list(CAMERAS))
    real = pq.read_table

    def refuses_nested(path, columns=None, **kwargs):
        if columns and any(c in CAMERAS for c in columns):
            raise pa.ArrowNotImplementedError("Nested data conversions not implemented for chunked array outputs")
        return real(path, columns=columns, **kwargs)

    monkeypatch.setattr(pq, "read_table", refuses_nested)
    monkeypatch.setattr(lerobot_meta, "WHOLE_READ_BYTES", 0)  # every row group now counts as one over 2 GB
    assert lerobot_meta.read_parquet(files[0], list(CAMERAS)).equals(whole)
    ds = LeRobotDataset(root)
    assert decode_frame_id(ds.frame(len(episodes) - 1, 2)["observation.images.wrist"]) == (len(episodes) - 1, 2, 1)


def test_v21_layout(written):
    root, _ = written["v21_h264"]
    assert (root / "data/chunk-001/episode_000002.parquet").exists()
    assert (root / "videos/chunk-001/observation.images.front/episode_000002.mp4").exists()
    assert len((root / "meta/episodes_stats.jsonl").read_text().splitlines()) == 3


def test_modality_views(tmp_path):
    modality = {
        "state": {"arm": {"start": 0, "end": 3}, "gripper": {"start": 3, "end": 4}},
        "action": {"arm": {"start": 0, "end": 2}, "gripper": {"start": 2, "end": 3}},
        "video": {"ego": {"original_key": "observation.images.front"}},
        "annotation": {"human.task_description": {"original_key": "task_index"}},
    }
    episodes = make_episodes([5], cameras=("front",))
    root = write_lerobot_dataset(
        tmp_path / "m", episodes, fps=FPS, version="v3.0", image_storage="png", modality=modality
    )
    from embodied_jax.data.samples import SampleLoader, SampleSpec

    sample = SampleLoader(LeRobotDataset(root), SampleSpec(action_horizon=2)).sample(0, 1)
    np.testing.assert_array_equal(sample["state.gripper"], episodes[0]["observation.state"][1, 3:4])
    np.testing.assert_array_equal(sample["action.arm"], episodes[0]["action"][1:3, 0:2])
    np.testing.assert_array_equal(sample["video.ego"], sample["observation.images.front"])
    assert sample["annotation.human.task_description"] == "pick"
    (root / "meta/modality.json").write_text(json.dumps({"state": {"arm": {"start": 0, "end": 9}}}))
    with pytest.raises(DatasetError, match=r"modality.json.*state.arm.*exceeds"):
        LeRobotDataset(root)


# ----- malformed datasets ------------------------------------------------------------------------------------------
@pytest.fixture()
def v30_copy(written, tmp_path):
    return pathlib.Path(shutil.copytree(written["v30_av1"][0], tmp_path / "v30"))


@pytest.fixture()
def v21_copy(written, tmp_path):
    return pathlib.Path(shutil.copytree(written["v21_h264"][0], tmp_path / "v21"))


def test_missing_parquet_names_file_and_episode(v21_copy):
    path = v21_copy / "data/chunk-000/episode_000001.parquet"
    path.unlink()
    with pytest.raises(DatasetError, match=r"episode_000001\.parquet \(episode 1\): missing file"):
        LeRobotDataset(v21_copy)
    ds = LeRobotDataset(v21_copy, skip_bad_episodes=True)
    assert ds.episode_indices.tolist() == [0, 2] and [e for e, _ in ds.skipped] == [1]


def test_wrong_column_names_file(v30_copy):
    path = v30_copy / "data/chunk-000/file-001.parquet"
    table = pq.read_table(path)
    pq.write_table(table.rename_columns(["actions" if c == "action" else c for c in table.column_names]), path)
    with pytest.raises(DatasetError, match=r"file-001\.parquet \(episode 2\): missing column\(s\) \['action'\]"):
        LeRobotDataset(v30_copy)
    ds = LeRobotDataset(v30_copy, skip_bad_episodes=True)
    assert sorted(e for e, _ in ds.skipped) == [2, 3] and ds.num_episodes == 3


def test_timestamp_outside_tolerance(v30_copy):
    path = v30_copy / "data/chunk-000/file-000.parquet"
    table = pq.read_table(path)
    timestamps = table.column("timestamp").to_numpy().copy()
    timestamps[10] += 0.5 / FPS  # a row of episode 1 (episode 0 has 8 frames)
    table = table.set_column(table.column_names.index("timestamp"), "timestamp", pa.array(timestamps))
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=r"file-000\.parquet: episode 1: timestamp .* outside tolerance_s"):
        LeRobotDataset(v30_copy)
    assert LeRobotDataset(v30_copy, tolerance_s=0.06).num_episodes == 5


def test_video_timestamp_outside_tolerance(v30_copy):
    # from_timestamp shifted by half a frame: the table is fine, the decoded frame's time is not
    path = next((v30_copy / "meta/episodes").glob("chunk-*/file-*.parquet"))
    table = pq.read_table(path)
    column = "videos/observation.images.front/from_timestamp"
    values = table.column(column).to_numpy().copy()
    values[1] += 0.04
    pq.write_table(table.set_column(table.column_names.index(column), column, pa.array(values)), path)
    ds = LeRobotDataset(v30_copy)
    with pytest.raises(
        DatasetError,
        match=r"file-000\.mp4: frame 10 is at t=1\.0+s but t=1\.04\d*s was requested "
        r"\(outside tolerance_s=0\.0001\) \[episode 1, camera observation\.images\.front\]",
    ):
        ds.images(1, "observation.images.front", [2])
    assert decode_frame_id(ds.images(1, "observation.images.wrist", [2])[0]) == (1, 2, 1)


def test_undecodable_video(v30_copy):
    path = v30_copy / "videos/observation.images.wrist/chunk-000/file-001.mp4"
    path.write_bytes(b"\x00not a video" * 100)
    ds = LeRobotDataset(v30_copy)
    with pytest.raises(
        DatasetError, match=r"file-001\.mp4: cannot open video.*episode 3, camera observation\.images\.wrist"
    ):
        ds.images(ds.position_of(3), "observation.images.wrist", [0])
    ds = LeRobotDataset(v30_copy, skip_bad_episodes=True)
    assert sorted(e for e, _ in ds.skipped) == [2, 3]
    assert ds.episode_indices.tolist() == [0, 1, 4]
    assert decode_frame_id(ds.frame(2, 3)["observation.images.wrist"]) == (4, 3, 1)


def test_missing_video_and_metadata(v30_copy, v21_copy):
    (v30_copy / "videos/observation.images.front/chunk-001/file-000.mp4").unlink()
    with pytest.raises(DatasetError, match=r"chunk-001/file-000\.mp4: missing video file for episode 4"):
        LeRobotDataset(v30_copy)
    (v21_copy / "meta/info.json").unlink()
    with pytest.raises(DatasetError, match=r"info\.json: missing file"):
        LeRobotDataset(v21_copy)


def test_episode_metadata_mismatch(v30_copy):
    path = next((v30_copy / "meta/episodes").glob("chunk-*/file-*.parquet"))
    table = pq.read_table(path)
    lengths = table.column("length").to_numpy().copy()
    lengths[1] += 1
    to_index = table.column("dataset_to_index").to_numpy().copy()
    to_index[1] += 1
    table = table.set_column(table.column_names.index("length"), "length", pa.array(lengths))
    table = table.set_column(table.column_names.index("dataset_to_index"), "dataset_to_index", pa.array(to_index))
    pq.write_table(table, path)
    with pytest.raises(
        DatasetError, match=r"file-000\.parquet: episode 1: metadata says 12 frames but the file has 11"
    ):
        LeRobotDataset(v30_copy)


# ----- inspect CLI ---------------------------------------------------------------------------------------------------
def test_inspect_save_frame(written, tmp_path, capsys):
    root, episodes = written["v30_av1"]
    out = tmp_path / "frame.npz"
    assert inspect_cli.main([str(root), "--episode", "3", "--frame", "4", "--save", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "format: LeRobot v3.0" in printed and "video av1 64x48" in printed and "[1] place" in printed
    arrays = np.load(out)
    np.testing.assert_array_equal(arrays["observation.state"], episodes[3]["observation.state"][4])
    np.testing.assert_array_equal(arrays["action"], episodes[3]["action"][4])
    assert arrays["observation.images.front"].dtype == np.uint8
    assert decode_frame_id(arrays["observation.images.front"]) == (3, 4, 0)
    assert str(arrays["task"]) == "place" and int(arrays["episode_index"]) == 3 and int(arrays["frame_index"]) == 4
    assert float(arrays["timestamp"]) == pytest.approx(0.4)


def test_inspect_module_runs(written, subprocess_env):
    root, _ = written["v21_h264"]
    result = subprocess.run(
        [sys.executable, "-m", "embodied_jax.data.inspect", str(root)],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "format: LeRobot v2.1" in result.stdout and "episodes: 3" in result.stdout and "video h264" in result.stdout


def test_av1_encode_keeps_the_scheduling_policy(tmp_path):
    """SVT-AV1 raises its caller to SCHED_FIFO where it may (as root); processes started after an
    encode would run real-time. encode_video restores the caller's policy."""
    before = (os.sched_getscheduler(0), os.sched_getparam(0))
    encode_video(tmp_path / "v.mp4", [np.zeros((2, 16, 16, 3), np.uint8)], fps=10, codec="av1")
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before


def test_frames_of_many_files_are_read_once_while_they_fit_the_cache(written, monkeypatch):
    """Random frames across a dataset of several data files: each file's image column is read once
    while the columns fit ``IMAGE_CACHE_BYTES``; under a budget of one column, each change of file reads."""
    from embodied_jax.data import lerobot

    root, episodes = written["v30_png"]  # two episodes per file: two files
    reads = []
    real = lerobot.read_parquet

    def counting(path, columns=None, **kwargs):
        if columns and any(c in CAMERAS for c in columns):
            reads.append(path.name)
        return real(path, columns, **kwargs)

    monkeypatch.setattr(lerobot, "read_parquet", counting)
    order = [0, 2, 1, 2, 0, 1, 2, 0]  # episodes 0-1 in the first file, 2 in the second
    ds = LeRobotDataset(root)
    for position in order:
        decode_frame_id(ds.images(position, CAMERAS[0], [0])[0])
    assert sorted(reads) == sorted(set(reads)) and len(reads) == 2
    reads.clear()
    monkeypatch.setattr(lerobot, "IMAGE_CACHE_BYTES", 1)
    ds = LeRobotDataset(root)
    for position in order:
        assert decode_frame_id(ds.images(position, CAMERAS[0], [1])[0]) == (position, 1, 0)
    assert len(reads) == 7  # a read at every change of file (the last column kept whatever its size)
