"""The evaluations a run's trainer calls during training (``ExperimentConfig.evaluation``, saved
with the run's config): ``SimEvaluation`` in batched MJX, ``MetaWorldEvaluation`` in Meta-World's
own environments; their settings are also the defaults of the run's final evaluation.

``SimEvaluation`` is an ``ExperimentConfig.evaluation``: at the run's first evaluation the
trainer calls ``start``, which wraps the live model and the run's normalisation
statistics in a ``PolicyBundle`` (the pre- and post-processing a robot runs) and
compiles the evaluation program for the task's batched MJX environments once; the
returned ``SimEvaluationRun`` is kept by the trainer for the run and only passes new
weights on later calls. ``evaluator(bundle)`` builds the same program for a loaded
policy (the demo's final evaluation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
from flax import nnx

from embodied_jax.bundle import PolicyBundle, act_fn
from embodied_jax.config_registry import register
from embodied_jax.parallel.mesh import MeshConfig, make_mesh
from embodied_jax.train.config import Evaluation

if TYPE_CHECKING:
    from embodied_jax.sim import Evaluator


@register
@dataclasses.dataclass(frozen=True)
class SimEvaluation(Evaluation):
    task: str = "reach"
    num_envs: int = 32
    execute_steps: int = 5
    image_size: tuple[int, int] = (32, 32)
    seed: int = 2  # the validation seed (sim.seeds.VALIDATION_SEED): reported figures use the test seed
    phase_in_state: bool = False  # the policy's state ends with the episode's phase (as its data was collected)

    ADDED_FIELDS = ("phase_in_state",)  # runs saved before it read back with the default (config_registry)

    def evaluator(self, bundle: PolicyBundle, *, num_videos: int = 0, mesh=None) -> tuple[Evaluator, Any]:
        """``(evaluator, params)`` of ``bundle`` on the task; ``mesh``: split the environments
        over its ``data`` axis (see ``sim.Evaluator``)."""
        from embodied_jax.sim import Env, EnvConfig, EvalConfig, Evaluator  # MJX: imported when first used

        env = Env(self.task, EnvConfig(image_size=tuple(self.image_size), phase_in_state=self.phase_in_state))
        act, params = act_fn(bundle, env.instruction)
        config = EvalConfig(
            num_envs=self.num_envs, execute_steps=self.execute_steps, num_videos=num_videos, seed=self.seed
        )
        return Evaluator(env, act, config, mesh=mesh), params

    def start(self, model: Any, *, config: Any, norm_stats: Mapping[str, Any] | None) -> SimEvaluationRun:
        """Called by the trainer inside its mesh: on one device the evaluation runs as is; on
        several, its environments are split over the mesh's ``data`` axis like the batch."""
        mesh = make_mesh(config.mesh)
        bundle = PolicyBundle(config, model, norm_stats, step=0)
        # The simulator's constants are made on one device, outside the trainer's mesh.
        with jax.set_mesh(make_mesh(MeshConfig(data=-1), jax.local_devices()[:1])):
            evaluator, _ = self.evaluator(bundle, mesh=mesh if mesh.size > 1 else None)
        return SimEvaluationRun(self, evaluator)


class SimEvaluationRun:
    """One training run's compiled evaluation: ``run(model, step) -> metrics``."""

    def __init__(self, evaluation: SimEvaluation, evaluator: Evaluator):
        self.evaluation = evaluation
        self.evaluator = evaluator

    def __call__(self, model: Any, step: int) -> dict[str, float]:
        params = nnx.state(model)
        if self.evaluator.mesh is None:
            # One device: the MJX renderer is a custom call that SPMD partitioning cannot place.
            params = jax.device_put(params, jax.local_devices()[0])
        metrics = self.evaluator(jax.random.key(self.evaluation.seed), params=params)
        task = self.evaluation.task
        return {
            f"{task}/success_rate": metrics["success_rate"],
            f"{task}/mean_episode_length": metrics["mean_episode_length"],
            f"{task}/mean_reward": metrics["mean_reward"],
        }


@register
@dataclasses.dataclass(frozen=True)
class MetaWorldEvaluation(Evaluation):
    """In-training closed-loop evaluation in Meta-World's own environments (``sim.metaworld``):
    ``episodes`` per task, ``envs`` stepped together per policy call, on the evaluation seed."""

    # runs saved before these fields read back with their defaults
    ADDED_FIELDS = ("limit", "prompts", "render_style", "crop", "camera_pos")

    tasks: str = "metaworld:mt10"
    episodes: int = 10
    envs: int = 10
    execute_steps: int = 4
    image_size: tuple[int, int] = (64, 64)
    seed: int = 2  # the validation seed (sim.metaworld.VALIDATION_SEED): reported figures use the test seed
    limit: int = 500  # steps per episode (Meta-World's max_path_length, LeRobot's protocol)
    prompts: str = "lerobot"  # LeRobot's task descriptions, or "project"
    render_style: str = "fast"  # or "lerobot" (Meta-World's own renderer settings)
    # (top, left, size), fractions of the frame: a zoomed window of the workspace, as collected
    # (sim.metaworld.MetaWorldEnv); None: the whole frame, as LeRobot's.
    crop: tuple[float, float, float] | None = None
    # corner2's position (x, y, z), as collected (sim.metaworld.MetaWorldEnv); None: LeRobot's.
    camera_pos: tuple[float, float, float] | None = None

    def view(self):
        """What the policy is shown (``sim.metaworld.View``): frames as collected, the run's prompts."""
        from embodied_jax.sim import metaworld

        return metaworld.View(tuple(self.image_size), self.prompts, self.render_style, self.crop, self.camera_pos)

    def settings(self):
        from embodied_jax.sim import metaworld

        envs = min(self.envs, self.episodes)
        return metaworld.EvalSettings(
            self.episodes, envs, self.execute_steps, self.seed, videos=0, limit=self.limit, view=self.view()
        )

    def start(self, model: Any, *, config: Any, norm_stats: Mapping[str, Any] | None) -> MetaWorldEvaluationRun:
        return MetaWorldEvaluationRun(self, PolicyBundle(config, model, norm_stats, step=0))


class MetaWorldEvaluationRun:
    """One training run's Meta-World evaluation: ``run(model, step) -> metrics`` (overall and per task)."""

    def __init__(self, evaluation: MetaWorldEvaluation, bundle: PolicyBundle):
        self.evaluation, self.bundle = evaluation, bundle

    def __call__(self, model: Any, step: int) -> dict[str, float]:
        from embodied_jax.sim import metaworld

        self.bundle.params = nnx.state(model)

        def policy(batch, call_seed):
            return self.bundle.predict(batch, rng=jax.random.key(call_seed))

        report = metaworld.evaluate(policy, self.evaluation.tasks, self.evaluation.settings())
        metrics = {"metaworld/success_rate": report["success_rate"], "metaworld/group_average": report["group_average"]}
        for name, entry in (*report["per_task"].items(), *report["per_difficulty"].items()):
            metrics[f"metaworld/{name}/success_rate"] = entry["success_rate"]
        return metrics
