"""The noise-steering run (``rl/steering.py``): episodes with the steered policy, every decision into
a replay buffer, SAC updates between decisions, held-out evaluations, checkpoints; resumable.

One iteration is one batch of ``rl.num_envs`` episodes stepped together on the host (Meta-World's
environments, or a JAX environment behind ``host_rollout.JaxHostEnvs``). Each decision the actor
picks the initial noise of every row, the frozen policy denoises it into a chunk and ``execute_steps``
of it are executed; ``updates_per_decision`` SAC steps follow once the buffer holds ``warmup``
transitions. When the batch's episodes end, its transitions (actor and critic inputs, noise,
reward, whether success ended the episode, the next decision's inputs and the return-to-go) enter
the buffer. The reward is the episode's success (1 when it first succeeds) plus ``rl.shaping``
times the task's dense reward; success ends an episode (terminal), the step limit only truncates
it (a bootstrapped critic, ``steer.critic_target``, takes the next decision's value there).

Held-out evaluations (``rl/steered.py``; ``rl.eval_envs`` episodes per task on ``rl.eval_seed``): for Meta-World the
project's evaluation by LeRobot's protocol, with the policy as deployed (random noise) at the start
and the steered policy (the actor's mean noise, ``steer.deterministic_eval``) after; for a JAX
environment the same two policies in host-stepped episodes from the seed's reset keys. Checkpoints
(``<workdir>/steer_state/<iteration>``: the actor, critics, optimiser states and counters; the
replay buffer in ``<workdir>/replay.npz``) every ``rl.checkpoint_every`` iterations, at the end and
on SIGTERM; a resumed run continues from the latest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import pathlib
import signal
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from embodied_jax.config_registry import to_dict
from embodied_jax.rl import host_rollout
from embodied_jax.rl.held_out import evaluate_when_due, held_out_row, stop_reason
from embodied_jax.rl.loop import RLResult
from embodied_jax.rl.replay import ReplayBuffer
from embodied_jax.rl.rollout import decisions_per_episode
from embodied_jax.rl.start import Start, start
from embodied_jax.rl.steered import HostHeldOut, MetaWorldSteeredHeldOut, Steerer
from embodied_jax.rl.steering import SteerNetworks, SteerSettings, make_update
from embodied_jax.train.loop import Preempted, SignalFlag
from embodied_jax.train.metrics import MetricsWriter
from embodied_jax.train.run_lock import RunLock

log = logging.getLogger(__name__)
STATE_DIR = "steer_state"
REPLAY = "replay.npz"
CONFIG = "steer_config.json"  # the run's start, RL and steering settings (to_dict), for its evaluations


def _counters(c: dict) -> dict:
    return {
        "iteration": np.asarray(c["iteration"], np.int32),
        "env_steps": np.asarray(c["env_steps"], np.int64),
        "updates": np.asarray(c["updates"], np.int64),
        "elapsed_s": np.asarray(c["elapsed_s"], np.float32),
        "start_success": np.asarray(c["start_success"], np.float32),
        "below_start": np.asarray(c["below_start"], np.int32),
        "return_min": np.asarray(c["return_min"], np.float32),
        "return_max": np.asarray(c["return_max"], np.float32),
    }


@dataclasses.dataclass
class SteerSetup:
    """What a steering run and its later evaluations share: the start, the environments, the
    networks with their initial parameters, the steered policy and the episode's shape."""

    st: Start
    env: Any  # the rollout's host-stepped environments
    nets: SteerNetworks
    params: Any  # SteerParams, initial
    steerer: Steerer
    policy_params: Any  # the frozen policy's weights
    execute_steps: int
    decisions: int  # per episode


