"""Noise-space steering (rl/steering.py, rl/steer_loop.py): the replay buffer, SAC learning a
contextual bandit's best noise, the steered chunk being the frozen policy's chunk from the chosen
noise, and a toy run that stores privileged critic inputs and resumes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.models.toy_flow import ToyFlowConfig
from embodied_jax.parallel.mesh import MeshConfig
from embodied_jax.rl.config import RLConfig
from embodied_jax.rl.replay import ReplayBuffer
from embodied_jax.rl.steering import SteerNetworks, SteerSettings, make_update, steered_chunk
from experiments.rl import RLSteerConfig


def test_replay_buffer_overwrites_the_oldest_samples_uniformly_and_round_trips(tmp_path):
    buffer = ReplayBuffer(5)
    buffer.add({"x": np.arange(3, dtype=np.float32)[:, None], "y": np.arange(3)})
    buffer.add({"x": np.arange(3, 7, dtype=np.float32)[:, None], "y": np.arange(3, 7)})
    assert len(buffer) == 5 and sorted(buffer.fields["y"].tolist()) == [2, 3, 4, 5, 6]  # 0 and 1 overwritten
    drawn = buffer.sample(np.random.default_rng(0), (4, 1000))
    assert drawn["x"].shape == (4, 1000, 1) and set(np.unique(drawn["y"])) == {2, 3, 4, 5, 6}
    np.testing.assert_array_equal(drawn["x"][..., 0], drawn["y"])  # fields stay paired
    buffer.save(tmp_path / "replay.npz")
    back = ReplayBuffer.load(tmp_path / "replay.npz")
    back.add({"x": np.asarray([[7.0]], np.float32), "y": np.asarray([7])})
    buffer.add({"x": np.asarray([[7.0]], np.float32), "y": np.asarray([7])})
    np.testing.assert_array_equal(back.fields["y"], buffer.fields["y"])  # the cursor came back too
    with pytest.raises(ValueError, match="fields"):
        buffer.add({"x": np.zeros((1, 1), np.float32)})
    with pytest.raises(ValueError, match="different lengths"):
        buffer.add({"x": np.zeros((2, 1), np.float32), "y": np.zeros(3)})


def test_untrained_actor_explores_the_noise_the_policy_was_trained_from():
    nets, params = SteerNetworks.init(3, 5, (2, 2), SteerSettings(), seed=0)
    noise, _ = nets.actor_sample(params.actor, jnp.ones((20000, 3)), jax.random.key(0))
    assert abs(float(jnp.var(noise)) - 1.0) < 0.03 and abs(float(jnp.mean(noise))) < 0.02
    assert float(jnp.max(jnp.abs(noise))) <= SteerSettings().noise_bound
    mean, _ = nets.actor_sample(params.actor, jnp.ones((4, 3)), jax.random.key(0), deterministic=True)
    np.testing.assert_allclose(np.asarray(mean), 0.0)


def test_actor_log_density_matches_the_squashed_gaussian_computed_in_numpy():
    nets, params = SteerNetworks.init(2, 2, (1, 2), SteerSettings(noise_bound=1.5), seed=1)
    x = jnp.asarray([[0.3, -0.2]])
    noise, logp = nets.actor_sample(params.actor, x, jax.random.key(3))
    mean, log_std = (np.asarray(a, np.float64) for a in nets.actor_dist(params.actor, x))
    u = np.arctanh(np.asarray(noise, np.float64) / 1.5)
    std = np.exp(log_std)
    expected = np.sum(
        -0.5 * ((u - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi) - np.log(1.5 * (1 - np.tanh(u) ** 2))
    )
    np.testing.assert_allclose(float(logp[0]), expected, rtol=1e-4, atol=1e-4)
    # the prior's KL: zero for the untrained actor, the Gaussians' KL in NumPy otherwise
    np.testing.assert_allclose(np.asarray(nets.prior_kl(params.actor, x)), 0.0, atol=1e-6)
    shifted = jax.tree.map(lambda a: a + 0.1, params.actor)
    mean, log_std = (np.asarray(a, np.float64) for a in nets.actor_dist(shifted, x))
    s0, s1 = np.exp(nets.log_std0), np.exp(log_std)
    kl = np.sum(np.log(s0 / s1) + (s1**2 + mean**2) / (2 * s0**2) - 0.5)
    np.testing.assert_allclose(float(nets.prior_kl(shifted, x)[0]), kl, rtol=1e-4)


def test_sac_learns_the_best_noise_of_a_contextual_bandit():
    """One-step episodes: the reward is highest at noise 0.8 * context; the actor's mean gets there."""
    settings = SteerSettings(
        width=64, batch_size=128, actor_lr=3e-3, critic_lr=3e-3, init_temperature=0.01, prior_weight=0.0
    )
    nets, params = SteerNetworks.init(1, 1, (1, 2), settings, seed=0)
    update, init_opt = make_update(nets, settings, gamma=0.99)
    opt_state = init_opt(params)
    rng = np.random.default_rng(0)
    buffer = ReplayBuffer(4096)
    key = jax.random.key(0)
    for round_ in range(30):
        context = rng.choice([-1.0, 1.0], size=(128, 1)).astype(np.float32)
        noise, _ = nets.actor_sample(params.actor, jnp.asarray(context), jax.random.fold_in(key, round_))
        noise = np.asarray(noise)
        reward = -np.sum((noise - 0.8 * context) ** 2, -1).astype(np.float32)
        buffer.add(
            {
                "actor_in": context,
                "critic_in": context,
                "noise": noise,
                "reward": reward,
                "terminal": np.ones(128, np.float32),
                "next_actor_in": context,
                "next_critic_in": context,
                "return_to_go": reward,
            }
        )
        batches = jax.tree.map(jnp.asarray, buffer.sample(rng, (20, settings.batch_size)))
        params, opt_state, metrics = update(
            params, opt_state, batches, jax.random.fold_in(key, 1000 + round_), (-20.0, 0.0)
        )
    best, _ = nets.actor_sample(params.actor, jnp.asarray([[1.0], [-1.0]]), key, deterministic=True)
    np.testing.assert_allclose(np.asarray(best), [[0.8, 0.8], [-0.8, -0.8]], atol=0.15)
    assert np.isfinite(float(metrics["critic_loss"]))


