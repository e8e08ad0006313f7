"""A third model family, made here from π0.5's parts, goes through training, the policy bundle and
the in-program rollout with nothing in ``embodied_jax/bundle`` knowing it: its config (a
registered ``Pi05Config`` subclass) and its input builder (a new class, composing π0.5's, with a
prompt of its own and its own in-program form) are all it brings."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from embodied_jax.config_registry import register
from embodied_jax.models.pi05.config import Pi05Config
from embodied_jax.models.pi05.inputs import Pi05InputBuilder
from embodied_jax.models.pi05.prompt import tokenize_prompt
from embodied_jax.policy import InProgramInputs, RowTransform
from tests.conftest import DEMO_IMAGE

PROMPT = "do {task}"  # no state in the prompt: unlike π0.5's, the same tokens for every state


@dataclasses.dataclass(frozen=True)
class PromptOnlyBuilder:
    """π0.5's images and state, with a prompt that holds the task alone."""

    inner: Pi05InputBuilder

    @property
    def packed(self) -> bool:
        return self.inner.packed

    def _tokens(self, task: str) -> tuple[np.ndarray, np.ndarray]:
        return tokenize_prompt(self.inner.tokenizer, PROMPT.format(task=task.strip()), self.inner.max_token_len)

    def __call__(self, sample):
        out = self.inner(sample)
        out["tokens"], out["token_mask"] = self._tokens(sample["task"])
        return out

    def in_program(self, instruction: str, front: RowTransform) -> InProgramInputs:
        inner = self.inner.in_program(instruction, front)
        tokens, mask = (jnp.asarray(x) for x in self._tokens(instruction))

        def row(raw_state, images):
            return {**inner.row(raw_state, images), "tokens": tokens, "token_mask": mask}

        return InProgramInputs(row)


@register
@dataclasses.dataclass(frozen=True)
class PromptOnlyConfig(Pi05Config):
    """The third family: π0.5's model (found through ``policy.implements``' MRO lookup) fed by
    ``PromptOnlyBuilder``."""

    def input_builder(self, packed: bool = False):
        return PromptOnlyBuilder(super().input_builder(packed))


@pytest.fixture(scope="module")
def third_run(tmp_path_factory):
    from embodied_jax.train.config import CheckpointConfig, MetricsConfig, TrainConfig
    from experiments.demo import demo_config, run_demo

    workdir = tmp_path_factory.mktemp("third")
    base = demo_config(image_size=DEMO_IMAGE)
    fields = {f.name: getattr(base.model, f.name) for f in dataclasses.fields(base.model)}
    config = dataclasses.replace(
        base,
        episodes=4,
        eval_envs=0,
        num_videos=0,
        workdir=str(workdir),
        model=PromptOnlyConfig(**{**fields, "num_inference_steps": 2}),
        train=TrainConfig(steps=2, batch_size=8, log_every=1, eval_every=0),
        checkpoint=CheckpointConfig(save_every=2, keep_last=1, async_save=False),
        metrics=MetricsConfig(progress_bar=False, tensorboard=False),
    )
    assert run_demo(config) == 0
    return workdir


@pytest.mark.timeout(600)
def test_a_third_family_trains_serves_and_rolls_out_in_the_program(third_run):
    from embodied_jax import load_policy
    from embodied_jax.bundle.device_io import device_io
    from embodied_jax.rl import rollout as rollout_lib
    from embodied_jax.rl.config import RLConfig, RLExperimentConfig
    from embodied_jax.rl.loop import critic_functions
    from embodied_jax.rl.start import start
    from embodied_jax.sim.tasks import TASKS

    bundle = load_policy(third_run)
    assert type(bundle.config.model) is PromptOnlyConfig
    assert isinstance(bundle.transform.builder, PromptOnlyBuilder)
    instruction = TASKS["reach"].instruction
    # The host path (serving) and the in-program path give the same observation.
    rng = np.random.default_rng(0)
    state = rng.normal(size=(3, bundle.state_dim)).astype(np.float32)
    images = {
        key.removeprefix("observation.images."): rng.integers(0, 256, (3, DEMO_IMAGE, DEMO_IMAGE, 3), np.uint8)
        for key in bundle.inputs.camera_keys
    }
    raw = {
        bundle.inputs.state_key: state,
        "task": instruction,
        **{f"observation.images.{c}": x for c, x in images.items()},
    }
    want = bundle.preprocess(raw, resize=True)
    got = jax.jit(device_io(bundle, instruction).observe)(state, images)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-6, atol=1e-6)
    expected_tokens, _ = PromptOnlyBuilder(bundle.transform.builder.inner)._tokens(instruction)
    np.testing.assert_array_equal(np.asarray(got["tokens"][0]), expected_tokens)
    assert np.asarray(bundle.predict({k: v[0] if k != "task" else v for k, v in raw.items()})).ndim == 2

    # An RL rollout from the run: observations, sampling and actions in one jitted program.
    config = RLExperimentConfig(
        init_from=str(third_run),
        workdir=str(third_run / "rl"),
        rl=RLConfig(task="reach", num_envs=2, iterations=1, eval_envs=0, num_inference_steps=2),
    )
    st = start(config, jax.devices()[:1])
    critic, critic_params = critic_functions(rollout_lib.critic_width(st.env), 16, 0)
    execute = 25
    spec = rollout_lib.RolloutSpec(2, execute, rollout_lib.decisions_per_episode(st.env.episode_limit, execute))
    with st.rt.context():
        rollout = rollout_lib.make_rollout(st.env, st.agent, critic, spec)(st.params, critic_params, jax.random.key(1))
    assert rollout.first_action.shape == (spec.decisions, 2, bundle.action_dim)
    assert np.isfinite(np.asarray(rollout.log_prob)).all() and np.isfinite(np.asarray(rollout.first_action)).all()
    assert np.asarray(rollout.env_steps).min() > 0
    np.testing.assert_array_equal(np.asarray(rollout.model_observation["tokens"][0, 0]), expected_tokens)
