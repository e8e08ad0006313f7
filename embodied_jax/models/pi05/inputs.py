"""π0.5 input builder: one raw sample -> the model's observation/action arrays (NumPy).

Follows openpi/LeRobot's π0.5 preprocessing:

- the state (already normalised to [-1, 1] by the data layer's quantile normaliser) is
  zero-padded to ``max_state_dim`` and discretised into 256 bins with
  ``np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1`` (values below -1 give -1, as upstream);
- the prompt is ``f"Task: {task}, State: {bins};\\nAction: "`` where the task is stripped and has
  ``_`` and newlines replaced by spaces, tokenised with BOS, truncated and right-padded to
  ``max_token_len`` (``token_mask`` marks real tokens);
- images are float32 in [-1, 1] (``images.to_unit_range``: uint8, or float in [0, 1] or [-1, 1]),
  resized with padding to ``image_size`` when needed (``images.resize_with_pad``, openpi's
  floor rounding, padded with -1); a camera slot missing from the sample is filled with -1 and masked out;
- actions are zero-padded to ``max_action_dim``; ``action_dim_mask`` marks the real dimensions.

With ``packed=True`` the builder emits a sample for ``data/packing.py`` instead: ``tokens``
unpadded = ``image_tokens`` image-token ids (``image_token_id``, PaliGemma's ``<image>``) per
camera the sample has, then the prompt; ``images`` [n, H, W, 3] for those cameras only (an
absent camera is never encoded). The model fills those tokens with the images' tokens,
so a packed sample's prefix is the unpadded sample's real tokens in the same order.

The builder is a plain callable on one unbatched sample so the data pipeline can map it; its
``in_program`` form gives the same inputs as jnp for one row of a jitted program
(``policy.InProgramBuilder``): cameras the run lacks are -1 and masked, images read with
``floats="auto"`` and never resized, the prompt assembled from ``prompt.Pi05Prompt``'s tables.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from embodied_jax.images import resize_with_pad, to_unit_range
from embodied_jax.models.in_program import check_image_size, pad_state
from embodied_jax.models.pi05.prompt import (
    Pi05Prompt,
    build_prompt,
    discretize_state,
    host_prompt_tokens,
    tokenize_prompt,
)
from embodied_jax.models.tokenizer import load_tokenizer
from embodied_jax.policy import InProgramInputs, RowTransform

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Pi05InputBuilder:
    """Callable mapping one sample {"task", "state", "images": {cam: [H, W, 3]}, "actions"?} to model inputs."""

    tokenizer_path: str | os.PathLike
    camera_names: tuple[str, ...] = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    image_size: tuple[int, int] = (224, 224)
    max_token_len: int = 200
    max_state_dim: int = 32
    max_action_dim: int = 32
    state_bins: int = 256
    packed: bool = False  # emit variable-length samples for the packer (module docstring)
    image_tokens: int = 256  # vision tokens per image (image-token ids per camera when packed)
    image_token_id: int = 257_152  # the image-token id (outside the text vocabulary)

    def __post_init__(self):
        object.__setattr__(self, "_tokenizer", load_tokenizer(self.tokenizer_path))

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def tokens_per_image(self) -> int:
        return self.image_tokens

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        for key in ("task", "state"):
            if key not in sample:
                raise KeyError(f"π0.5 input builder: sample has no {key!r} (keys: {sorted(sample)})")
        state = np.asarray(sample["state"], np.float32)
        bins = discretize_state(state, self.max_state_dim, self.state_bins)
        tokens, token_mask = tokenize_prompt(self._tokenizer, build_prompt(sample["task"], bins), self.max_token_len)
        given = sample.get("images", {})
        unknown = set(given) - set(self.camera_names)
        if unknown:
            raise KeyError(f"π0.5 input builder: cameras {sorted(unknown)} not in camera_names {self.camera_names}")
        images, masks = {}, {}
        for cam in self.camera_names:
            if cam in given:
                images[cam] = resize_with_pad(
                    to_unit_range(given[cam], floats="auto"), *self.image_size, rounding="floor"
                )
                masks[cam] = np.bool_(True)
            else:
                images[cam] = np.full((*self.image_size, 3), -1.0, np.float32)
                masks[cam] = np.bool_(False)
        out = {
            "images": images,
            "image_masks": masks,
            "state": np.pad(state, (0, self.max_state_dim - state.shape[0])),
            "tokens": tokens,
            "token_mask": token_mask,
        }
        if "actions" in sample:
            actions = np.asarray(sample["actions"], np.float32)
            if actions.ndim != 2 or actions.shape[1] > self.max_action_dim:
                raise ValueError(
                    f"π0.5 input builder: actions must be [horizon, <= {self.max_action_dim}], got {actions.shape}"
                )
            out["actions"] = np.pad(actions, ((0, 0), (0, self.max_action_dim - actions.shape[1])))
            out["action_dim_mask"] = np.arange(self.max_action_dim) < actions.shape[1]
        if "privileged_state" in sample:
            if self.packed:
                raise ValueError(
                    "π0.5: the privileged head (--data.inputs.privileged-key) trains on unpacked batches; "
                    "drop --data.packing.seq-len"
                )
            out["privileged_state"] = np.asarray(sample["privileged_state"], np.float32)
        if self.packed:
            return packed_sample(out, self.camera_names, self.image_tokens, self.image_token_id)
        return out

    def in_program(self, instruction: str, front: RowTransform) -> InProgramInputs:
        """This builder's inputs for ``instruction`` as jnp for one row (the module docstring)."""
        prompt = Pi05Prompt.build(self, instruction, front)
        host_tokens = None
        if not prompt.verify(self, instruction, front):
            log.warning(
                "the tokenizer %s merges text across the π0.5 prompt's pieces (the in-program assembly "
                "differs from its own encoding): the prompt tokens come from the host through "
                "jax.pure_callback on every call",
                getattr(self.tokenizer, "path", type(self.tokenizer).__name__),
            )
            host_tokens = host_prompt_tokens(self, instruction, front)
        size = tuple(self.image_size)

        def row(raw_state, images):
            state, given = front.state(raw_state), front.images(images)
            out_images, masks = {}, {}
            for cam in self.camera_names:
                if cam in given:
                    out_images[cam] = to_unit_range(given[cam], floats="auto", xp=jnp)
                    check_image_size(cam, out_images[cam], size, "π0.5")
                    masks[cam] = jnp.asarray(True)
                else:
                    out_images[cam] = jnp.full((*size, 3), -1.0, jnp.float32)
                    masks[cam] = jnp.asarray(False)
            out = {"images": out_images, "image_masks": masks, "state": pad_state(state, self.max_state_dim)}
            if host_tokens is None:
                out["tokens"], out["token_mask"] = prompt.tokens(raw_state)
            return out

        return InProgramInputs(row, host_tokens)


