"""The RL loop: rollout, advantages, PPO update, metrics, evaluation and checkpoints, resumable.

One iteration: ``rollouts_per_update`` jitted rollouts of ``num_envs`` episodes each with the
policy in the loop (``rollout.py``), advantages (GAE with the critic, or GRPO's group-normalised success), the
start policy's log-probability of every sampled chain (the KL to the start), and one jitted
PPO update (``ppo.py``) of the weights ``rl.train`` names (``scope.py``). Each iteration writes a
``metrics.jsonl`` / TensorBoard row: success rate and return of the rollout, value loss, KL to
the start, clip fraction, approximate entropy (minus the mean log-probability of the chains),
the critic's explained variance, the advantages' mean and std, the executed actions' spread
(``diagnostics.py``), environment steps and decisions per second, rollout and update seconds.
Held-out evaluation (the start, every ``eval_every`` iterations and at the end) runs the policy
as it is deployed (the deterministic sampler, the bundle's own evaluation path) on reset seeds
the rollouts never use; ``stop_below_start`` evaluations in a row below the start end the run.

The run holds ``<workdir>/run.lock``; SIGTERM/SIGINT end it after the current iteration with a
checkpoint (``Preempted``); a resumed run continues from the latest checkpoint and repeats the
uninterrupted run's metrics. A non-finite update is skipped (the weights before it are kept);
three in a row end the run with ``NonFiniteLossError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import pathlib
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from embodied_jax.rl import advantages, host_rollout, ppo
from embodied_jax.rl import rollout as rollout_lib
from embodied_jax.rl.checkpoint import RLCheckpointer
from embodied_jax.rl.config import RLExperimentConfig
from embodied_jax.rl.critic import Critic
from embodied_jax.rl.demos import DemoBatches
from embodied_jax.rl.diagnostics import rollout_diagnostics
from embodied_jax.rl.held_out import evaluate_when_due, held_out_evaluation, held_out_row, stop_reason
from embodied_jax.rl.scope import Scope
from embodied_jax.rl.start import start
from embodied_jax.train.loop import NonFiniteLossError, Preempted, SignalFlag
from embodied_jax.train.metrics import MetricsWriter
from embodied_jax.train.run_lock import RunLock

log = logging.getLogger(__name__)
MAX_SKIPS = 3
KL_SAMPLE = 256  # decisions scored by the start policy per iteration when the KL is only reported


@dataclasses.dataclass
class RLResult:
    workdir: pathlib.Path
    iterations: int  # completed
    history: list[dict[str, float]]
    evaluation: dict[str, Any] | None  # the final held-out evaluation (runs only)
    stopped: str | None = None  # why the run ended before ``rl.iterations`` (time, a fall below the start)


def _observation_example(st) -> dict[str, Any]:
    """One observation of the run's environments (abstract, or a reset's for host-stepped ones)."""
    if not st.host_stepped:
        return rollout_lib.observation_example(st.env)
    st.env.reset(jax.random.key(0), np.arange(st.env.num_envs))
    return st.env.observe()


def critic_functions(state_dim: int, width: int, seed: int):
    """``(critic(params, state, progress), params)``: params ``{"net", "shift", "scale"}``, the network
    predicting the value in units of the returns' running scale (``value_stats``): value = net *
    scale + shift, so the critic learns at the same pace whatever the rewards' size. ``shift`` and
    ``scale`` get no gradient; the loop sets them."""
    graphdef, net = nnx.split(Critic(state_dim, width, rngs=nnx.Rngs(seed)))

    def critic(p, s, prog):
        raw = nnx.merge(graphdef, p["net"], copy=True)(s, prog)
        return raw * jax.lax.stop_gradient(p["scale"]) + jax.lax.stop_gradient(p["shift"])

    return critic, {"net": net, "shift": jnp.zeros((), jnp.float32), "scale": jnp.ones((), jnp.float32)}


def value_stats(critic_params, returns, active, first: bool, decay: float = 0.9):
    """``critic_params`` with ``shift``/``scale`` moved to the mean and std of this rollout's returns
    (over active decisions): set on the first iteration, an exponential average (``decay``) after."""
    mask = np.asarray(active, bool)
    r = np.asarray(returns, np.float64)[mask]
    if r.size == 0:
        return critic_params
    mean, std = r.mean(), max(r.std(), 1e-3)
    if not first:
        mean = decay * float(critic_params["shift"]) + (1 - decay) * mean
        std = decay * float(critic_params["scale"]) + (1 - decay) * std
    return {**critic_params, "shift": jnp.asarray(mean, jnp.float32), "scale": jnp.asarray(std, jnp.float32)}


def chain_scores(agent, params, batch: dict[str, Any], chunk: int) -> jax.Array:
    """log-probabilities [N] of the flat batch's chains under ``params``, ``chunk`` rows at a time."""
    rows = {"model_observation": batch["model_observation"], "chain": batch["chain"]}
    return jax.lax.map(
        lambda r: agent.log_prob(params, jax.tree.map(lambda x: x[None], r["model_observation"]), r["chain"][None])[0],
        rows,
        batch_size=chunk,
    )


