"""The MuJoCo Playground adapter: offline setup messages, and loading a (fake) Playground env.

Real Playground is not installable offline, so the loading path runs against
``tests/fake_playground``: the same API surface, one tiny primitive-only env stepped by
MJX's JAX backend and drawn by the ray-caster, so it compiles in seconds.
"""

import importlib.util
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.sim import env as env_lib
from embodied_jax.sim import evaluate, playground

FAKE_PACKAGE = pathlib.Path(__file__).parent / "fake_playground" / "mujoco_playground"
TARGET_X = 0.2
EPISODE_LENGTH = 25  # the fake env's default config
CONFIG = env_lib.EnvConfig(physics="jax", renderer="raycast", image_size=(16, 16), shadows=False)

# A box on a rail, servoed to the commanded position, and a target marker; no contacts or
# constraints, so the physics is a few small ops.
SLIDER_XML = f"""
<mujoco model="fake_slider">
  <option timestep="0.01"><flag contact="disable" constraint="disable"/></option>
  <worldbody>
    <light directional="true" dir="0 0 -1" pos="0 0 2"/>
    <geom name="floor" type="plane" size="1 1 0.05" rgba=".8 .8 .8 1"/>
    <geom name="target" type="sphere" pos="{TARGET_X} 0 0.03" size="0.03" rgba="0 1 0 1"/>
    <camera name="overhead" pos="0 0 0.6" xyaxes="1 0 0 0 1 0" fovy="45"/>
    <body name="box" pos="0 0 0.05">
      <joint name="rail" type="slide" axis="1 0 0" damping="8"/>
      <geom type="box" size="0.04 0.04 0.04" rgba="1 0 0 1" mass="0.2"/>
    </body>
  </worldbody>
  <actuator><position joint="rail" kp="80" ctrlrange="-0.3 0.3"/></actuator>
</mujoco>
"""


@pytest.fixture
def fake_playground(tmp_path, monkeypatch):
    """Fake Playground importable from a temporary copy; yields (its package dir, a menagerie checkout)."""
    site = tmp_path / "site"
    shutil.copytree(FAKE_PACKAGE, site / "mujoco_playground", ignore=shutil.ignore_patterns("__pycache__"))
    menagerie = tmp_path / "menagerie"
    (menagerie / "fake_slider").mkdir(parents=True)
    (menagerie / "fake_slider" / "scene.xml").write_text(SLIDER_XML)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("MUJOCO_MENAGERIE_DIR", raising=False)
    assert importlib.util.find_spec("mujoco_playground").origin == str(site / "mujoco_playground" / "__init__.py")
    yield site / "mujoco_playground", menagerie
    # find_spec consults sys.modules first: forget the fake so later tests see Playground as absent.
    for name in [m for m in sys.modules if m == "mujoco_playground" or m.startswith("mujoco_playground.")]:
        del sys.modules[name]


def _load(menagerie, **kwargs) -> playground.PlaygroundEnv:
    return playground.load_playground_env(
        "FakeSlideBox",
        config=CONFIG,
        menagerie_dir=menagerie,
        instruction="slide the box onto the green marker",
        **kwargs,
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
            jax.random.key_data(pg.info["rng"]),
        )

    equal = [
        (a == b).reshape(a.shape[0], -1).all(1)
        for a, b in zip(jax.tree.leaves(fields(old)), jax.tree.leaves(fields(new)), strict=True)
    ]
    return jnp.stack(equal).all(0)


@pytest.mark.skipif(importlib.util.find_spec("mujoco_playground") is not None, reason="Playground is installed")
def test_missing_playground_gives_install_instructions():
    assert importlib.util.find_spec("mujoco_playground") is None
    with pytest.raises(playground.PlaygroundUnavailable, match="pip install playground"):
        playground.load_playground_env("PandaPickCube")


@pytest.mark.skipif(importlib.util.find_spec("mujoco_playground") is None, reason="Playground not installed")
def test_missing_menagerie_explains_offline_setup(monkeypatch, tmp_path):
    monkeypatch.setattr(playground, "menagerie_path", lambda: tmp_path / "absent" / "mujoco_menagerie")
    monkeypatch.delenv("MUJOCO_MENAGERIE_DIR", raising=False)
    with pytest.raises(playground.PlaygroundUnavailable, match="menagerie_dir"):
        playground.ensure_assets()


def test_ensure_assets_links_menagerie_then_env_loads(fake_playground, tmp_path, monkeypatch):
    package, menagerie = fake_playground
    target = package / "external_deps" / "mujoco_menagerie"
    with pytest.raises(playground.PlaygroundUnavailable, match="menagerie_dir") as missing:
        playground.ensure_assets()
    assert str(target) in str(missing.value)

    assert playground.ensure_assets(menagerie_dir=menagerie) == target
    assert target.is_symlink() and target.resolve() == menagerie.resolve()
    assert playground.ensure_assets() == target  # already in place: nothing more needed

    # The checkout moved: the dangling link is replaced, here from the environment variable.
    moved = menagerie.rename(tmp_path / "moved_menagerie")
    monkeypatch.setenv("MUJOCO_MENAGERIE_DIR", str(moved))
    assert playground.ensure_assets() == target and target.resolve() == moved.resolve()

    env = _load(None)
    assert (env.name, env.instruction) == ("FakeSlideBox", "slide the box onto the green marker")
    assert env.cameras == ("overhead",) and env.action_dim == 1
    assert env.episode_limit == EPISODE_LENGTH and env.control_dt == pytest.approx(0.04)
    assert env._pg._config.impl == "jax"  # the physics backend reached Playground's config


