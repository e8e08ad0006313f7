"""Simulation throughput: batched MJX vs one CPU MuJoCo environment per loop.

    python -m experiments.benchmarks.sim_throughput [--task reach] [--batches 1 64 256]
                                                    [--image-size 64] [--baseline-episodes 4]
                                                    [--policy CKPT_DIR]

1. Environment steps/s without a policy (scripted expert actions, no rendering), B worlds:
   MJX JAX backend vs MJX Warp backend (both one jitted ``lax.scan``) vs plain
   ``mujoco.mj_step`` looping over the same B environments on the CPU.
2. Closed-loop evaluation episodes/s with rendering (scene + wrist cameras) and a small
   image+state policy (fixed random weights; a stand-in with the demo policy's inputs and
   outputs; ``--policy`` loads a trained one instead, e.g. the demo's ``runs/demo/reach``, through
   ``load_policy``), action chunks of H=10 with k=5 executed: the batched evaluator at B = 1, 64,
   256 vs the way LeRobot / Isaac-GR00T evaluate (one CPU ``mj_step`` environment per
   loop, policy called with batch 1 at every replan, images rendered per environment).
   The per-environment renderer is MuJoCo's OpenGL renderer when a GL context can be
   created, otherwise the Warp renderer with one world (this machine has no GL).

Prints every figure and the ratios from this one run.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
import types
from typing import Annotated, Literal

import jax
import jax.numpy as jnp
import mujoco
import numpy as np
import tyro
from mujoco import mjx

from embodied_jax.bundle import act_fn
from embodied_jax.cli import parse_flags
from embodied_jax.sim import closed_loop as eval_lib
from embodied_jax.sim import env as env_lib
from embodied_jax.sim import rollout as rollout_lib
from embodied_jax.sim import scenes
from embodied_jax.sim import tasks as tasks_lib
from experiments.benchmarks import harness

HORIZON, EXECUTE = 10, 5
TaskName = Literal[tuple(sorted(tasks_lib.TASKS))]  # the registered tasks: --task's choices


def trivial_policy(env: env_lib.Env, horizon: int = HORIZON):
    """A fixed random linear map from pooled camera images + state to an action chunk."""
    feat = len(env.cameras) * 4 * 4 * 3 + env.state_dim
    weights = jax.random.normal(jax.random.key(0), (feat, horizon * env.action_dim)) / np.sqrt(feat)
    low, high = env.action_bounds()

    def act(observation, rng):
        b = observation["state"].shape[0]
        pooled = []
        for cam in env.cameras:
            img = observation["images"][cam].astype(jnp.float32) / 255.0
            h, w = img.shape[1:3]
            pooled.append(img.reshape(b, 4, h // 4, 4, w // 4, 3).mean((2, 4)).reshape(b, -1))
        x = jnp.concatenate(pooled + [observation["state"]], -1)
        out = jnp.tanh(x @ weights).reshape(b, horizon, env.action_dim)
        return low + (out + 1) / 2 * (high - low)

    return act


def _timed(fn, *args):
    jax.block_until_ready(fn(*args))  # compile + warm
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def physics_steps(task: str, batch: int) -> dict[str, float]:
    """Control steps/s (each = tasks.SUBSTEPS physics steps) for B worlds."""
    out = {}
    for backend in ("jax", "warp"):
        env = env_lib.Env(task, env_lib.EnvConfig(physics=backend, warp_max_worlds=batch))
        run = rollout_lib.make_rollout(env, rollout_lib.expert_policy(env), batch)
        seconds = _timed(run, jax.random.key(0))
        out[backend] = batch * env.episode_limit / seconds
        if backend == "jax":
            actions = np.asarray(run(jax.random.key(0)).action)
            qpos0 = np.asarray(run(jax.random.key(0)).qpos[0])
            mocap = np.asarray(
                jax.vmap(env.reset)(jax.random.split(jax.random.split(jax.random.key(0))[0], batch)).data.mocap_pos
            )
    # Plain MuJoCo, same worlds and actions, one after the other.
    task_obj = env.task
    model = task_obj.model
    data = mujoco.MjData(model)
    start = time.perf_counter()
    for b in range(batch):
        mujoco.mj_resetData(model, data)
        data.qpos[:] = qpos0[b]
        data.mocap_pos[:] = mocap[b]
        for t in range(env.episode_limit):
            data.ctrl[:] = numpy_ctrl(task_obj, actions[t, b], data.ctrl)
            mujoco.mj_step(model, data, nstep=tasks_lib.SUBSTEPS)
    out["mj_step"] = batch * env.episode_limit / (time.perf_counter() - start)
    return out


def numpy_ctrl(task: tasks_lib.Task, action: np.ndarray, ctrl: np.ndarray) -> np.ndarray:
    low, high = (np.asarray(x) for x in task.action_bounds())
    action = np.clip(action, low, high)
    ctrl = ctrl.copy()
    for i, lay in enumerate(task.layouts):
        a = action[4 * i : 4 * i + 4]
        ctrl[list(lay.ctrl)] = [a[0], a[1], a[2], a[3] * scenes.FINGER_OPEN, a[3] * scenes.FINGER_OPEN]
    return ctrl


def batched_episodes_per_s(env: env_lib.Env, batch: int, act) -> tuple[float, float]:
    config = eval_lib.EvalConfig(num_envs=batch, execute_steps=EXECUTE, num_videos=0)
    evaluator = eval_lib.Evaluator(env, act, config)
    seconds = _timed(evaluator.rollout, jax.random.key(1))
    return batch / seconds, seconds


def _per_env_renderer(env: env_lib.Env):
    """MuJoCo's GL renderer if a context can be made, else Warp/ray-caster with one world."""
    h, w = env.config.image_size
    try:
        gl = mujoco.Renderer(env.mj_model, h, w)

        def render(model, data):
            frames = {}
            for cam in env.cameras:
                gl.update_scene(data, camera=cam)
                frames[cam] = gl.render()[None]
            return frames

        return render, "mujoco.Renderer (OpenGL)"
    except Exception:  # no GL on this machine: fall back to a one-world batch renderer
        renderer = env.renderer()
        jitted = jax.jit(lambda d: renderer(jax.tree.map(lambda x: x[None], d)))
        return (lambda model, data: jitted(mjx.put_data(model, data))), f"{renderer.kind} renderer, 1 world"


