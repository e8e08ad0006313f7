"""Held-out evaluation during RL, shared by PPO and steering: the policy as deployed, its metrics row, the stop rule.

The policy runs as deployed (the deterministic sampler, the bundle's own evaluation path) on reset
seeds the rollouts never use, in MJX (``HeldOutEvaluation``) or in Meta-World's environments
(``MetaWorldHeldOut``); ``stop_below_start`` evaluations in a row below the start end a run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
from typing import Any

import jax
from flax import nnx

from embodied_jax.rl.config import RLExperimentConfig
from embodied_jax.rl.start import Start

log = logging.getLogger(__name__)


class HeldOutEvaluation:
    """The policy as deployed (``SimEvaluation``'s evaluator: the bundle's act, ODE sampling) on the
    held-out seed, compiled once and called with each iteration's weights."""

    def __init__(self, st: Start, config: RLExperimentConfig, execute_steps: int):
        from embodied_jax.parallel.mesh import MeshConfig, make_mesh

        rl = config.rl
        self.st = st
        evaluation = dataclasses.replace(
            st.base.evaluation, num_envs=rl.eval_envs, seed=rl.eval_seed, execute_steps=execute_steps
        )
        self.seed = rl.eval_seed
        with jax.set_mesh(make_mesh(MeshConfig(data=-1), jax.local_devices()[:1])):
            self.evaluator, _ = evaluation.evaluator(st.bundle_with(st.params))

    def __call__(self, params, out_dir: pathlib.Path | None = None) -> dict[str, Any]:
        model_state = nnx.state(self.st.bundle_with(params).model)
        model_state = jax.device_put(model_state, jax.local_devices()[0])
        return self.evaluator(jax.random.key(self.seed), params=model_state, out_dir=out_dir)


class MetaWorldHeldOut:
    """The policy as deployed (the bundle's ``predict``) in Meta-World's evaluation
    (``sim.metaworld.evaluate``, LeRobot's protocol) on the held-out seed: ``rl.eval_envs`` episodes
    per task of ``rl.task``."""

    def __init__(self, st: Start, config: RLExperimentConfig, execute_steps: int):
        from embodied_jax.sim import metaworld

        rl, evaluation = config.rl, st.base.evaluation
        self.st, self.tasks = st, rl.task
        self.settings = dataclasses.replace(
            evaluation.settings(),
            episodes=rl.eval_envs,
            envs=min(evaluation.envs, rl.eval_envs),
            execute_steps=execute_steps,
            seed=rl.eval_seed,
        )
        self.evaluate = metaworld.evaluate

    def __call__(self, params, out_dir: pathlib.Path | None = None) -> dict[str, Any]:
        bundle = self.st.bundle_with(params)

        def policy(batch, call_seed):
            return bundle.predict(batch, rng=jax.random.key(call_seed))

        return self.evaluate(policy, self.tasks, self.settings)


def held_out_row(task: str, result: dict[str, Any]) -> dict[str, float]:
    """A held-out evaluation's metrics: the success rate (and mean return) over all its episodes, and
    with several Meta-World tasks each task's rate."""
    row = {f"eval/{task}/success_rate": result["success_rate"]}
    if "mean_return" in result:
        row[f"eval/{task}/mean_return"] = result["mean_return"]
    per_task = result.get("per_task", {})
    if len(per_task) > 1:
        row.update({f"eval/{name}/success_rate": entry["success_rate"] for name, entry in per_task.items()})
    return row


def evaluate_when_due(rl, it: int, last: bool, evaluate, counters: dict, watch: bool, workdir: pathlib.Path, row: dict):
    """The held-out evaluation of iteration ``it`` when it is due (every ``rl.eval_every`` iterations
    and at the last; ``evaluate(last) -> result``, None: no evaluation), its metrics added to ``row``
    and, with ``watch``, the stop rule (``counters["below_start"]``). Returns (fell, final): whether
    the run fell below its start ``rl.stop_below_start`` times in a row, and the result written to
    ``<workdir>/eval/results.json`` when this evaluation is the run's last (else None)."""
    if evaluate is None or not (last or (rl.eval_every and it % rl.eval_every == 0)):
        return False, None
    result = evaluate(last)
    row.update(held_out_row(rl.task, result))
    fell = False
    if watch:
        below = result["success_rate"] < counters["start_success"]
        counters["below_start"] = counters["below_start"] + 1 if below else 0
        fell = counters["below_start"] >= rl.stop_below_start
    if not (last or fell):
        return fell, None
    final = {**result, "iteration": it, "seed": rl.eval_seed}
    (workdir / "eval").mkdir(exist_ok=True)
    (workdir / "eval" / "results.json").write_text(json.dumps(final, indent=2))
    return fell, final


def stop_reason(rl, it: int, counters: dict, fell: bool, over_time: bool) -> str | None:
    """Why the run ends after iteration ``it`` before ``rl.iterations`` (logged), or None."""
    if fell:
        reason = (
            f"held-out success fell below the start's {counters['start_success']:.1%} in "
            f"{rl.stop_below_start} evaluations in a row"
        )
        log.warning("stopping at iteration %d: %s", it, reason)
        return reason
    if over_time:
        log.info("stopping after %.1f minutes (rl.minutes)", counters["elapsed_s"] / 60)
        return f"{rl.minutes} minutes (rl.minutes)"
    return None


def held_out_evaluation(st: Start, config: RLExperimentConfig, execute_steps: int):
    """``evaluate(params, out_dir=None) -> {"success_rate", ...}`` of the policy as deployed on the
    held-out seed, or None (the toy policy, or ``rl.eval_envs`` 0)."""
    if st.bundle is None or not config.rl.eval_envs:
        return None
    return (MetaWorldHeldOut if st.host_stepped else HeldOutEvaluation)(st, config, execute_steps)
