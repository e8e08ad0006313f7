"""``python -m embodied_jax.evaluate`` and the observation contract of ``PolicyBundle.predict``
(docs/observations.md), on the one tiny demo run the test session shares (``demo_run``, conftest.py).

A closed-loop evaluation of a bundle compiles a program with host callbacks, which the persistent
compilation cache never keeps: this file runs exactly one, and checks everything else without.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from embodied_jax.bundle import ObservationError
from embodied_jax.data.sample_transform import SampleTransform
from embodied_jax.evaluation.cli import main
from embodied_jax.evaluation.closed_loop import summary_line

STATE, SCENE, WRIST = "observation.state", "observation.images.scene", "observation.images.wrist"


evaluated_frames: list = []  # filled by the evaluated fixture


@pytest.fixture(scope="module")
def evaluated(demo_run, tmp_path_factory):
    """One evaluation through the command line of a copy of the run (its report goes to the
    default place inside the copy): the copy, the exit status and what it printed; the
    ``frame_index`` of every sample the bundle's per-sample transform saw meanwhile is in
    ``evaluated_frames``."""
    run = tmp_path_factory.mktemp("evaluated")
    shutil.copytree(demo_run / "checkpoints", run / "checkpoints")
    printed = io.StringIO()
    transform = SampleTransform.__call__

    def spy(self, sample, rng=None):
        evaluated_frames.append(sample.get("frame_index"))
        return transform(self, sample, rng)

    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setattr(SampleTransform, "__call__", spy)
        argv = [str(run / "checkpoints"), "--task", "reach", "--envs", "2", "--videos", "1"]
        status = main([*argv, "--record", "--results", str(run / "results")])
    return run, status, printed.getvalue()


def test_evaluate_records_its_result_with_the_checkout_and_the_runs_config(evaluated):
    from embodied_jax import load_policy, records

    run, status, printed = evaluated
    bundle = load_policy(run / "checkpoints")
    assert status == 0, printed
    (row,) = [json.loads(line) for line in (run / "results" / "evaluate.jsonl").read_text().splitlines()]
    assert f"recorded: {run / 'results' / 'evaluate.jsonl'}" in printed
    assert row["benchmark"] == "evaluate" and row["config_hash"] == records.config_hash(bundle.config)
    assert row["result"]["task"] == "reach" and row["result"]["episodes"] == 2 and row["result"]["step"] == 4
    assert row["seeds"] == {"evaluation": 1} and row["wall_s"]["evaluation"] > 0  # the test seed
    assert row["command"].startswith("python -m embodied_jax.evaluate ") and "--record" in row["command"]
    assert row["clean"] == (row["commit"] is not None and not row["commit"].endswith("-dirty"))
    assert row["machine"]["shared"] is False and row["checkpoint"] == str(run / "checkpoints")


def test_evaluate_writes_the_demos_report_next_to_the_checkpoints(evaluated, demo_run, bundle):
    run, status, printed = evaluated
    assert status == 0, printed
    out = run / "eval" / "reach-step4"
    results = json.loads((out / "results.json").read_text())
    # the demo's report: experiments/demo.py writes it with the same evaluate_policy
    assert {"task", "episodes", "success_rate", "success_ci95", "mean_episode_length", "videos"} <= set(results)
    assert results["task"] == "reach" and results["episodes"] == 2 and results["step"] == 4
    low, high = results["success_ci95"]
    assert low <= results["success_rate"] <= high and results["mean_episode_length"] > 0
    saved = bundle.config.evaluation  # the run's own evaluation settings
    assert results["image_size"] == list(saved.image_size) and results["execute_steps"] == saved.execute_steps
    (video,) = results["videos"]
    assert video == str(out / "reach_episode0.mp4") and (out / "reach_episode0.mp4").stat().st_size > 0
    assert (out / "reach_frames.png").stat().st_size > 0
    assert summary_line(results) in printed.splitlines()
    assert f"results: {out / 'results.json'}" in printed and f"video: {video}" in printed


def test_the_simulators_time_step_reaches_the_bundles_preprocessing(evaluated, bundle):
    """Each query's control step arrives at the per-sample transform as ``frame_index``, as a served
    observation's (and every training sample's) does: the evaluation's path is serving's."""
    _, status, printed = evaluated
    assert status == 0, printed
    assert evaluated_frames and all(isinstance(f, np.int64) for f in evaluated_frames), evaluated_frames[:4]
    k = bundle.config.evaluation.execute_steps
    seen = sorted({int(f) for f in evaluated_frames})
    assert len(seen) > 1 and seen == list(range(0, k * len(seen), k)), seen


def test_settings_default_to_the_runs_own_evaluation_else_the_policys_input_size_on_the_test_seed():
    from embodied_jax.evaluation.closed_loop import defaults
    from embodied_jax.evaluation.in_training import SimEvaluation

    saved = SimEvaluation(task="reach", num_envs=7, execute_steps=3, image_size=(24, 40), seed=9, phase_in_state=True)
    run = types.SimpleNamespace(config=types.SimpleNamespace(evaluation=saved), image_size=(32, 32))
    # The seed is the test seed, never the run's own (validation) one.
    want = {"envs": 7, "execute_steps": 3, "image_size": (24, 40), "seed": 1, "phase_in_state": True}
    assert defaults(run) == want
    run.config.evaluation = None
    want = {"envs": 32, "execute_steps": 5, "image_size": (32, 32), "seed": 1, "phase_in_state": False}
    assert defaults(run) == want


def test_an_unknown_task_is_one_error_line(demo_run, subprocess_env, repo_root):
    out = subprocess.run(
        [sys.executable, "-m", "embodied_jax.evaluate", str(demo_run), "--task", "fly"],
        env=subprocess_env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=repo_root,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: unknown task 'fly': built-in tasks are ['handover', 'pick_place', 'reach'], metaworld:<task>|mt10|mt50 "
        "for Meta-World, or playground:<Env> for a MuJoCo Playground manipulation env (e.g. playground:PandaPickCube)"
    ]


def _bad_input(args, capsys) -> str:
    assert main(args) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: "), errors
    return errors[0]


def test_bad_input_is_one_error_line(demo_run, tmp_path, capsys):
    assert "--envs 0" in _bad_input([str(demo_run), "--task", "reach", "--envs", "0"], capsys)
    (tmp_path / "checkpoints").mkdir()
    assert "no checkpoint steps" in _bad_input([str(tmp_path), "--task", "reach"], capsys)
    assert "holds steps [4]" in _bad_input([str(demo_run), "--task", "reach", "--step", "3"], capsys)
    # A task the policy does not fit: handover's robot has two arms (8-dim actions, three cameras).
    line = _bad_input([str(demo_run), "--task", "handover", "--out", str(tmp_path / "out")], capsys)
    assert "takes 8-dim actions, but the policy predicts" in line
    line = _bad_input([str(demo_run), "--task", "reach", "--envs", "2", "--episodes", "3"], capsys)
    assert "--envs 2 and --episodes 3: a built-in task runs them together" in line
    line = _bad_input([str(demo_run), "--task", "reach", "--noise-scale", "-1"], capsys)
    assert "--noise-scale -1.0: must be finite" in line


@pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="Meta-World not installed")
def test_metaworld_tasks_the_policy_cannot_take_are_one_error_line(demo_run, tmp_path, capsys):
    assert "unknown Meta-World task 'juggle'" in _bad_input([str(demo_run), "--task", "metaworld:juggle"], capsys)
    # The demo's policy wants a scene and a wrist camera and has no Meta-World camera: refused before any episode.
    line = _bad_input([str(demo_run), "--task", "metaworld:reach", "--out", str(tmp_path / "out")], capsys)
    assert "Meta-World gives observation.image" in line


@pytest.mark.skipif(importlib.util.find_spec("mujoco_playground") is None, reason="Playground not installed")
def test_a_playground_robot_without_its_assets_is_one_error_line(demo_run, capsys, monkeypatch, tmp_path):
    from embodied_jax.sim import playground

    monkeypatch.setattr(playground, "menagerie_path", lambda: tmp_path / "absent" / "mujoco_menagerie")
    monkeypatch.delenv("MUJOCO_MENAGERIE_DIR", raising=False)
    assert "menagerie_dir" in _bad_input([str(demo_run), "--task", "playground:PandaPickCube"], capsys)


@pytest.mark.skipif(importlib.util.find_spec("mujoco_playground") is not None, reason="Playground is installed")
def test_a_playground_task_without_playground_is_one_error_line(demo_run, capsys):
    assert "pip install playground" in _bad_input([str(demo_run), "--task", "playground:PandaPickCube"], capsys)


# ---------------------------------------------------------------------------------- predict
@pytest.fixture(scope="module")
def bundle(demo_run):
    from embodied_jax import load_policy

    return load_policy(demo_run)


@pytest.fixture(scope="module")
def one(demo_run):
    """One unbatched raw observation: a recorded frame of the run's dataset."""
    from embodied_jax.data.lerobot import LeRobotDataset

    frame = LeRobotDataset(demo_run / "dataset").frame(0, 0)
    return {STATE: frame[STATE], SCENE: frame[SCENE], WRIST: frame[WRIST], "task": frame["task"]}


