"""Meta-World's scripted policies collected as LeRobot data in the hub dataset's layout: features,
replay from the episode seed, workers, per-task settings, resumption, DART calibration."""

import sys

import numpy as np
import pytest

from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.sim import metaworld

pytest.importorskip("metaworld", reason=f"Meta-World is installed without its pins: {metaworld.INSTALL}")

SIZE, STEPS = 32, 40


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    """Two pick-place episodes of at most 40 steps at 32 px, through the collection command line."""
    from embodied_jax.sim import collect

    root = tmp_path_factory.mktemp("mw") / "pick-place"
    argv = ["metaworld:pick-place", "--episodes", "2", "--out", str(root), "--image-size", str(SIZE)]
    assert collect.main([*argv, "--noise", "0", "--keep-failures", "--max-steps", str(STEPS)]) == 0
    return LeRobotDataset(root)


def test_collected_dataset_has_the_hub_datasets_features_shapes_dtypes_and_fps(collected):
    ds = collected
    assert ds.num_episodes == 2 and 2 <= ds.num_frames <= 2 * STEPS
    assert ds.camera_keys == (metaworld.IMAGE_KEY,)
    assert ds.info["robot_type"] == "metaworld" and ds.fps == metaworld.FPS == 80
    assert ds.info["codebase_version"] == "v3.0"
    features = {key: (f["dtype"], f["shape"]) for key, f in ds.features.items()}
    expected = dict(metaworld.HUB_FEATURES)
    expected[metaworld.IMAGE_KEY] = ("image", [3, SIZE, SIZE])  # the hub's 480, collected here at 32
    assert features == expected
    assert list(ds.tasks) == [metaworld.LEROBOT_DESCRIPTIONS["pick-place"]] == ["Pick and place a puck to a goal"]
    actions = ds.episode_array(0, "action")
    assert np.all(np.abs(actions) <= 1.0)
    env_state = ds.episode_array(0, metaworld.ENV_STATE_KEY)
    assert env_state.shape == (len(actions), 39)
    np.testing.assert_allclose(env_state[:, :4], ds.episode_array(0, metaworld.STATE_KEY), atol=1e-6)
    assert set(np.unique(ds.episode_array(0, metaworld.TASK_ID_KEY)).tolist()) == {31}  # LeRobot's pick-place-v3
    assert metaworld.task_id("window-open") == 48 and metaworld.task_id("window-close") == 49  # not sorted there
    rewards = ds.episode_array(0, metaworld.REWARD_KEY)
    assert rewards.shape == (len(actions),) and np.all(np.isfinite(rewards)) and rewards.max() > 0
    # The environment state is data only: a Meta-World run reads the image, the 4-D state and the actions.
    from experiments.metaworld import metaworld_config

    spec = metaworld_config().data.pipeline.spec
    read = {*spec.state_keys, *spec.action_keys, *spec.extra_keys, *spec.camera_keys}
    assert read == {metaworld.STATE_KEY, metaworld.ACTION_KEY, metaworld.IMAGE_KEY}


def test_frames_and_states_replay_from_the_episode_seed(collected):
    """Episode 0 of the collection seed resets to the same state again: its first frame read back
    equals a fresh render of it (lossless storage), and the state matches the end-effector."""
    env = metaworld.MetaWorldEnv("pick-place", (SIZE, SIZE))
    try:
        env.reset(metaworld.episode_seed(metaworld.COLLECTION_SEED, "pick-place", 0))
        np.testing.assert_array_equal(collected.images(0, metaworld.IMAGE_KEY, [0])[0], env.render())
        np.testing.assert_allclose(collected.episode_array(0, "observation.state")[0], env.state(), atol=1e-6)
        first = env.render()
        env.reset(metaworld.episode_seed(metaworld.TEST_SEED, "pick-place", 0))  # the test seed: another start
        assert not np.array_equal(first, env.render())
    finally:
        env.close()


def test_tasks_collected_in_parallel_make_the_same_dataset(tmp_path):
    from embodied_jax.data.lerobot import LeRobotDataset

    kwargs = dict(view=metaworld.View((SIZE, SIZE)), max_steps=6, keep_failures=True, log=lambda line: None)
    serial = LeRobotDataset(metaworld.collect(["reach", "push"], 1, tmp_path / "serial", **kwargs))
    parallel = LeRobotDataset(metaworld.collect(["reach", "push"], 1, tmp_path / "parallel", workers=2, **kwargs))
    assert list(parallel.tasks) == list(serial.tasks) and parallel.num_frames == serial.num_frames == 12
    for episode in range(2):
        for key in (metaworld.ACTION_KEY, metaworld.ENV_STATE_KEY):
            np.testing.assert_array_equal(parallel.episode_array(episode, key), serial.episode_array(episode, key))
        np.testing.assert_array_equal(
            parallel.images(episode, metaworld.IMAGE_KEY, [5]), serial.images(episode, metaworld.IMAGE_KEY, [5])
        )
    from embodied_jax.sim.metaworld.collect import check_memory

    with pytest.raises(metaworld.MetaWorldError, match="smaller --image-size"):  # MT50 at LeRobot's 480 px
        check_memory(50, 50, (480, 480), available=24 * 2**30)
    check_memory(50, 50, (64, 64), available=24 * 2**30)