def _mesh(devices: list):
    if len(devices) == 1:
        return None
    return jax.sharding.Mesh(np.asarray(devices), ("data",))


def train(config: RLExperimentConfig, devices: list | None = None) -> RLResult:
    rl = config.rl
    workdir = pathlib.Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    devices = list(devices or jax.local_devices())
    with contextlib.ExitStack() as cleanup:
        lock = cleanup.enter_context(RunLock(workdir))
        stop = cleanup.enter_context(SignalFlag())
        st = start(config, devices)
        k = st.execute_steps
        spec = rollout_lib.RolloutSpec(
            num_envs=rl.num_envs,
            execute_steps=k,
            decisions=rollout_lib.decisions_per_episode(st.env.episode_limit, k),
            shaping=rl.shaping,
            groups=rl.groups if rl.advantage == "grpo" else None,
            privileged_critic=rl.privileged_critic,
            expert_features=rl.expert_features,
        )
        if st.host_stepped:
            critic_in = host_rollout.critic_width(st.env, rl.privileged_critic)
        else:
            critic_in = rollout_lib.critic_width(st.env, rl.privileged_critic)
        if rl.expert_features:
            critic_in += rollout_lib.expert_width(st.agent, st.params, _observation_example(st))
        critic, critic_params = critic_functions(critic_in, rl.critic_width, rl.seed)
        # Several rollouts per update: as many times the minibatches, each of one rollout's size (self-
        # imitation draws a batch of its own size whatever the rollouts).
        settings = rl.ppo
        if rl.rollouts_per_update > 1 and rl.ppo.objective != "self_imitation":
            settings = dataclasses.replace(rl.ppo, minibatches=rl.ppo.minibatches * rl.rollouts_per_update)
        policy_opt = optax.chain(optax.clip_by_global_norm(rl.max_grad_norm), optax.adam(_policy_lr(rl, settings)))
        critic_opt = optax.chain(optax.clip_by_global_norm(rl.max_grad_norm), optax.adam(rl.critic_lr))
        params, fixed = st.scope.partition(st.params)  # params: the weights RL moves; fixed: the rest
        if len(devices) == 1:  # the updates' outputs live on the device uncommitted to a mesh: no retrace
            params, fixed, critic_params = jax.device_put((params, fixed, critic_params), devices[0])
        opt_states = (policy_opt.init(params), critic_opt.init(critic_params))
        if st.host_stepped:
            rollout = host_rollout.make_host_rollout(st.env, st.agent, critic, spec)
            cleanup.callback(st.env.close)
        else:
            with st.rt.context():
                rollout = rollout_lib.make_rollout(st.env, st.agent, critic, spec, mesh=_mesh(devices))
        update = ppo.make_update(st.agent, critic, settings, policy_opt, critic_opt)
        minibatch = spec.decisions * rl.num_envs // rl.ppo.minibatches
        score = jax.jit(lambda p, batch: chain_scores(st.agent, p, batch, minibatch))
        sample_score = jax.jit(
            lambda p, batch, idx: chain_scores(st.agent, p, jax.tree.map(lambda x: x[idx], batch), KL_SAMPLE)
        )

        def start_log_prob(batch, key):
            """The start policy's log-probability of the chains, and the KL of the policy that sampled
            them to the start (k3 over ``KL_SAMPLE`` of the active decisions): all chains when the
            KL is optimised (``ppo.kl_coef``); otherwise the sample's only, the rest their own."""
            n = batch["log_prob"].shape[0]
            weights = jnp.asarray(batch["active"], jnp.float32) + 1e-6
            idx = jax.random.choice(key, n, (min(KL_SAMPLE, n),), replace=False, p=weights / weights.sum())
            sampled = sample_score(st.params, batch, idx)
            log_r = sampled - jnp.asarray(batch["log_prob"])[idx]
            kl = jnp.sum((jnp.exp(log_r) - 1.0 - log_r) * batch["active"][idx]) / jnp.maximum(
                batch["active"][idx].sum(), 1
            )
            if rl.ppo.kl_coef > 0:
                return score(st.params, batch), float(kl)
            return jnp.asarray(batch["log_prob"]).at[idx].set(sampled), float(kl)

        demos = None
        if rl.demo_batch:
            demos = DemoBatches(st, rl.demo_batch, settings.epochs * settings.minibatches, rl.seed)
            cleanup.callback(demos.close)
        demo_iterator = demos.iterator if demos is not None else None
        ckpt = RLCheckpointer(workdir, rl.keep_last)
        cleanup.callback(ckpt.close)
        counters = {"iteration": 0, "env_steps": 0, "elapsed_s": 0.0, "start_success": -1.0, "below_start": 0}
        latest = ckpt.latest()
        if latest is not None:
            template = {"critic": critic_params, "opt": opt_states, "counters": _counters_array(counters)}
            full, restored = ckpt.restore(latest, st, template, demo_iterator)
            params, _ = st.scope.partition(full)
            critic_params, opt_states = restored["critic"], restored["opt"]
            counters = {k_: v.item() for k_, v in restored["counters"].items()}
            log.info("resumed %s at iteration %d", workdir, counters["iteration"])
        (workdir / "rl_config.json").write_text(json.dumps(dataclasses.asdict(rl), indent=1))
        metrics = MetricsWriter(
            dataclasses.replace(config.metrics, progress_bar=False),
            workdir,
            rl.iterations,
            counters["iteration"],
            resumed_from=latest,
        )
        cleanup.callback(metrics.close)
        held_out = held_out_evaluation(st, config, k)
        evaluate_start = held_out is not None and rl.eval_every > 0  # the start's figure, stop rule or not
        watch = evaluate_start and rl.stop_below_start > 0
        if evaluate_start and counters["start_success"] < 0:
            result = held_out(st.params)
            counters["start_success"] = result["success_rate"]
            metrics.write(0, held_out_row(rl.task, result))
        began, base_elapsed = time.monotonic(), counters["elapsed_s"]
        skips = 0
        final = stopped = None
        it = counters["iteration"]
        while it < rl.iterations:
            key = jax.random.fold_in(jax.random.key(rl.seed), it)
            k_roll, k_update = jax.random.split(key)
            t0 = time.perf_counter()
            weights = Scope.combine(params, fixed)
            rollouts = [
                rollout(weights, critic_params, jax.random.fold_in(k_roll, r) if r else k_roll)
                for r in range(rl.rollouts_per_update)
            ]
            jax.block_until_ready([r.success for r in rollouts])
            t_roll = time.perf_counter() - t0
            # Advantages per rollout (GRPO's groups share reset keys within one), then side by side.
            per_rollout = [_advantages(rl, r) for r in rollouts]
            adv = jnp.concatenate([a for a, _ in per_rollout], axis=1)
            returns = jnp.concatenate([g for _, g in per_rollout], axis=1)
            batch_rollout = rollout_lib.concat_rollouts(rollouts)
            critic_params = value_stats(critic_params, returns, batch_rollout.active, first=it == 0)
            batch = ppo.flat_decisions(batch_rollout, adv, returns, batch_rollout.log_prob)
            t0 = time.perf_counter()
            batch["start_log_prob"], kl_to_start = start_log_prob(batch, jax.random.fold_in(k_update, 1))
            pool = None
            if rl.ppo.objective == "self_imitation":
                pool = ppo.imitation_pool(batch, rl.ppo.imitate)
                batch = ppo.imitation_batch(
                    batch, rl.ppo.imitation_decisions, jax.random.fold_in(k_update, 2), pool=pool
                )
            if batch is None:  # self-imitation with no (chosen) successful decision: nothing to imitate
                new, row = None, {}
            else:
                demo_batches = demos.next_update() if demos is not None else None
                new = update(params, fixed, critic_params, opt_states, batch, k_update, demo_batches)
                jax.block_until_ready(new)
                row = {k_: float(v) for k_, v in new[3].items()}
            t_update = time.perf_counter() - t0
            if new is None:
                log.info("iteration %d: no successful decision to imitate (%s); no update", it, rl.ppo.imitate)
            elif not all(math.isfinite(v) for v in row.values()) or not _finite(new[0]):
                skips += 1
                log.warning("iteration %d: non-finite update skipped (%d in a row)", it, skips)
                if skips >= MAX_SKIPS:
                    raise NonFiniteLossError(f"{MAX_SKIPS} non-finite updates in a row at iteration {it}")
            else:
                skips = 0
                params, critic_params, opt_states = new[:3]
            it += 1
            env_steps = int(jnp.sum(batch_rollout.env_steps))
            decisions = int(jnp.sum(batch_rollout.active))
            counters["iteration"] = it
            counters["env_steps"] += env_steps
            counters["elapsed_s"] = base_elapsed + time.monotonic() - began
            active = np.asarray(batch_rollout.active, bool)
            if pool is not None:
                row["imitation_pool"] = int(pool.size)  # the decisions self-imitation could draw from
            row.update(
                episodes=int(batch_rollout.success.shape[0]),
                kl_to_start=kl_to_start,
                success_rate=float(jnp.mean(batch_rollout.success)),
                episode_return=float(jnp.mean(batch_rollout.episode_return)),
                approx_entropy=float(-np.asarray(batch_rollout.log_prob)[active].mean()),
                env_steps_per_s=env_steps / t_roll,
                decisions_per_s=decisions / t_roll,
                rollout_s=t_roll,
                update_s=t_update,
                env_steps=counters["env_steps"],
                skips=skips,
                **rollout_diagnostics(batch_rollout, adv, returns),
            )
            over_time = rl.minutes is not None and counters["elapsed_s"] >= 60 * rl.minutes
            last = it >= rl.iterations or over_time or stop.signum is not None
            trained = Scope.combine(params, fixed)
            fell, due = evaluate_when_due(
                rl,
                it,
                last,
                held_out and (lambda end, w=trained: held_out(w, workdir / "eval" if end else None)),
                counters,
                watch,
                workdir,
                row,
            )
            final = due or final
            metrics.write(it, row)
            if last or fell or it % rl.checkpoint_every == 0:
                lock.check()
                rest = {"critic": critic_params, "opt": opt_states, "counters": _counters_array(counters)}
                ckpt.save(it, st, trained, rest, demo_iterator)
            if stop.signum is not None:
                raise Preempted(stop.signum or signal.SIGTERM, it)
            stopped = stop_reason(rl, it, counters, fell, over_time)
            if stopped:
                break
        return RLResult(workdir, it, metrics.history, final, stopped)


