"""Meta-World through the project: LeRobot's environment and frames, a policy evaluated closed-loop
in its own environments, the weld adaptation, the suite names and the protocol (collection:
test_metaworld_collect.py)."""

import inspect
import json
import pathlib
import sys

import numpy as np
import pytest

from embodied_jax.sim import metaworld

pytest.importorskip("metaworld", reason=f"Meta-World is installed without its pins: {metaworld.INSTALL}")

SIZE, STEPS = 32, 40


def test_each_purpose_has_its_own_reset_seeds():
    """Collection, calibration, validation and test never start an episode from the same seed."""
    purposes = (
        metaworld.COLLECTION_SEED,
        metaworld.CALIBRATION_SEED,
        metaworld.VALIDATION_SEED,
        metaworld.TEST_SEED,
    )
    assert len(set(purposes)) == 4
    seeds = [{metaworld.episode_seed(p, task, i) for task in metaworld.MT10 for i in range(60)} for p in purposes]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not seeds[a] & seeds[b], (purposes[a], purposes[b])
    assert metaworld.EvalSettings().seed == metaworld.TEST_SEED
    from embodied_jax.evaluation.in_training import MetaWorldEvaluation

    assert MetaWorldEvaluation().seed == metaworld.VALIDATION_SEED  # in-training: choosing, not reporting


def test_a_frame_is_lerobots_pixel_for_pixel():
    """pick-place reset from one seed and rendered through the project, against the same frame made
    the way LeRobot's wrapper (``lerobot/envs/metaworld.py``) makes it, written out here."""
    import metaworld as mw

    seed = metaworld.episode_seed(metaworld.TEST_SEED, "pick-place", 0)
    env = metaworld.MetaWorldEnv("pick-place", metaworld.LEROBOT_IMAGE_SIZE, render_style="lerobot")
    try:
        env.reset(seed)
        ours = env.render()
    finally:
        env.close()

    metaworld.adapt()  # the weld width of this MuJoCo (mujoco 3.17), as the project installs it
    mt1 = mw.MT1("pick-place-v3", seed=42)
    theirs_env = mt1.train_classes["pick-place-v3"](render_mode="rgb_array", camera_name="corner2")
    try:
        theirs_env.set_task(mt1.train_tasks[0])
        theirs_env.model.cam_pos[2] = [0.75, 0.075, 0.7]
        theirs_env.reset()
        theirs_env._freeze_rand_vec = False
        theirs_env.seeded_rand_vec = True
        theirs_env.seed(seed)
        theirs_env.reset(seed=seed)
        theirs = np.flip(theirs_env.render(), (0, 1))
    finally:
        theirs_env.close()
    assert ours.shape == theirs.shape == (480, 480, 3)
    np.testing.assert_array_equal(ours, theirs)
    # The fast style: the same camera and scene without shadows, reflections and skybox.
    fast = metaworld.MetaWorldEnv("pick-place", (48, 48))
    try:
        fast.reset(seed)
        assert fast.render().shape == (48, 48, 3)
    finally:
        fast.close()


def test_a_crop_is_that_window_of_the_whole_frame_and_bad_windows_are_refused():
    """``crop=(top, left, size)``: the frame rendered at ``image_size / size``, then that window."""
    seed = metaworld.episode_seed(metaworld.VALIDATION_SEED, "reach", 0)
    frames = {}
    for crop, size in (((0.25, 0.5, 0.5), (32, 32)), (None, (64, 64))):
        env = metaworld.MetaWorldEnv("reach", size, crop=crop)
        try:
            env.reset(seed)
            frames[crop] = env.render()
        finally:
            env.close()
    window = frames[(0.25, 0.5, 0.5)]
    assert window.shape == (32, 32, 3)
    np.testing.assert_array_equal(window, frames[None][16:48, 32:64])
    for bad in ((0.6, 0.0, 0.5), (0.0, 0.0, 0.0), (0.1, 0.1)):
        with pytest.raises(metaworld.MetaWorldError, match="crop"):
            metaworld.MetaWorldEnv("reach", (32, 32), crop=bad)


