"""Expert demonstrations -> LeRobot dataset -> read back by the data layer."""

import numpy as np
import pytest

from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.sim import collect
from embodied_jax.sim import env as env_lib

# The same episode count, image size, execution noise and phase-in-state as the demo's end-to-end
# test: both collect through one identical compiled rollout, so the session's compilation cache
# builds it once.
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
                "--phase-in-state",
            ]
        )
        == 0
    )
    env = env_lib.Env("reach", env_lib.EnvConfig(image_size=(SIZE, SIZE), phase_in_state=True))
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


def _red_pixels(frames: np.ndarray) -> np.ndarray:
    """Pixels of the reach target (a small red ball: a few pixels at 32 px)."""
    r, g, b = (frames[..., i].astype(int) for i in range(3))
    return (r > 120) & (r > g + 60) & (r > b + 60)


def test_frames_read_back_equal_the_renders_the_policy_sees(dataset, tmp_path):
    """Lossless by default: every frame read back through the data layer is the simulator's
    render of that state, bit for bit, small objects included; H.264 at this size is not."""
    ds, expected = dataset
    assert ds.image_keys == ("observation.images.scene", "observation.images.wrist") and not ds.video_keys
    for position, episode in enumerate(expected):
        for camera in ("scene", "wrist"):
            key = f"observation.images.{camera}"
            frames = ds.images(position, key, range(len(episode["action"])))
            assert frames.shape == episode[key].shape == (len(episode["action"]), SIZE, SIZE, 3)
            np.testing.assert_array_equal(frames, episode[key])
    scene = expected[0]["observation.images.scene"]
    target = _red_pixels(scene[0])
    assert 0 < target.sum() < 20  # the small object is in the frame
    frame = ds.frame(1, 0)
    np.testing.assert_array_equal(frame["observation.images.scene"], expected[1]["observation.images.scene"][0])
    # The same frames through H.264 (the former default) lose the small object's colour.
    from embodied_jax.data.writer import write_lerobot_dataset

    lossy = LeRobotDataset(write_lerobot_dataset(tmp_path / "h264", expected[:1], fps=10, image_storage="video"))
    decoded = lossy.images(0, "observation.images.scene", range(len(expected[0]["action"])))
    assert np.abs(decoded[0][target].astype(int) - scene[0][target].astype(int)).max() > 20


def test_dataset_has_gr00t_modality_groups(dataset):
    ds, _ = dataset
    assert dict(ds.modality.action) == {"hand": (0, 3), "gripper": (3, 4)}
    assert dict(ds.modality.state) == {"hand": (0, 3), "gripper": (3, 4), "phase": (4, 5)}
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


def test_state_ends_with_the_episodes_phase(dataset):
    _, expected = dataset
    limit = env_lib.Env("reach").episode_limit
    for episode in expected:
        phase = episode["observation.state"][:, -1]
        np.testing.assert_allclose(phase, np.arange(len(phase)) / limit, atol=1e-6)


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


def test_collection_prints_the_noisy_experts_success_rate(dataset, capsys, tmp_path):
    collect.collect(
        "reach", EPISODES, tmp_path / "ds", image_size=(SIZE, SIZE), seed=1, noise=NOISE, phase_in_state=True
    )
    line = capsys.readouterr().out
    assert "reach: expert succeeded in" in line and f"at {NOISE * 100:g} cm of DART noise" in line


def test_dart_calibration_picks_the_largest_noise_the_expert_survives():
    env = env_lib.Env("reach", env_lib.EnvConfig(image_size=(SIZE, SIZE)))
    # 2 m of noise on a 0.5 m workspace: the expert cannot succeed; 1 cm it always does (128 of 128).
    chosen, measured = collect.calibrate_noise(env, levels=(0.01, 2.0, 0.02), episodes=16)
    assert chosen == 0.02 and list(measured) == [0.01, 0.02, 2.0]
    assert measured[0.01] >= 0.9 and measured[2.0] < 0.9
    chosen, measured = collect.calibrate_noise(env, levels=(2.0,), episodes=16)
    assert chosen == 0.0 and measured[2.0] < 0.9
    for name in ("reach", "pick_place", "handover"):
        assert env_lib.Env(name).task.dart_noise > 0  # every built-in task collects with recoveries


def test_one_dart_rule_for_every_simulator_stops_at_the_first_miss():
    from embodied_jax.sim import dart

    rates = {0.1: 1.0, 0.2: 0.95, 0.3: 0.5, 0.4: 0.99}  # 0.4 is never tried: 0.3 missed first
    tried = []
    chosen, measured = dart.calibrate(lambda level: tried.append(level) or rates[level], (0.4, 0.2, 0.1, 0.3))
    assert chosen == 0.2 and tried == [0.1, 0.2, 0.3] and measured == {0.1: 1.0, 0.2: 0.95, 0.3: 0.5}
    assert dart.calibrate(lambda level: 0.0, (0.1,)) == (0.0, {0.1: 0.0})


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    out = ["--episodes", "2", "--out", str(tmp_path)]
    for argv, message in (
        (["reach", *out, "--image-size", "1", "2", "3"], "--image-size takes one (square) or two"),
        (["juggle", *out], "task 'juggle': one of"),
        (["reach", *out, "--noise", "lots"], "--noise 'lots': metres (a number) or 'auto'"),
        (["reach", *out, "--max-steps", "9"], "--max-steps is for metaworld: tasks"),
    ):
        assert collect.main(argv) == 2
        assert f"error: {message}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a flag the command does not have: tyro's usage error
        collect.main(["reach", *out, "--juggle"])
    assert not any(tmp_path.iterdir())
    with pytest.raises(ValueError, match="noise"):
        collect.resolve_noise(env_lib.Env("reach"), -0.01)
    with pytest.raises(ValueError, match="episodes"):
        collect.expert_episodes(env_lib.Env("reach"), 0)
