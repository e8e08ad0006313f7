"""Where an RL run starts: a behaviour-cloned run of this project, or the toy task from scratch.

``start(config)`` returns a ``Start``: the run's saved config (the one every RL checkpoint
saves again, so ``load_policy``, ``evaluate``, ``export`` and ``serve`` read an RL checkpoint as
any other), its runtime, its restored train state and statistics, the environment and the
``FlowAgent`` whose params are the run's (EMA) weights, and the ``Scope`` of those RL trains. For a run, the policy's
pre- and post-processing inside the program are the bundle's ``device_io``; the environment is
the run's evaluation task with its image size and state layout.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from typing import Any

import jax
import jax.numpy as jnp

from embodied_jax.assets import asset_files
from embodied_jax.bundle import PolicyBundle
from embodied_jax.bundle.device_io import device_io
from embodied_jax.errors import InputError
from embodied_jax.loading import restore_run
from embodied_jax.nn import flow
from embodied_jax.rl import toy
from embodied_jax.rl.agent import FlowAgent
from embodied_jax.rl.config import RLExperimentConfig
from embodied_jax.rl.scope import Scope
from embodied_jax.train.config import ExperimentConfig
from embodied_jax.train.runtime import Runtime, build, initial_state
from embodied_jax.train.state import TrainState

log = logging.getLogger(__name__)


class RLStartError(InputError, ValueError):
    """A starting point RL cannot use (no run there, no simulated task, a task other than the run's)."""


@dataclasses.dataclass
class Start:
    base: ExperimentConfig  # the policy's config (the run's, or the RL experiment's own for the toy)
    rt: Runtime
    state: TrainState  # the starting train state (its params or EMA are the policy's weights)
    norm_stats: dict
    env: Any
    agent: FlowAgent
    params: Any  # the policy's weights RL starts from (``scope`` picks those it trains)
    assets: dict[str, pathlib.Path]
    bundle: PolicyBundle | None  # None for the toy policy
    execute_steps: int
    scope: Scope  # the weights RL trains
    host_callback: bool = False  # π0.5's prompt tokens come from the host (bundle/device_io.py)
    host_stepped: bool = False  # env is a batch stepped on the host (rl/host_rollout.py), not a JAX env

    def train_state(self, params: Any) -> TrainState:
        """The starting train state with ``params`` as its weights (and its EMA, if it keeps one)."""
        ema = None if self.state.ema is None else params
        return dataclasses.replace(self.state, params=params, ema=ema)

    def bundle_with(self, params: Any) -> PolicyBundle:
        with self.rt.context():
            model = self.rt.parts.merge(params, self.state.frozen, self.state.fp8, self.state.other)
        return PolicyBundle(self.base, model, self.norm_stats, step=self.bundle.step if self.bundle else 0)


def _sde(config: RLExperimentConfig, execute_steps: int) -> flow.FlowSDE:
    """The rollout's Flow-SDE; with ``rl.executed_log_prob`` only the ``execute_steps`` executed
    actions of each chunk count in its likelihood; with ``rl.action_noise`` the exploration is
    Gaussian noise on the chunk around the deterministic chain."""
    counted = execute_steps if config.rl.executed_log_prob else None
    return flow.FlowSDE(config.rl.noise_level, config.rl.stochastic_steps, counted, config.rl.action_noise)


def _model_edits(config: RLExperimentConfig) -> dict[str, Any] | None:
    """With ``rl.num_inference_steps`` (``rl.noise_scale``) the policy is sampled, evaluated and saved
    with that many denoising steps (that initial noise): the held-out figures (the start's included)
    and the RL checkpoints' config are those of the sampler RL trained."""
    edits = {"num_inference_steps": config.rl.num_inference_steps, "noise_scale": config.rl.noise_scale}
    return {k: v for k, v in edits.items() if v is not None} or None


def _merge(rt: Runtime, state: TrainState):
    return lambda params: rt.parts.merge(params, state.frozen, state.fp8, state.other)


def start(config: RLExperimentConfig, devices: list | None = None) -> Start:
    devices = list(devices or jax.local_devices())
    if config.init_from is None:
        return _toy_start(config, devices)
    run = pathlib.Path(config.init_from)
    if not (run / "checkpoints").is_dir() and not run.is_dir():
        raise RLStartError(f"--init-from {config.init_from}: no run directory with checkpoints there")
    try:
        base, rt, state, norm_stats, step = restore_run(run, devices=devices, model_edits=_model_edits(config))
    except FileNotFoundError as e:
        raise RLStartError(f"--init-from {config.init_from}: {e}") from e
    evaluation = base.evaluation
    task = config.rl.task
    params = state.ema if state.ema is not None else state.params
    with rt.context():
        model = rt.parts.merge(params, state.frozen, state.fp8, state.other)
    bundle = PolicyBundle(base, model, norm_stats, step=step)
    from embodied_jax.sim.metaworld.suite import is_metaworld

    if is_metaworld(task):
        return _metaworld_start(config, base, rt, state, norm_stats, bundle, params)
    if evaluation is None or not hasattr(evaluation, "task"):
        raise RLStartError(f"--init-from {config.init_from}: the run has no simulated evaluation task to learn in")
    if task != evaluation.task:
        raise RLStartError(f"rl.task={task!r}, but the run at {config.init_from} was trained for {evaluation.task!r}")
    from embodied_jax.sim import Env, EnvConfig  # MJX: imported when first used

    env = Env(task, EnvConfig(image_size=tuple(evaluation.image_size), phase_in_state=evaluation.phase_in_state))
    io = device_io(bundle, env.instruction)
    k = config.rl.execute_steps or evaluation.execute_steps
    agent = FlowAgent(_merge(rt, state), io.observe, io.act, _sde(config, k), config.rl.num_inference_steps)
    if io.host_tokens:
        log.warning("the prompt's tokens come from a host callback in every rollout step (bundle/device_io.py)")
    scope = Scope.of(base.model, config.rl.train)
    return Start(
        base, rt, state, norm_stats, env, agent, params, asset_files(base.model), bundle, k, scope, io.host_tokens
    )


def _metaworld_start(config, base, rt, state, norm_stats, bundle, params) -> Start:
    """Meta-World's own environments, stepped on the host (``sim.metaworld.MetaWorldBatch``), for a
    run trained on Meta-World (its evaluation's view: frames and prompts as it trained on them); ``rl.num_envs`` split
    evenly over the tasks, each row's prompt its task's."""
    from embodied_jax.sim.metaworld import IMAGE_KEY, MetaWorldBatch, parse_tasks

    evaluation = base.evaluation
    if evaluation is None or not hasattr(evaluation, "tasks"):
        raise RLStartError(
            f"rl.task={config.rl.task!r}, but the run at {config.init_from} was not trained on Meta-World"
        )
    tasks, trained = parse_tasks(config.rl.task), set(parse_tasks(evaluation.tasks))
    unknown = [t for t in tasks if t not in trained]
    if unknown:
        raise RLStartError(f"rl.task: the run at {config.init_from} was not trained on {unknown} ({evaluation.tasks})")
    if config.rl.num_envs % len(tasks):
        raise RLStartError(f"rl.num_envs={config.rl.num_envs} must split evenly over the {len(tasks)} tasks")
    envs = MetaWorldBatch(
        tasks,
        config.rl.num_envs // len(tasks),
        evaluation.view(),
        limit=evaluation.limit,
    )
    ios = [device_io(bundle, instruction, {envs.camera: IMAGE_KEY}) for instruction in envs.instructions]

    def observe(observation):
        per_task = [io.observe(observation) for io in ios]
        rows = jnp.arange(observation["state"].shape[0])
        return jax.tree.map(lambda *xs: jnp.stack(xs)[observation["task_index"], rows], *per_task)

    k = config.rl.execute_steps or evaluation.execute_steps
    agent = FlowAgent(_merge(rt, state), observe, ios[0].act, _sde(config, k), config.rl.num_inference_steps)
    scope = Scope.of(base.model, config.rl.train)
    assets = asset_files(base.model)
    return Start(base, rt, state, norm_stats, envs, agent, params, assets, bundle, k, scope, host_stepped=True)


def _toy_start(config: RLExperimentConfig, devices: list) -> Start:
    if config.rl.task != "toy_reach":
        raise RLStartError(
            f"rl.task={config.rl.task!r} needs --init-from RUN (a behaviour-cloned run); only "
            "'toy_reach' starts from scratch"
        )
    env = toy.ToyReach()
    rt = build(config, devices)
    state = initial_state(rt)
    k = config.rl.execute_steps or 4
    agent = FlowAgent(
        _merge(rt, state),
        observe=lambda obs: {"state": obs["state"]},
        act=lambda actions, state: actions,
        sde=_sde(config, k),
        num_steps=config.rl.num_inference_steps,
    )
    scope = Scope.of(config.model, config.rl.train)
    return Start(config, rt, state, {}, env, agent, state.params, {}, None, k, scope)
