"""The RL stack's numerics and its toy run: Flow-SDE against NumPy, GAE and GRPO against NumPy,
the PPO ratio, a learning toy policy, and sharded rollouts equal to single-device ones."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from embodied_jax.nn import flow
from embodied_jax.rl import advantages
from embodied_jax.rl import rollout as rollout_lib
from embodied_jax.rl.loop import critic_functions
from embodied_jax.rl.start import start
from experiments.rl import rl_toy_reach


class _Nothing(nnx.Module):  # flow.sample rebuilds a module in its loop; the analytic fields hold none
    pass


def _gaussian_velocity(mu, sigma0, clean_time):
    """The exact velocity of data N(mu, sigma0^2) under the flow x_s = (1 - s) x0 + s eps."""

    def velocity(module, x, i, times):
        s = jnp.abs(times[i] - clean_time)
        var = (1 - s) ** 2 * sigma0**2 + s**2
        centred = x - (1 - s) * mu
        e_x0 = mu + (1 - s) * sigma0**2 / var * centred
        e_eps = s / var * centred
        u = e_eps - e_x0  # dx/ds
        return u if clean_time == 0.0 else -u

    return velocity


@pytest.mark.parametrize("clean_time", [0.0, 1.0])
def test_flow_sde_keeps_the_data_distribution_and_its_log_density_is_gaussian(clean_time):
    steps, n = 20, 4096
    dt = 1.0 / steps
    times = 1.0 - jnp.arange(steps) * dt if clean_time == 0.0 else jnp.arange(steps) * dt
    schedule = flow.FlowSchedule(times.astype(jnp.float32), -dt if clean_time == 0.0 else dt, clean_time)
    mu, sigma0 = 0.7, 0.3
    v = _gaussian_velocity(mu, sigma0, clean_time)
    sde = flow.FlowSDE(noise_level=0.7, stochastic_steps=None)
    x0 = jax.random.normal(jax.random.key(0), (n, 1))
    trace = flow.sample(
        _Nothing(), lambda m, x, i: v(m, x, i, schedule.times), x0, schedule, trace=True, sde=sde, rng=jax.random.key(1)
    )
    out = np.asarray(trace.actions)[:, 0]
    # the SDE keeps the ODE's marginals: the data's mean and std (Euler error and sampling error only)
    assert abs(out.mean() - mu) < 0.03 and abs(out.std() - sigma0) < 0.03
    ode = flow.sample(_Nothing(), lambda m, x, i: v(m, x, i, schedule.times), x0, schedule)
    assert abs(np.asarray(ode).std() - sigma0) < 0.03

    # the log-density of every step, computed here in NumPy from the states and velocities
    states, vels = np.asarray(trace.states, np.float64), np.asarray(trace.velocities, np.float64)
    t = np.asarray(schedule.times, np.float64)
    s = np.abs(t - clean_time)
    expected = np.zeros_like(vels)
    for i in range(steps):
        u = vels[i] if clean_time == 0.0 else -vels[i]
        floor = max(1 - s[i], dt)
        sign_dt = -dt if clean_time == 0.0 else dt
        mean = states[i] + sign_dt * vels[i] - dt * 0.49 / (2 * floor) * (states[i] + (1 - s[i]) * u)
        std = np.sqrt(0.49 * s[i] / floor * dt)
        expected[i] = -0.5 * ((states[i + 1] - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)
    np.testing.assert_allclose(np.asarray(trace.log_density), expected, rtol=1e-4, atol=1e-4)


def test_the_rl_default_sampler_keeps_the_deployed_samplers_marginals():
    """At RLConfig's defaults (every step stochastic) and the demo model's 10 steps, on Gaussian data
    the RL sampler's actions have the deployed Euler sampler's mean and a spread at most 15% wider
    (the Euler ODE under-disperses a narrow target; the SDE corrects part of that: 1.005x measured at
    the default noise 0.1, 1.09x at 0.5)."""
    from embodied_jax.rl.config import RLConfig

    steps, n = 10, 8192
    dt = 1.0 / steps
    schedule = flow.FlowSchedule((1.0 - jnp.arange(steps) * dt).astype(jnp.float32), -dt, 0.0)
    mu, sigma0 = 0.7, 0.3
    v = _gaussian_velocity(mu, sigma0, 0.0)
    rl = RLConfig()
    sde = flow.FlowSDE(rl.noise_level, rl.stochastic_steps)
    x0 = jax.random.normal(jax.random.key(0), (n, 1))

    def velocity(m, x, i):
        return v(m, x, i, schedule.times)

    rl_actions = np.asarray(
        flow.sample(_Nothing(), velocity, x0, schedule, trace=True, sde=sde, rng=jax.random.key(1)).actions
    )
    deployed = np.asarray(flow.sample(_Nothing(), velocity, x0, schedule))
    assert abs(rl_actions.mean() - deployed.mean()) < 0.02
    assert 1.0 <= rl_actions.std() / deployed.std() <= 1.15


def test_model_chain_log_prob_equals_the_sampled_one_and_only_stochastic_steps_count():
    from embodied_jax.models.toy_flow import ToyFlowConfig
    from embodied_jax.parallel.mesh import MeshConfig, make_mesh
    from embodied_jax.parallel.sharding import mesh_context

    with mesh_context(make_mesh(MeshConfig(data=-1), jax.devices()[:1])):
        model = ToyFlowConfig(horizon=4, num_steps=5).make(nnx.Rngs(0))
    obs = {"state": jax.random.normal(jax.random.key(2), (6, 8))}
    sde = flow.FlowSDE(0.8, stochastic_steps=(0, 3))
    trace = model.sample_actions(obs, jax.random.key(3), trace=True, sde=sde)
    density = np.asarray(trace.log_density)
    assert np.all(density[[1, 2, 4]] == 0) and np.all(density[[0, 3]] != 0)
    # deterministic steps are the Euler step exactly
    euler = trace.states[1] + (-1.0 / 5) * trace.velocities[1]
    np.testing.assert_allclose(trace.states[2], euler, rtol=1e-6, atol=1e-6)
    recomputed = model.chain_log_prob(obs, trace.states, sde)
    np.testing.assert_allclose(recomputed, flow.chunk_log_prob(trace.log_density), rtol=1e-5, atol=1e-3)
    # Counting the first 2 positions of the chunk: the same chain's densities there, none elsewhere.
    executed = sde._replace(counted_positions=2)
    np.testing.assert_allclose(
        model.chain_log_prob(obs, trace.states, executed), density[:, :, :2].sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-3
    )


def test_action_noise_likelihood_is_the_gaussian_around_the_deterministic_chain_from_the_initial_noise():
    """``FlowSDE(action_noise=σ)``: the chunk is the deployed sampler's from the chain's own initial noise
    plus N(0, σ²), its log-density (sampled and recomputed) is that Gaussian's in NumPy, and the
    recomputed one depends on the initial noise, not on the stored intermediate states."""
    from embodied_jax.models.toy_flow import ToyFlowConfig
    from embodied_jax.parallel.mesh import MeshConfig, make_mesh
    from embodied_jax.parallel.sharding import mesh_context

    with mesh_context(make_mesh(MeshConfig(data=-1), jax.devices()[:1])):
        model = ToyFlowConfig(horizon=4, num_steps=5).make(nnx.Rngs(0))
    obs = {"state": jax.random.normal(jax.random.key(2), (6, 8))}
    sigma = 0.05
    sde = flow.FlowSDE(action_noise=sigma, counted_positions=3)
    trace = model.sample_actions(obs, jax.random.key(3), trace=True, sde=sde)
    deployed = np.asarray(model.sample_actions(obs, jax.random.key(9), noise=trace.states[0]), np.float64)
    z = (np.asarray(trace.actions, np.float64) - deployed) / sigma
    assert 0.5 < z.std() < 1.5  # the noise is there, at about its scale
    expected = (-0.5 * z**2 - np.log(sigma) - 0.5 * np.log(2 * np.pi))[:, :3].sum(axis=(1, 2))
    density = np.asarray(trace.log_density)
    assert np.all(density[:-1] == 0)
    np.testing.assert_allclose(flow.chunk_log_prob(trace.log_density), expected, rtol=1e-4, atol=1e-2)
    np.testing.assert_allclose(model.chain_log_prob(obs, trace.states, sde), expected, rtol=1e-4, atol=1e-2)
    moved_middle = trace.states.at[1:-1].add(1.0)
    np.testing.assert_allclose(model.chain_log_prob(obs, moved_middle, sde), expected, rtol=1e-4, atol=1e-2)
    moved_noise = trace.states.at[0].add(0.5)
    assert np.all(np.abs(np.asarray(model.chain_log_prob(obs, moved_noise, sde)) - expected) > 1.0)


def _numpy_gae(rewards, values, terminal, active, last_value, gamma, lam):
    T, B = rewards.shape
    adv = np.zeros((T, B))
    for b in range(B):
        running = 0.0
        for t in reversed(range(T)):
            if not active[t, b]:
                running = 0.0
                continue
            if terminal[t, b]:
                nxt, cont = 0.0, 0.0
            elif t + 1 < T:
                nxt, cont = values[t + 1, b], 1.0
            else:
                nxt, cont = last_value[b], 1.0
            delta = rewards[t, b] + gamma * nxt - values[t, b]
            running = delta + gamma * lam * cont * running
            adv[t, b] = running
    return adv, adv + values * active


def test_gae_and_group_advantages_equal_numpy():
    rng = np.random.default_rng(0)
    T, B = 7, 5
    lengths = rng.integers(1, T + 1, B)
    active = np.arange(T)[:, None] < lengths[None]
    terminal = (np.arange(T)[:, None] == lengths[None] - 1) & (lengths[None] < T)
    rewards = rng.normal(size=(T, B)) * active
    values = rng.normal(size=(T, B)) * active
    last = rng.normal(size=B)
    adv, ret = advantages.gae(
        jnp.asarray(rewards, jnp.float32),
        jnp.asarray(values, jnp.float32),
        jnp.asarray(terminal),
        jnp.asarray(active),
        jnp.asarray(last, jnp.float32),
        gamma=0.9,
        lam=0.8,
    )
    ref_adv, ref_ret = _numpy_gae(rewards, values, terminal, active, last, 0.9, 0.8)
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-5, atol=1e-5)

    success = np.array([1, 0, 1, 1, 0, 0, 1, 1], np.float32)  # groups of b % 2
    got = advantages.group_advantages(jnp.asarray(success), groups=2)
    for g in range(2):
        members = success[g::2]
        np.testing.assert_allclose(got[g::2], (members - members.mean()) / (members.std() + 1e-6), rtol=1e-5)


@pytest.fixture(scope="module")
def toy_start():
    config = rl_toy_reach()
    config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, num_envs=64))
    return config, start(config, jax.devices())


def _toy_rollout(toy_start, mesh):
    config, st = toy_start
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 32, 0)
    spec = rollout_lib.RolloutSpec(64, 4, rollout_lib.decisions_per_episode(st.env.episode_limit, 4), shaping=0.2)
    with st.rt.context():
        fn = rollout_lib.make_rollout(st.env, st.agent, critic, spec, mesh=mesh)
    return jax.device_get(fn(st.params, critic_params, jax.random.key(5)))


def test_sharded_rollouts_equal_single_device_ones(toy_start):
    single = _toy_rollout(toy_start, None)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("data",))
    sharded = _toy_rollout(toy_start, mesh)
    assert int(single.success.sum()) == int(sharded.success.sum())
    np.testing.assert_array_equal(single.success, sharded.success)
    np.testing.assert_allclose(single.episode_return, sharded.episode_return, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(single.log_prob, sharded.log_prob, rtol=1e-4, atol=1e-3)


def test_toy_flow_policy_learns_to_reach_and_the_first_ratio_is_one(tmp_path, monkeypatch):
    from embodied_jax.rl.loop import train
    from embodied_jax.train.config import MetricsConfig

    config = rl_toy_reach()
    config = dataclasses.replace(
        config,
        workdir="rl",  # relative, as on a command line: the checkpoints are written all the same
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
        rl=dataclasses.replace(config.rl, iterations=16, checkpoint_every=100),
    )
    monkeypatch.chdir(tmp_path)
    history = train(config, jax.devices()[:1]).history
    assert (tmp_path / "rl" / "checkpoints" / "16").is_dir() and (tmp_path / "rl" / "rl_state" / "16").is_dir()
    success = [h["success_rate"] for h in history]
    for h in history:
        assert abs(h["first_ratio"] - 1.0) < 1e-4  # the first minibatch sees the weights that sampled it
    assert np.mean(success[:2]) < 0.2  # seeded: the untrained policy reaches about one goal in eight
    assert np.mean(success[-3:]) >= 0.35  # and after 16 iterations more than a third


def test_host_stepped_rollouts_equal_in_program_ones(toy_start):
    from embodied_jax.rl.host_rollout import JaxHostEnvs, make_host_rollout

    config, st = toy_start
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 32, 0)
    spec = rollout_lib.RolloutSpec(64, 4, rollout_lib.decisions_per_episode(st.env.episode_limit, 4), shaping=0.2)
    in_program = _toy_rollout(toy_start, None)
    host = make_host_rollout(JaxHostEnvs(st.env, 64), st.agent, critic, spec)(
        st.params, critic_params, jax.random.key(5)
    )
    assert 0 < int(host.success.sum()) < 64
    np.testing.assert_array_equal(host.success, in_program.success)
    np.testing.assert_array_equal(host.env_steps, in_program.env_steps)
    np.testing.assert_allclose(host.episode_return, in_program.episode_return, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(host.log_prob, in_program.log_prob, rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(host.active, in_program.active)
    np.testing.assert_allclose(host.critic_input, in_program.critic_input, rtol=1e-6, atol=1e-6)


def _train_toy_with_held_out_figures(tmp_path, monkeypatch, figures, **rl):
    """The toy RL run with its held-out evaluations answering ``figures`` in turn (the start first)."""
    from embodied_jax.rl import loop
    from embodied_jax.train.config import MetricsConfig

    figures = iter(figures)
    monkeypatch.setattr(
        loop, "held_out_evaluation", lambda st, config, k: lambda params, out_dir=None: {"success_rate": next(figures)}
    )
    config = rl_toy_reach()
    config = dataclasses.replace(
        config,
        workdir=str(tmp_path / "rl"),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
        rl=dataclasses.replace(config.rl, num_envs=32, checkpoint_every=100, **rl),
    )
    return loop.train(config, jax.devices()[:1])


def test_a_run_that_falls_below_its_start_three_evaluations_in_a_row_stops_and_says_so(tmp_path, monkeypatch):
    # the start, then one evaluation per iteration
    result = _train_toy_with_held_out_figures(
        tmp_path, monkeypatch, [0.5, 0.4, 0.6, 0.3, 0.45, 0.2], iterations=10, eval_every=1
    )
    assert result.iterations == 5  # below 0.5 at 1; 0.6 at 2 resets the count; below at 3, 4 and 5
    assert "fell below the start's 50.0% in 3 evaluations in a row" in result.stopped
    assert result.evaluation["success_rate"] == 0.2
    assert (tmp_path / "rl" / "checkpoints" / "5").is_dir()


def test_with_the_stop_rule_off_the_start_is_still_evaluated_and_the_run_goes_on(tmp_path, monkeypatch):
    import json

    # the start, then iterations 2 and 3 (the last)
    result = _train_toy_with_held_out_figures(
        tmp_path, monkeypatch, [0.5, 0.1, 0.05], iterations=3, eval_every=2, stop_below_start=0
    )
    assert result.iterations == 3 and result.stopped is None
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    held = {r["step"]: r["eval/toy_reach/success_rate"] for r in rows if "eval/toy_reach/success_rate" in r}
    assert held == {0: 0.5, 2: 0.1, 3: 0.05}


def test_several_rollouts_per_update_train_on_all_their_episodes(toy_start, tmp_path, monkeypatch):
    """``rollouts_per_update``: the update's batch is the rollouts side by side (the first the one a
    single rollout per update draws), its minibatches as many times as many, each of one rollout's size."""
    config, st = toy_start
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 32, 0)
    spec = rollout_lib.RolloutSpec(16, 4, rollout_lib.decisions_per_episode(st.env.episode_limit, 4))
    with st.rt.context():
        rollout = rollout_lib.make_rollout(st.env, st.agent, critic, spec)
        parts = [rollout(st.params, critic_params, jax.random.key(k)) for k in (5, 6)]
    both = rollout_lib.concat_rollouts(parts)
    assert both.success.shape == (32,) and both.log_prob.shape == (spec.decisions, 32)
    np.testing.assert_array_equal(both.success, np.concatenate([p.success for p in parts]))
    np.testing.assert_array_equal(both.chain[:, 16:], parts[1].chain)
    for whole, first in zip(
        jax.tree.leaves(both.model_observation), jax.tree.leaves(parts[0].model_observation), strict=True
    ):
        np.testing.assert_array_equal(whole[:, :16], first)

    one = _train_toy_with_held_out_figures(tmp_path / "one", monkeypatch, [0.5], iterations=1).history[-1]
    two = _train_toy_with_held_out_figures(
        tmp_path / "two", monkeypatch, [0.5], iterations=1, rollouts_per_update=3
    ).history[-1]
    assert (one["episodes"], two["episodes"]) == (32, 96)
    assert two["env_steps"] > one["env_steps"] and abs(two["first_ratio"] - 1.0) < 1e-4