def _batch(raw: dict, n: int) -> dict:
    return {k: ([v] * n if k == "task" else np.stack([v] * n)) for k, v in raw.items()}


def test_predict_keeps_the_observations_batching(bundle, one):
    horizon, dim = bundle.config.model.action_horizon, bundle.action_dim
    key = jax.random.key(5)
    single = bundle.predict(one, rng=key)
    assert single.shape == (horizon, dim) and single.dtype == np.float32
    np.testing.assert_array_equal(single, bundle.predict(_batch(one, 1), rng=key)[0])
    assert bundle.predict(_batch(one, 2), rng=key).shape == (2, horizon, dim)
    assert bundle.predict({**_batch(one, 2), "task": one["task"]}, rng=key).shape == (2, horizon, dim)  # one task
    with pytest.raises(ObservationError, match=rf"mixes batched keys \['{SCENE}'\] with unbatched keys"):
        bundle.predict({**one, SCENE: one[SCENE][None]})
    with pytest.raises(ObservationError, match=r"mixes batched keys \['task'\]"):
        bundle.predict({**one, "task": [one["task"]]})


def test_a_noise_scale_given_at_loading_replaces_the_runs_and_names_its_report(demo_run, bundle, one):
    from embodied_jax import load_policy
    from embodied_jax.evaluation.cli import report_dir

    assert bundle.config.model.noise_scale == 1.0
    centre = load_policy(demo_run, model_edits={"noise_scale": 0.0})
    assert centre.config.model.noise_scale == 0.0
    first, second = (centre.predict(one, rng=jax.random.key(k)) for k in (1, 2))
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, bundle.predict(one, rng=jax.random.key(1)))
    with pytest.raises(ValueError, match="has no \\['noise'\\]"):
        load_policy(demo_run, model_edits={"noise": 0.0})
    assert report_dir(demo_run, "metaworld:mt10", 4, noise_scale=0.0).name == "metaworld-mt10-step4-noise0"
    assert report_dir(demo_run, "reach", 4).name == "reach-step4"


