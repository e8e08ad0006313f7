"""Untrusted directories stay inside their root: runs, exports, datasets, frame stores.

Each test reproduces a reported fault: a file outside the directory holds a known sentinel, and
the directory is crafted to make the reader fetch it (an absolute path, ``..``, a link) or to
make it allocate or backtrack without bound. Every case must end in the named error of its
reader, naming the file and field, with nothing of the sentinel read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embodied_jax.assets import AssetError
from embodied_jax.data import framestore as fs
from embodied_jax.data import lerobot_format as fmt
from embodied_jax.data.convert import convert
from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.data.lerobot_meta import DatasetError
from embodied_jax.data.synthetic import make_episodes
from embodied_jax.data.video import encode_png
from embodied_jax.data.writer import write_lerobot_dataset
from embodied_jax.paths import UnsafePathError, resolve_inside

SENTINEL = "SENTINEL-outside-the-root"
CAMERA = "observation.images.front"
SIZE = 32


@pytest.fixture()
def outside(tmp_path) -> pathlib.Path:
    """A directory next to the one under test, holding a secret the reader must never return."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "id_rsa").write_text(SENTINEL)
    return path


# ----- the helper --------------------------------------------------------------------------------------------------
def test_resolve_inside_refuses_what_leaves_the_root(tmp_path, outside):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "file").write_text("inside")
    os.symlink(root / "sub" / "file", root / "sub" / "near")
    os.symlink(outside / "id_rsa", root / "sub" / "far")
    assert resolve_inside(root, "sub/file", what="t") == root / "sub" / "file"
    assert resolve_inside(root, "sub/near", what="t").read_text() == "inside"  # a link staying inside is fine
    for bad, why in [
        ("/etc/hostname", "absolute"),
        ("sub/../../outside/id_rsa", r"'\.\.'"),
        ("sub/far", "outside"),
        ("", "not a usable path"),
    ]:
        with pytest.raises(UnsafePathError, match=rf"^t: .*{why}"):
            resolve_inside(root, bad, what="t")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        resolve_inside(root, "sub/near", what="t", links=False)
    with pytest.raises(UnsafePathError, match="not a regular file"):
        resolve_inside(root, "sub", what="t", regular_file=True)


# ----- runs and exported policies ----------------------------------------------------------------------------------
def _saved_config(tokenizer_path: str) -> dict:
    from embodied_jax.config_registry import to_dict
    from experiments.demo import demo_config

    base = demo_config(image_size=SIZE)
    return to_dict(dataclasses.replace(base, model=dataclasses.replace(base.model, tokenizer_path=tokenizer_path)))


def _fake_run(run: pathlib.Path, config: dict) -> pathlib.Path:
    """A run's checkpoint step as the loader sees it before reading weights (no training needed)."""
    step = run / "checkpoints" / "4"
    (step / "config").mkdir(parents=True)
    (step / "config" / "metadata").write_text(json.dumps(config))
    (step / "state").mkdir()
    for name, text in [("_CHECKPOINT_METADATA", "{}"), ("commit_success.txt", "ok"), ("state/_METADATA", "{}")]:
        (step / name).write_text(text)
    (step / "state" / "manifest.ocdbt").write_bytes(b"")
    return step


def test_export_refuses_a_symlinked_asset(tmp_path, outside):
    from embodied_jax.export import export_policy

    run = tmp_path / "run"
    step = _fake_run(run, _saved_config(str(run / "tokenizer.model")))
    (step / "assets" / "tokenizer_path").mkdir(parents=True)
    link = step / "assets" / "tokenizer_path" / "tokenizer.model"
    os.symlink(outside / "id_rsa", link)
    with pytest.raises(AssetError, match=rf"{re.escape(str(link))} is a symbolic link"):
        export_policy(run, tmp_path / "export")
    written = [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink() and outside not in p.parents]
    assert all(SENTINEL not in p.read_text(errors="ignore") for p in written)
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize("layout", ["export", "run"])
def test_a_saved_config_naming_a_file_outside_without_its_copy_is_refused(tmp_path, outside, layout):
    """An absolute tokenizer_path in a config read back, with no assets/: never read from outside."""
    from embodied_jax import load_policy

    config = _saved_config(str(outside / "id_rsa"))
    directory = tmp_path / layout
    if layout == "export":
        directory.mkdir()
        (directory / "policy.json").write_text(json.dumps({"format_version": 1, "step": 4}))
        (directory / "config.json").write_text(json.dumps(config))
    else:
        _fake_run(directory, config)
    with pytest.raises(AssetError, match=r"model\.tokenizer_path=.*id_rsa.*assets/tokenizer_path holds no copy"):
        load_policy(directory)


