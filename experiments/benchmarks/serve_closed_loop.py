"""The simulator drives a policy through the policy server, one client per environment, and the
result is compared with the in-process batched evaluator on the same episodes.

    python -m experiments.benchmarks.serve_closed_loop RUN_DIR [--task reach] [--envs 64]

Both runs use ``sim.Evaluator`` with the same reset seeds; at every replan the policy is queried
for every environment with the seed ``env * 100003 + time_step``. In process, one
``PolicyBundle.predict_rows`` call answers all environments; through the server, each
environment's client sends its own observation and the server batches them (``--max-batch``).
Prints the largest action difference over the whole rollout and both success counts, and fails
(status 1) when they disagree by more than 1e-4 or one episode.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import sys
import time
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness

SEED_STRIDE = 100_003


def _row_seeds(time_step: np.ndarray) -> list[int]:
    return [int(i * SEED_STRIDE + t) for i, t in enumerate(np.asarray(time_step))]


def _callback_act(answer, bundle, instruction: str, recorded: list):
    """A jittable ``act(observation, rng)`` whose actions come from ``answer(raw_rows, seeds)``
    on the host; every answer is appended to ``recorded``."""
    horizon, width = bundle.action_shape

    def host(state, images, time_step):
        rows = []
        for i in range(state.shape[0]):
            raw = {bundle.inputs.state_key: np.asarray(state[i]), "task": instruction}
            for cam, image in images.items():
                raw[f"observation.images.{cam}"] = np.asarray(image[i])
            rows.append(raw)
        actions = np.asarray(answer(rows, _row_seeds(time_step)), np.float32)
        recorded.append(actions)
        return actions

    def act(observation, rng):
        del rng  # the seeds name each row's noise
        state = observation["state"]
        out = jax.ShapeDtypeStruct((state.shape[0], horizon, width), jnp.float32)
        return jax.pure_callback(host, out, state, observation["images"], observation["time_step"])

    return act


@dataclasses.dataclass(frozen=True)
class Flags:
    """serve_closed_loop's command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN_DIR")]]
    """a trained run or exported policy"""
    task: str | None = None
    """default: the run's evaluation task"""
    envs: int = 64
    max_batch: int = 8
    batch_timeout_ms: float = 5.0


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.serve_closed_loop", description=__doc__.splitlines()[0]
    )

    from embodied_jax import load_policy
    from embodied_jax.bundle import row_keys
    from embodied_jax.evaluation.in_training import SimEvaluation
    from embodied_jax.serve.client import PolicyClient
    from embodied_jax.sim import Env, EnvConfig, EvalConfig, Evaluator
    from experiments.benchmarks.serve_latency import RunningServer

    bundle = load_policy(args.run)
    evaluation = bundle.config.evaluation if isinstance(bundle.config.evaluation, SimEvaluation) else SimEvaluation()
    task = args.task or evaluation.task
    env = Env(task, EnvConfig(image_size=tuple(bundle.image_size)))
    config = EvalConfig(num_envs=args.envs, execute_steps=evaluation.execute_steps, num_videos=0, seed=evaluation.seed)

    def in_process(rows, seeds):
        keys = jnp.stack([row_keys(jax.random.key(s), 1)[0] for s in seeds])
        return bundle.predict_rows(rows, keys)

    local_actions: list = []
    t0 = time.perf_counter()
    local = Evaluator(env, _callback_act(in_process, bundle, env.instruction, local_actions), config)(jax.random.key(0))
    local_s = time.perf_counter() - t0

    running = RunningServer(bundle, args.max_batch, args.batch_timeout_ms)
    clients = [PolicyClient("127.0.0.1", running.server.port) for _ in range(args.envs)]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=args.envs)

    def through_server(rows, seeds):
        replies = pool.map(lambda c, r, s: c.infer({**r, "seed": s})["actions"], clients, rows, seeds)
        return np.stack(list(replies))

    served_actions: list = []
    try:
        t0 = time.perf_counter()
        act = _callback_act(through_server, bundle, env.instruction, served_actions)
        served = Evaluator(env, act, config)(jax.random.key(0))
        served_s = time.perf_counter() - t0
    finally:
        for client in clients:
            client.close()
        pool.shutdown()
        running.close()
    per_replan = [float(np.abs(a - b).max()) for a, b in zip(local_actions, served_actions, strict=True)]
    difference = max(per_replan)
    # Identical observations give answers equal to float rounding (batch sizes differ: 64 rows in
    # process, buckets of up to --max-batch through the server); in closed loop such differences
    # can grow once they change a rollout, so say where the first one above 1e-4 appears.
    first_large = next((i for i, d in enumerate(per_replan) if d > 1e-4), None)
    successes = [round(m["success_rate"] * m["episodes"]) for m in (local, served)]
    report = {
        "task": task,
        "episodes": local["episodes"],
        "replans": len(local_actions),
        "max_action_difference": difference,
        "first_replan_difference": per_replan[0],
        "first_replan_above_1e-4": first_large,
        "successes_in_process": successes[0],
        "successes_through_server": successes[1],
        "in_process_s": local_s,
        "through_server_s": served_s,
        "server_requests": running.server.served,
    }
    print(json.dumps(report))
    if difference > 1e-4 or abs(successes[0] - successes[1]) > 1:
        raise SystemExit(1)
    return report


if __name__ == "__main__":
    sys.exit(harness.run(main, "serve_closed_loop"))  # --record: the result appended to results/serve_closed_loop.jsonl