def test_predict_names_each_bad_input(bundle, one):
    assert bundle.image_size == (32, 32) and bundle.state_dim == len(one[STATE])
    wider, dim = np.zeros((40, 40, 3), np.uint8), bundle.state_dim
    cases = [
        (
            {k: v for k, v in one.items() if k != WRIST},
            rf"lacks \['{WRIST}'\]; .* needs \['{STATE}', 'task', '{SCENE}', '{WRIST}'\]",
        ),
        (
            {**one, SCENE: wider},
            rf"{SCENE}: expected images of the policy's input size \[32, 32, 3\], got shape \(40, 40, 3\)",
        ),
        ({**one, SCENE: np.zeros((32, 32, 4), np.uint8)}, rf"{SCENE}: expected an RGB image \[H, W, 3\]"),
        ({**one, STATE: np.zeros(dim + 1, np.float32)}, rf"{STATE}: expected {dim} values per state"),
        ({**one, STATE: np.full(dim, np.nan, np.float32)}, rf"{STATE} holds {dim} non-finite values \(of {dim}\)"),
        ({**one, STATE: np.zeros(dim, bool)}, rf"{STATE}: expected real numbers"),
        ({**one, WRIST: one[WRIST].astype(np.int16)}, rf"{WRIST}: images must be uint8"),
        ({**one, "task": 3}, r"task: expected the instruction as a str"),
    ]
    for bad, message in cases:
        with pytest.raises(ObservationError, match=message):
            bundle.predict(bad)
    # Another size is taken when asked for, resized with padding as the training pipeline resized its frames.
    assert bundle.predict({**one, SCENE: wider}, resize=True).shape == (
        bundle.config.model.action_horizon,
        bundle.action_dim,
    )


def test_time_keys_reach_the_transform_as_in_training_and_are_checked(bundle, one, demo_run, monkeypatch):
    """``frame_index`` and ``timestamp`` are optional: checked like every key, handed to the per-sample
    transform with the types every training sample had them in, and accepted by the server's checks."""
    from embodied_jax.data.lerobot import LeRobotDataset
    from embodied_jax.data.samples import SampleLoader, SampleSpec

    trained = SampleLoader(LeRobotDataset(demo_run / "dataset"), SampleSpec(action_horizon=2)).sample(0, 0)
    seen = []
    transform = SampleTransform.__call__

    def spy(self, sample, rng=None):
        seen.append({k: sample[k] for k in ("frame_index", "timestamp") if k in sample})
        return transform(self, sample, rng)

    monkeypatch.setattr(SampleTransform, "__call__", spy)
    timed = {**one, "frame_index": 3, "timestamp": 0.3}
    key = jax.random.key(1)
    # The model ignores them: the same actions.
    np.testing.assert_array_equal(bundle.predict(timed, rng=key), bundle.predict(one, rng=key))
    assert seen[0] == {"frame_index": 3, "timestamp": np.float32(0.3)} and seen[1] == {}
    for name in ("frame_index", "timestamp"):
        assert type(seen[0][name]) is type(trained[name]), name
    seen.clear()
    bundle.predict({**_batch(one, 2), "frame_index": np.asarray([0, 5], np.int32)})
    assert [s["frame_index"] for s in seen] == [0, 5]
    bundle.check_observation(timed, batched=False)  # what the server checks: known keys
    cases = [
        ({**one, "frame_index": 1.5}, r"frame_index: expected integers"),
        ({**one, "frame_index": -1}, r"frame_index: expected finite values >= 0"),
        ({**one, "timestamp": np.nan}, r"timestamp: expected finite values >= 0"),
        ({**one, "timestamp": "now"}, r"timestamp: expected real numbers"),
        ({**one, "frame_index": [1, 2]}, r"mixes batched keys \['frame_index'\] with unbatched keys"),
        ({**_batch(one, 2), "frame_index": [1, 2, 3]}, r"frame_index: the observation has 2 states but 3 values"),
    ]
    for bad, message in cases:
        with pytest.raises(ObservationError, match=message):
            bundle.predict(bad)