def _policy_lr(rl, settings: ppo.PPOSettings):
    """The actor's learning rate: 0 for the first ``rl.critic_warmup`` iterations' updates (counted by
    the optimiser, so a resumed run keeps its place), ``rl.policy_lr`` after."""
    if not rl.critic_warmup:
        return rl.policy_lr
    held = rl.critic_warmup * settings.epochs * settings.minibatches
    return optax.join_schedules([optax.constant_schedule(0.0), optax.constant_schedule(rl.policy_lr)], [held])


def _advantages(rl, r):
    adv, returns = advantages.gae(
        r.reward, r.value, r.terminal, r.active, jnp.zeros_like(r.success, jnp.float32), gamma=rl.gamma, lam=rl.lam
    )
    if rl.advantage == "grpo":
        adv = advantages.group_advantages(r.success, rl.groups)[None, :] * r.active
    return adv, returns


def _counters_array(counters: dict) -> dict:
    return {
        "iteration": np.asarray(counters["iteration"], np.int32),
        "env_steps": np.asarray(counters["env_steps"], np.int32),
        "elapsed_s": np.asarray(counters["elapsed_s"], np.float32),
        "start_success": np.asarray(counters["start_success"], np.float32),
        "below_start": np.asarray(counters["below_start"], np.int32),
    }


def _finite(tree) -> bool:
    return all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating))
