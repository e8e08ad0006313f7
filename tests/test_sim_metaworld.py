"""Meta-World through the project: its scripted policies collected as LeRobot data, read back,
a policy evaluated closed-loop in its own environments, the weld adaptation, the suite names."""

import inspect
import json
import pathlib
import sys

import numpy as np
import pytest

from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.sim import metaworld

pytest.importorskip("metaworld", reason=f"Meta-World is installed without its pins: {metaworld.INSTALL}")

SIZE, STEPS = 32, 40


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """One pick-place episode of at most 40 steps at 32 px, through the collection command line."""
    from embodied_jax.sim import collect

    root = tmp_path_factory.mktemp("mw") / "pick-place"
    argv = ["metaworld:pick-place", "--episodes", "1", "--out", str(root), "--image-size", str(SIZE)]
    assert collect.main([*argv, "--noise", "0", "--keep-failures", "--max-steps", str(STEPS)]) == 0
    return LeRobotDataset(root)


def test_collected_episode_has_lerobots_metaworld_layout(collected):
    ds = collected
    assert ds.num_episodes == 1 and 1 <= ds.num_frames <= STEPS
    assert ds.camera_keys == (metaworld.IMAGE_KEY,)
    assert ds.features["observation.state"]["shape"] == [4] and ds.features["action"]["shape"] == [4]
    assert ds.info["robot_type"] == "sawyer" and ds.fps == metaworld.FPS
    assert list(ds.tasks) == [metaworld.INSTRUCTIONS["pick-place"]]
    actions = ds.episode_array(0, "action")
    assert np.all(np.abs(actions) <= 1.0)


def test_frames_and_states_replay_from_the_episode_seed(collected):
    """Episode 0 of seed 0 resets to the same state again: its first frame read back equals a
    fresh render of it (lossless storage), and the state matches the end-effector."""
    env = metaworld.MetaWorldEnv("pick-place", (SIZE, SIZE))
    try:
        env.reset(metaworld.episode_seed(0, "pick-place", 0))
        np.testing.assert_array_equal(collected.images(0, metaworld.IMAGE_KEY, [0])[0], env.render())
        np.testing.assert_allclose(collected.episode_array(0, "observation.state")[0], env.state(), atol=1e-6)
        first = env.render()
        env.reset(metaworld.episode_seed(1, "pick-place", 0))  # evaluation's seed: another start
        assert not np.array_equal(first, env.render())
    finally:
        env.close()
    assert metaworld.episode_seed(0, "reach", 3) != metaworld.episode_seed(1, "reach", 3)


def test_scripted_policy_solves_reach_and_dart_calibration_is_printed(capsys):
    env = metaworld.MetaWorldEnv("reach", (SIZE, SIZE))
    try:
        result = metaworld.expert_episode(env, metaworld.episode_seed(0, "reach", 0), record=False)
    finally:
        env.close()
    assert result.success and result.length < metaworld.STEP_LIMIT
    chosen, measured = metaworld.calibrate_noise("reach", levels=(0.1, 50.0), episodes=4)
    assert chosen == 0.1 and measured[0.1] == 1.0 and measured[50.0] < 0.9


class RecordingPolicy:
    """A tiny policy: constant chunks; it records what it was given."""

    def __init__(self, horizon=8):
        self.horizon, self.calls, self.images, self.frames = horizon, [], [], []

    def __call__(self, batch, seed):
        self.calls.append((jsonable(batch), seed))
        self.images.append(batch["observation.image"])
        self.frames.append(batch["frame_index"].tolist())
        return np.zeros((len(batch["task"]), self.horizon, 4), np.float32)


def jsonable(batch):
    return {k: (v.shape, str(v.dtype)) if hasattr(v, "shape") else list(v) for k, v in batch.items()}


def test_evaluation_runs_in_metawords_environments_and_reports(tmp_path):
    policy = RecordingPolicy()
    settings = metaworld.EvalSettings(episodes=1, envs=1, execute_steps=4, seed=1, videos=1, limit=20)
    metrics = metaworld.evaluate(policy, "metaworld:pick-place", settings, image_size=(SIZE, SIZE), out_dir=tmp_path)
    assert len(policy.calls) == 5  # one batched call per decision: 20 steps / 4
    shapes, _ = policy.calls[0]
    assert shapes["observation.image"] == ((1, SIZE, SIZE, 3), "uint8")
    assert shapes["observation.state"] == ((1, 4), "float32")
    assert shapes["task"] == [metaworld.INSTRUCTIONS["pick-place"]]
    assert policy.frames == [[0], [4], [8], [12], [16]]  # each decision's step since reset, as a robot sends it
    task = metrics["per_task"]["pick-place"]
    assert task["episodes"] == 1 and task["success_rate"] == 0.0 and task["mean_episode_length"] == 20
    assert metrics["per_difficulty"]["hard"]["episodes"] == 1 and metrics["success_ci95"][1] < 1.0
    assert all(pathlib.Path(v).stat().st_size > 0 for v in metrics["videos"])
    assert pathlib.Path(metrics["frame_grid"]).stat().st_size > 0
    # Reproducible from its seed: the same observations, and the same policy seeds, again.
    again = RecordingPolicy()
    metaworld.evaluate(again, "metaworld:pick-place", settings, image_size=(SIZE, SIZE))
    assert [seed for _, seed in again.calls] == [seed for _, seed in policy.calls]
    for first, second in zip(policy.images, again.images, strict=True):
        np.testing.assert_array_equal(first, second)