def test_action_noise_ratio_is_one_and_the_critic_warmup_holds_the_policy_then_lets_it_move(tmp_path, monkeypatch):
    """One toy run with ``rl.action_noise`` (the update recomputes each chunk's whole chain from its
    initial noise: with the weights that sampled it the ratio is 1) and ``rl.critic_warmup=1`` (the
    first iteration's update leaves the policy where it started: its log-probabilities under the
    start's weights the same, KL 0 before the second update; the second update moves it)."""
    history = _train_toy_with_held_out_figures(
        tmp_path, monkeypatch, [0.5], iterations=3, critic_warmup=1, action_noise=0.05
    ).history
    rows = [row for row in history if "kl_to_start" in row]
    assert all(abs(row["first_ratio"] - 1.0) < 1e-4 for row in rows)
    assert [row["kl_to_start"] for row in rows][:2] == [0.0, 0.0] and rows[2]["kl_to_start"] > 0.0
    assert rows[2]["approx_kl"] > 0 and np.isfinite(rows[2]["approx_kl"])


def test_a_value_head_on_the_expert_reads_its_features_of_the_observation_in_both_rollouts(toy_start):
    """``expert_features``: the critic's input is the robot and privileged state, then the action
    expert's features of the same observation (deterministic: no sampling noise in them, no gradient
    to the policy), alike in the in-program and the host-stepped rollout."""
    from embodied_jax.rl.host_rollout import JaxHostEnvs, make_host_rollout

    _, st = toy_start
    base = rollout_lib.critic_width(st.env)
    extra = rollout_lib.expert_width(st.agent, st.params, rollout_lib.observation_example(st.env))
    model = st.agent.merge(st.params)
    assert extra == model.config.horizon * model.config.action_dim
    critic, critic_params = critic_functions(base + extra, 32, 0)
    decisions = rollout_lib.decisions_per_episode(st.env.episode_limit, 4)
    spec = rollout_lib.RolloutSpec(64, 4, decisions, shaping=0.2, expert_features=True)
    with st.rt.context():
        got = jax.device_get(
            rollout_lib.make_rollout(st.env, st.agent, critic, spec)(st.params, critic_params, jax.random.key(5))
        )
    assert got.critic_input.shape == (decisions, 64, base + extra)
    observation = jax.tree.map(lambda x: x[0], got.model_observation)
    want = model.action_features(observation)
    np.testing.assert_allclose(got.critic_input[0, :, base:], want, rtol=1e-5, atol=1e-6)
    features = st.agent.features(st.params, observation)
    grads = jax.grad(lambda p: st.agent.features(p, observation).sum())(st.params)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads))  # a value head moves no policy weight
    np.testing.assert_array_equal(features, st.agent.features(st.params, observation))
    host = make_host_rollout(JaxHostEnvs(st.env, 64), st.agent, critic, spec)(
        st.params, critic_params, jax.random.key(5)
    )
    np.testing.assert_allclose(np.asarray(host.critic_input), got.critic_input, rtol=1e-5, atol=1e-5)


def test_a_held_out_row_gives_each_metaworld_tasks_rate_beside_the_whole():
    from embodied_jax.rl.held_out import held_out_row

    result = {"success_rate": 0.25, "per_task": {"push": {"success_rate": 0.1}, "reach": {"success_rate": 0.4}}}
    assert held_out_row("metaworld:push,reach", result) == {
        "eval/metaworld:push,reach/success_rate": 0.25,
        "eval/push/success_rate": 0.1,
        "eval/reach/success_rate": 0.4,
    }
    one = {"success_rate": 0.5, "mean_return": 2.0, "per_task": {"reach": {"success_rate": 0.5}}}
    assert held_out_row("reach", one) == {"eval/reach/success_rate": 0.5, "eval/reach/mean_return": 2.0}