def test_some_tasks_collected_with_their_own_count_and_noise(tmp_path):
    from embodied_jax.data.lerobot import LeRobotDataset

    names = ("reach", "push", "pick-place")
    assert metaworld.parse_task_data(["push=3@auto", "pick-place=2@0.3", "reach=4"], names) == {
        "push": (3, None),
        "pick-place": (2, 0.3),
        "reach": (4, 0.0),
    }
    for bad in ("door-open=3", "push=0", "push=3@-1", "push=three", "push", "push=2@loud"):
        with pytest.raises(metaworld.MetaWorldError, match="TASK=EPISODES@NOISE"):
            metaworld.parse_task_data([bad], names)
    with pytest.raises(metaworld.MetaWorldError, match="twice"):
        metaworld.parse_task_data(["push=2", "push=3"], names)
    # A difficulty group sets the run's tasks in it (pick-place and push are "hard"); a task overrides its group.
    assert metaworld.parse_task_data(["hard=5@auto", "push=2"], names) == {"push": (2, 0.0), "pick-place": (5, None)}
    with pytest.raises(metaworld.MetaWorldError, match="TASK=EPISODES@NOISE"):
        metaworld.parse_task_data(["very_hard=5"], names)  # a group with none of the run's tasks
    with pytest.raises(metaworld.MetaWorldError, match="twice"):
        metaworld.parse_task_data(["hard=5", "mt10=2"], names)
    kwargs = dict(view=metaworld.View((SIZE, SIZE)), max_steps=4, keep_failures=True, log=lambda line: None)
    ds = LeRobotDataset(
        metaworld.collect(["reach", "push"], 1, tmp_path / "ds", task_data={"push": (2, 0.5)}, **kwargs)
    )
    ids = [int(ds.episode_array(e, metaworld.TASK_ID_KEY)[0]) for e in range(ds.num_episodes)]
    assert ids == [metaworld.task_id("reach"), metaworld.task_id("push"), metaworld.task_id("push")]
    clean = LeRobotDataset(metaworld.collect(["push"], 1, tmp_path / "clean", **kwargs))
    noisy = ds.episode_array(1, metaworld.ACTION_KEY)  # push's first episode, from the same reset seed
    assert np.abs(noisy - clean.episode_array(0, metaworld.ACTION_KEY)).max() > 0.05
    with pytest.raises(metaworld.MetaWorldError, match="outside the collection"):
        metaworld.collect(["reach"], 1, tmp_path / "x", task_data={"push": (2, 0.0)}, **kwargs)


def test_an_interrupted_collection_resumes_with_the_tasks_it_had_not_finished(tmp_path, monkeypatch):
    collect_module = sys.modules["embodied_jax.sim.metaworld.collect"]  # the package's `collect` is the function
    kwargs = dict(view=metaworld.View((SIZE, SIZE)), max_steps=4, keep_failures=True)
    whole = LeRobotDataset(metaworld.collect(["reach", "push"], 1, tmp_path / "whole", log=lambda line: None, **kwargs))
    collected, task_of = [], collect_module._collect_task

    def failing_on_push(job):
        if job.task == "push":
            raise RuntimeError("interrupted")
        collected.append(job.task)
        return task_of(job)

    monkeypatch.setattr(collect_module, "_collect_task", failing_on_push)
    with pytest.raises(RuntimeError, match="interrupted"):
        metaworld.collect(["reach", "push"], 1, tmp_path / "ds", log=lambda line: None, **kwargs)
    assert collected == ["reach"] and len(list((tmp_path / "ds.parts").iterdir())) == 1
    monkeypatch.setattr(collect_module, "_collect_task", lambda job: (collected.append(job.task), task_of(job))[1])
    lines = []
    resumed = LeRobotDataset(metaworld.collect(["reach", "push"], 1, tmp_path / "ds", log=lines.append, **kwargs))
    assert collected == ["reach", "push"] and any("reach: reused" in line for line in lines)
    assert not (tmp_path / "ds.parts").exists()
    for key in (metaworld.ACTION_KEY, metaworld.ENV_STATE_KEY, metaworld.TASK_ID_KEY):
        for episode in range(2):
            np.testing.assert_array_equal(resumed.episode_array(episode, key), whole.episode_array(episode, key))
    # Other settings for a task do not reuse its part.
    assert metaworld.collect(["reach"], 2, tmp_path / "more", log=lines.append, **kwargs)


def test_scripted_policy_and_dart_calibration():
    chosen, measured = metaworld.calibrate_noise("reach", levels=(0.1, 50.0), episodes=4)
    assert chosen == 0.1 and measured[0.1] == 1.0 and measured[50.0] < 0.9


def test_a_run_on_the_hubs_480_px_frames_is_evaluated_on_lerobots_frames(collected):
    """A dataset not collected by the run (the hub's, copied in): its frame size is read from its
    info.json (the hub states CHW) and the evaluation renders at it, in LeRobot's style at 480."""
    from experiments.metaworld import dataset_image_size, evaluation_for_frames, metaworld_mt50

    assert dataset_image_size(collected.root) == (SIZE, SIZE)
    evaluation = metaworld_mt50().evaluation
    hub = evaluation_for_frames(evaluation, metaworld.LEROBOT_IMAGE_SIZE)
    assert hub.image_size == (480, 480) and hub.render_style == "lerobot"
    assert evaluation_for_frames(evaluation, tuple(evaluation.image_size)) is evaluation
    assert evaluation_for_frames(evaluation, (96, 96)).render_style == evaluation.render_style == "fast"


def test_a_run_collected_at_another_size_is_evaluated_at_that_size(collected):
    """Frames collected at --data.pipeline.image-size (here the fixture's) are what the run's
    evaluations render, whatever the evaluation's own default (64 px): a 128 px run failed at its
    first in-training evaluation with 64 px frames."""
    import dataclasses

    from experiments.metaworld import metaworld_mt50, run_evaluation

    config = metaworld_mt50()
    config = dataclasses.replace(
        config, evaluation=dataclasses.replace(config.evaluation, image_size=(2 * SIZE, 2 * SIZE))
    )
    evaluation = run_evaluation(config, collected.root)
    assert tuple(evaluation.image_size) == (SIZE, SIZE) and evaluation.tasks == config.tasks