def setup(config, devices: list) -> SteerSetup:
    """The run's start (``rl/start.py``), environments and networks sized by one observation."""
    rl, settings = config.rl, config.steer
    st = start(config, devices)
    env = st.env if st.host_stepped else host_rollout.JaxHostEnvs(st.env, rl.num_envs)
    k = st.execute_steps
    policy_params = jax.device_put(st.params, devices[0])
    env.reset(jax.random.key(0), np.arange(env.num_envs))
    example = env.observe()
    example["time_step"] = np.zeros((env.num_envs,), np.int32)

    def shapes(p, o):
        model, model_obs = st.agent.merge(p), st.agent.observe(o)
        return model.action_features(model_obs), model.sample_actions(model_obs, jax.random.key(0))

    features, chunk = jax.eval_shape(shapes, policy_params, example)
    noise_dim = int(features.shape[-1])  # the velocity at t = 1 has the initial noise's shape
    noise_shape = (int(chunk.shape[1]), noise_dim // int(chunk.shape[1]))
    actor_dim = int(np.asarray(example["state"]).shape[-1]) + noise_dim
    critic_dim = actor_dim + int(env.privileged_state().shape[-1])
    nets, params = SteerNetworks.init(actor_dim, critic_dim, noise_shape, settings, rl.seed)
    steerer = Steerer(st, nets)
    return SteerSetup(st, env, nets, params, steerer, policy_params, k, decisions_per_episode(env.episode_limit, k))


def held_out_evaluation(s: SteerSetup, config, seed: int, episodes: int):
    """``evaluate(policy_params, actor=None, deterministic=True)`` on ``episodes`` per task of ``seed``."""
    config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, eval_seed=seed, eval_envs=episodes))
    if s.st.host_stepped:
        return MetaWorldSteeredHeldOut(s.st, s.steerer, config, s.execute_steps)
    return HostHeldOut(s.st, s.steerer, episodes, seed, s.decisions, s.execute_steps)


def _manager(workdir: pathlib.Path, keep: int) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(workdir.absolute() / STATE_DIR, options=options)


def _restore(manager, latest: int, template: dict) -> dict:
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), template)
    return dict(manager.restore(latest, args=ocp.args.StandardRestore(target)))


def load_actor(workdir: str | pathlib.Path, s: SteerSetup, config, step: int | None = None):
    """(the trained actor's parameters, its iteration) from a steering run's checkpoints."""
    manager = _manager(pathlib.Path(workdir), config.rl.keep_last)
    try:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{workdir}: no steering checkpoint ({STATE_DIR}/)")
        _, init_opt = make_update(s.nets, config.steer, config.rl.gamma)
        template = {"params": s.params, "opt": init_opt(s.params), "counters": _counters(_COUNTERS)}
        return _restore(manager, step, template)["params"].actor, step
    finally:
        manager.close()


_COUNTERS = {
    "iteration": 0,
    "env_steps": 0,
    "updates": 0,
    "elapsed_s": 0.0,
    "start_success": -1.0,
    "below_start": 0,
    # the range of the episode returns seen so far (partial episodes' returns included): the critics' targets
    "return_min": 0.0,
    "return_max": 0.0,
}


