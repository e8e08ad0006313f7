"""The end-to-end path on a tiny scale: collect -> train -> policy bundle -> closed-loop eval -> JSON."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from embodied_jax.train.config import CheckpointConfig
from experiments.demo import demo_config
from tests.conftest import DEMO_IMAGE as IMAGE


def test_demo_writes_dataset_and_checkpoint(demo_run):
    # Its report (evaluate_policy) is checked through the evaluate command line (test_evaluate.py).
    assert (demo_run / "dataset" / "meta" / "info.json").exists()
    assert (demo_run / "checkpoints" / "4").is_dir()
    record = {"task": "reach", "model": "Pi05Config", "phase_in_state": True}
    assert json.loads((demo_run / "demo.json").read_text()) == record


def test_demo_defaults_are_relative_moves_and_the_phase_in_the_state(demo_run):
    from embodied_jax import load_policy

    bundle = load_policy(demo_run)
    assert bundle.config.data.pipeline.spec.delta_action_mask == (True, True, True, False)  # hand moves, absolute grip
    assert bundle.config.evaluation.phase_in_state and bundle.state_dim == 5  # x, y, z, grip, phase


def test_training_logs_closed_loop_success_next_to_the_loss(demo_run):
    rows = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reach/success_rate" in r]
    assert [r["step"] for r in evals] == [4]
    assert 0.0 <= evals[0]["eval/reach/success_rate"] <= 1.0 and evals[0]["eval/reach/mean_episode_length"] > 0
    assert "loss" in evals[0]  # the evaluation's scores share their step's row
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})  # one row per step


def test_policy_bundle_predicts_unnormalised_actions(demo_run):
    from embodied_jax import load_policy
    from embodied_jax.data.lerobot import LeRobotDataset

    bundle = load_policy(demo_run)
    assert bundle.step == 4
    raw = _raw_observation(LeRobotDataset(demo_run / "dataset").frame(0, 0))
    actions = bundle.predict(raw)
    assert actions.shape == (1, bundle.config.model.action_horizon, 4)
    assert np.isfinite(actions).all()
    # Unnormalised and absolute: less the state on the hand dims (delta actions), the chunk lies in the
    # range of the data's (relative) actions, which the statistics describe.
    stats = bundle.stats["action"]
    span = np.asarray(stats.max) - np.asarray(stats.min)
    mask = np.asarray(bundle.config.data.pipeline.spec.delta_action_mask)
    relative = actions[0] - np.where(mask, raw["observation.state"][0, :4], 0.0)
    assert (relative >= np.asarray(stats.min) - 2 * span).all() and (relative <= np.asarray(stats.max) + 2 * span).all()
    assert np.abs(actions[0, :, :3] - raw["observation.state"][0, :3]).max() < 0.2  # near the hand, not the origin
    obs = bundle.preprocess(raw)
    assert obs["images"]["base_0_rgb"].shape == (1, IMAGE, IMAGE, 3)
    assert obs["tokens"].shape == (1, bundle.config.model.max_token_len) and obs["token_mask"][0, 0]


def _raw_observation(frame: dict) -> dict:
    return {
        "observation.state": frame["observation.state"][None],
        "task": frame["task"],
        "observation.images.scene": frame["observation.images.scene"][None],
        "observation.images.wrist": frame["observation.images.wrist"][None],
    }


def test_serving_applies_the_pipelines_sample_transform(demo_run):
    """The bundle's preprocessing of a robot observation equals what the training pipeline made of the same frame."""
    import grain

    from embodied_jax import load_policy
    from embodied_jax.data.lerobot import LeRobotDataset
    from embodied_jax.data.pipeline import build_dataset
    from embodied_jax.data.samples import SampleLoader

    bundle = load_policy(demo_run)
    data = bundle.config.data
    samples, _, _ = build_dataset(
        dataclasses.replace(data.pipeline, sources=data.sources),
        process_index=0,
        process_count=1,
        seed=0,
        inputs=data.inputs,
        builder=bundle.config.model.input_builder(),
        stats=bundle.stats,
    )
    dataset = LeRobotDataset(demo_run / "dataset")
    order = grain.MapDataset.range(dataset.num_frames).shuffle(seed=0)  # the pipeline's order of its one source
    for record in (0, 5):
        trained = samples[record]
        raw = SampleLoader(dataset, data.pipeline.spec)(order[record])
        served = bundle.preprocess(_raw_observation(raw))
        assert set(served) == set(trained) - {"actions", "action_dim_mask"}
        for key, value in served.items():
            if isinstance(value, dict):
                for cam, image in value.items():
                    np.testing.assert_array_equal(image[0], trained[key][cam], err_msg=f"{key}/{cam}")
            else:
                np.testing.assert_array_equal(value[0], trained[key], err_msg=key)


