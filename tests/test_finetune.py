"""Finetuning ``pi05_finetune`` end to end on tiny scale (GR00T's: tests/test_finetune_tiny.py).

Each run: a LeRobot dataset written by the data writer (3 episodes of 28² images) -> the
experiment's data config and input builder -> a tiny model started ``--init-from`` an Orbax
checkpoint made by the weight converter (upstream safetensors of a random tiny model ->
``models.convert.to_orbax``) -> 2 training steps with checkpointing. Checked against the
dataset (NumPy statistics) and the converted weights, not against the code under test.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from embodied_jax.data.writer import write_lerobot_dataset
from embodied_jax.models import convert
from embodied_jax.parallel.mesh import MESH_AXES, MeshConfig
from embodied_jax.train.checkpoint import Checkpointer
from embodied_jax.train.config import CheckpointConfig, MetricsConfig, TrainConfig
from embodied_jax.train.loop import build, train

IMAGE = 28
STATE_DIM, ACTION_DIM, HORIZON = 5, 4, 4
TASKS = ("pick up the cube", "open the drawer")


def _episodes(cameras: tuple[str, ...], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    episodes = []
    for i, frames in enumerate((6, 7, 5)):
        episode = {
            "task": TASKS[i % 2],
            "observation.state": rng.normal(size=(frames, STATE_DIM)).astype(np.float32) * (1 + np.arange(STATE_DIM)),
            "action": rng.uniform(-2, 3, size=(frames, ACTION_DIM)).astype(np.float32),
        }
        for cam in cameras:
            episode[cam] = rng.integers(0, 256, (frames, IMAGE, IMAGE, 3), dtype=np.uint8)
        episodes.append(episode)
    return episodes


def _all(episodes: list[dict], key: str) -> np.ndarray:
    return np.concatenate([e[key] for e in episodes])


def _leaves(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(jax.device_get(v)) for path, v in flat}


def _converted(model_config, layout, tmp_path, seed: int = 7) -> tuple[str, dict[str, np.ndarray]]:
    """Random "pretrained" weights (every leaf N(0, 0.05²), so zero-initialised gates are open too)
    written in the upstream safetensors layout, then converted to an Orbax dir as ``--init-from`` reads."""
    from embodied_jax.models.weights.safetensors_io import export_checkpoint

    # one device: tiny dims do not divide over an 8-way FSDP axis, and saving 8 replicas costs seconds
    mesh = jax.make_mesh((1, 1, 1), MESH_AXES, devices=jax.devices()[:1])
    abstract, _ = convert.abstract_params(model_config, mesh)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: (0.05 * rng.standard_normal(a.shape)).astype(a.dtype), abstract)
    export_checkpoint(params, layout, tmp_path / "upstream")
    out = convert.to_orbax(tmp_path / "upstream", tmp_path / "converted", model_config, layout, mesh=mesh)
    return str(out), _leaves(params)


def _finetune(base, model, dataset, workdir, init_from):
    """The registered experiment with the tiny model and dataset swapped in, 2 steps, test-friendly I/O."""
    data = base.data
    config = dataclasses.replace(
        base,
        model=model,
        init_from=init_from,
        workdir=str(workdir),
        data=dataclasses.replace(
            data,
            root=str(dataset),  # --data.root
            pipeline=dataclasses.replace(
                data.pipeline,
                image_size=(IMAGE, IMAGE),
                spec=dataclasses.replace(data.pipeline.spec, action_horizon=HORIZON),
            ),
        ),
        train=TrainConfig(steps=2, batch_size=8, log_every=1),
        # weight decay off: a parameter without gradient keeps its value exactly
        optimizer=dataclasses.replace(base.optimizer, lr=1e-2, warmup_steps=1, weight_decay=0.0, frozen_dtype=None),
        mesh=MeshConfig(data=-1),
        checkpoint=CheckpointConfig(save_every=2, keep_last=1, async_save=False),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
    )
    result = train(config)
    rt = build(config)
    ckpt = Checkpointer(result.checkpoint_dir, CheckpointConfig(async_save=False))
    try:
        assert ckpt.latest_step() == 2
        state, norm_stats = ckpt.restore(rt.abstract_state, rt.shardings)
    finally:
        ckpt.close()
    losses = [h["loss"] for h in result.history if "loss" in h]
    return losses, state, norm_stats


# ----------------------------------------------------------------------------- π0.5


@pytest.fixture(scope="module")
def pi05_run(tmp_path_factory):
    from embodied_jax.models.pi05.weights import PI05_LAYOUT
    from embodied_jax.models.tokenizer import train_sentencepiece
    from experiments.pi05 import pi05_finetune, tiny_model

    tmp = tmp_path_factory.mktemp("pi05_finetune")
    cams = ("observation.images.image", "observation.images.wrist_image")  # the experiment's default keys
    episodes = _episodes(cams, seed=0)
    write_lerobot_dataset(tmp / "dataset", episodes, fps=10, image_storage="png")
    corpus = [f"Task: {t}, State: {' '.join(str(i) for i in range(256))};\nAction: " for t in TASKS] * 8
    train_sentencepiece(corpus, tmp / "tokenizer.model", vocab_size=300, model_type="unigram")

    tiny = tiny_model()
    base_model = dataclasses.replace(
        tiny,
        vision=dataclasses.replace(tiny.vision, image_size=IMAGE, patch_size=14),
        action_horizon=HORIZON,
        tokenizer_path=str(tmp / "tokenizer.model"),
    )
    init_from, exported = _converted(base_model, PI05_LAYOUT, tmp)
    model = dataclasses.replace(base_model, lora_rank=4, lora_alpha=8.0)
    losses, state, stats = _finetune(pi05_finetune(), model, tmp / "dataset", tmp / "run", init_from)
    return dict(episodes=episodes, losses=losses, state=state, stats=stats, exported=exported)


def test_pi05_finetune_trains_from_converted_weights(pi05_run):
    assert len(pi05_run["losses"]) == 2 and np.isfinite(pi05_run["losses"]).all()


def test_pi05_finetune_with_lora_trains_only_the_adapters(pi05_run):
    trainable = _leaves(pi05_run["state"].params)
    frozen = _leaves(pi05_run["state"].frozen)
    exported = pi05_run["exported"]
    assert trainable and all(k.rsplit("/", 1)[-1] in ("lora_a", "lora_b") for k in trainable)
    assert not any("lora_" in k for k in frozen)
    # every base weight is the converted one, unchanged by two steps
    assert set(frozen) == set(exported)
    for name, value in frozen.items():
        np.testing.assert_array_equal(value, exported[name], err_msg=name)
    # lora_b starts at zero: the adapters moved
    moved = [k for k, v in trainable.items() if k.endswith("lora_b") and np.abs(v).max() > 0]
    assert len(moved) == sum(k.endswith("lora_b") for k in trainable)


def test_pi05_finetune_checkpoint_has_quantile_stats(pi05_run):
    stats, episodes = pi05_run["stats"], pi05_run["episodes"]
    assert set(stats) == {"observation.state", "action"}
    for key in stats:
        values = _all(episodes, key)
        np.testing.assert_allclose(
            np.asarray(stats[key]["q01"]).reshape(-1), np.quantile(values, 0.01, axis=0), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_allclose(
            np.asarray(stats[key]["q99"]).reshape(-1), np.quantile(values, 0.99, axis=0), rtol=1e-5, atol=1e-6
        )