# ----- LeRobot datasets --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, pathlib.Path]:
    """Tiny PNG-stored datasets (no video to encode) of both formats."""
    episodes = make_episodes([4, 3], cameras=("front",), height=SIZE, width=SIZE)
    return {
        version: write_lerobot_dataset(
            tmp_path_factory.mktemp(version), episodes, fps=10, version=version, image_storage="png"
        )
        for version in (fmt.V21, fmt.V30)
    }


@pytest.fixture(params=[fmt.V21, fmt.V30])
def dataset(request, written, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(written[request.param], tmp_path / "dataset"))


@pytest.fixture()
def v21(written, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(written[fmt.V21], tmp_path / "dataset"))


@pytest.fixture()
def v30(written, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(written[fmt.V30], tmp_path / "dataset"))


def _edit_info(root: pathlib.Path, **changes) -> None:
    path = root / fmt.INFO_PATH
    info = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            info.pop(key)
        else:
            info[key] = value
    path.write_text(json.dumps(info))


def _poisoned_copy(root: pathlib.Path, outside: pathlib.Path) -> pathlib.Path:
    """A copy of the dataset outside it whose actions are all the sentinel value 12345."""
    copy = pathlib.Path(shutil.copytree(root, outside / "dataset"))
    for path in copy.glob("data/**/*.parquet"):
        table = pq.read_table(path)
        column = table.column("action")
        poisoned = pa.array([[12345.0] * len(row) for row in column.to_pylist()], type=column.type)
        pq.write_table(table.set_column(table.column_names.index("action"), "action", poisoned), path)
    return copy


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_data_path_leaving_the_dataset_is_refused(dataset, outside, where):
    copy = _poisoned_copy(dataset, outside)
    template = json.loads((dataset / fmt.INFO_PATH).read_text())["data_path"]
    escaped = f"../outside/dataset/{template}" if where == "parent" else f"{copy}/{template}"
    _edit_info(dataset, data_path=escaped)
    with pytest.raises(DatasetError, match=r"info\.json: data_path: .*(absolute paths and '\.\.' are refused)"):
        LeRobotDataset(dataset)


def test_a_link_leaving_the_dataset_is_refused_one_inside_is_followed(v21, outside):
    copy = _poisoned_copy(v21, outside)
    first, second = sorted(v21.glob("data/**/*.parquet"))
    (v21 / "moved").mkdir()
    second.rename(v21 / "moved" / second.name)
    os.symlink(v21 / "moved" / second.name, second)  # inside the root: fine
    first.unlink()
    os.symlink(copy / first.relative_to(v21), first)  # leads out: refused
    with pytest.raises(DatasetError, match=rf"data_path: {re.escape(str(first))} leads to .*outside"):
        LeRobotDataset(v21)
    first.unlink()
    shutil.copyfile(copy / first.relative_to(v21), first)  # a regular file again: the dataset loads
    ds = LeRobotDataset(v21)
    assert ds.num_episodes == 2 and not np.any(ds.arrays["action"][4:] == 12345.0)


def _point_image_cells(root: pathlib.Path, path: str) -> None:
    """Every image cell of the v3.0 dataset's first data file holds no bytes, only ``path``."""
    data = next(root.glob("data/**/*.parquet"))
    table = pq.read_table(data)
    cells = pa.array([{"bytes": None, "path": path}] * table.num_rows, type=table.schema.field(CAMERA).type)
    pq.write_table(table.set_column(table.column_names.index(CAMERA), CAMERA, cells), data)