def test_camera_pos_moves_corner2_only_when_asked_and_bad_positions_are_refused():
    """``camera_pos``: corner2 placed there instead of LeRobot's pose (a lever, never the default)."""
    import mujoco

    seed = metaworld.episode_seed(metaworld.VALIDATION_SEED, "reach", 0)
    frames, placed = {}, {}
    for pos in (None, metaworld.CAMERA_POS, metaworld.METAWORLD_CAMERA_POS):
        env = metaworld.MetaWorldEnv("reach", (32, 32), camera_pos=pos)
        try:
            env.reset(seed)
            frames[pos], model = env.render(), env._env.model
            placed[pos] = tuple(model.cam_pos[mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, metaworld.CAMERA)])
        finally:
            env.close()
    assert placed[None] == pytest.approx(metaworld.CAMERA_POS)
    assert placed[metaworld.METAWORLD_CAMERA_POS] == pytest.approx(metaworld.METAWORLD_CAMERA_POS)
    np.testing.assert_array_equal(frames[None], frames[metaworld.CAMERA_POS])
    assert np.abs(frames[None].astype(int) - frames[metaworld.METAWORLD_CAMERA_POS]).mean() > 5
    for bad in ((1.0, 2.0), ("a", 0, 0), (0.0, float("nan"), 1.0)):
        with pytest.raises(metaworld.MetaWorldError, match="camera_pos"):
            metaworld.MetaWorldEnv("reach", (32, 32), camera_pos=bad)


def test_a_runs_view_reaches_the_evaluation_and_the_rl_environments():
    """One ``View`` (size, render style, window, camera, prompts) from the run's config to every
    environment made for it: in-training evaluation and RL's host-stepped batch alike."""
    from embodied_jax.evaluation.in_training import MetaWorldEvaluation

    run = MetaWorldEvaluation(
        tasks="metaworld:reach",
        image_size=(24, 24),
        prompts="project",
        render_style="lerobot",
        crop=(0.1, 0.3, 0.6),
        camera_pos=metaworld.METAWORLD_CAMERA_POS,
    )
    view = run.view()
    assert view == metaworld.View((24, 24), "project", "lerobot", (0.1, 0.3, 0.6), metaworld.METAWORLD_CAMERA_POS)
    assert run.settings().view == view
    batch = metaworld.MetaWorldBatch(("reach",), 2, view)
    try:
        assert [env.view for env in batch.envs] == [view, view]
        assert batch.envs[0].render_style == "lerobot" and batch.instructions == (metaworld.INSTRUCTIONS["reach"],)
    finally:
        batch.close()
    for bad, field in (
        ({"prompts": "mine"}, "prompts"),
        ({"image_size": (0, 8)}, "image_size"),
        ({"render_style": "x"}, "render_style"),
    ):
        with pytest.raises(metaworld.MetaWorldError, match=field):
            metaworld.View(**bad)


def test_protocol_limit_termination_and_prompts():
    """500 steps (Meta-World's max_path_length), the first success ends an episode, LeRobot's prompts
    by default and the project's on request."""
    assert metaworld.STEP_LIMIT == 500 == metaworld.EvalSettings().limit
    env = metaworld.MetaWorldEnv("reach", (SIZE, SIZE))
    try:
        assert env.max_path_length == metaworld.STEP_LIMIT
        assert env.instruction == "Reach a goal position"
        result = metaworld.expert_episode(env, metaworld.episode_seed(0, "reach", 0), record=True)
    finally:
        env.close()
    assert result.success and result.length < metaworld.STEP_LIMIT
    success = result.episode[metaworld.SUCCESS_KEY]
    assert success[-1] and not success[:-1].any()  # ended by its first success
    project = metaworld.MetaWorldEnv("reach", (SIZE, SIZE), prompts="project")
    try:
        assert project.instruction == metaworld.INSTRUCTIONS["reach"]
    finally:
        project.close()
    with pytest.raises(metaworld.MetaWorldError, match="prompts"):
        metaworld.prompt("reach", "mine")
    with pytest.raises(ValueError, match="max_path_length|ends its episodes"):
        metaworld.evaluate(RecordingPolicy(), "metaworld:reach", metaworld.EvalSettings(episodes=1, envs=1, limit=501))


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
    settings = metaworld.EvalSettings(
        episodes=1, envs=1, execute_steps=4, videos=1, limit=20, view=metaworld.View((SIZE, SIZE))
    )
    metrics = metaworld.evaluate(policy, "metaworld:pick-place", settings, out_dir=tmp_path)
    assert len(policy.calls) == 5  # one batched call per decision: 20 steps / 4
    shapes, _ = policy.calls[0]
    assert shapes["observation.image"] == ((1, SIZE, SIZE, 3), "uint8")
    assert shapes["observation.state"] == ((1, 4), "float32")
    assert shapes["task"] == [metaworld.LEROBOT_DESCRIPTIONS["pick-place"]]
    assert policy.frames == [[0], [4], [8], [12], [16]]  # each decision's step since reset, as a robot sends it
    task = metrics["per_task"]["pick-place"]
    assert task["episodes"] == 1 and task["success_rate"] == 0.0 and task["mean_episode_length"] == 20
    assert metrics["per_difficulty"]["hard"]["episodes"] == 1 and metrics["success_ci95"][1] < 1.0
    assert metrics["group_average"] == 0.0
    assert all(pathlib.Path(v).stat().st_size > 0 for v in metrics["videos"])
    assert pathlib.Path(metrics["frame_grid"]).stat().st_size > 0
    # Reproducible from its seed: the same observations, and the same policy seeds, again.
    again = RecordingPolicy()
    metaworld.evaluate(again, "metaworld:pick-place", settings)
    assert [seed for _, seed in again.calls] == [seed for _, seed in policy.calls]
    for first, second in zip(policy.images, again.images, strict=True):
        np.testing.assert_array_equal(first, second)