def packed_sample(sample: dict[str, Any], camera_names, image_tokens: int, image_token_id: int) -> dict[str, Any]:
    """An unpadded builder sample -> the packer's form: image-token ids for its present cameras, then
    its real prompt tokens; ``images`` [n, H, W, 3] of those cameras; other values unchanged."""
    present = [c for c in camera_names if bool(sample["image_masks"][c])]
    out = {k: v for k, v in sample.items() if k not in ("images", "image_masks", "tokens", "token_mask")}
    prompt = np.asarray(sample["tokens"])[np.asarray(sample["token_mask"], bool)]
    image_ids = np.full(len(present) * image_tokens, image_token_id, np.int32)
    out["tokens"] = np.concatenate([image_ids, prompt]).astype(np.int32)
    shape = np.shape(sample["images"][camera_names[0]])
    out["images"] = (
        np.stack([np.asarray(sample["images"][c], np.float32) for c in present])
        if present
        else np.zeros((0, *shape), np.float32)
    )
    return out


# ----------------------------------------------------------------------------- synthetic data


def synthetic_samples(config, count: int, seed: int = 0, prompt_lengths=None) -> list[dict[str, Any]]:
    """Unpacked random samples of ``config``'s shapes (2 of the camera slots filled when there are 3+)."""
    rng = np.random.default_rng(seed)
    size = config.vision.image_size
    default_len = config.synthetic_prompt_len or max(1, config.max_token_len // 4)
    samples = []
    for i in range(count):
        n = int(prompt_lengths[i]) if prompt_lengths is not None else default_len
        tokens = np.zeros((config.max_token_len,), np.int32)
        tokens[:n] = rng.integers(1, config.vocab_size, n)
        samples.append(
            {
                "images": {c: rng.uniform(-1, 1, (size, size, 3)).astype(np.float32) for c in config.camera_names},
                "image_masks": {
                    c: np.bool_(j < 2 or len(config.camera_names) < 3) for j, c in enumerate(config.camera_names)
                },
                "state": rng.uniform(-1, 1, (config.max_state_dim,)).astype(np.float32),
                "tokens": tokens,
                "token_mask": np.arange(config.max_token_len) < n,
                "actions": rng.normal(size=(config.action_horizon, config.max_action_dim)).astype(np.float32),
            }
        )
    return samples


def stack_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack per-sample dicts (nested one level for per-camera dicts) into a batch."""
    out = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = {k: np.stack([r[key][k] for r in rows]) for k in value}
        else:
            out[key] = np.stack([r[key] for r in rows])
    return out


def synthetic_pi05_batch(config, batch_size: int, seed: int = 0) -> dict[str, Any]:
    """An unpacked training batch of ``config``'s exact shapes."""
    return stack_rows(synthetic_samples(config, batch_size, seed))
