"""An RL run of a trained policy (the session's tiny demo run): it resumes from its checkpoint with
the uninterrupted run's metrics (the demonstrations' batches included), and its checkpoints load
with ``load_policy`` as any run's, sampling with the denoising steps RL trained with."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from embodied_jax.rl.config import RLConfig, RLExperimentConfig
from embodied_jax.rl.ppo import PPOSettings
from embodied_jax.train.config import MetricsConfig
from embodied_jax.train.optimizer import path_str

TIMINGS = {"rollout_s", "update_s", "env_steps_per_s", "decisions_per_s"}


def _config(demo_run, workdir, iterations):
    return RLExperimentConfig(
        init_from=str(demo_run),
        workdir=str(workdir),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
        rl=RLConfig(
            task="reach",
            num_envs=8,
            iterations=iterations,
            checkpoint_every=1,
            eval_envs=0,
            policy_lr=1e-3,
            shaping=0.1,  # dense rewards: advantages that are not all zero when no episode succeeds
            demo_batch=4,  # the run's demonstrations beside PPO: their iterator resumes with the run
            num_inference_steps=1,  # the demo run samples with 2: RL's policy is saved with RL's sampler
            noise_scale=0.5,  # ... and its initial noise (the run's: 1)
            ppo=PPOSettings(epochs=1, minibatches=2),
        ),
    )


def _rows(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_rl_run_resumes_with_identical_metrics_and_loads_with_load_policy(demo_run, tmp_path):
    from embodied_jax import load_policy
    from embodied_jax.rl.loop import train

    devices = jax.local_devices()[:1]
    whole = train(_config(demo_run, tmp_path / "whole", 2), devices)
    assert whole.iterations == 2
    # the same run as if stopped after its first iteration: its second checkpoint never written
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut, ignore=shutil.ignore_patterns("run.lock"))
    for part in ("checkpoints", "rl_state"):
        shutil.rmtree(cut / part / "2")
    resumed = train(_config(demo_run, cut, 2), devices)
    assert resumed.iterations == 2
    a, b = _rows(tmp_path / "whole"), _rows(cut)
    assert [r["step"] for r in b] == [1, 2]
    assert all(r["demo_loss"] > 0 for r in a)
    for x, y in zip(a, b, strict=True):
        for key in x.keys() - TIMINGS:
            np.testing.assert_allclose(y[key], x[key], rtol=1e-6, err_msg=key)

    bundle = load_policy(cut)  # the RL weights, read as any run's policy
    start = load_policy(demo_run)
    assert bundle.step == 2
    assert (bundle.config.model.num_inference_steps, start.config.model.num_inference_steps) == (1, 2)
    assert (bundle.config.model.noise_scale, start.config.model.noise_scale) == (0.5, 1.0)
    changed = jax.tree.map(lambda p, q: float(np.abs(np.asarray(p) - np.asarray(q)).max()), bundle.params, start.params)
    assert max(jax.tree.leaves(changed)) > 0  # the update moved the policy
    # only its action expert (RLConfig.train's default): vision tower, projector and the VLM's stream bit-identical
    moved = {path_str(k) for k, v in jax.tree_util.tree_leaves_with_path(changed) if v > 0}
    fixed = {path_str(k) for k, _ in jax.tree_util.tree_leaves_with_path(changed)} - moved
    assert moved and all(
        p.startswith(("llm/layers/experts/1/", "llm/final_norms/1/", "action_", "time_mlp")) for p in moved
    )
    assert any(p.startswith("vision_tower/") for p in fixed) and any(
        p.startswith("llm/layers/experts/0/") for p in fixed
    )
    again = load_policy(tmp_path / "whole")
    same = jax.tree.map(lambda p, q: np.array_equal(np.asarray(p), np.asarray(q)), bundle.params, again.params)
    assert all(jax.tree.leaves(same))  # resumed and uninterrupted runs end with the same weights