def test_unknown_or_inconsistent_env_is_rejected(fake_playground):
    _, menagerie = fake_playground
    with pytest.raises(
        ValueError,
        match=r"'PandaPickCube' is not a Playground manipulation env; "
        r"available: \['FakeSlideBox'\]",
    ):
        playground.load_playground_env("PandaPickCube", config=CONFIG, menagerie_dir=menagerie)
    with pytest.raises(ValueError, match="contradicts EnvConfig.physics"):
        _load(menagerie, config_overrides={"impl": "warp"})


def test_reset_step_observe_latch_success_and_freeze_done_worlds(fake_playground):
    _, menagerie = fake_playground
    env = _load(menagerie)
    # World 0 drives onto the target and then away (ignored once done), world 1 holds the rail
    # centre, world 2 blows up (NaN commands) and must end as a failure at its last finite state.
    toward = jnp.array([[TARGET_X], [0.0], [jnp.nan]])
    away = jnp.array([[-0.3], [0.0], [jnp.nan]])
    actions = jnp.stack([toward] * 12 + [away] * 3)

    @jax.jit
    def run(keys):
        start = jax.vmap(env.reset)(keys)

        def body(states, action):
            nxt = env_lib.batch_step(env, states, action)
            return nxt, (nxt.success, nxt.done, nxt.step, nxt.reward, _unchanged(states, nxt))

        end, trace = jax.lax.scan(body, start, actions)
        both = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), start, end)
        # Only what the checks need: returning whole states makes this program slower to compile.
        fresh = (start.step == 0) & ~start.done & ~start.success
        return fresh, start.data.qpos, end.data.qpos, trace, env.observe(both)

    fresh, start_qpos, end_qpos, trace, obs = run(jax.random.split(jax.random.key(0), 3))
    state = np.asarray(obs["state"])
    images = np.asarray(obs["images"]["overhead"])

    assert state.shape == (6, 3) and state.dtype == np.float32 and np.isfinite(state).all()
    assert set(obs["images"]) == {"overhead"}
    assert images.shape == (6, 16, 16, 3) and images.dtype == np.uint8
    assert not np.array_equal(images[0], images[3])  # world 0's box moved onto the target
    assert abs(state[3, 0] - TARGET_X) < 0.02 and state[3, 2] == pytest.approx(TARGET_X)
    assert np.asarray(fresh).all()

    success, done, step, reward, unchanged = (np.asarray(a) for a in trace)
    first = int(np.argmax(done[:, 0]))
    assert 0 < first < 12 and success[first, 0]
    assert success[first:, 0].all() and done[first:, 0].all() and (step[first:, 0] == first + 1).all()
    assert unchanged[first + 1 :, 0].all() and not unchanged[: first + 1, 0].any()  # even when driven away

    assert not success[:, 1].any() and not done[:, 1].any() and step[-1, 1] == len(actions)

    assert done[:, 2].all() and not success[:, 2].any() and (step[:, 2] == 1).all() and (reward[:, 2] == 0).all()
    assert unchanged[1:, 2].all()
    np.testing.assert_array_equal(np.asarray(end_qpos)[2], np.asarray(start_qpos)[2])


def test_evaluator_success_rate_on_playground_env(fake_playground):
    _, menagerie = fake_playground
    env = _load(menagerie)
    num_envs, chunk = 4, 5

    def act(obs, rng):
        # The first half of the worlds drive to the target read from the observation; the rest stay put.
        goal = jnp.where(jnp.arange(num_envs) < num_envs // 2, obs["state"][:, 2], 0.0)
        return jnp.broadcast_to(goal[:, None, None], (num_envs, chunk, 1))

    config = evaluate.EvalConfig(num_envs=num_envs, execute_steps=chunk, num_videos=0)
    evaluator = evaluate.Evaluator(env, act, config)
    result = evaluator.rollout()
    metrics = evaluate.summarize(env, config, result)

    np.testing.assert_array_equal(result.success, [True, True, False, False])
    assert metrics["successes"] == 2 and metrics["success_rate"] == 0.5 and metrics["episodes"] == num_envs
    length = np.asarray(result.length)
    assert (0 < length[:2]).all() and (length[:2] < EPISODE_LENGTH).all() and (length[2:] == EPISODE_LENGTH).all()
    assert metrics["task"] == "FakeSlideBox" and metrics["instruction"] == "slide the box onto the green marker"
