"""Closed-loop evaluation of trained policies in batched MJX, during and after training.

``SimEvaluation`` is what ``ExperimentConfig.evaluation`` holds: every
``train.eval_every`` steps the trainer hands it the live model and the run's
normalisation statistics; it wraps them in a ``PolicyBundle`` (the same pre- and
post-processing a robot runs) and evaluates the policy on the task's batched MJX
environments. The evaluation program is compiled once; later calls only pass new
weights.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from embodied_jax.bundle import PolicyBundle
from embodied_jax.parallel.mesh import MeshConfig, make_mesh

if TYPE_CHECKING:
    from embodied_jax.sim import Evaluator

_EVALUATORS: dict[tuple, tuple[Evaluator, PolicyBundle]] = {}


@dataclasses.dataclass(frozen=True)
class SimEvaluation:
    task: str = "reach"
    num_envs: int = 32
    execute_steps: int = 5
    image_size: tuple[int, int] = (32, 32)
    seed: int = 0

    def evaluator(self, bundle: PolicyBundle, *, num_videos: int = 0, mesh=None) -> tuple[Evaluator, Any]:
        """``mesh``: split the environments over its ``data`` axis (see ``sim.Evaluator``)."""
        from embodied_jax.sim import Env, EnvConfig, EvalConfig, Evaluator  # MJX: imported when first used

        env = Env(self.task, EnvConfig(image_size=tuple(self.image_size)))
        act, params = bundle.act_fn(env.instruction, with_params=True)
        config = EvalConfig(num_envs=self.num_envs, execute_steps=self.execute_steps, num_videos=num_videos,
                            seed=self.seed)
        return Evaluator(env, act, config, mesh=mesh), params

    def evaluate(self, model: Any, step: int, *, config: Any, norm_stats: dict | None) -> dict[str, float]:
        """Called by the trainer inside its mesh: on one device the evaluation runs as is; on
        several, its environments are split over the mesh's ``data`` axis like the batch."""
        from flax import nnx

        key = (self, id(config))
        if key not in _EVALUATORS:
            mesh = make_mesh(config.mesh)
            bundle = PolicyBundle(config, model, norm_stats, step=step)
            # The simulator's constants are made on one device, outside the trainer's mesh.
            with jax.set_mesh(make_mesh(MeshConfig(data=-1), jax.local_devices()[:1])):
                evaluator, _ = self.evaluator(bundle, mesh=mesh if mesh.size > 1 else None)
            _EVALUATORS[key] = (evaluator, bundle)
        evaluator, bundle = _EVALUATORS[key]
        bundle.model = model
        params = nnx.state(model)
        if evaluator.mesh is None:
            # One device: the MJX renderer is a custom call that SPMD partitioning cannot place.
            params = jax.device_put(params, jax.local_devices()[0])
        metrics = evaluator(jax.random.key(self.seed), params=params)
        return {f"{self.task}/success_rate": metrics["success_rate"],
                f"{self.task}/mean_episode_length": metrics["mean_episode_length"],
                f"{self.task}/mean_reward": metrics["mean_reward"]}
