"""The settings of a reinforcement-learning run (pure data; ``rl/loop.py`` runs them).

An RL run starts from a behaviour-cloned run of this project (``ExperimentConfig.init_from``:
its workdir; model, data statistics and evaluation settings are the run's) or, without one,
from the experiment's own model trained from scratch on ``task="toy_reach"`` (``rl/toy.py``).
"""

from __future__ import annotations

import dataclasses
import math

from embodied_jax.config_registry import register
from embodied_jax.rl.ppo import PPOSettings
from embodied_jax.train.config import ExperimentConfig


@register
@dataclasses.dataclass(frozen=True)
class RLConfig:
    ADDED_FIELDS = ("noise_scale",)  # runs saved before it read back with the run's noise (config_registry)

    task: str = "reach"  # a built-in MJX task (sim/tasks.py) or "toy_reach"
    num_envs: int = 64  # environments per rollout
    # Rollouts of num_envs episodes each per update (πRL: 8 of 64 environments): num_envs x this many
    # episodes per iteration with one compiled rollout; the update takes this many times the minibatches
    # (each the size of one rollout's), so a gradient step's memory stays one rollout's (the rollouts'
    # decisions are all held until the update).
    rollouts_per_update: int = 1
    execute_steps: int | None = None  # k actions executed per chunk (None: the run's evaluation's)
    iterations: int = 50
    minutes: float | None = None  # stop after this much wall time (checkpointed), whichever first
    # Flow-SDE (nn/flow.py): the noise level a and which denoising steps are stochastic (None: all).
    # Every step stochastic, so the likelihood ratio sees each step that moves the executed chunk.
    # 0.1: on the pick_place demo policy (k = 1) the rollouts then succeed about as often as the policy
    # as deployed (50% against 55%); at πRL's 0.5 they succeed at 17% (docs/rl.md, "Figures").
    noise_level: float = 0.1
    stochastic_steps: tuple[int, ...] | None = None
    # > 0: no Flow-SDE step; instead the deterministic chain from the chunk's initial noise (the deployed
    # sampler's) plus Gaussian noise of this std on the normalised chunk, whose likelihood is computed
    # through the whole chain (nn/flow.py): the ratio sees every step that moves the executed action, and its
    # one density is that of the perturbation executed (the Flow-SDE's early steps add noise the later ones
    # take back out). On handover 0.01 costs 6 points before RL and RL did not gain (docs/rl.md).
    action_noise: float = 0.0
    # The sampler's denoising steps during RL and afterwards: the held-out evaluations (the start's too) and
    # the checkpoints' config take them, so the policy is deployed as it was trained (None: the model's own).
    num_inference_steps: int | None = None
    # The spread of each chunk's initial noise, N(0, s^2), during RL and afterwards, kept as num_inference_steps
    # is (None: the run's ``noise_scale``; 0: every chain starts at the flow's centre, the steps' noise explores).
    noise_scale: float | None = None
    # Only the executed actions of each chunk (its first execute_steps) count in the likelihood ratio:
    # with k = 1 of a horizon of 8, seven eighths of the chunk's densities never reach the robot.
    executed_log_prob: bool = False
    gamma: float = 0.99  # per decision
    lam: float = 0.95
    advantage: str = "gae"  # "gae" (critic) or "grpo" (group-normalised episode success)
    groups: int = 8  # GRPO: reset-key groups (num_envs / groups episodes share each initial state)
    shaping: float = 0.0  # weight of the task's dense reward next to the success reward of 1
    ppo: PPOSettings = PPOSettings()
    # "action_expert": only the model's action expert trains (PolicyConfig.action_expert_regexes), the
    # vision tower and the VLM stay bit-identical; "all": every weight.
    train: str = "action_expert"
    # RL starts from the run's EMA weights and trains them directly; those trained weights are the ones
    # evaluated and checkpointed (as both params and EMA): no EMA is kept during RL.
    policy_lr: float = 1e-5
    # Iterations at the start in which only the critic trains (the actor's learning rate 0), so the first
    # policy update uses a critic that has learned (explained variance 0 at the first update otherwise).
    # On handover the first updates' dip of 5-14 points came anyway with 3 (docs/rl.md).
    critic_warmup: int = 0
    critic_lr: float = 1e-3
    privileged_critic: bool = True  # the critic sees the simulator's privileged state (never deployed)
    # The critic also reads the action expert's features of the policy's observation (a value head on
    # the expert, as πRL's: Policy.action_features, computed with the rollout's weights, no gradient).
    expert_features: bool = False
    max_grad_norm: float = 1.0
    # Demonstrations per minibatch from the run's own training data, trained with behaviour cloning's
    # loss beside the RL objective (times ppo.demo_coef; rl/demos.py). 0: none.
    demo_batch: int = 0
    critic_width: int = 128
    checkpoint_every: int = 5  # iterations (and at the end, and on SIGTERM)
    keep_last: int = 3
    eval_every: int = 0  # iterations between held-out evaluations (0: only at the end)
    eval_envs: int = 128
    # With eval_every: the start is evaluated first, and the run stops when this many evaluations in a
    # row fall below it (0: never).
    stop_below_start: int = 3
    # Held-out reset seeds (sim.seeds.VALIDATION_SEED: RL settings are chosen on these episodes; a
    # reported figure evaluates the result on the test seed): the rollouts draw theirs from ``seed``.
    eval_seed: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.advantage not in ("gae", "grpo"):
            raise ValueError(f"RLConfig.advantage must be 'gae' or 'grpo', got {self.advantage!r}")
        if self.advantage == "grpo" and (self.groups < 1 or self.num_envs % self.groups):
            raise ValueError(f"RLConfig.num_envs={self.num_envs} must be a multiple of groups={self.groups}")
        if self.train not in ("action_expert", "all"):
            raise ValueError(f"RLConfig.train must be 'action_expert' or 'all', got {self.train!r}")
        if self.demo_batch < 0:
            raise ValueError(f"RLConfig.demo_batch must be >= 0, got {self.demo_batch}")
        if self.rollouts_per_update < 1:
            raise ValueError(f"RLConfig.rollouts_per_update must be >= 1, got {self.rollouts_per_update}")
        if self.num_inference_steps is not None and self.num_inference_steps < 1:
            raise ValueError(f"RLConfig.num_inference_steps must be >= 1, got {self.num_inference_steps}")
        if self.noise_scale is not None and not (math.isfinite(self.noise_scale) and self.noise_scale >= 0):
            raise ValueError(f"RLConfig.noise_scale must be finite and >= 0, got {self.noise_scale}")
        if self.noise_level <= 0:
            raise ValueError(f"RLConfig.noise_level must be > 0, got {self.noise_level}")
        if self.critic_warmup < 0:
            raise ValueError(f"RLConfig.critic_warmup must be >= 0, got {self.critic_warmup}")
        if self.action_noise < 0:
            raise ValueError(f"RLConfig.action_noise must be >= 0 (0: Flow-SDE), got {self.action_noise}")


@dataclasses.dataclass(frozen=True)
class RLExperimentConfig(ExperimentConfig):
    """``python -m experiments.launch rl_<task> --init-from RUN``: the RL settings in ``rl``; with
    ``init_from`` the model, data and evaluation are the run's and this config's are unused. Not a
    saved config of its own (its checkpoints save the run's config; ``rl_config.json`` the ``rl``
    settings), as the other experiments' subclasses are saved as ``ExperimentConfig``."""

    rl: RLConfig = RLConfig()
    record: bool = False  # append the held-out result to experiments/benchmarks/results/<name>.jsonl
    shared_machine: bool = False  # for --record: other work shared the machine during the run