def test_evaluation_steps_several_environments_per_policy_call():
    policy = RecordingPolicy()
    settings = metaworld.EvalSettings(episodes=3, envs=2, execute_steps=8, seed=2, videos=0, limit=8)
    metrics = metaworld.evaluate(policy, "metaworld:reach", settings, image_size=(SIZE, SIZE))
    assert metrics["episodes"] == 3
    # Two groups (2 + 1 environments), one decision each; every call has the same batch of 2 rows.
    assert [shapes["observation.image"][0][0] for shapes, _ in policy.calls] == [2, 2]


def test_suites_and_task_names():
    assert len(metaworld.MT50) == 50 and len(metaworld.MT10) == 10
    assert set(metaworld.MT10) <= set(metaworld.MT50)
    assert sorted(t for group in metaworld.DIFFICULTY.values() for t in group) == list(metaworld.MT50)
    assert metaworld.parse_tasks("metaworld:mt10") == metaworld.MT10
    assert metaworld.parse_tasks("metaworld:pick-place-v3,reach") == ("pick-place", "reach")
    for bad in ("metaworld:", "metaworld:juggle", "pick-place"):
        with pytest.raises(metaworld.MetaWorldError):
            metaworld.parse_tasks(bad)


def test_weld_adaptation_fits_this_metaworld_and_refuses_a_changed_one():
    import metaworld.sawyer_xyz_env as sawyer
    import mujoco

    metaworld.adapt()
    model = mujoco.MjModel.from_xml_string(metaworld.env._WELD_PROBE)
    assert model.eq_data.shape[1] == 12  # mujoco 3.17: one more value per weld than Meta-World writes
    assert sawyer.SawyerMocapBase.reset_mocap_welds is metaworld.env._reset_mocap_welds
    original = inspect.getsource(metaworld.adapted_from())
    metaworld.check_adaptable(original, 12)  # the installed source writes the 11 values adapted
    changed = original.replace("5.0", "6.0")
    with pytest.raises(metaworld.MetaWorldError, match="reset_mocap_welds"):
        metaworld.check_adaptable(changed, 12)
    with pytest.raises(metaworld.MetaWorldError, match="fewer"):
        metaworld.check_adaptable(original, 10)


def test_missing_metaworld_and_gl_are_one_clear_error(monkeypatch):
    metaworld.adapt.cache_clear()
    monkeypatch.setitem(sys.modules, "metaworld", None)
    with pytest.raises(metaworld.MetaWorldError, match="--no-deps metaworld"):
        metaworld.adapt()
    monkeypatch.undo()
    metaworld.adapt.cache_clear()
    metaworld.adapt()

    metaworld.check_gl.cache_clear()
    monkeypatch.setenv("MUJOCO_GL", "osmesa")
    import mujoco.rendering.classic.gl_context as gl_context

    saved = gl_context.GLContext

    class Broken:
        def __init__(self, *args):
            raise OSError("libOSMesa.so: cannot open shared object file")

    import importlib

    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: type("M", (), {"GLContext": Broken}))
    try:
        with pytest.raises(metaworld.MetaWorldError, match="apt-get install -y libosmesa6"):
            metaworld.check_gl()
    finally:
        monkeypatch.setattr(importlib, "import_module", real_import)
        gl_context.GLContext = saved
        metaworld.check_gl.cache_clear()
        monkeypatch.undo()


def test_learning_curve_plots_every_in_training_success_rate(tmp_path):
    from PIL import Image

    from embodied_jax.sim import media
    from experiments.metaworld import plot_learning_curve

    rows = [
        {"step": 100, "loss": 1.0},
        {"step": 1500, "eval/metaworld/success_rate": 0.2, "eval/metaworld/reach/success_rate": 0.4},
        {"step": 3000, "eval/metaworld/success_rate": 0.6, "eval/metaworld/reach/success_rate": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    path = plot_learning_curve(tmp_path / "metrics.jsonl", tmp_path / "curve.png", media)
    image = np.asarray(Image.open(path))
    assert image.shape == (400, 860, 3)
    blue = np.all(image == media.PLOT_COLORS[0], axis=-1)  # the overall series, drawn thicker
    assert blue.sum() > 200 and blue[:, :48].sum() == 0  # on the plot, not over the y labels
    assert plot_learning_curve(tmp_path / "absent.jsonl", tmp_path / "none.png", media) is None
