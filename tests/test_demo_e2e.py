"""The end-to-end path on a tiny scale: collect -> train -> policy bundle -> closed-loop eval -> JSON."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from embodied_jax.train.config import CheckpointConfig, MetricsConfig, TrainConfig
from experiments.demo import demo_config

IMAGE = 32  # as tests/test_sim_collect.py: the expert rollout compiles once for both


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("demo")
    base = demo_config(image_size=IMAGE)
    config = dataclasses.replace(
        base, episodes=6, eval_envs=8, num_videos=1, workdir=str(workdir),
        model=dataclasses.replace(base.model, num_inference_steps=2),  # plumbing, not success: cheap sampling
        train=TrainConfig(steps=4, batch_size=8, log_every=2, eval_every=4),  # in-training eval at the end
        checkpoint=CheckpointConfig(save_every=4, keep_last=1, async_save=False),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
        evaluation=dataclasses.replace(base.evaluation, num_envs=8, execute_steps=5),
    )
    assert config.run() == 0
    return workdir


def test_demo_writes_dataset_checkpoint_and_report(demo_run):
    results = json.loads((demo_run / "eval" / "results.json").read_text())
    assert results["task"] == "reach" and results["episodes"] == 8
    assert 0.0 <= results["success_rate"] <= 1.0
    low, high = results["success_ci95"]
    assert low <= results["success_rate"] <= high
    assert (demo_run / "eval" / "reach_episode0.mp4").stat().st_size > 0
    assert (demo_run / "eval" / "reach_frames.png").exists()
    assert (demo_run / "dataset" / "meta" / "info.json").exists()
    assert (demo_run / "checkpoints" / "4").is_dir()


def test_training_logs_closed_loop_success_next_to_the_loss(demo_run):
    rows = [json.loads(line) for line in (demo_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reach/success_rate" in r]
    assert [r["step"] for r in evals] == [4]
    assert 0.0 <= evals[0]["eval/reach/success_rate"] <= 1.0 and evals[0]["eval/reach/mean_episode_length"] > 0
    assert any("loss" in r and r["step"] == 4 for r in rows)


def test_policy_bundle_predicts_unnormalised_actions(demo_run):
    from embodied_jax import load_policy
    from embodied_jax.data.lerobot import LeRobotDataset

    bundle = load_policy(demo_run)
    assert bundle.step == 4
    dataset = LeRobotDataset(demo_run / "dataset")
    frame = dataset.frame(0, 0)
    raw = {"observation.state": frame["observation.state"][None], "task": frame["task"],
           "observation.images.scene": frame["observation.images.scene"][None],
           "observation.images.wrist": frame["observation.images.wrist"][None]}
    actions = bundle.predict(raw)
    assert actions.shape == (1, bundle.config.model.action_horizon, 4)
    assert np.isfinite(actions).all()
    # Unnormalised: quantile-normalised outputs in [-1, 1] map back into the data's action range.
    stats = bundle.stats["action"]
    span = np.asarray(stats.max) - np.asarray(stats.min)
    assert (actions >= np.asarray(stats.min) - 2 * span).all() and (actions <= np.asarray(stats.max) + 2 * span).all()
    obs = bundle.preprocess(raw)
    assert obs["images"]["base_0_rgb"].shape == (1, IMAGE, IMAGE, 3)
    assert obs["tokens"].shape == (1, bundle.config.model.max_token_len) and obs["token_mask"][0, 0]


def test_gr00t_demo_prompts_tokenize_without_unknown_words(tmp_path):
    """``demo_gr00t``: its word-level tokenizer covers the Eagle prompt of every built-in task, and the
    config's image-token id, vocabulary and prompt length agree with it."""
    from embodied_jax.sim.tasks import TASKS
    from experiments.demo import GR00T_CAMERAS, build_gr00t_tokenizer

    config = demo_config(arch="gr00t")
    model = dataclasses.replace(config.model, tokenizer_path=str(build_gr00t_tokenizer(tmp_path / "tokenizer.json")))
    builder = model.input_builder()  # checks the special tokens and the <IMG_CONTEXT> id
    assert builder.tokenizer.vocab_size == model.vocab_size
    for task in TASKS.values():
        tokens, mask = builder.tokenize(task.instruction)
        ids = tokens[mask]
        assert (ids != 0).all(), task.name  # id 0 is [UNK]
        assert (ids == model.image_token_id).sum() == len(GR00T_CAMERAS) * model.image_tokens
    assert config.data.data.norm_modes == (("observation.state", "min_max"), ("action", "min_max"))
    with pytest.raises(ValueError, match="arch"):
        demo_config(arch="rt2")
