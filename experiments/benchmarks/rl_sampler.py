"""``python -m experiments.benchmarks.rl_sampler RUN --task T``: the RL sampler's executed actions
against the deployed sampler's, on the run's policy and the same observations, for several
Flow-SDE settings in one run.

``--observations`` start states of the task (the RL rollouts' own stream: built-in tasks from
``jax.random.key(seed)``, Meta-World from ``MetaWorldBatch``); for each, ``--draws`` chunks from
the deployed sampler (the model's Euler steps from fresh noise) and from each setting's
Flow-SDE sampler (``rl.diagnostics.compare_samplers``). Printed per setting: ``spread_ratio``
(the executed actions' std over draws, RL / deployed; 1 is the deployed policy's spread) and
``mean_gap`` (|RL mean - deployed mean| in units of the deployed std). A setting is
``noise_level@steps`` with steps ``all`` or comma-separated step indices, or ``std@action``: Gaussian
noise of that std on the deterministic chain's chunk (``RLConfig.action_noise``).

``--episodes N`` (built-in tasks): also N whole episodes rolled out as RL rolls them out with each
setting's sampler, and N episodes of the policy as deployed (RL's held-out evaluation, on the
validation seed's resets): how much success each setting's exploration costs the policy before RL
has changed anything.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Annotated

import tyro

from embodied_jax.cli import parse_flags
from experiments.benchmarks import harness


@dataclasses.dataclass(frozen=True)
class Flags:
    """rl_sampler's command line."""

    run: tyro.conf.Positional[Annotated[str, tyro.conf.arg(metavar="RUN")]]
    """a behaviour-cloned run directory"""
    task: str = "pick_place"
    observations: int = 8
    draws: int = 64
    settings: tuple[str, ...] = ("0.5@all", "1.0@0", "0.3@all", "1.0@all")
    seed: int = 0
    episodes: int = 0
    """built-in tasks: also roll out this many episodes per setting, and as deployed (0: none)"""


def parse_setting(text: str):
    from embodied_jax.nn.flow import FlowSDE

    noise, _, steps = text.partition("@")
    if not steps:
        raise ValueError(f"setting {text!r}: expected noise_level@steps (steps: all, action or 0,1,...)")
    if steps == "action":
        return FlowSDE(action_noise=float(noise))
    return FlowSDE(float(noise), None if steps == "all" else tuple(int(s) for s in steps.split(",")))


def main(argv: list[str] | None = None) -> dict:
    args = parse_flags(
        Flags, args=argv, prog="python -m experiments.benchmarks.rl_sampler", description=__doc__.splitlines()[0]
    )
    import jax
    import numpy as np

    from embodied_jax.rl.config import RLConfig, RLExperimentConfig
    from embodied_jax.rl.diagnostics import compare_samplers
    from embodied_jax.rl.start import start

    sdes = {text: parse_setting(text) for text in args.settings}
    config = RLExperimentConfig(init_from=args.run, rl=RLConfig(task=args.task, num_envs=args.observations))
    st = start(config, jax.local_devices()[:1])
    key = jax.random.key(args.seed)
    if st.host_stepped:
        st.env.reset(key, np.arange(args.observations))
        observation = st.env.observe()
        st.env.close()
    else:
        states = jax.jit(jax.vmap(st.env.reset))(jax.random.split(key, args.observations))
        observation = jax.device_get(st.env.observe(states))
    observation["time_step"] = np.zeros((args.observations,), np.int32)
    result = {"task": args.task, "observations": args.observations, "draws": args.draws, "settings": {}}
    for text, sde in sdes.items():
        agent = dataclasses.replace(st.agent, sde=sde)
        out = compare_samplers(agent, st.params, observation, args.draws, jax.random.fold_in(key, 1))
        result["settings"][text] = {"spread_ratio": out["spread_ratio"], "mean_gap": out["mean_gap"]}
        result["deployed_std"] = float(out["deployed"]["std"].mean())
        print(f"{text:>10}: spread ratio {out['spread_ratio']:.3f}, mean gap {out['mean_gap']:.3f} deployed std")
    print(f"deployed sampler's mean std over draws: {result['deployed_std']:.4f}")
    if args.episodes:
        result["success"] = _success(st, args, sdes, jax.random.fold_in(key, 2))
    print(json.dumps({"rl_sampler": result}))
    return result


def _success(st, args: Flags, sdes: dict, key) -> dict:
    """Success over ``args.episodes`` episodes: RL's rollout with each setting's sampler, and the
    policy as deployed (``rl.held_out.HeldOutEvaluation`` on the validation seed)."""
    import jax
    import numpy as np

    from embodied_jax.rl import rollout as rollout_lib
    from embodied_jax.rl.config import RLConfig, RLExperimentConfig
    from embodied_jax.rl.held_out import HeldOutEvaluation
    from embodied_jax.rl.loop import critic_functions

    if st.host_stepped:
        raise SystemExit("--episodes: built-in (MJX) tasks only; Meta-World's rollouts are rl_metaworld's")
    k = st.execute_steps
    spec = rollout_lib.RolloutSpec(
        num_envs=args.episodes, execute_steps=k, decisions=rollout_lib.decisions_per_episode(st.env.episode_limit, k)
    )
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 32, 0)  # values unused here
    out = {}
    for text, sde in sdes.items():
        with st.rt.context():
            rollout = rollout_lib.make_rollout(st.env, dataclasses.replace(st.agent, sde=sde), critic, spec)
        out[text] = float(np.mean(jax.device_get(rollout(st.params, critic_params, key).success)))
        print(f"{text:>10}: rollout success {100 * out[text]:.1f}% of {args.episodes} episodes")
    config = RLExperimentConfig(init_from=args.run, rl=RLConfig(task=args.task, eval_envs=args.episodes))
    out["deployed"] = float(HeldOutEvaluation(st, config, k)(st.params)["success_rate"])
    print(f"  deployed: success {100 * out['deployed']:.1f}% of {args.episodes} validation-seed episodes")
    return out


if __name__ == "__main__":
    sys.exit(harness.run(main, "rl_sampler"))
