"""Batched closed-loop evaluation of a policy in MJX with action chunking.

The policy is any callable ``act(observation, rng) -> actions [B, H, A]`` (or
``act(params, observation, rng)`` when ``params`` are passed to the evaluator, so a
changing set of weights does not retrace). ``observation`` is the batch a real robot
would give it::

    {"state": float32 [B, S],                    # joint positions, grip in [0, 1]
     "images": {camera: uint8 [B, H, W, 3]},     # "scene" + wrist camera(s)
     "time_step": int32 [B]}                     # control steps since reset

The task instruction is ``env.instruction`` (a string: bake it into the policy's prompt
before evaluating). Actions are unnormalised absolute joint targets (see ``tasks``).

B environments run in parallel; every ``execute_steps`` (k) control steps the policy
is queried and the first k of its H actions are executed. Reset, rendering, policy
and physics for the whole evaluation are ONE jitted program (an outer ``lax.scan``
over replans, an inner one over the k executed actions). With a mesh, the batch is
split over the mesh's ``data`` axis with ``shard_map`` (each device simulates its
share; other mesh axes stay automatic for the policy's own sharding).

Inference delay and real-time chunking (``inference_delay`` d, ``rtc``): the policy is
still queried every k steps (step t_r = r·k) with the observation at that moment, and chunk
C_r's action i is meant for step t_r + i, but the chunk only arrives d steps later (0 <= d <=
k, and H >= k + d). Until then the robot keeps executing the previous chunk at its own time
indices, C_{r-1}[k : k + d]; from t_r + d it switches to C_r[d : k], and C_r[k : k + d] run
during the next query's delay: k actions per replan, each executed at the step it was
predicted for. The first query of an episode has no previous chunk: its first d actions are
executed as they are (the robot waits at reset for the first chunk; d = 0 behaviour), with
either method. Naive switching (``rtc=False``) samples every chunk plainly; RTC
(``nn/rtc.py``) passes the previous chunk's unexecuted actions shifted to the new chunk's
time origin (``shift_prefix(C_{r-1}, k)``, unnormalised robot actions) with
``prefix_weights(H, delay=d, executed=k)`` ("exp"; all zero at the first query), so that the
new chunk's first d actions are the ones executing during the delay and the rest of the
overlap blends into it. An RTC policy is ``act(observation, rng, prefix_actions,
prefix_weights)`` (``params`` first with ``params``; ``embodied_jax.bundle.act_fn(bundle, ..., rtc=True)``), which
samples plainly when both are None. d = 0 without RTC is the program described above.

Results: per-task success rate with a 95% Wilson interval, mean episode length, mean
per-step reward and mean return; the squared third difference of the executed actions
(summed over action dims; the commanded motion's jerk) averaged over every running
episode's stencils whose four steps straddle a chunk switch (the first action executed
from a new chunk, step r·k + d for r >= 1): ``jerk_at_boundaries``, and over the other
stencils: ``jerk_elsewhere`` (None where there are none: k <= 3); mp4 videos of the first
episodes (scene camera at every control step) and a PNG grid of frames; everything
summarised in JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from embodied_jax.errors import InputError
from embodied_jax.nn import rtc as rtc_lib
from embodied_jax.sim import env as env_lib
from embodied_jax.sim import media
from embodied_jax.sim import render as render_lib

ActFn = Callable[..., jax.Array]
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    num_envs: int = 64
    execute_steps: int = 5  # k: actions executed from each predicted chunk before replanning
    num_videos: int = 4  # first episodes recorded as mp4 (0: no video rendering at all)
    video_camera: str = "scene"
    grid_frames: int = 8  # frames per recorded episode in the PNG grid
    seed: int = 0
    max_steps: int | None = None  # default: the task's episode limit
    data_axis: str = "data"
    inference_delay: int = 0  # d: control steps from a query until its chunk arrives (0 <= d <= k)
    rtc: bool = False  # real-time chunking: each query is guided towards the previous chunk's rest


class InferenceDelayError(InputError, ValueError):
    """An inference delay the evaluation cannot simulate (negative, longer than a replan, or than the chunk)."""


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1.0 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    return max(0.0, centre - half), min(1.0, centre + half)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EvalRollout:
    """Per-episode outcome [B] and per-step records [B, T] of one evaluation."""

    success: jax.Array
    length: jax.Array  # control steps until done (success or limit)
    reward: jax.Array  # [B, T] per-step reward (0 after done)
    active: jax.Array  # [B, T] the episode was running at that step
    video: jax.Array  # [V, T + 1, H, W, 3] uint8 frames of the first episodes
    actions: jax.Array  # [B, T, A] float32 actions executed


class Evaluator:
    """Compiles the closed-loop evaluation of ``act`` on ``env`` once; call it with a key.

    ``mesh``: shard the ``num_envs`` worlds over ``mesh.shape[config.data_axis]`` devices.
    """

    def __init__(self, env: env_lib.Env, act: ActFn, config: EvalConfig = EvalConfig(), *, mesh=None):
        self.env, self.act, self.config, self.mesh = env, act, config, mesh
        k = config.execute_steps
        if k < 1:
            raise ValueError(f"EvalConfig.execute_steps must be >= 1, got {k}")
        if not 0 <= config.inference_delay <= k:
            raise InferenceDelayError(
                f"EvalConfig.inference_delay={config.inference_delay}: between 0 and execute_steps={k} (a chunk "
                f"must arrive before the next query)"
            )
        self.max_steps = config.max_steps or env.episode_limit
        self.num_replans = -(-self.max_steps // k)
        shards = 1
        if mesh is not None:
            if config.data_axis not in mesh.shape:
                raise ValueError(f"mesh has no axis {config.data_axis!r} (axes: {tuple(mesh.shape)})")
            shards = mesh.shape[config.data_axis]
        if config.num_envs % shards:
            raise ValueError(f"EvalConfig.num_envs={config.num_envs} must divide evenly over {shards} data shards")
        self.local_envs = config.num_envs // shards
        if config.num_videos > self.local_envs:
            raise ValueError(f"EvalConfig.num_videos={config.num_videos} exceeds the {self.local_envs} envs per shard")
        self._renderer_kind = self._pick_renderer(shards)
        self._renderer(env.cameras)  # build renderers now, outside any trace
        if config.num_videos:
            self._renderer((config.video_camera,))
        self._compiled: dict[bool, Callable] = {}

    def _pick_renderer(self, shards: int) -> str:
        """Warp's per-device buffers are shared by virtual CPU devices: use the ray-caster there."""
        kind = render_lib.resolve_kind(self.env.config.renderer)
        if kind == "warp" and shards > 1 and jax.devices()[0].platform == "cpu":
            if self.env.config.renderer == "warp":
                raise ValueError("renderer='warp' cannot run sharded over several CPU devices; use 'raycast' or 'auto'")
            log.warning(
                "evaluating %s sharded over %d CPU devices with the ray-caster (Warp cannot shard over CPU "
                "devices): its images differ slightly from Warp-rendered ones, such as collected datasets",
                self.env.name,
                shards,
            )
            kind = "raycast"
        return kind

    # --- the traced program ---------------------------------------------------------
    def _renderer(self, cameras):
        # The env's own cache: evaluators of the same env (in-training evaluation) share renderers.
        return self.env.renderer(tuple(cameras), kind=self._renderer_kind)

    def _images(self, states, cameras):
        return self._renderer(cameras)(self.env.current_kinematics(states.data))

    def _local_rollout(self, reset_keys: jax.Array, policy_key: jax.Array, params) -> EvalRollout:
        """Evaluate ``reset_keys.shape[0]`` worlds (one shard)."""
        env, config = self.env, self.config
        k, d, num_videos = config.execute_steps, config.inference_delay, config.num_videos
        if self.mesh is not None:
            policy_key = jax.random.fold_in(policy_key, jax.lax.axis_index(config.data_axis))
        states = jax.vmap(env.reset)(reset_keys)
        batch = reset_keys.shape[0]

        def video_frame(states):
            if num_videos == 0:
                return jnp.zeros((0, 1, 1, 3), jnp.uint8)
            sub = jax.tree.map(lambda x: x[:num_videos], states)
            return self._images(sub, (config.video_camera,))[config.video_camera]

        def observe(states, r):
            return {
                "state": env.robot_state(states),
                "images": self._images(states, env.cameras),
                "time_step": jnp.full((batch,), r * k, jnp.int32),
            }

        def query(obs, r, *prefix):
            key = jax.random.fold_in(policy_key, r)
            chunk = self.act(obs, key, *prefix) if params is None else self.act(params, obs, key, *prefix)
            if chunk.ndim != 3 or chunk.shape[0] != batch or chunk.shape[2] != env.action_dim or chunk.shape[1] < k:
                raise ValueError(f"act must return [B={batch}, H>={k}, A={env.action_dim}] actions, got {chunk.shape}")
            return chunk

        def execute(states, actions):
            def one(states, j):
                active = ~states.done
                frame = video_frame(states)
                action = actions[:, j].astype(jnp.float32)
                nxt = env_lib.batch_step(env, states, action)
                return nxt, (jnp.where(active, nxt.reward, 0.0), active, frame, action)

            return jax.lax.scan(one, states, jnp.arange(k))

        def replan(carry, r):
            states = carry
            chunk = query(observe(states, r), r)
            return execute(states, chunk)

        def delayed_replan(carry, r):
            states, previous = carry
            obs = observe(states, r)
            if config.rtc:
                # The first query has no previous chunk: zero weights sample the plain chunk.
                weights = jnp.where(r > 0, rtc_lib.prefix_weights(horizon, d, k), 0.0)
                chunk = query(obs, r, rtc_lib.shift_prefix(previous, k), weights)
            else:
                chunk = query(obs, r)
            # During the delay the previous chunk runs on at its own time indices (the first chunk: its own).
            kept = jnp.where(r > 0, previous[:, k : k + d], chunk[:, :d].astype(previous.dtype))
            states, rec = execute(states, jnp.concatenate([kept, chunk[:, d:k].astype(previous.dtype)], 1))
            return (states, chunk.astype(previous.dtype)), rec

        if d == 0 and not config.rtc:
            final, (reward, active, frames, actions) = jax.lax.scan(replan, states, jnp.arange(self.num_replans))
        else:
            plain = (None, None) if config.rtc else ()
            shape = jax.eval_shape(lambda s: query(observe(s, 0), 0, *plain), states).shape
            horizon = shape[1]
            if horizon < k + d:
                raise InferenceDelayError(
                    f"chunks of {horizon} actions cannot cover execute_steps={k} plus inference_delay={d} steps"
                )
            previous = jnp.zeros(shape, jnp.float32)
            carry, (reward, active, frames, actions) = jax.lax.scan(
                delayed_replan, (states, previous), jnp.arange(self.num_replans)
            )
            final = carry[0]
        steps = self.num_replans * k
        reward = reward.reshape(steps, batch)[: self.max_steps].T
        active = active.reshape(steps, batch)[: self.max_steps].T
        actions = actions.reshape(steps, batch, -1)[: self.max_steps].swapaxes(0, 1)
        frames = frames.reshape((steps,) + frames.shape[2:])[: self.max_steps]
        frames = jnp.concatenate([frames, video_frame(final)[None]], 0).swapaxes(0, 1)
        return EvalRollout(
            success=final.success,
            length=active.sum(1).astype(jnp.int32),
            reward=reward,
            active=active,
            video=frames,
            actions=actions,
        )

    def _program(self, with_params: bool):
        if with_params in self._compiled:
            return self._compiled[with_params]
        config, mesh = self.config, self.mesh

        def program(rng, params):
            # Same episode keys as rollout.make_rollout(env, ..., batch=num_envs)(rng).
            k_reset, k_policy = jax.random.split(rng)
            reset_keys = jax.random.split(k_reset, config.num_envs)
            if mesh is None:
                return self._local_rollout(reset_keys, k_policy, params)
            ax = config.data_axis
            # Size-1 axes are manual too: host callbacks in the policy (e.g. a policy bundle's
            # preprocessing) need every mesh axis manual, and a size-1 axis loses nothing.
            manual = {ax} | {name for name, size in mesh.shape.items() if size == 1}
            sharded = jax.shard_map(
                self._local_rollout,
                mesh=mesh,
                in_specs=(P(ax), P(), P()),
                out_specs=EvalRollout(
                    success=P(ax), length=P(ax), reward=P(ax), active=P(ax), video=P(ax), actions=P(ax)
                ),
                axis_names=manual,
                check_vma=False,
            )
            return sharded(reset_keys, k_policy, params)

        self._compiled[with_params] = jax.jit(program)
        return self._compiled[with_params]

    def rollout(self, rng: jax.Array | None = None, params: Any = None) -> EvalRollout:
        """Run the evaluation; returns device arrays (videos from the first shard only under a mesh)."""
        rng = jax.random.key(self.config.seed) if rng is None else rng
        return self._program(params is not None)(rng, params)

    def __call__(self, rng: jax.Array | None = None, params: Any = None, *, out_dir=None) -> dict[str, Any]:
        return summarize(self.env, self.config, self.rollout(rng, params), out_dir=out_dir)


