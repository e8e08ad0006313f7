"""The evaluator's simulated inference delay and real-time chunking, on stand-in policies.

The world is a stand-in too: a point hand that moves half way to its commanded position each
step, rendered as a colour (the timing of queries, delays and chunk switches is the evaluator's
own, whatever simulates the world; an MJX task costs ~15 s of compilation per program here).

One stand-in policy (``params`` choose what it encodes, so evaluations of one config share a
compiled program): chunk r's action i is a smooth trajectory at its intended step t_r + i, plus
(``params[0]``) the query's step in the grip dim, so that the executed actions name the chunk
they came from, plus (``params[1]``) a random offset per query, so that consecutive chunks
disagree. Its RTC form blends the given prefix in by the weights, as a guided sampler's chunk
approaches the prefix (the model side is ``test_rtc.py``'s).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.data.stats import FeatureStats, Normalizer
from embodied_jax.nn import rtc
from embodied_jax.sim import closed_loop as eval_lib
from embodied_jax.sim import env as env_lib

ENVS, HORIZON, K, DELAY, STEPS = 8, 8, 4, 2, 24
SOURCE = jnp.asarray([1.0, 0.0])  # grip dim: the step of the query a chunk answered
JITTER = jnp.asarray([0.0, 1.0])  # 2 cm offsets, new at every query
SMOOTH = jnp.asarray([0.0, 0.0])


def act(params, observation, rng):
    t = observation["time_step"][:, None] + jnp.arange(HORIZON)  # intended step of each action
    smooth = jnp.stack([0.005 * t - 0.1, 0.05 * jnp.sin(0.2 * t), jnp.full(t.shape, 0.15), jnp.full(t.shape, 0.5)], -1)
    source = jnp.zeros(4).at[3].set(1.0) * (observation["time_step"][:, None, None] / 100.0 - 0.5)
    offset = 0.02 * jax.random.normal(rng, (t.shape[0], 1, 4)) * jnp.asarray([1.0, 1.0, 1.0, 0.0])
    return smooth + params[0] * source + params[1] * offset


def act_rtc(params, observation, rng, prefix=None, weights=None):
    chunk = act(params, observation, rng)
    if prefix is None:
        return chunk
    w = jnp.broadcast_to(weights, (HORIZON,))[None, :, None]
    return w * prefix + (1.0 - w) * chunk


class PointEnv:
    """What ``sim.Evaluator`` uses of an ``Env``: a point hand chasing its action, a target on
    the stand-in's path (reached within 3 cm: different episode lengths)."""

    name, instruction, cameras, action_dim, episode_limit, control_dt = "point", "reach", ("scene",), 4, STEPS, 0.1
    config = env_lib.EnvConfig(image_size=(8, 8), renderer="raycast")

    def renderer(self, cameras, kind=None):
        def render(hand):
            colour = (jnp.clip(hand[:, :3] + 0.5, 0, 1) * 255).astype(jnp.uint8)
            return {cam: jnp.broadcast_to(colour[:, None, None], (hand.shape[0], 8, 8, 3)) for cam in cameras}

        return render

    def current_kinematics(self, data):
        return data

    def robot_state(self, states):
        return states.data

    def reset(self, key):
        s, dz = jax.random.uniform(key, (2,), minval=jnp.asarray([4.0, -0.05]), maxval=jnp.asarray([20.0, 0.05]))
        target = jnp.stack([0.005 * s - 0.1, 0.05 * jnp.sin(0.2 * s), 0.15 + dz])  # off the path by dz
        hand = jnp.asarray([-0.1, 0.0, 0.15, 0.5])
        false = jnp.zeros((), bool)
        return env_lib.EnvState(hand, {"target": target}, jnp.zeros((), jnp.int32), jnp.zeros(()), false, false)

    def step(self, state, action):
        hand = jnp.where(state.done, state.data, state.data + 0.5 * (action - state.data))
        distance = jnp.linalg.norm(hand[:3] - state.info["target"])
        success = state.success | (distance < 0.03)
        step = state.step + 1
        return env_lib.EnvState(hand, state.info, step, -distance, success, success | (step >= STEPS))