def test_evaluation_steps_several_environments_per_policy_call():
    policy = RecordingPolicy()
    settings = metaworld.EvalSettings(
        episodes=3, envs=2, execute_steps=8, seed=2, videos=0, limit=8, view=metaworld.View((SIZE, SIZE))
    )
    metrics = metaworld.evaluate(policy, "metaworld:reach", settings)
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


def test_an_evaluation_can_prompt_with_sentences_the_policy_never_trained_on():
    policy = RecordingPolicy()
    settings = metaworld.EvalSettings(
        episodes=1, envs=1, execute_steps=8, videos=0, limit=8, view=metaworld.View((SIZE, SIZE), "project")
    )
    metaworld.evaluate(policy, "metaworld:push", settings)
    (shapes, _), *_ = policy.calls
    assert shapes["task"] == [metaworld.INSTRUCTIONS["push"]] != [metaworld.LEROBOT_DESCRIPTIONS["push"]]


def test_the_mt50_experiments_follow_lerobots_protocol():
    """MT50: the 50 tasks, 10 test-seed episodes each, LeRobot's prompts and 500-step episodes,
    demonstrations without noise; in-training evaluation on the validation seed; GR00T the same."""
    from experiments.metaworld import metaworld_instructions, metaworld_mt10, metaworld_mt50, metaworld_mt50_gr00t

    for factory in (metaworld_mt50, metaworld_mt50_gr00t):
        config = factory()
        assert metaworld.parse_tasks(config.tasks) == metaworld.MT50
        assert config.eval_episodes == 10 and config.collect_noise == 0.0 and config.prompts == "lerobot"
        assert config.evaluation.seed == metaworld.VALIDATION_SEED and config.evaluation.limit == metaworld.STEP_LIMIT
    assert type(metaworld_mt50_gr00t().model).__name__ == "Gr00tConfig"
    assert metaworld_mt10().eval_episodes == 50
    words = set(" ".join(metaworld_instructions()).split())
    assert {"Pick", "puck", "slide"} <= words  # both prompt sets reach the tokenizer


def test_the_learning_curve_of_mt50_shows_the_difficulty_groups(tmp_path):
    from experiments.metaworld import plot_learning_curve

    rows = [
        {"step": 10, "eval/metaworld/success_rate": 0.1, "eval/metaworld/hard/success_rate": 0.0},
        {"step": 20, "eval/metaworld/success_rate": 0.3, "eval/metaworld/reach/success_rate": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    drawn = []
    spy = type("Media", (), {"line_plot": staticmethod(lambda series, title: drawn.append(series) or title)})
    spy.write_png = staticmethod(lambda out, image: out)
    plot_learning_curve(tmp_path / "metrics.jsonl", tmp_path / "c.png", spy, groups_only=True)
    assert set(drawn[0]) == {"metaworld", "metaworld/hard"}