def train(config, devices: list | None = None) -> RLResult:
    """``config``: an ``RLExperimentConfig`` with a ``steer: SteerSettings`` field."""
    rl, settings = config.rl, config.steer
    workdir = pathlib.Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    devices = list(devices or jax.local_devices())
    with contextlib.ExitStack() as cleanup:
        lock = cleanup.enter_context(RunLock(workdir))
        stop = cleanup.enter_context(SignalFlag())
        s = setup(config, devices)
        st, env, nets, params, steerer = s.st, s.env, s.nets, s.params, s.steerer
        policy_params, k, decisions = s.policy_params, s.execute_steps, s.decisions
        if st.host_stepped:
            cleanup.callback(env.close)
        update, init_opt = make_update(nets, settings, rl.gamma)
        opt_state = init_opt(params)

        manager = _manager(workdir, rl.keep_last)
        cleanup.callback(manager.close)
        counters = dict(_COUNTERS)
        buffer = ReplayBuffer(settings.buffer)
        latest = manager.latest_step()
        if latest is not None:
            restored = _restore(manager, latest, {"params": params, "opt": opt_state, "counters": _counters(counters)})
            params, opt_state = restored["params"], restored["opt"]
            counters = {k_: v.item() for k_, v in restored["counters"].items()}
            if (workdir / REPLAY).exists():
                buffer = ReplayBuffer.load(workdir / REPLAY)
            log.info("resumed %s at iteration %d (%d transitions)", workdir, counters["iteration"], len(buffer))
        saved = {"init_from": config.init_from, "rl": to_dict(rl), "steer": to_dict(settings)}
        if config.init_from is None:  # the toy policy: its model is the experiment's own
            saved["model"] = to_dict(config.model)
        (workdir / CONFIG).write_text(json.dumps(saved, indent=1))
        metrics = MetricsWriter(
            dataclasses.replace(config.metrics, progress_bar=False),
            workdir,
            rl.iterations,
            counters["iteration"],
            resumed_from=latest,
        )
        cleanup.callback(metrics.close)

        held_out = held_out_evaluation(s, config, rl.eval_seed, rl.eval_envs) if rl.eval_envs else None
        if held_out is not None and rl.eval_every and counters["start_success"] < 0:
            base = held_out(policy_params)
            steered = held_out(policy_params, params.actor, settings.deterministic_eval)
            counters["start_success"] = steered["success_rate"]
            row = held_out_row(rl.task, steered)
            row.update({f"base/{k_}": v for k_, v in held_out_row(rl.task, base).items()})
            metrics.write(0, row)

        rng = np.random.default_rng([rl.seed, counters["iteration"]])
        began, base_elapsed = time.monotonic(), counters["elapsed_s"]
        final = stopped = None
        it = counters["iteration"]
        watch = held_out is not None and rl.eval_every > 0 and rl.stop_below_start > 0
        while it < rl.iterations:
            key = jax.random.fold_in(jax.random.key(rl.seed), it)
            k_reset, k_policy, k_update = jax.random.split(key, 3)
            t_start = time.perf_counter()
            update_s, update_rows, noise_abs = 0.0, [], []
            n = env.num_envs
            env.reset(k_reset, np.arange(n))
            ret = np.zeros(n, np.float32)
            previous = None  # the last decision's transitions, completed by the next observation
            batch_transitions = []  # this batch's, kept until its episodes end (their returns-to-go)
            for r in range(decisions + 1):
                obs = env.observe()
                obs["time_step"] = np.full((n,), r * k, np.int32)
                ending = r == decisions or env.done.all()
                actions, actor_in, noise = steerer.decide(
                    policy_params, params.actor, obs, jax.random.fold_in(k_policy, r), False
                )
                actor_in = np.asarray(actor_in)
                critic_in = np.concatenate([actor_in, env.privileged_state()], -1)
                if previous is not None:
                    batch_transitions.append(_transitions(previous, actor_in, critic_in))
                if ending:  # this observation only completed the last transitions
                    break
                running, had_success = ~env.done, env.success.copy()
                actions = np.asarray(actions)
                dense = np.zeros(n, np.float32)
                for j in range(k):
                    dense += env.step(actions[:, j])
                reward = ((env.success & ~had_success).astype(np.float32) + rl.shaping * dense) * running
                ret += reward
                counters["return_min"] = min(counters["return_min"], float(ret.min()))
                counters["return_max"] = max(counters["return_max"], float(ret.max()))
                noise_abs.append(float(np.abs(np.asarray(noise))[running].mean()))
                # success ends an episode (no bootstrap); the step limit only truncates it
                previous = (
                    np.flatnonzero(running),
                    actor_in,
                    critic_in,
                    np.asarray(noise),
                    reward,
                    env.success & running,
                )
                if len(buffer) >= max(settings.warmup, settings.batch_size):
                    t0 = time.perf_counter()
                    batches = buffer.sample(rng, (settings.updates_per_decision, settings.batch_size))
                    bounds = (min(0.0, counters["return_min"]), max(counters["return_max"], 1e-6))
                    params, opt_state, m = update(
                        params, opt_state, jax.tree.map(jnp.asarray, batches), jax.random.fold_in(k_update, r), bounds
                    )
                    update_rows.append({k_: float(v) for k_, v in m.items()})
                    counters["updates"] += settings.updates_per_decision
                    update_s += time.perf_counter() - t0
            for transitions in _with_returns_to_go(batch_transitions, rl.gamma):
                buffer.add(transitions)
            success, env_steps = env.success.copy(), int(np.sum(env.steps))
            t_total = time.perf_counter() - t_start
            it += 1
            counters["iteration"] = it
            counters["env_steps"] += env_steps
            counters["elapsed_s"] = base_elapsed + time.monotonic() - began
            row = {
                "success_rate": float(success.mean()),
                "episode_return": float(ret.mean()),
                "episodes": len(success),
                "buffer": len(buffer),
                "updates": counters["updates"],
                "noise_abs_mean": float(np.mean(noise_abs)) if noise_abs else 0.0,
                "rollout_s": t_total - update_s,
                "update_s": update_s,
                "env_steps_per_s": env_steps / max(t_total - update_s, 1e-9),
                "env_steps": counters["env_steps"],
            }
            if update_rows:
                row.update({k_: float(np.mean([u[k_] for u in update_rows])) for k_ in update_rows[0]})
            over_time = rl.minutes is not None and counters["elapsed_s"] >= 60 * rl.minutes
            last = it >= rl.iterations or over_time or stop.signum is not None
            fell, due = evaluate_when_due(
                rl,
                it,
                last,
                held_out and (lambda end, a=params.actor: held_out(policy_params, a, settings.deterministic_eval)),
                counters,
                watch,
                workdir,
                row,
            )
            final = due or final
            metrics.write(it, row)
            if last or fell or it % rl.checkpoint_every == 0:
                lock.check()
                buffer.save(workdir / REPLAY)
                state = {"params": params, "opt": opt_state, "counters": _counters(counters)}
                manager.save(it, args=ocp.args.StandardSave(state), force=True)
                manager.wait_until_finished()
            if stop.signum is not None:
                raise Preempted(stop.signum or signal.SIGTERM, it)
            stopped = stop_reason(rl, it, counters, fell, over_time)
            if stopped:
                break
        return RLResult(workdir, it, metrics.history, final, stopped)


