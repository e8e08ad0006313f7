"""Saved configs: every experiment's config round-trips through JSON; bad payloads are clear errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from embodied_jax.config_registry import FORMAT_VERSION, ConfigFormatError, from_dict, register, to_dict
from embodied_jax.train.config import ExperimentConfig


def _base_view(config):
    """What a checkpoint saves of ``config``: its registered base class's fields."""
    return ExperimentConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(ExperimentConfig)})


def test_every_experiment_config_round_trips_through_json():
    from experiments.registry import experiments

    for name, (_, factory) in experiments().items():
        config = factory()
        saved = json.loads(json.dumps(to_dict(config)))
        assert saved["format_version"] == FORMAT_VERSION
        restored = from_dict(saved)
        expected = config if type(config) is ExperimentConfig else _base_view(config)
        assert restored == expected, name
        assert "experiments" not in json.dumps(saved), name  # the library's names only


def _saved_demo():
    from experiments.demo import demo_config

    return json.loads(json.dumps(to_dict(demo_config())))


def test_unknown_and_missing_fields_are_errors_naming_them():
    saved = _saved_demo()
    saved["config"]["model"]["vision"]["widht"] = 64
    with pytest.raises(ConfigFormatError, match=r"config\.model\.vision: SiglipConfig has no field 'widht'"):
        from_dict(saved)
    saved = _saved_demo()
    del saved["config"]["train"]["steps"]
    with pytest.raises(ConfigFormatError, match=r"config\.train: TrainConfig field 'steps' missing"):
        from_dict(saved)
    saved = _saved_demo()
    saved["config"]["data"]["__config__"] = "NoSuchData"
    with pytest.raises(ConfigFormatError, match="config.data: unknown config 'NoSuchData'"):
        from_dict(saved)


def test_fields_added_later_take_their_defaults_when_an_older_config_lacks_them():
    saved = _saved_demo()
    assert saved["config"]["evaluation"]["phase_in_state"] is True  # the demo's default today
    del saved["config"]["evaluation"]["phase_in_state"]  # as runs saved before the field existed
    assert from_dict(saved).evaluation.phase_in_state is False  # their behaviour: no phase
    del saved["config"]["evaluation"]["execute_steps"]  # not an added field: still an error
    with pytest.raises(ConfigFormatError, match="field 'execute_steps' missing"):
        from_dict(saved)


def test_a_renamed_field_reads_from_its_old_name_in_saved_configs_and_on_the_command_line(capsys):
    from experiments.launch import parse

    saved = _saved_demo()
    pipeline = saved["config"]["data"].pop("pipeline")
    saved["config"]["data"]["data"] = pipeline  # as runs saved before LeRobotData.data became .pipeline
    assert from_dict(saved) == from_dict(_saved_demo())
    config = parse(["demo", "--data.data.num-workers", "3", "--data.data.read-threads=2"])
    assert config.data.pipeline.num_workers == 3 and config.data.pipeline.read_threads == 2
    err = capsys.readouterr().err
    assert err.count("--data.data.* is deprecated; it is now --data.pipeline.*") == 1
    assert parse(["demo", "--data.pipeline.num-workers", "3"]).data.pipeline.num_workers == 3


def test_unversioned_or_unregistered_configs_are_refused():
    with pytest.raises(ConfigFormatError, match="format_version"):
        from_dict({"__class__": "experiments.demo:DemoConfig"})  # the format before versioning
    with pytest.raises(ConfigFormatError, match="format_version=99"):
        from_dict({"format_version": 99, "config": {}})

    @dataclasses.dataclass(frozen=True)
    class Unregistered:
        x: int = 1

    with pytest.raises(ConfigFormatError, match=r"config\.model: .*Unregistered is not a registered config"):
        to_dict(ExperimentConfig(model=Unregistered()))
    with pytest.raises(ValueError, match="registered twice"):
        register(dataclasses.make_dataclass("ExperimentConfig", [("y", int, 0)], frozen=True))


def test_model_configs_keep_the_compute_fields_and_build_one_compute_from_them():
    """``nn.compute.Compute``: a model config keeps the six settings as its own saved fields (its
    config.json and ``--model.dtype`` and friends unchanged) and builds the one object its modules take."""
    from embodied_jax.nn.compute import Compute
    from experiments import launch

    names = [f.name for f in dataclasses.fields(Compute)]
    flags = ["--model.dtype", "bfloat16", "--model.fp8", "flax", "--model.no-scan-layers"]
    for name in ("pi05_bench", "gr00t_bench"):
        config = launch.parse([name, *flags]).model
        saved = to_dict(config)["config"]
        assert "compute" not in saved and {n: saved[n] for n in names} == dataclasses.asdict(config.compute)
        assert config.compute == Compute("bfloat16", "float32", "flax", "auto", False, "none"), name
        assert from_dict(to_dict(config)).compute == config.compute