@pytest.mark.timeout(120)  # a FIFO read without the check would block forever
@pytest.mark.parametrize("kind", ["absolute", "parent", "dev_zero", "link_to_dev_zero", "fifo"])
def test_image_cell_paths_stay_inside_and_name_regular_files(v30, outside, kind):
    secret = outside / "secret.png"  # a valid frame of the right size: the old reader returned it
    secret.write_bytes(encode_png(np.full((SIZE, SIZE, 3), 123, np.uint8)))
    (v30 / "images").mkdir()
    if kind == "link_to_dev_zero":
        os.symlink("/dev/zero", v30 / "images" / "zero.png")
    if kind == "fifo":
        os.mkfifo(v30 / "images" / "fifo.png")
    cell = {
        "absolute": str(secret),
        "parent": "../outside/secret.png",
        "dev_zero": "/dev/zero",
        "link_to_dev_zero": "images/zero.png",
        "fifo": "images/fifo.png",
    }[kind]
    _point_image_cells(v30, cell)
    ds = LeRobotDataset(v30)
    why = {"link_to_dev_zero": "leads to /dev/zero", "fifo": "is not a regular file"}.get(kind, "are refused")
    with pytest.raises(DatasetError, match=rf"episode 0: frame 1 of {CAMERA}: path: .*{why}"):
        ds.images(0, CAMERA, [1])


def test_a_missing_image_file_names_the_file_and_the_frame(v30):
    _point_image_cells(v30, "images/missing.png")
    ds = LeRobotDataset(v30)
    with pytest.raises(
        DatasetError, match=rf"missing\.png: missing image file \[episode 0, frame 2, camera {CAMERA}\]"
    ):
        ds.images(0, CAMERA, [2])


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("data/{episode_index:>400000000}.parquet", r"\{episode_index:>400000000\}: an integer field takes a spec"),
        ("data/{episode_index:013d}.parquet", r"width at most 12"),
        ("data/{nope}.parquet", r"\{nope\} is not a field of this template"),
        ("data/{episode_index.__class__}.parquet", r"\{episode_index\.__class__\} is not a field"),
        ("data/{episode_index[0]}.parquet", r"\{episode_index\[0\]\} is not a field"),
        ("data/{episode_index!r}.parquet", r"conversions are refused"),
        ("data/{}.parquet", r"\{\} is not a field"),
    ],
    ids=["huge_width", "width_13", "unknown_field", "attribute", "index", "conversion", "positional"],
)
def test_path_templates_take_only_lerobot_fields_and_small_integer_specs(v21, template, message):
    _edit_info(v21, data_path=template)
    # Refused by the template's own check, before any formatting (the huge width once allocated for 9-15 s).
    with pytest.raises(DatasetError, match=rf"info\.json: data_path: .*{message}") as caught:
        LeRobotDataset(v21)
    assert "0x" not in str(caught.value) and "<class" not in str(caught.value)  # no object leaks into it


def test_a_huge_task_index_is_refused_before_allocating(dataset):
    big = 3_000_000_000
    if (dataset / fmt.V21_TASKS_PATH).exists():
        path = dataset / fmt.V21_TASKS_PATH
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        rows[-1]["task_index"] = big
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        path = dataset / fmt.V30_TASKS_PATH
        table = pq.read_table(path)
        indices = table.column("task_index").to_pylist()[:-1] + [big]
        column = pa.array(indices, type=table.schema.field("task_index").type)
        pq.write_table(table.set_column(table.column_names.index("task_index"), "task_index", column), path)
    with pytest.raises(  # the bound check, before anything is allocated for the index
        DatasetError, match=rf"tasks\.(jsonl|parquet): task_index = {big}: expected an integer in \[0, 2\)"
    ):
        LeRobotDataset(dataset)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(chunks_size=0), r"chunks_size = 0: expected an integer >= 1"),
        (dict(fps=0), r"fps = 0: expected a frame rate in \(0, 10000\]"),
        (dict(fps=float("nan")), r"fps = nan: expected a frame rate"),
    ],
    ids=["chunks_size_0", "fps_0", "fps_nan"],
)
def test_zero_rates_and_chunk_sizes_are_named(v21, change, message):
    _edit_info(v21, **change)
    with pytest.raises(DatasetError, match=rf"info\.json: {message}"):
        LeRobotDataset(v21)


# ----- frame stores ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(written, tmp_path_factory) -> pathlib.Path:
    destination = tmp_path_factory.mktemp("store") / "fs"
    convert(written[fmt.V30], destination, workers=1, log=lambda *_: None)
    return destination


@pytest.fixture()
def store(converted, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(converted, tmp_path / "store"))


def _edit_summary(root: pathlib.Path, **changes) -> None:
    path = root / fs.SUMMARY
    summary = json.loads(path.read_text())
    summary.update({k: v for k, v in changes.items() if v is not None})
    for key in [k for k, v in changes.items() if v is None]:
        summary.pop(key)
    path.write_text(json.dumps(summary))