def test_the_critics_targets_stay_within_the_returns_seen():
    """An actor leading the critics out of the data cannot raise their targets past the value range."""
    settings = SteerSettings(width=16, batch_size=8, critic_lr=1e-1, critic_target="bootstrap")
    nets, params = SteerNetworks.init(1, 1, (1, 1), settings, seed=0)
    update, init_opt = make_update(nets, settings, gamma=0.99)
    ones = jnp.ones((50, 8, 1))
    batches = {
        "actor_in": ones,
        "critic_in": ones,
        "noise": 0 * ones,
        "reward": jnp.ones((50, 8)),  # a reward every step, never terminal: unbounded values, but the clip
        "terminal": jnp.zeros((50, 8)),
        "next_actor_in": ones,
        "next_critic_in": ones,
        "return_to_go": jnp.ones((50, 8)),
    }
    _, _, metrics = update(params, init_opt(params), batches, jax.random.key(0), (0.0, 1.0))
    assert float(metrics["target_mean"]) <= 1.0 + 1e-6


def test_the_steered_chunk_is_the_frozen_policys_chunk_from_the_chosen_noise(tmp_path):
    from embodied_jax.rl.start import start

    st = start(_toy_config(tmp_path, 1))
    with st.rt.context():
        model = st.agent.merge(st.params)
    worlds = jax.vmap(st.env.reset)(jax.random.split(jax.random.key(0), 3))
    observation = st.agent.observe(st.env.observe(worlds))
    state_width = observation["state"].shape[-1]
    width = model.action_features(observation).shape[-1]
    nets, params = SteerNetworks.init(
        state_width + width, state_width + width, (4, width // 4), SteerSettings(), seed=0
    )
    chunk, actor_in, noise = steered_chunk(
        model, nets, params.actor, observation, observation["state"], jax.random.key(1), False
    )
    again = model.sample_actions(observation, jax.random.key(9), noise=noise.reshape(3, 4, width // 4))
    np.testing.assert_allclose(np.asarray(chunk), np.asarray(again), atol=1e-6)
    np.testing.assert_allclose(np.asarray(actor_in[:, :state_width]), np.asarray(observation["state"]))
    mean_chunk, _, zero = steered_chunk(
        model, nets, params.actor, observation, observation["state"], jax.random.key(1), True
    )
    np.testing.assert_allclose(np.asarray(zero), 0.0)  # the untrained actor's mean: the flow's centre
    plain = model.sample_actions(observation, jax.random.key(2), noise=jnp.zeros((3, 4, width // 4)))
    np.testing.assert_allclose(np.asarray(mean_chunk), np.asarray(plain), atol=1e-6)


def _toy_config(workdir, iterations):
    return RLSteerConfig(
        name="steer_toy",
        model=ToyFlowConfig(horizon=4, num_steps=4),
        mesh=MeshConfig(data=-1),
        workdir=str(workdir),
        rl=RLConfig(
            task="toy_reach",
            num_envs=16,
            execute_steps=4,
            iterations=iterations,
            eval_envs=16,
            eval_every=1,
            stop_below_start=0,
            checkpoint_every=1,
        ),
        steer=SteerSettings(warmup=32, batch_size=32, updates_per_decision=2, width=16),
    )


def test_a_toy_steering_run_stores_privileged_critic_inputs_and_resumes(tmp_path):
    from embodied_jax.rl import toy
    from embodied_jax.rl.host_rollout import JaxHostEnvs
    from embodied_jax.rl.steer_loop import REPLAY, train

    first = train(_toy_config(tmp_path, 2))
    assert first.iterations == 2 and first.evaluation is not None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "base/eval/toy_reach/success_rate" in rows[0] and rows[-1]["updates"] > 0
    buffer = ReplayBuffer.load(tmp_path / REPLAY)
    actor_in, critic_in = buffer.fields["actor_in"][: len(buffer)], buffer.fields["critic_in"][: len(buffer)]
    # the critic reads the actor's inputs and then the privileged state, which the actor never sees
    envs = JaxHostEnvs(toy.ToyReach(), 2)
    envs.reset(jax.random.key(0), np.arange(2))
    privileged_width = envs.privileged_state().shape[-1]
    assert critic_in.shape[1] == actor_in.shape[1] + privileged_width
    np.testing.assert_array_equal(critic_in[:, : actor_in.shape[1]], actor_in)
    assert np.all(np.abs(buffer.fields["noise"][: len(buffer)]) <= SteerSettings().noise_bound)
    # each decision's return-to-go: its reward plus the discounted return-to-go of its episode's next decision
    reward, to_go = buffer.fields["reward"][: len(buffer)], buffer.fields["return_to_go"][: len(buffer)]
    assert np.all(to_go >= reward - 1e-6) and np.all(to_go <= 1.0 + 1e-6)
    assert np.isclose(to_go.max(), 1.0, atol=1e-6) or reward.max() == 0.0
    seen = len(buffer)

    resumed = train(_toy_config(tmp_path, 3))
    assert resumed.iterations == 3
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]  # the start evaluated once, no iteration repeated
    assert len(ReplayBuffer.load(tmp_path / REPLAY)) > seen  # the buffer came back and grew

    from experiments.benchmarks import rl_steer_eval

    scored = rl_steer_eval.main([str(tmp_path), "--episodes", "16", "--seed", "1"])
    assert scored["step"] == 3 and len(scored["policies"]) == 3
    assert all(0.0 <= p["success_rate"] <= 1.0 and p["episodes"] == 16 for p in scored["policies"].values())


def test_returns_to_go_follow_each_row_through_its_episode():
    from embodied_jax.rl.steer_loop import _with_returns_to_go

    def decision(rows, rewards):
        return {"row": np.asarray(rows), "reward": np.asarray(rewards, np.float32)}

    # row 0 succeeds at its third decision; row 1 stops after two (the step limit) without reward
    batch = [decision([0, 1], [0, 0]), decision([0, 1], [0, 0]), decision([0], [1])]
    out = _with_returns_to_go(batch, gamma=0.5)
    for transitions, expected in zip(out, [[0.25, 0.0], [0.5, 0.0], [1.0]], strict=True):
        np.testing.assert_allclose(transitions["return_to_go"], expected)
    assert all("row" not in t for t in out)