def boundary_jerk(actions, active, execute_steps: int, inference_delay: int = 0) -> tuple[float, float | None]:
    """Mean squared third difference (summed over action dims) of executed ``actions`` [B, T, A]
    over the stencils of running episodes (``active`` [B, T] at their last step) that straddle a
    chunk switch (step r·k + d, r >= 1: the stencil's first step before it, its last at or after
    it), and over all other such stencils (None if there are none)."""
    actions, active = np.asarray(actions, np.float64), np.asarray(active, bool)
    jerk = (np.diff(actions, n=3, axis=1) ** 2).sum(-1)  # [B, T - 3], stencil t covers steps t .. t + 3
    t = np.arange(jerk.shape[1])
    # A switch s lies in t + 1 .. t + 3: t + 3 - s >= 0 and t - s < 0 for some s = r·k + d.
    after = t + 3 - inference_delay
    at = (after >= execute_steps) & (after // execute_steps > (t - inference_delay) // execute_steps)
    running = active[:, 3:]
    boundary, elsewhere = running & at, running & ~at
    mean = lambda mask: float(jerk[mask].mean()) if mask.any() else None  # noqa: E731
    return mean(boundary), mean(elsewhere)


def summarize(env: env_lib.Env, config: EvalConfig, result: EvalRollout, *, out_dir=None) -> dict[str, Any]:
    """Metrics of one evaluation; with ``out_dir`` also videos, a PNG grid and ``results.json``."""
    success = np.asarray(result.success)
    active = np.asarray(result.active)
    reward = np.asarray(result.reward)
    n, s = int(success.size), int(success.sum())
    low, high = wilson_interval(s, n)
    steps = np.maximum(active.sum(1), 1)
    at_boundaries, elsewhere = boundary_jerk(result.actions, active, config.execute_steps, config.inference_delay)
    metrics: dict[str, Any] = {
        "task": env.name,
        "instruction": env.instruction,
        "episodes": n,
        "successes": s,
        "success_rate": s / n,
        "success_ci95": [low, high],
        "mean_episode_length": float(np.asarray(result.length).mean()),
        "mean_reward": float((reward.sum(1) / steps).mean()),
        "mean_return": float(reward.sum(1).mean()),
        "execute_steps": config.execute_steps,
        "inference_delay": config.inference_delay,
        "rtc": config.rtc,
        "jerk_at_boundaries": at_boundaries,
        "jerk_elsewhere": elsewhere,
        "image_size": list(env.config.image_size),
    }
    if out_dir is not None:
        out = pathlib.Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        video = np.asarray(result.video)[: config.num_videos]
        fps = round(1.0 / env.control_dt)
        metrics["videos"] = [
            str(media.write_mp4(out / f"{env.name}_episode{i}.mp4", v, fps)) for i, v in enumerate(video)
        ]
        if len(video):
            picks = np.linspace(0, video.shape[1] - 1, config.grid_frames).round().astype(int)
            metrics["frame_grid"] = str(
                media.write_png(out / f"{env.name}_frames.png", media.frame_grid(video[:, picks]))
            )
        (out / f"{env.name}_results.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def evaluate_tasks(
    tasks: Sequence[str | env_lib.Env],
    act_for: Callable[[env_lib.Env], ActFn],
    config: EvalConfig = EvalConfig(),
    *,
    env_config: env_lib.EnvConfig = env_lib.EnvConfig(),
    mesh=None,
    out_dir: str | os.PathLike | None = None,
    params: Any = None,
) -> dict[str, Any]:
    """Evaluate on several tasks; ``act_for(env)`` builds the policy for a task (its prompt).

    Returns ``{"tasks": {name: metrics}, "mean_success_rate": float}`` and writes
    ``results.json`` (plus per-task media) under ``out_dir`` when given.
    """
    per_task = {}
    for task in tasks:
        env = task if isinstance(task, env_lib.Env) else env_lib.Env(task, env_config)
        per_task[env.name] = Evaluator(env, act_for(env), config, mesh=mesh)(params=params, out_dir=out_dir)
    results = {"tasks": per_task, "mean_success_rate": float(np.mean([m["success_rate"] for m in per_task.values()]))}
    if out_dir is not None:
        pathlib.Path(out_dir, "results.json").write_text(json.dumps(results, indent=2))
    return results
