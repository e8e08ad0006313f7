"""``python -m experiments.benchmarks.rl_rollout RUN --task T``: the RL rollout's throughput with the
policy in the loop against the same rollout with a zero-cost policy, in one run.

Both rollouts are ``embodied_jax.rl.rollout.make_rollout`` programs of ``--num-envs`` episodes
(reset, rendering, physics and bookkeeping identical); one samples the run's policy through
Flow-SDE (pre-processing, sampling and post-processing in the program), the other returns a
constant chunk (the middle of the action bounds) at no cost. They are timed in alternation
after one warm-up each; printed: environment steps/s and decisions/s of both and their ratio
(the target: the policy's rollout at >= 0.5 of the zero-cost one). ``--xla-fusion-emitters off``
runs the same under ``--xla_cpu_use_fusion_emitters=false`` (a flag of the whole process).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Annotated, Literal

import tyro

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness

FLAG = "--xla_cpu_use_fusion_emitters=false"


@dataclasses.dataclass(frozen=True)
class Flags:
    """rl_rollout's command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]]
    """a behaviour-cloned run directory"""
    task: str = "pick_place"
    num_envs: int = 32
    rounds: int = 3
    xla_fusion_emitters: Literal["on", "off"] = "on"


class ConstantPolicy:
    """The zero-cost policy: the same chunk for every environment, nothing sampled."""

    def __init__(self, env, horizon: int):
        import jax.numpy as jnp

        low, high = env.action_bounds()
        self.chunk = jnp.broadcast_to((jnp.asarray(low) + jnp.asarray(high)) / 2, (horizon, env.action_dim))

    def sample(self, params, observation, rng):
        import jax.numpy as jnp

        from embodied_jax.rl.agent import Decision

        b = observation["state"].shape[0]
        actions = jnp.broadcast_to(self.chunk, (b, *self.chunk.shape))
        zeros = jnp.zeros((b,), jnp.float32)
        return Decision(actions, jnp.zeros((b, 1, 1), jnp.float32), zeros, {})


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.rl_rollout", description=__doc__.splitlines()[0]
    )
    if args.xla_fusion_emitters == "off" and FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}".strip()
    import jax
    import numpy as np

    from embodied_jax.rl import rollout as rollout_lib
    from embodied_jax.rl.config import RLConfig, RLExperimentConfig
    from embodied_jax.rl.loop import critic_functions
    from embodied_jax.rl.start import start

    config = RLExperimentConfig(init_from=args.run, rl=RLConfig(task=args.task, num_envs=args.num_envs))
    st = start(config, jax.local_devices()[:1])
    k = st.execute_steps
    spec = rollout_lib.RolloutSpec(args.num_envs, k, rollout_lib.decisions_per_episode(st.env.episode_limit, k))
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 128, 0)
    horizon = st.base.model.action_horizon
    with st.rt.context():
        programs = {
            "policy": rollout_lib.make_rollout(st.env, st.agent, critic, spec),
            "constant": rollout_lib.make_rollout(st.env, ConstantPolicy(st.env, horizon), critic, spec),
        }
    counts = {}

    def timed(name):
        def go():
            r = programs[name](st.params, critic_params, jax.random.key(len(counts.setdefault(name, []))))
            jax.block_until_ready(r.success)
            counts[name].append((int(np.asarray(r.env_steps).sum()), int(np.asarray(r.active).sum())))

        return go

    times = harness.alternate({name: timed(name) for name in programs}, rounds=args.rounds)
    result = {
        "host_callback": st.host_callback,
        "task": args.task,
        "num_envs": args.num_envs,
        "execute_steps": k,
        "xla_fusion_emitters": args.xla_fusion_emitters,
    }
    for name in programs:
        seconds = np.asarray(times[name]["wall"])
        steps, decisions = np.asarray(counts[name][-len(seconds) :]).T
        result[name] = {
            "env_steps_per_s": float(np.median(steps / seconds)),
            "decisions_per_s": float(np.median(decisions / seconds)),
            "median_rollout_s": float(np.median(seconds)),
        }
    result["ratio"] = result["policy"]["env_steps_per_s"] / result["constant"]["env_steps_per_s"]
    for name in programs:
        r = result[name]
        rates = f"{r['env_steps_per_s']:.0f} env steps/s, {r['decisions_per_s']:.0f} decisions/s"
        print(f"{name:>8}: {rates}, rollout {r['median_rollout_s']:.2f} s")
    print(f"policy in the loop / zero-cost policy: {result['ratio']:.2f}")
    print(json.dumps({"rl_rollout": result}))
    return result


if __name__ == "__main__":
    sys.exit(harness.run(main, "rl_rollout"))
