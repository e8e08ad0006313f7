"""Batched MuJoCo-MJX simulation: built-in tasks, rendering, scripted experts, evaluation.

Public entry points (each module's docstring has the details):

- ``Env(task, EnvConfig(image_size=(H, W)))``: ``reset(rng)`` / ``step(state, action)``
  on one world (``jax.vmap`` them), ``observe(states)`` on a batch -> joint state and
  uint8 RGB from the ``scene`` and wrist cameras (Warp batch renderer, or the pure-JAX
  ray-caster without Warp). Tasks: ``reach``, ``pick_place``, ``handover``.
- ``experts.expert_for(task)``: scripted waypoint experts (>= 95% success).
- ``rollout.make_rollout``: one jitted batched rollout of a per-step policy.
- ``python -m embodied_jax.sim.collect TASK --episodes N --out DIR``: expert
  demonstrations as a LeRobot dataset.
- ``evaluate.Evaluator`` / ``evaluate.evaluate_tasks``: closed-loop evaluation of any
  ``act(observation, rng) -> [B, H, A]`` with action chunking, in one jitted program,
  optionally sharded over a mesh's ``data`` axis; success rate with a Wilson 95%
  interval, episode length, reward, mp4 videos, a PNG frame grid and JSON.
- ``playground.load_playground_env``: MuJoCo Playground manipulation envs when their
  assets are on disk.

This package knows models only through the ``act`` callable; it never imports
``embodied_jax.train`` or a concrete model.
"""
from embodied_jax.sim.env import Env, EnvConfig, EnvState, batch_reset, batch_step
from embodied_jax.sim.evaluate import EvalConfig, Evaluator, evaluate_tasks, summarize, wilson_interval
from embodied_jax.sim.tasks import TASKS, make_task

__all__ = [
    "Env", "EnvConfig", "EnvState", "batch_reset", "batch_step",
    "EvalConfig", "Evaluator", "evaluate_tasks", "summarize", "wilson_interval",
    "TASKS", "make_task",
]
