"""The MuJoCo Playground adapter against the real ``playground`` package: offline setup messages,
success read from what each env reports, proprioceptive state by default, and a scene of the
project's own (``sim.playground_scene.EmbodiedJaxReach``) registered with Playground, loaded,
stepped and evaluated. (Playground's own manipulation robots need mujoco_menagerie, which
cannot be fetched offline.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.sim import closed_loop, playground, playground_scene
from embodied_jax.sim import env as env_lib

pytest.importorskip("mujoco_playground", reason="MuJoCo Playground is not installed (requirements-dev.txt has it)")


CONFIG = env_lib.EnvConfig(physics="jax", renderer="raycast", image_size=(16, 16), shadows=False)
EPISODE_LENGTH = 30  # the reach task's limit, the registered scene's default episode_length


@pytest.fixture(scope="module")
def registered():
    return playground_scene.register()


def _load(**kwargs) -> playground.PlaygroundEnv:
    playground_scene.register()
    return playground.load_playground_env(
        playground_scene.NAME, config=CONFIG, instruction="move the gripper to the red ball", **kwargs
    )


def _unchanged(old: env_lib.EnvState, new: env_lib.EnvState) -> jax.Array:
    """bool [B]: each world kept its physics state, its bookkeeping and Playground's own state.

    (A chosen set of fields: comparing every mjx.Data field inside the scan doubles its compile time.)
    """

    def fields(states):
        pg = states.info["playground"]
        return (
            states.data.qpos,
            states.data.qvel,
            states.data.ctrl,
            states.data.time,
            states.step,
            states.reward,
            states.success,
            states.done,
            pg.data.qpos,
            pg.obs,
            pg.reward,
            pg.done,
            pg.metrics,
            pg.info["target"],
        )

    equal = [
        (a == b).reshape(a.shape[0], -1).all(1)
        for a, b in zip(jax.tree.leaves(fields(old)), jax.tree.leaves(fields(new)), strict=True)
    ]
    return jnp.stack(equal).all(0)


def test_missing_menagerie_explains_offline_setup(monkeypatch, tmp_path):
    monkeypatch.setattr(playground, "menagerie_path", lambda: tmp_path / "absent" / "mujoco_menagerie")
    monkeypatch.delenv("MUJOCO_MENAGERIE_DIR", raising=False)
    with pytest.raises(playground.PlaygroundUnavailable, match="menagerie_dir"):
        playground.ensure_assets()
    with pytest.raises(playground.PlaygroundUnavailable, match="menagerie_dir"):
        playground.load_playground_env("PandaPickCube")  # Playground's own robots need the menagerie


def test_ensure_assets_links_menagerie(tmp_path, monkeypatch):
    target = tmp_path / "site" / "external_deps" / "mujoco_menagerie"
    monkeypatch.setattr(playground, "menagerie_path", lambda: target)
    monkeypatch.delenv("MUJOCO_MENAGERIE_DIR", raising=False)
    menagerie = tmp_path / "menagerie"
    menagerie.mkdir()
    with pytest.raises(playground.PlaygroundUnavailable, match="menagerie_dir") as missing:
        playground.ensure_assets()
    assert str(target) in str(missing.value)
    assert playground.ensure_assets(menagerie_dir=menagerie) == target
    assert target.is_symlink() and target.resolve() == menagerie.resolve()
    assert playground.ensure_assets() == target  # already in place: nothing more needed
    moved = menagerie.rename(tmp_path / "moved_menagerie")  # the checkout moved: the link is replaced
    monkeypatch.setenv("MUJOCO_MENAGERIE_DIR", str(moved))
    assert playground.ensure_assets() == target and target.resolve() == moved.resolve()


def test_registered_scene_loads_with_proprioceptive_state_and_its_success(registered):
    from mujoco_playground import registry

    assert registered in registry.manipulation.ALL_ENVS
    env = _load()
    assert (env.name, env.instruction) == ("EmbodiedJaxReach", "move the gripper to the red ball")
    assert env.cameras == ("scene", "wrist") and env.action_dim == 4
    assert env.episode_limit == EPISODE_LENGTH and env.control_dt == pytest.approx(0.1)
    assert env._pg._config.impl == "jax"  # the physics backend reached Playground's config
    assert env.success_source == 'metrics["success"] > 0'
    states = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.key(0), 2))
    proprio = np.asarray(env.robot_state(states))
    observation = np.asarray(states.info["playground"].obs)
    assert proprio.shape == (2, 5)  # x, y, z and two fingers: the actuated joints, nothing else
    np.testing.assert_array_equal(proprio, observation[:, :5])
    privileged = _load(privileged_state=True)
    np.testing.assert_array_equal(np.asarray(privileged.robot_state(states)), observation)  # + target pose
    with pytest.raises(ValueError, match="both choose the state"):
        _load(privileged_state=True, state_fn=lambda s: s.obs)


def test_env_reporting_no_success_is_refused_not_scored_zero(registered):
    from mujoco_playground import manipulation

    base = playground_scene.environment_class()

    class Silent(base):  # the same scene, its success metric removed
        def reset(self, rng):
            state = super().reset(rng)
            return state.replace(metrics={})

        def step(self, state, action):
            new = super().step(state, action)
            return new.replace(metrics={})

    manipulation.register_environment("EmbodiedJaxReachSilent", Silent, playground_scene.default_config)
    with pytest.raises(ValueError, match="reports no success.*pass success_fn"):
        playground.load_playground_env("EmbodiedJaxReachSilent", config=CONFIG)
    env = playground.load_playground_env(
        "EmbodiedJaxReachSilent", config=CONFIG, success_fn=lambda s: s.data.qpos[0] > 10.0
    )
    assert env.success_source == "success_fn"
    assert set(playground.SUCCESS_READERS) <= playground.MENAGERIE_ENVS


def test_unknown_or_inconsistent_env_is_rejected(registered):
    with pytest.raises(ValueError, match="'NoSuchEnv' is not a Playground manipulation env"):
        playground.load_playground_env("NoSuchEnv", config=CONFIG)
    with pytest.raises(ValueError, match="contradicts EnvConfig.physics"):
        _load(config_overrides={"impl": "warp"})


def test_reset_step_observe_latch_success_and_freeze_done_worlds(registered):
    env = _load()
    keys = jax.random.split(jax.random.key(0), 3)

    @jax.jit
    def run(keys):
        start = jax.vmap(env.reset)(keys)
        target = start.info["playground"].info["target"]
        hold = env.robot_state(start)[:, :3]
        # World 0 drives to its target, then away (ignored once done); world 1 holds still;
        # world 2 blows up (NaN commands) and must end as a failure at its last finite state.
        toward = jnp.stack([target[0], hold[1], jnp.full(3, jnp.nan)])
        away = jnp.stack([-target[0], hold[1], jnp.full(3, jnp.nan)])
        open_grip = jnp.ones((3, 1))
        actions = jnp.stack(
            [jnp.concatenate([toward, open_grip], 1)] * 12 + [jnp.concatenate([away, open_grip], 1)] * 3
        )

        def body(states, action):
            nxt = env_lib.batch_step(env, states, action)
            return nxt, (nxt.success, nxt.done, nxt.step, nxt.reward, _unchanged(states, nxt))

        end, trace = jax.lax.scan(body, start, actions)
        both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), start, end)
        fresh = (start.step == 0) & ~start.done & ~start.success
        return fresh, start.data.qpos, end.data.qpos, trace, env.observe(both), len(actions)

    fresh, start_qpos, end_qpos, trace, obs, steps = run(keys)
    state = np.asarray(obs["state"])
    images = np.asarray(obs["images"]["scene"])
    assert state.shape == (6, 5) and state.dtype == np.float32 and np.isfinite(state).all()
    assert set(obs["images"]) == {"scene", "wrist"}
    assert images.shape == (6, 16, 16, 3) and images.dtype == np.uint8
    assert not np.array_equal(images[0], images[3])  # world 0's arm moved
    assert np.asarray(fresh).all()

    success, done, step, reward, unchanged = (np.asarray(a) for a in trace)
    first = int(np.argmax(done[:, 0]))
    assert 0 < first < 12 and success[first, 0]
    assert success[first:, 0].all() and done[first:, 0].all() and (step[first:, 0] == first + 1).all()
    assert unchanged[first + 1 :, 0].all() and not unchanged[: first + 1, 0].any()  # even when driven away
    assert not success[:, 1].any() and not done[:, 1].any() and step[-1, 1] == steps
    assert done[:, 2].all() and not success[:, 2].any() and (step[:, 2] == 1).all() and (reward[:, 2] == 0).all()
    assert unchanged[1:, 2].all()
    np.testing.assert_array_equal(np.asarray(end_qpos)[2], np.asarray(start_qpos)[2])


def test_evaluator_success_rate_on_playground_env(registered):
    env = _load(privileged_state=True)  # the test policy reads the target from the privileged observation
    num_envs, chunk = 4, 5

    def act(obs, rng):
        # The first half of the worlds drive to the target; the rest hold their position.
        here, target = obs["state"][:, :3], obs["state"][:, 5:8]
        goal = jnp.where((jnp.arange(num_envs) < num_envs // 2)[:, None], target, here)
        action = jnp.concatenate([goal, jnp.ones((num_envs, 1))], 1)
        return jnp.broadcast_to(action[:, None], (num_envs, chunk, 4))

    config = closed_loop.EvalConfig(num_envs=num_envs, execute_steps=chunk, num_videos=0)
    evaluator = closed_loop.Evaluator(env, act, config)
    result = evaluator.rollout()
    metrics = closed_loop.summarize(env, config, result)

    np.testing.assert_array_equal(result.success, [True, True, False, False])
    assert metrics["successes"] == 2 and metrics["success_rate"] == 0.5 and metrics["episodes"] == num_envs
    length = np.asarray(result.length)
    assert (0 < length[:2]).all() and (length[:2] < EPISODE_LENGTH).all() and (length[2:] == EPISODE_LENGTH).all()
    assert metrics["task"] == "EmbodiedJaxReach" and metrics["instruction"] == "move the gripper to the red ball"