def _with_returns_to_go(batch: list[dict], gamma: float) -> list[dict]:
    """Each decision's transitions with ``return_to_go``: its reward plus the discounted rewards of
    the same episode's later decisions (an episode ends at success or at the step limit, so nothing
    follows its last decision)."""
    later = np.zeros(1 + max((int(t["row"].max()) for t in batch if t["row"].size), default=-1), np.float32)
    for transitions in reversed(batch):
        rows = transitions.pop("row")
        later[rows] = transitions["reward"] + gamma * later[rows]
        transitions["return_to_go"] = later[rows].copy()
    return batch


def _transitions(previous, next_actor_in: np.ndarray, next_critic_in: np.ndarray) -> dict[str, np.ndarray]:
    """The transitions of the rows that were running at the previous decision (``row``: their rows)."""
    rows, actor_in, critic_in, noise, reward, terminal = previous
    return {
        "row": rows,
        "actor_in": actor_in[rows],
        "critic_in": critic_in[rows],
        "noise": noise[rows],
        "reward": reward[rows].astype(np.float32),
        "terminal": terminal[rows].astype(np.float32),
        "next_actor_in": next_actor_in[rows],
        "next_critic_in": next_critic_in[rows],
    }


__all__ = ["SteerSettings", "SteerSetup", "held_out_evaluation", "load_actor", "setup", "train"]
