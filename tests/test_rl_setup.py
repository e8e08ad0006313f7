"""What an RL update may touch and what its critic may see: only the action expert trains by
default (the rest bit-identical after an update), and the critic's privileged state reaches no
input of the policy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from embodied_jax.rl import advantages, ppo
from embodied_jax.rl import rollout as rollout_lib
from embodied_jax.rl.loop import critic_functions
from embodied_jax.rl.scope import Scope
from embodied_jax.rl.start import start
from embodied_jax.train.optimizer import path_str
from embodied_jax.train.state import model_parts
from experiments.demo import demo_config
from experiments.rl import rl_toy_reach


def _paths(tree: dict) -> set[str]:
    return {path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("arch", ["pi05", "gr00t"])
def test_the_action_expert_scope_keeps_vision_and_language_model_fixed(arch):
    config = demo_config(arch=arch).model
    parts = model_parts(config)
    params = jax.tree.map(lambda x: np.zeros((), np.float32), parts.templates[0].to_pure_dict())
    trainable, fixed = Scope.of(config, "action_expert").partition(params)
    train_paths, fixed_paths = _paths(trainable), _paths(fixed)
    assert train_paths.isdisjoint(fixed_paths) and train_paths | fixed_paths == _paths(params)
    vision = ("vision_tower/", "llm/layers/experts/0/", "multi_modal_projector/")
    if arch == "gr00t":
        vision = ("backbone/eagle_model/vision_model/", "backbone/eagle_model/language_model/")
    expert = ("action_out_proj/", "llm/layers/experts/1/") if arch == "pi05" else ("action_head/model/",)
    for prefix in vision:
        assert any(p.startswith(prefix) for p in fixed_paths) and not any(p.startswith(prefix) for p in train_paths)
    for prefix in expert:
        assert any(p.startswith(prefix) for p in train_paths)
    assert Scope.combine(trainable, fixed).keys() == params.keys()
    everything, nothing = Scope.of(config, "all").partition(params)
    assert _paths(everything) == _paths(params) and not nothing
    with pytest.raises(ValueError, match="RLConfig.train"):
        Scope.of(config, "vision")


def test_an_update_moves_the_trainable_weights_and_leaves_the_fixed_ones_bit_identical():
    config = rl_toy_reach()
    config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, num_envs=32))
    st = start(config, jax.devices()[:1])
    scope = Scope((r"^out/",))  # the toy's output layer trains, the rest is fixed
    trainable, fixed = scope.partition(st.params)
    assert _paths(trainable) == {"out/kernel", "out/bias"}
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 32, 0)
    spec = rollout_lib.RolloutSpec(32, 4, rollout_lib.decisions_per_episode(st.env.episode_limit, 4), shaping=0.2)
    with st.rt.context():
        rollout = rollout_lib.make_rollout(st.env, st.agent, critic, spec)(st.params, critic_params, jax.random.key(1))
    adv, returns = advantages.gae(
        rollout.reward,
        rollout.value,
        rollout.terminal,
        rollout.active,
        jnp.zeros_like(rollout.success, jnp.float32),
        gamma=0.99,
        lam=0.95,
    )
    # one decision short of filling the minibatches evenly: each epoch leaves a random remainder out
    batch = jax.tree.map(lambda x: x[:-1], ppo.flat_decisions(rollout, adv, returns, rollout.log_prob))
    policy_opt, critic_opt = optax.adam(1e-3), optax.adam(1e-3)
    update = ppo.make_update(st.agent, critic, config.rl.ppo, policy_opt, critic_opt)
    opt_states = (policy_opt.init(trainable), critic_opt.init(critic_params))
    new, _, _, metrics = update(trainable, fixed, critic_params, opt_states, batch, jax.random.key(2))
    assert abs(float(metrics["first_ratio"]) - 1.0) < 1e-4
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(trainable), jax.tree.leaves(new), strict=True))
    # the weights the loop goes on with are the originals, bit for bit, outside the trainable part
    combined = Scope.combine(new, fixed)
    for path, leaf in jax.tree_util.tree_leaves_with_path(st.params):
        if not path_str(path).startswith("out/"):
            got = combined
            for key in path:
                got = got[key.key]
            np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf))


def test_the_critic_sees_the_objects_pose_and_the_policys_inputs_do_not():
    from embodied_jax.sim import Env, EnvConfig

    env = Env("pick_place", EnvConfig(image_size=(16, 16)))
    states = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.key(0), 2))
    moved = dataclasses.replace(states, data=states.data.replace(qpos=states.data.qpos.at[:, -7].add(0.05)))
    observe = jax.jit(env.robot_state)
    features = jax.jit(lambda s: rollout_lib.critic_input(env, s, env.robot_state(s), True))
    np.testing.assert_array_equal(observe(states), observe(moved))  # the policy's state: the robot only
    before, after = np.asarray(features(states)), np.asarray(features(moved))
    width = observe(states).shape[-1]
    np.testing.assert_array_equal(before[:, :width], after[:, :width])
    assert np.abs(before[:, width:] - after[:, width:]).max() == pytest.approx(0.05, abs=1e-6)
    assert rollout_lib.critic_width(env, True) == before.shape[-1] > rollout_lib.critic_width(env, False) == width


def test_the_critics_scale_follows_the_returns_and_gets_no_gradient():
    from embodied_jax.rl.loop import value_stats

    critic, params = critic_functions(3, 8, 0)
    returns = jnp.asarray([[10.0, 20.0, 99.0], [30.0, 40.0, 99.0]])
    active = jnp.asarray([[True, True, False], [True, True, False]])  # the 99s are after the episodes ended
    params = value_stats(params, returns, active, first=True)
    assert float(params["shift"]) == pytest.approx(25.0) and float(params["scale"]) == pytest.approx(
        np.std([10, 20, 30, 40])
    )
    later = value_stats(params, returns + 10.0, active, first=False)
    assert float(later["shift"]) == pytest.approx(0.9 * 25.0 + 0.1 * 35.0)
    x, progress = jnp.ones((2, 3)), jnp.zeros((2,))
    # value = net * scale + shift: the untrained (zero) head predicts the mean return
    np.testing.assert_allclose(critic(params, x, progress), [25.0, 25.0])
    grads = jax.grad(lambda p: critic(p, x, progress).sum())(params)
    assert float(grads["shift"]) == 0.0 and float(grads["scale"]) == 0.0


@pytest.mark.parametrize("family", ["pi05", "gr00t"])
def test_the_action_features_are_the_samplers_first_velocity_from_a_zero_chunk(family):
    """``Policy.action_features`` (a value head's input): the velocity the sampler's first step
    computes when it starts from a zero chunk, flattened; the same on every call."""
    from flax import nnx

    if family == "pi05":
        from embodied_jax.models.pi05.variants import variant
    else:
        from embodied_jax.models.gr00t.variants import variant
    config = variant("tiny")
    with nnx.use_eager_sharding(False):  # one device, no mesh: the parameters unsharded
        model = config.make(nnx.Rngs(0))
    # Random weights everywhere (the output projections start at zero, which would make any check pass).
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.unflatten(treedef, [0.1 * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]))
    batch = config.synthetic_batch(2, seed=1)
    observation = {k: v for k, v in batch.items() if k not in ("actions", "action_mask", "action_dim_mask")}
    features_of = nnx.jit(lambda m, o: m.action_features(o))
    features = np.asarray(features_of(model, observation))
    shape = model.sample_actions(observation, jax.random.key(0), trace=True).states.shape
    trace = model.sample_actions(observation, jax.random.key(0), noise=np.zeros(shape[1:], np.float32), trace=True)
    first = np.asarray(trace.velocities[0]).reshape(2, -1)
    assert features.shape == first.shape and np.abs(features).max() > 0
    np.testing.assert_allclose(features, first, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(features, np.asarray(features_of(model, observation)))  # no sampling in them


@pytest.fixture(scope="module")
def toy_decisions():
    """The toy policy's start, its critic and one rollout's flat decisions with random advantages."""
    config = rl_toy_reach()
    config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, num_envs=8))
    st = start(config, jax.devices()[:1])
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 32, 0)
    spec = rollout_lib.RolloutSpec(8, 4, rollout_lib.decisions_per_episode(st.env.episode_limit, 4))
    with st.rt.context():
        rollout = rollout_lib.make_rollout(st.env, st.agent, critic, spec)(st.params, critic_params, jax.random.key(1))
    adv = jax.random.normal(jax.random.key(2), rollout.reward.shape)
    return st, critic, critic_params, ppo.flat_decisions(rollout, adv, jnp.zeros_like(adv), rollout.log_prob)


def test_the_weighted_flow_objective_regresses_onto_the_better_decisions_only(toy_decisions):
    st, critic, critic_params, batch = toy_decisions
    settings = ppo.PPOSettings(objective="weighted_flow")
    key = jax.random.key(3)

    def policy_loss(mb):
        _, metrics = ppo.ppo_loss(st.agent, critic, settings, st.params, critic_params, mb, None, key)
        return float(metrics["policy_loss"])

    # The reference: advantages normalised over the active decisions, their positive part, times the
    # model's own per-example flow-matching loss on each decision's chunk (the same draws).
    active = np.asarray(batch["active"], bool)
    a = np.asarray(batch["advantage"])
    normalised = (a - a[active].mean()) / (a[active].std() + 1e-8)
    flow = np.asarray(st.agent.flow_loss(st.params, batch["model_observation"], batch["chain"][:, -1], key))
    assert flow.shape == a.shape and (flow > 0).all()
    want = (np.maximum(normalised, 0) * flow * active).sum() / active.sum()
    assert policy_loss(batch) == pytest.approx(want, rel=1e-5)
    # A decision that did worse than expected teaches nothing: its chunk can be anything.
    worst = int(np.argmin(np.where(active, a, np.inf)))
    moved = {**batch, "chain": batch["chain"].at[worst, -1].add(1.0)}
    assert policy_loss(moved) == pytest.approx(policy_loss(batch), rel=1e-6)
    better = int(np.argmax(np.where(active, a, -np.inf)))
    assert policy_loss({**batch, "chain": batch["chain"].at[better, -1].add(1.0)}) != pytest.approx(want, rel=1e-3)
    with pytest.raises(ValueError, match="objective"):
        ppo.PPOSettings(objective="dpo")


def test_self_imitation_regresses_onto_the_successful_episodes_decisions_and_demos_add_bc_loss(toy_decisions):
    st, critic, critic_params, batch = toy_decisions
    active, success = np.asarray(batch["active"], bool), np.asarray(batch["success"], bool)
    # half the episodes succeed, whatever the toy's rollout did: the objective reads only this flag
    success = np.zeros(success.shape, bool).reshape(-1, 8)
    success[:, ::2] = True
    batch = {**batch, "success": jnp.asarray(success.reshape(-1))}
    success = success.reshape(-1)
    settings = ppo.PPOSettings(objective="self_imitation")
    key = jax.random.key(3)

    def loss(mb, demos=None):
        total, metrics = ppo.ppo_loss(st.agent, critic, settings, st.params, critic_params, mb, None, key, demos)
        return float(total), metrics

    flow = np.asarray(st.agent.flow_loss(st.params, batch["model_observation"], batch["chain"][:, -1], key))
    kept = active & success
    assert kept.any() and (active & ~success).any()
    want = (flow * kept).sum() / kept.sum()
    _, metrics = loss(batch)
    assert float(metrics["policy_loss"]) == pytest.approx(want, rel=1e-5)
    assert "clip_fraction" not in metrics  # no likelihood ratio is computed for it
    failed, won = int(np.flatnonzero(active & ~success)[0]), int(np.flatnonzero(kept)[0])
    moved = {**batch, "chain": batch["chain"].at[failed, -1].add(1.0), "advantage": -batch["advantage"]}
    assert float(loss(moved)[1]["policy_loss"]) == pytest.approx(want, rel=1e-6)  # failures and advantages unread
    assert float(loss({**batch, "chain": batch["chain"].at[won, -1].add(1.0)})[1]["policy_loss"]) != pytest.approx(
        want, rel=1e-3
    )
    # the update's draw: only successful active decisions, a fixed number, none when nothing succeeded
    drawn = ppo.imitation_batch(batch, 64, jax.random.key(5))
    assert drawn["active"].shape == (64,) and np.asarray(drawn["active"]).all() and np.asarray(drawn["success"]).all()
    assert ppo.imitation_batch({**batch, "success": jnp.zeros_like(batch["success"])}, 64, key) is None
    # better_than_expected: only the successes with a positive advantage (GRPO: contested initial states)
    signs = np.where(np.arange(success.size) % 4 < 2, 1.0, -1.0)  # of the successes, every other one
    signed = {**batch, "advantage": jnp.asarray(signs, jnp.float32)}
    drawn = ppo.imitation_batch(signed, 64, jax.random.key(5), imitate="better_than_expected")
    assert np.asarray(drawn["success"]).all() and (np.asarray(drawn["advantage"]) > 0).all()
    pool = ppo.imitation_pool(signed, "better_than_expected")
    assert pool.size == (active & success & (signs > 0)).sum() > 0
    assert (np.asarray(ppo.imitation_batch(signed, 64, jax.random.key(5))["advantage"]) < 0).any()
    no_surprise = {**batch, "advantage": jnp.asarray(-1.0 * success, jnp.float32)}  # every success foreseen
    assert ppo.imitation_batch(no_surprise, 8, key, "better_than_expected") is None
    with pytest.raises(ValueError, match="imitate"):
        ppo.PPOSettings(imitate="failures")
    # demonstrations add behaviour cloning's loss on them, times demo_coef
    observation, chunks = batch["model_observation"], batch["chain"][:, -1]
    demos = {"state": np.asarray(observation["state"][:4]), "actions": np.asarray(chunks[:4])}
    bc = float(st.agent.bc_loss(st.params, demos, jax.random.fold_in(key, 1)))
    settings = dataclasses.replace(settings, demo_coef=0.5)
    with_demos, metrics = loss(batch, demos)
    assert bc > 0 and float(metrics["demo_loss"]) == pytest.approx(bc, rel=1e-5)
    assert with_demos == pytest.approx(loss(batch)[0] + 0.5 * bc, rel=1e-5)


@pytest.mark.parametrize("family", ["pi05", "gr00t"])
def test_each_examples_loss_is_its_own_and_they_average_to_the_training_loss(family):
    from flax import nnx

    if family == "pi05":
        from embodied_jax.models.pi05.variants import variant
    else:
        from embodied_jax.models.gr00t.variants import variant
    config = variant("tiny")
    with nnx.use_eager_sharding(False):
        model = config.make(nnx.Rngs(0))
    batch = config.synthetic_batch(3, seed=1)
    observation = {k: v for k, v in batch.items() if k not in ("actions", "action_mask", "action_dim_mask")}
    chunk = model.sample_actions(observation, jax.random.key(0), trace=True).states[-1]  # what RL regresses onto
    losses_of = nnx.jit(lambda m, b, k: (m.example_losses(b, k), m.loss(b, k)[0]))
    key = jax.random.key(4)
    each, whole = losses_of(model, {**observation, "actions": chunk}, key)
    assert each.shape == (3,) and np.all(np.asarray(each) > 0)
    np.testing.assert_allclose(float(np.mean(each)), float(whole), rtol=1e-5)
    moved, _ = losses_of(model, {**observation, "actions": chunk.at[2].add(0.5)}, key)
    np.testing.assert_allclose(np.asarray(moved)[:2], np.asarray(each)[:2], rtol=1e-5)
    assert abs(float(moved[2]) - float(each[2])) > 1e-4
