"""Closed-loop evaluator: success rates equal hand-computed values; media and JSON written.

The reference rollout of ``test_sim_tasks`` (64 expert and 8 random-policy worlds, same
episode keys as the evaluator) gives the actions that a replay policy feeds back
open-loop; its per-episode success is recomputed in NumPy from the reference trajectory.
The zero policy commands zero motion (the hand's pose at reset, every step): a world
succeeds only if its target starts within tolerance. (Zero *joint targets* would sweep the
hand across the workspace, through some targets.) Both share one compiled evaluation (the
action table is the ``params`` argument).
"""

import json
import logging
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.sim import closed_loop as eval_lib
from embodied_jax.sim import env as env_lib
from embodied_jax.sim import render as render_lib
from tests.sim_reference import BATCH, EXPERT_EPISODES, reference_rollout

NUM_ENVS, HORIZON, EXECUTE = BATCH, 8, 5
SHARDED_ENVS = 8  # 2 worlds on each of 4 devices
SEED = 3


def replay_act(table, observation, rng):
    """Actions table[t : t + H] for the current control step t, as [B, H, A]."""
    t = observation["time_step"][0]
    padded = jnp.concatenate([table, jnp.repeat(table[-1:], HORIZON, 0)], 0)
    return jax.lax.dynamic_slice_in_dim(padded, t, HORIZON, 0).swapaxes(0, 1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    env = env_lib.Env("reach", env_lib.EnvConfig(image_size=(32, 32)))
    reference = reference_rollout(env)(jax.random.key(SEED))
    reference = jax.tree.map(np.asarray, reference)
    config = eval_lib.EvalConfig(num_envs=NUM_ENVS, execute_steps=EXECUTE, num_videos=2, grid_frames=4)
    evaluator = eval_lib.Evaluator(env, replay_act, config)
    out = tmp_path_factory.mktemp("eval")
    replay_rollout = evaluator.rollout(jax.random.key(SEED), params=jnp.asarray(reference.action))
    replay = eval_lib.summarize(env, config, replay_rollout, out_dir=out)
    hold = np.concatenate([reference.qpos[0, :, 0:3], np.ones_like(reference.qpos[0, :, :1])], -1)
    zero = evaluator(jax.random.key(SEED), params=jnp.broadcast_to(jnp.asarray(hold), reference.action.shape))
    return types.SimpleNamespace(
        env=env, reference=reference, replay=replay, replay_rollout=replay_rollout, zero=zero, out=out
    )


def test_replay_of_expert_actions_matches_hand_computed_success(setup):
    env, reference, replay = setup.env, setup.reference, setup.replay
    pinch = reference.qpos[:, :, 0:3]  # hand position at reset and after each action but the last
    within = np.linalg.norm(pinch - reference.info["target"][None], axis=-1) < 0.03
    # The state after the last action is not recorded: there the environment's latched flag decides.
    reached = within.any(0) | reference.success[-1]
    assert reached[:EXPERT_EPISODES].mean() >= 0.95 and reached[EXPERT_EPISODES:].mean() < 0.5
    assert replay["successes"] == int(reached.sum())
    assert replay["success_rate"] == pytest.approx(reached.mean())
    # A world solved at reset is done after its first step.
    first_hit = np.where(within.any(0), np.maximum(np.argmax(within, axis=0), 1), env.episode_limit)
    lengths = np.where(reached, first_hit, env.episode_limit)
    assert replay["mean_episode_length"] == pytest.approx(lengths.mean())


def test_zero_policy_matches_hand_computed_success(setup):
    env, reference, zero = setup.env, setup.reference, setup.zero
    at_reset = np.linalg.norm(reference.qpos[0, :, 0:3] - reference.info["target"], axis=-1) < 0.03
    assert zero["successes"] == int(at_reset.sum()) < 0.1 * NUM_ENVS
    assert zero["mean_episode_length"] == pytest.approx(np.where(at_reset, 1, env.episode_limit).mean())
    low, high = zero["success_ci95"]
    assert low <= zero["success_rate"] <= high < 0.25


def test_wilson_interval_against_formula():
    s, n, z = 45, 64, 1.959964
    p = s / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert eval_lib.wilson_interval(s, n) == pytest.approx((centre - half, centre + half))
    assert eval_lib.wilson_interval(64, 64)[1] == pytest.approx(1.0)


def test_results_json_videos_and_grid_written(setup):
    env, replay, out = setup.env, setup.replay, setup.out
    written = json.loads((out / "reach_results.json").read_text())
    assert written["success_rate"] == replay["success_rate"] and written["episodes"] == NUM_ENVS
    assert len(replay["videos"]) == 2
    import av

    with av.open(replay["videos"][0]) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert len(frames) == env.episode_limit + 1 and frames[0].shape == (32, 32, 3)
    from PIL import Image

    grid = np.asarray(Image.open(replay["frame_grid"]))
    assert grid.shape == (2 * 32 + 2, 4 * 32 + 3 * 2, 3) and grid.std() > 5


def test_sharded_evaluation_over_data_axis_matches(setup, caplog):
    env, reference = setup.env, setup.reference
    devices = np.array(jax.devices()[:4])
    mesh = jax.sharding.Mesh(devices, ("data",))
    # The first SHARDED_ENVS worlds: jax.random.split(key, n) is a prefix of split(key, N > n), so
    # they are the same episodes as the unsharded evaluation's first worlds.
    config = eval_lib.EvalConfig(num_envs=SHARDED_ENVS, execute_steps=EXECUTE, num_videos=0)

    def shard_replay(table, observation, rng):
        """Inside shard_map each device sees its own worlds: pick their columns of the table."""
        local = observation["state"].shape[0]
        first = jax.lax.axis_index("data") * local
        return replay_act(jax.lax.dynamic_slice_in_dim(table, first, local, 1), observation, rng)

    with caplog.at_level(logging.WARNING, logger=eval_lib.__name__):
        sharded = eval_lib.Evaluator(env, shard_replay, config, mesh=mesh)
    # The default renderer is Warp where installed: sharded over CPU devices it falls back, and says so.
    assert ("ray-caster" in caplog.text) == render_lib.warp_available()
    result = sharded.rollout(jax.random.key(SEED), params=jnp.asarray(reference.action[:, :SHARDED_ENVS]))
    assert result.success.sharding.spec[0] == "data"
    whole = setup.replay_rollout
    np.testing.assert_array_equal(np.asarray(result.success), np.asarray(whole.success)[:SHARDED_ENVS])
    np.testing.assert_array_equal(np.asarray(result.length), np.asarray(whole.length)[:SHARDED_ENVS])
    np.testing.assert_allclose(np.asarray(result.reward), np.asarray(whole.reward)[:SHARDED_ENVS], atol=1e-6)
    assert len(set(np.asarray(result.length).tolist())) > 1  # episodes of different lengths: a real check


def test_evaluators_of_one_env_share_its_renderers(setup):
    env = setup.env
    config = eval_lib.EvalConfig(num_envs=NUM_ENVS, execute_steps=EXECUTE, num_videos=2)
    built = len(env.renderers)
    again = eval_lib.Evaluator(env, replay_act, config)  # builds nothing new: the fixture's are reused
    assert len(env.renderers) == built and "_eval_renderers" not in vars(env)
    kind = render_lib.resolve_kind(env.config.renderer)
    assert again._renderer(env.cameras) is env.renderer(env.cameras, kind=kind)
    assert again._renderer(("scene",)) is env.renderer(("scene",), kind=kind)


def test_bad_policy_output_and_config_are_rejected(setup):
    env = setup.env
    with pytest.raises(ValueError, match="execute_steps"):
        eval_lib.Evaluator(env, replay_act, eval_lib.EvalConfig(execute_steps=0))
    with pytest.raises(ValueError, match="divide evenly"):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
        eval_lib.Evaluator(env, replay_act, eval_lib.EvalConfig(num_envs=6), mesh=mesh)
    bad = eval_lib.Evaluator(
        env,
        lambda obs, rng: jnp.zeros((NUM_ENVS, 2, env.action_dim)),
        eval_lib.EvalConfig(num_envs=NUM_ENVS, execute_steps=EXECUTE, num_videos=0),
    )
    with pytest.raises(ValueError, match="act must return"):
        jax.eval_shape(lambda k: bad._program(False)(k, None), jax.random.key(0))


def test_collection_validation_and_test_scenes_never_coincide():
    """Seeds by purpose (``sim.seeds``): the evaluator's scenes on the validation and the test seed
    and the collector's first batch share no reach target; the in-training evaluation defaults to
    the validation seed and ``evaluate`` to the test seed."""
    from embodied_jax.evaluation.closed_loop import defaults
    from embodied_jax.evaluation.in_training import SimEvaluation
    from embodied_jax.sim import seeds

    env = env_lib.Env("reach", env_lib.EnvConfig(image_size=(32, 32)))
    targets = jax.jit(lambda keys: jax.vmap(env.reset)(keys).info["target"])
    episodes = 128

    def evaluation_keys(seed):  # Evaluator: split(key(seed)) -> reset key -> one per world
        return jax.random.split(jax.random.split(jax.random.key(seed))[0], episodes)

    _, first_batch = jax.random.split(jax.random.key(seeds.COLLECTION_SEED))  # sim.collect.expert_episodes
    scenes = {
        "collection": jax.random.split(jax.random.split(first_batch)[0], episodes),
        "validation": evaluation_keys(seeds.VALIDATION_SEED),
        "test": evaluation_keys(seeds.TEST_SEED),
    }
    sets = {name: {tuple(t) for t in np.round(np.asarray(targets(keys)), 6)} for name, keys in scenes.items()}
    assert all(len(s) == episodes for s in sets.values())
    names = list(sets)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not sets[a] & sets[b], f"{a} and {b} share scenes"
    assert len(set(seeds.PURPOSES.values())) == len(seeds.PURPOSES)
    assert SimEvaluation().seed == seeds.VALIDATION_SEED
    bundle = types.SimpleNamespace(config=types.SimpleNamespace(evaluation=SimEvaluation()), image_size=None)
    assert defaults(bundle)["seed"] == seeds.TEST_SEED