def test_a_tiny_store_declaring_16_gib_is_refused_not_allocated(tmp_path):
    """The reported 236-byte store: one array declaring 2^34 bytes, no chunk written. TensorStore
    would fill it in memory (std::bad_alloc aborts the process); its size is checked first."""
    root = tmp_path / "store"
    frames = 2**34
    (root / "arrays" / "index").mkdir(parents=True)
    metadata = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [frames],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [frames]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "bytes"}],
        "fill_value": 0,
    }
    (root / "arrays" / "index" / "zarr.json").write_text(json.dumps(metadata))
    (root / "arrays" / "done.json").write_text("{}")
    summary = {
        "format": fs.FORMAT,
        "fps": 10,
        "tasks": [],
        "cameras": {},
        "image_size": None,
        "features": {},
        "source_version": "v3.0",
        "array_keys": ["index"],
        "episodes": [{"episode_index": 0, "length": frames}],
    }
    (root / fs.SUMMARY).write_text(json.dumps(summary))
    with pytest.raises(fs.FrameStoreError, match=r"arrays/index: declares a uint8 array of shape \[17179869184\]"):
        fs.FrameStore(root, require_complete=False)


def test_a_frame_array_declaring_more_than_its_camera_is_refused(store):
    path = store / "frames" / CAMERA / "episode_000000" / "zarr.json"
    metadata = json.loads(path.read_text())
    metadata["shape"] = [metadata["shape"][0], 4096, 4096, 3]
    path.write_text(json.dumps(metadata))
    frames = fs.FrameStore(store)
    with pytest.raises(fs.FrameStoreError, match=rf"episode 0, camera {CAMERA}: declares uint8 \[4, 4096, 4096, 3\]"):
        frames.images(0, CAMERA, [0])


@pytest.mark.parametrize("where", ["absolute", "parent"])
def test_array_keys_leaving_the_store_are_refused(store, outside, where):
    secret = outside / "arrays" / "index"
    fs.write_array(secret, np.full(7, 12345, np.int64), frames=False)  # a valid array the old reader returned
    key = str(secret) if where == "absolute" else "../outside/arrays/index"
    _edit_summary(store, array_keys=[key])
    with pytest.raises(fs.FrameStoreError, match=r"framestore\.json field 'array_keys': .*are refused"):
        fs.FrameStore(store)


def test_a_camera_key_leaving_the_store_is_refused(store):
    summary = json.loads((store / fs.SUMMARY).read_text())
    _edit_summary(store, cameras={"../../outside": summary["cameras"][CAMERA]})
    frames = fs.FrameStore(store)
    with pytest.raises(fs.FrameStoreError, match=r"framestore\.json field 'cameras': .*are refused"):
        frames.images(0, "../../outside", [0])


def test_a_missing_fps_names_the_field(store):
    _edit_summary(store, fps=None)
    with pytest.raises(fs.FrameStoreError, match=r"framestore\.json: missing field 'fps'"):
        fs.FrameStore(store)


# ----- config regexes ----------------------------------------------------------------------------------------------
CATASTROPHIC = r"^(?:[\w/]+)+Z"  # each path character doubles the ways to split it: exponential
PARAMETER_PATH = "action_head/model/transformer_blocks/attn1/to_q/kernel"


def test_a_catastrophic_freeze_regex_from_a_saved_config_is_refused_at_once():
    # What the pattern costs the regex engine on a real parameter path (in a child: it never ends).
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", f"import re; re.search({CATASTROPHIC!r}, {PARAMETER_PATH!r})"], timeout=3)
    from embodied_jax.config_registry import from_dict, to_dict
    from embodied_jax.train.optimizer import PatternError
    from embodied_jax.train.state import model_parts
    from tests.train_utils import toy_config

    base = toy_config("unused")
    saved = to_dict(
        dataclasses.replace(base, optimizer=dataclasses.replace(base.optimizer, freeze=(r"^blocks/", CATASTROPHIC)))
    )
    config = from_dict(json.loads(json.dumps(saved)))
    # Refused by its own check, before it is matched against any parameter path.
    with pytest.raises(PatternError, match=r"optimizer\.freeze: regex .*backtracks exponentially"):
        model_parts(config.model, config.optimizer.freeze)  # what loading a checkpoint builds first