def test_load_policy_leaves_a_live_runs_save_in_flight_alone(demo_run, tmp_path, monkeypatch):
    """A writer's asynchronous save is held open (before Orbax's publishing rename) while a
    reader opens the policy: the reader deletes nothing and the save then completes."""
    import asyncio
    import threading

    import jax
    from orbax.checkpoint._src.path import atomicity

    from embodied_jax import load_policy
    from embodied_jax.config_registry import from_dict
    from embodied_jax.train.checkpoint import Checkpointer
    from embodied_jax.train.loop import build

    run = tmp_path / "run"
    shutil.copytree(demo_run / "checkpoints", run / "checkpoints")
    release = threading.Event()
    publish = atomicity.AtomicRenameTemporaryPath.finalize

    async def held_finalize(self):
        await asyncio.to_thread(release.wait, 120)
        await publish(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", held_finalize)
    writer = Checkpointer(run / "checkpoints", CheckpointConfig(async_save=True))
    try:
        config = from_dict(writer.read_json(4, "config"))
        rt = build(config, jax.local_devices()[:1])
        state, stats = writer.restore(rt.abstract_state, rt.shardings, step=4)
        assert writer.save(6, state, norm_stats=stats, config=writer.read_json(4, "config"))
        in_flight = list((run / "checkpoints").glob("6.orbax-checkpoint-tmp*"))
        assert in_flight, "the save should still be in flight"
        assert load_policy(run).step == 4
        assert all(p.is_dir() for p in in_flight)
    finally:
        release.set()
        writer.wait()
    assert writer.all_steps()[-1] == 6 and writer.problem(6) is None
    writer.close()


def test_predict_draws_fresh_noise_unless_given_an_rng(demo_run):
    import jax

    from embodied_jax import load_policy
    from embodied_jax.data.lerobot import LeRobotDataset

    bundle = load_policy(demo_run)
    raw = _raw_observation(LeRobotDataset(demo_run / "dataset").frame(0, 0))
    first, second = bundle.predict(raw), bundle.predict(raw)
    assert not np.allclose(first, second)
    key = jax.random.key(7)
    np.testing.assert_array_equal(bundle.predict(raw, rng=key), bundle.predict(raw, rng=key))


def test_predict_refuses_bad_observations_by_name(demo_run):
    import jax

    from embodied_jax import load_policy
    from embodied_jax.bundle import ObservationError
    from embodied_jax.data.lerobot import LeRobotDataset

    bundle = load_policy(demo_run)
    raw = _raw_observation(LeRobotDataset(demo_run / "dataset").frame(0, 0))
    wrist = "observation.images.wrist"
    cases = [
        ({k: v for k, v in raw.items() if k != wrist}, r"lacks \['observation.images.wrist'\]"),
        ({**raw, "observation.state": raw["observation.state"] * np.nan}, "non-finite"),
        ({**raw, wrist: raw[wrist] / 255.0}, "needs predict\\(..., image_range"),
        ({**raw, wrist: raw[wrist].astype(np.int16)}, "must be uint8"),
        ({**raw, "observation.state": np.repeat(raw["observation.state"], 2, 0)}, r"\[2, H, W, 3\] \(one per state\)"),
    ]
    for bad, message in cases:
        with pytest.raises(ObservationError, match=message):
            bundle.predict(bad)
    key = jax.random.key(3)
    as_float = {**raw, **{k: raw[k] / np.float32(255.0) for k in (wrist, "observation.images.scene")}}
    np.testing.assert_array_equal(
        bundle.predict(as_float, rng=key, image_range=(0.0, 1.0)), bundle.predict(raw, rng=key)
    )


def test_a_checkpoint_loads_where_experiments_cannot_be_imported(demo_run, subprocess_env, tmp_path):
    """The demo's checkpoint names only library configs: ``load_policy`` needs no experiment code."""
    script = tmp_path / "load.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys

        class NoExperiments:
            def find_spec(self, name, path=None, target=None):
                if name == "experiments" or name.startswith("experiments."):
                    raise ImportError(f"{{name}} is not importable here")
                return None

        sys.meta_path.insert(0, NoExperiments())
        import embodied_jax

        bundle = embodied_jax.load_policy({str(demo_run)!r})
        assert "experiments" not in sys.modules
        print(type(bundle.config).__name__, type(bundle.config.model).__name__, bundle.step)
    """)
    )
    out = subprocess.run(
        [sys.executable, str(script)], env=subprocess_env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ExperimentConfig", "Pi05Config", "4"]


def test_gr00t_demo_prompts_tokenize_without_unknown_words(tmp_path):
    """``demo_gr00t``: its word-level tokenizer covers the Eagle prompt of every built-in task, and the
    config's image-token id, vocabulary and prompt length agree with it."""
    from embodied_jax.sim.tasks import TASKS
    from experiments.demo import GR00T_CAMERAS, build_gr00t_tokenizer

    config = demo_config(arch="gr00t")
    model = dataclasses.replace(config.model, tokenizer_path=str(build_gr00t_tokenizer(tmp_path / "tokenizer.json")))
    builder = model.input_builder()  # checks the special tokens and the <IMG_CONTEXT> id
    assert builder.tokenizer.vocab_size == model.llm.vocab_size
    for task in TASKS.values():
        tokens, mask = builder.tokenize(task.instruction)
        ids = tokens[mask]
        assert (ids != 0).all(), task.name  # id 0 is [UNK]
        assert (ids == model.image_token_id).sum() == len(GR00T_CAMERAS) * model.vision.num_patches
    # The demo's measured best (docs/manipulation.md): quantiles, and no dropout when training from scratch.
    assert config.data.pipeline.norm_modes == (("observation.state", "quantile"), ("action", "quantile"))
    assert config.model.action_head.dit.dropout == 0 and config.model.action_head.vl_self_attention.dropout == 0
    assert config.tokenizer == "qwen3_words"
    with pytest.raises(ValueError, match="arch"):
        demo_config(arch="rt2")


def test_a_rerun_for_another_task_in_the_same_workdir_is_refused(demo_run, capsys):
    from experiments import launch

    before = sorted(p.relative_to(demo_run) for p in demo_run.rglob("*"))
    assert launch.main(["demo", "--task", "pick_place", "--workdir", str(demo_run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "task 'reach' -> 'pick_place'" in err[0], err
    assert sorted(p.relative_to(demo_run) for p in demo_run.rglob("*")) == before


def test_the_default_demo_directory_is_per_task():
    import pathlib

    from experiments.demo import demo_config, run_directory

    config = demo_config()
    assert run_directory(config) == pathlib.Path("runs/demo/reach")
    assert run_directory(dataclasses.replace(config, task="pick_place")) == pathlib.Path("runs/demo/pick_place")
    assert run_directory(dataclasses.replace(config, workdir="elsewhere")) == pathlib.Path("elsewhere")


@pytest.mark.parametrize("arch", ["pi05", "gr00t"])
def test_the_demo_fits_its_model_to_the_task(arch):
    """handover (two arms, three cameras) gets 9 state dims with the phase, 8 action dims, an
    image slot per camera and 1.5x the steps; GR00T's pick_place twice the flow draws; the one-arm
    tasks keep the demo's sizes."""
    from experiments.demo import demo_config, fit_to_task

    base = demo_config(arch=arch)
    reach = fit_to_task(base)
    assert reach.model == base.model and reach.data == base.data and reach.train == base.train
    handover = fit_to_task(dataclasses.replace(base, task="handover"))
    model = handover.model
    assert (model.max_state_dim, model.action_dim, len(model.camera_names)) == (9, 8, 3)
    assert [k for k, _ in handover.data.inputs.cameras] == [
        "observation.images.scene",
        "observation.images.wrist_left",
        "observation.images.wrist_right",
    ]
    assert handover.data.pipeline.spec.camera_keys == tuple(k for k, _ in handover.data.inputs.cameras)
    assert handover.train.steps == round(1.5 * base.train.steps)
    pick = fit_to_task(dataclasses.replace(base, task="pick_place")).model  # GR00T: twice the flow draws
    assert pick.flow_samples_per_obs == base.model.flow_samples_per_obs * (2 if arch == "gr00t" else 1)
    assert handover.model.flow_samples_per_obs == base.model.flow_samples_per_obs
    if arch == "pi05":
        assert model.max_action_dim == 8 and model.max_token_len == base.model.max_token_len + 1
    else:
        assert model.max_token_len == model.image_block_tokens + 48
