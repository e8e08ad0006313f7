"""Expert demonstrations -> LeRobot dataset -> read back by the data layer."""

import numpy as np
import pytest

from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.sim import collect
from embodied_jax.sim import env as env_lib

# The same episode count, image size and execution noise as the demo's end-to-end test: both
# collect through one identical compiled rollout, so the session's compilation cache builds it once.
EPISODES, SIZE, NOISE = 6, 32, 0.015


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos") / "reach"
    # Through the CLI entry point (in-process), exactly as users run it.
    assert (
        collect.main(
            [
                "reach",
                "--episodes",
                str(EPISODES),
                "--out",
                str(root),
                "--image-size",
                str(SIZE),
                "--seed",
                "1",
                "--noise",
                str(NOISE),
            ]
        )
        == 0
    )
    env = env_lib.Env("reach", env_lib.EnvConfig(image_size=(SIZE, SIZE)))
    expected = collect.expert_episodes(env, EPISODES, seed=1, noise=NOISE)
    return LeRobotDataset(root), expected


def test_dataset_has_episodes_states_actions_and_task(dataset):
    ds, expected = dataset
    assert ds.num_episodes == EPISODES
    assert ds.num_frames == sum(len(e["action"]) for e in expected)
    assert ds.fps == 10
    for position, episode in enumerate(expected):
        np.testing.assert_allclose(ds.episode_array(position, "observation.state"), episode["observation.state"])
        np.testing.assert_allclose(ds.episode_array(position, "action"), episode["action"])
        assert ds.task(position, 0) == "move the gripper to the red ball"


def test_frames_decode_close_to_rendered_images(dataset):
    ds, expected = dataset
    for camera in ("scene", "wrist"):
        key = f"observation.images.{camera}"
        frames = ds.images(0, key, range(len(expected[0]["action"])))
        assert frames.shape == expected[0][key].shape == (len(expected[0]["action"]), SIZE, SIZE, 3)
        error = np.abs(frames.astype(int) - expected[0][key].astype(int)).mean()
        assert error < 12, (camera, error)  # lossy H.264, same content
    frame = ds.frame(1, 0)
    assert frame["observation.images.scene"].shape == (SIZE, SIZE, 3)


def test_dataset_has_gr00t_modality_groups(dataset):
    ds, _ = dataset
    assert dict(ds.modality.state) == dict(ds.modality.action) == {"hand": (0, 3), "gripper": (3, 4)}
    assert dict(ds.modality.video) == {"scene": "observation.images.scene", "wrist": "observation.images.wrist"}
    assert dict(ds.modality.annotation) == {"human.task_description": "task_index"}


def test_episodes_end_when_the_expert_succeeds(dataset):
    ds, expected = dataset
    env = env_lib.Env("reach")
    for episode in expected:
        assert 1 <= len(episode["action"]) < env.episode_limit
    # Actions are joint targets inside the joint ranges.
    low, high = (np.asarray(x) for x in env.action_bounds())
    actions = np.concatenate([e["action"] for e in expected])
    assert (actions >= low - 1e-6).all() and (actions <= high + 1e-6).all()


def test_labels_stay_the_experts_under_execution_noise(dataset):
    _, expected = dataset
    from embodied_jax.sim.experts import MAX_STEP

    for episode in expected:
        state, action = episode["observation.state"], episode["action"]
        # Clean expert labels: rate-limited moves from the measured hand position, gripper open.
        # Recorded noisy commands would overshoot MAX_STEP (noise std NOISE on every axis).
        step = np.linalg.norm(action[:, :3] - state[:, :3], axis=-1)
        assert (step <= MAX_STEP + 1e-5).all() and (action[:, 3] == 1.0).all()


def test_compiled_rollouts_are_reused_across_envs_and_bounded(dataset):
    info = collect._build_rollout.cache_info()
    assert info.maxsize == collect.ROLLOUT_CACHE_SIZE and info.currsize <= info.maxsize
    assert info.hits >= 1  # the fixture's second, fresh Env reused the CLI's compiled rollout
    config = env_lib.EnvConfig(image_size=(SIZE, SIZE))
    first = collect._expert_rollout(env_lib.Env("reach", config), 2, 3, 0.0)  # built, not run
    assert collect._expert_rollout(env_lib.Env("reach", config), 2, 3, 0.0) is first
    assert collect._expert_rollout(env_lib.Env("reach", config), 2, 4, 0.0) is not first


def test_cli_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        collect.main(["reach", "--episodes", "2", "--out", str(tmp_path), "--image-size", "1", "2", "3"])
    with pytest.raises(SystemExit):
        collect.main(["juggle", "--episodes", "2", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="episodes"):
        collect.expert_episodes(env_lib.Env("reach"), 0)