def config(**kw):
    return eval_lib.EvalConfig(num_envs=ENVS, execute_steps=K, num_videos=0, max_steps=STEPS, **kw)


@pytest.fixture(scope="module")
def env():
    return PointEnv()


@pytest.fixture(scope="module")
def naive(env):
    """The delayed evaluator without RTC (one program for every ``params``)."""
    return eval_lib.Evaluator(env, act, config(inference_delay=DELAY))


def run(evaluator, params):
    return jax.tree.map(np.asarray, evaluator.rollout(jax.random.key(0), params=params))


def test_zero_delay_is_the_evaluator_as_it_was_and_delays_keep_time(env, naive):
    default = eval_lib.Evaluator(env, act, config())
    explicit = eval_lib.Evaluator(env, act, config(inference_delay=0, rtc=False))
    before, now = run(default, SOURCE), run(explicit, SOURCE)
    for field in ("success", "length", "reward", "active", "actions"):
        np.testing.assert_array_equal(getattr(now, field), getattr(before, field))
    # Every query's first k actions, as they were predicted: step t runs chunk t // k at index t % k.
    steps = np.arange(STEPS)
    np.testing.assert_allclose(before.actions[..., 3], np.broadcast_to(steps // K * K / 100, (ENVS, STEPS)), atol=1e-7)
    np.testing.assert_allclose(before.actions[..., 0], np.broadcast_to(0.005 * steps - 0.1, (ENVS, STEPS)), atol=1e-7)
    # Chunks that depend only on the intended step run the same with a delay, bit for bit.
    plain, delayed = run(default, SMOOTH), run(naive, SMOOTH)
    for field in ("success", "length", "reward", "active", "actions"):
        np.testing.assert_array_equal(getattr(delayed, field), getattr(plain, field))
    assert 0 < plain.success.sum() < ENVS and len(set(plain.length.tolist())) > 1  # worlds that differ


def test_the_previous_chunk_runs_during_the_delay(naive):
    out = run(naive, SOURCE)
    steps = np.arange(STEPS)
    query = steps // K * K
    # The first query has no previous chunk: its own first d actions run.
    source = np.where((steps % K < DELAY) & (query > 0), query - K, query)
    np.testing.assert_allclose(out.actions[..., 3], np.broadcast_to(source / 100, (ENVS, STEPS)), atol=1e-7)
    np.testing.assert_allclose(out.actions[..., 0], np.broadcast_to(0.005 * steps - 0.1, (ENVS, STEPS)), atol=1e-7)


def test_rtc_guides_towards_the_previous_chunks_rest_and_lowers_jerk(env, naive):
    rtc_eval = eval_lib.Evaluator(env, act_rtc, config(inference_delay=DELAY, rtc=True))
    # The prefix is the previous chunk from the new one's time origin on: the intended steps agree.
    out = run(rtc_eval, SOURCE)
    steps = np.arange(STEPS)
    np.testing.assert_allclose(out.actions[..., 0], np.broadcast_to(0.005 * steps - 0.1, (ENVS, STEPS)), atol=1e-7)
    # After the delay the new chunk is the previous one's plan blended with its own by the weights;
    # during it the previous chunk runs (its own plan there: its weights are 0 past horizon - k).
    w = np.asarray(rtc.prefix_weights(HORIZON, DELAY, K))[steps % K]
    query = steps // K * K
    blended = np.where(steps % K < DELAY, query - K, w * (query - K) + (1 - w) * query)
    grip = np.where(query > 0, blended, query) / 100
    np.testing.assert_allclose(out.actions[..., 3], np.broadcast_to(grip, (ENVS, STEPS)), atol=1e-6)

    metrics = {name: e(jax.random.key(0), params=JITTER) for name, e in (("naive", naive), ("rtc", rtc_eval))}
    naive_jerk, rtc_jerk = metrics["naive"]["jerk_at_boundaries"], metrics["rtc"]["jerk_at_boundaries"]
    assert rtc_jerk < 0.5 * naive_jerk, (rtc_jerk, naive_jerk)
    # Within a naive chunk the motion is smooth: the jerk is all at its boundaries.
    assert metrics["naive"]["jerk_elsewhere"] < 1e-3 * naive_jerk
    assert metrics["rtc"]["inference_delay"] == DELAY and metrics["rtc"]["rtc"] is True


def test_boundary_jerk_counts_stencils_straddling_a_switch():
    k, d, steps = 4, 1, 17
    chunk = (np.arange(steps) - d) // k  # the chunk each step runs: switches at r·k + d
    chunk = np.maximum(chunk, 0).astype(np.float64)
    actions = np.repeat(chunk[None, :, None], 2, axis=0)
    active = np.ones((2, steps), bool)
    at, elsewhere = eval_lib.boundary_jerk(actions, active, k, d)
    assert at == pytest.approx(6 / 3) and elsewhere == 0.0  # a unit jump: third differences 1, -2, 1
    active[1, 8:] = False  # the second episode ends at step 8: stencils up to steps 4..7 count
    at, _ = eval_lib.boundary_jerk(actions, active, k, d)
    assert at == pytest.approx((3 * 6 + 6) / (3 * 3 + 3))
    assert eval_lib.boundary_jerk(actions, active, 3, 0)[1] is None  # every stencil straddles a switch


def test_delays_the_evaluator_cannot_simulate_are_named(env):
    with pytest.raises(eval_lib.InferenceDelayError, match="inference_delay"):
        eval_lib.Evaluator(env, act, config(inference_delay=K + 1))
    with pytest.raises(eval_lib.InferenceDelayError, match="inference_delay"):
        eval_lib.Evaluator(env, act, config(inference_delay=-1))
    short = eval_lib.Evaluator(env, lambda p, o, r: act(p, o, r)[:, : K + 1], config(inference_delay=DELAY))
    with pytest.raises(eval_lib.InferenceDelayError, match="cannot cover"):
        jax.eval_shape(lambda key: short._program(True)(key, SOURCE), jax.random.key(0))


@pytest.mark.parametrize(
    "mode, delta", [("mean_std", None), ("min_max", None), ("quantile", (True, True, False))], ids=str
)
def test_bundle_rtc_prefix_is_the_inverse_of_postprocess(mode, delta):
    """``act_fn(..., rtc=True)`` turns robot actions back into the model's normalised space."""
    from embodied_jax.bundle import PolicyBundle, model_actions_fn

    rng = np.random.default_rng(0)
    low, high = -rng.uniform(1, 2, 3), rng.uniform(1, 2, 3)
    qs = {"q01": low + 0.1, "q10": low, "q50": 0 * low, "q90": high, "q99": high - 0.1}
    stats = FeatureStats(mean=rng.normal(size=3), std=rng.uniform(0.5, 2, 3), min=low, max=high, count=9, quantiles=qs)
    bundle = object.__new__(PolicyBundle)  # only what postprocess and the prefix's conversion read
    bundle.inputs = types.SimpleNamespace(action_key="actions")
    bundle.stats = {"actions": stats}
    bundle._unnormalizer = Normalizer(bundle.stats, {"actions": mode})
    bundle._delta_action_mask = delta
    bundle.action_dim = 3
    model_actions = rng.uniform(-0.9, 0.9, (2, HORIZON, 3)).astype(np.float32)
    state = rng.normal(size=(2, 5)).astype(np.float32)
    robot = bundle.postprocess(model_actions, state)
    back = jax.jit(model_actions_fn(bundle))(robot, state)
    np.testing.assert_allclose(back, model_actions, atol=1e-5)