def loop_episodes_per_s(env: env_lib.Env, episodes: int, act) -> tuple[float, str]:
    """One CPU MuJoCo env per loop, policy at batch 1 at each replan, per-env rendering."""
    task, model = env.task, env.mj_model
    act = jax.jit(act)
    reset = jax.jit(env.reset)

    def tracked_success(qpos, info):
        data = types.SimpleNamespace(qpos=qpos)
        info = task.track(data, info)
        return task.success(data, info), info

    success = jax.jit(tracked_success)
    render, how = _per_env_renderer(env)
    data = mujoco.MjData(model)

    def episode(seed):
        state = reset(jax.random.key(seed))
        info = state.info
        mujoco.mj_resetData(model, data)
        data.qpos[:] = np.asarray(state.data.qpos)
        data.ctrl[:] = np.asarray(state.data.ctrl)
        data.mocap_pos[:] = np.asarray(state.data.mocap_pos)
        mujoco.mj_forward(model, data)
        chunk = None
        for t in range(env.episode_limit):
            if t % EXECUTE == 0:
                images = render(model, data)
                robot = np.asarray(task.robot_state(types.SimpleNamespace(qpos=jnp.asarray(data.qpos))))[None]
                obs = {"state": robot, "images": images, "time_step": np.array([t], np.int32)}
                chunk = np.asarray(act(obs, jax.random.key(t)))[0]
            data.ctrl[:] = numpy_ctrl(task, chunk[t % EXECUTE], data.ctrl)
            mujoco.mj_step(model, data, nstep=tasks_lib.SUBSTEPS)
            solved, info = success(jnp.asarray(data.qpos), info)
            if bool(solved):
                break

    episode(0)  # compile the jitted pieces
    start = time.perf_counter()
    for seed in range(1, episodes + 1):
        episode(seed)
    return episodes / (time.perf_counter() - start), how


@dataclasses.dataclass(frozen=True)
class Flags:
    """sim_throughput's command line."""

    task: TaskName = "reach"
    batches: tuple[int, ...] = (1, 64, 256)
    physics_batch: int = 64
    image_size: int = 64
    baseline_episodes: int = 4
    policy: Annotated[str | None, tyro.conf.arg(metavar="CKPT_DIR")] = None
    """a trained policy (load_policy); its image size replaces --image-size"""


def main(argv=None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.sim_throughput", description=__doc__.splitlines()[0]
    )
    bundle = None
    image_size = args.image_size
    if args.policy:
        from embodied_jax import load_policy

        bundle = load_policy(args.policy)
        image_size = bundle.config.data.pipeline.image_size[0]
    policy = "trivial stand-in" if bundle is None else f"{type(bundle.config.model).__name__} from {args.policy}"
    print(f"devices: {jax.devices()}  task: {args.task}  image {image_size}^2  policy: {policy}")

    steps = physics_steps(args.task, args.physics_batch)
    print(
        f"\n[env steps/s, no policy, no rendering, B={args.physics_batch}, "
        f"{tasks_lib.SUBSTEPS} physics steps per env step]"
    )
    for name, value in steps.items():
        print(f"  {name:8s} {value:10.1f} env-steps/s")
    print(
        f"  ratio JAX/Warp {steps['jax'] / steps['warp']:.2f}   JAX/mj_step {steps['jax'] / steps['mj_step']:.2f}"
        f"   Warp/mj_step {steps['warp'] / steps['mj_step']:.2f}"
    )

    env = env_lib.Env(args.task, env_lib.EnvConfig(image_size=(image_size, image_size)))
    if bundle is None:
        act = trivial_policy(env)
    else:
        act_with, params = act_fn(bundle, env.instruction)
        act = functools.partial(act_with, params)
    baseline, how = loop_episodes_per_s(env, args.baseline_episodes, act)
    horizon = HORIZON if bundle is None else bundle.config.model.action_horizon
    print(f"\n[closed-loop episodes/s with rendering, H={horizon}, k={EXECUTE}, cameras {env.cameras}]")
    print(f"  one env per loop (mj_step, batch-1 policy, {how}): {baseline:.3f} episodes/s")
    episodes = {"loop": baseline}
    for batch in args.batches:
        rate, seconds = batched_episodes_per_s(env, batch, act)
        episodes[f"B={batch}"] = rate
        print(f"  batched MJX B={batch:4d}: {rate:8.3f} episodes/s ({seconds:.2f} s)", end="")
        print(f"   ratio vs loop {rate / baseline:7.1f}x")
    return {"env_steps_per_s": steps, "episodes_per_s": episodes}


if __name__ == "__main__":
    sys.exit(harness.run(main, "sim_throughput"))  # --record: the result appended to results/sim_throughput.jsonl
