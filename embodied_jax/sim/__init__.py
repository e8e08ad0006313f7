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
- ``closed_loop.Evaluator`` / ``closed_loop.evaluate_tasks``: closed-loop evaluation of any
  ``act(observation, rng) -> [B, H, A]`` with action chunking, in one jitted program,
  optionally sharded over a mesh's ``data`` axis; success rate with a Wilson 95%
  interval, episode length, reward, mp4 videos, a PNG frame grid and JSON.
- ``playground.load_playground_env``: MuJoCo Playground manipulation envs when their
  assets are on disk.

This package knows models only through the ``act`` callable; it never imports
``embodied_jax.train`` or a concrete model.
"""

import importlib

# Imported on first use: MJX takes seconds to import, and importing a submodule such as
# ``embodied_jax.sim.tasks`` should not pay for it.
_EXPORTS = {
    "Env": "env",
    "EnvConfig": "env",
    "EnvState": "env",
    "batch_reset": "env",
    "batch_step": "env",
    "EvalConfig": "closed_loop",
    "Evaluator": "closed_loop",
    "evaluate_tasks": "closed_loop",
    "summarize": "closed_loop",
    "wilson_interval": "closed_loop",
    "TASKS": "tasks",
    "make_task": "tasks",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
