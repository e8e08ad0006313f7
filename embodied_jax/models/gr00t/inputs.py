"""GR00T-N1.5 input builder (one raw sample -> model arrays) and the packed VL layout.

Prompt: Eagle 2.5's chat template as GR00T applies it (one user turn holding the images
then the task text, generation prompt added), with each image marker ``<image-k>``
expanded as Eagle's processor does to ``<image k><img>`` + ``<IMG_CONTEXT>`` x 256 +
``</img>``::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
    <image 1><img><IMG_CONTEXT>...</img>{task}<|im_end|>\\n<|im_start|>assistant\\n

The Qwen3 tokenizer is read from a local ``tokenizer.json`` (``tokenizers`` package); the
special tokens above must be in its added vocabulary and ``<IMG_CONTEXT>`` must have the
config's ``image_token_id``. State is zero-padded to ``max_state_dim``, actions to
``action_dim`` with an ``action_mask``.

Two output forms: unpadded (``packed=False``, the Observation contract) has every
configured camera and the prompt right-padded to ``max_token_len`` (``token_mask`` marks
real tokens); ``packed=True`` emits a sample for ``data/packing.py``: the prompt unpadded,
with image blocks for the cameras the sample has only, and ``images`` [n, H, W, 3].

``in_program`` gives the unpadded form as jnp for one row of a jitted program
(``policy.InProgramBuilder``): the prompt is fixed per instruction, so it is tokenised once.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from embodied_jax.errors import DeviceIOError, InputError
from embodied_jax.images import to_unit_range
from embodied_jax.models.in_program import check_image_size, pad_state
from embodied_jax.models.tokenizer import JsonTokenizer
from embodied_jax.policy import InProgramInputs, RowTransform

SYSTEM_PROMPT = "You are a helpful assistant."
IMAGE_CONTEXT = "<IMG_CONTEXT>"
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<img>", "</img>", IMAGE_CONTEXT)


class PromptError(InputError, ValueError):
    """A task that cannot become a GR00T prompt (a special token in it, or too many tokens)."""


def eagle_prompt(task: str, num_images: int, image_tokens: int = 256) -> str:
    """The Eagle 2.5 chat prompt GR00T feeds the backbone, image-context tokens expanded."""
    images = "".join(f"<image {i + 1}><img>{IMAGE_CONTEXT * image_tokens}</img>" for i in range(num_images))
    return (
        f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{images}{task}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@dataclasses.dataclass(frozen=True)
class Gr00tInputBuilder:
    """Callable mapping one sample {"task", "images": {cam: [H, W, 3]}, "state", "actions"?, "embodiment_id"?}."""

    tokenizer_path: str | os.PathLike
    camera_names: tuple[str, ...] = ("ego_view",)
    image_tokens: int = 256
    image_token_id: int = 151669
    max_token_len: int = 320
    max_state_dim: int = 64
    action_dim: int = 32
    embodiment_id: int = 31  # upstream "new_embodiment"
    pad_token: str = "<|endoftext|>"
    image_size: int | None = None  # expected square image side (None: not checked)
    packed: bool = False  # emit variable-length samples for the packer (module docstring)

    def __post_init__(self):
        tok = JsonTokenizer(self.tokenizer_path, pad_token=self.pad_token)
        for token in SPECIAL_TOKENS:
            tok._token_id(token)  # raises naming the file and the token when absent
        got = tok._token_id(IMAGE_CONTEXT)
        if got != self.image_token_id:
            raise ValueError(
                f"{self.tokenizer_path}: {IMAGE_CONTEXT} has id {got}, the model expects "
                f"image_token_id={self.image_token_id}"
            )
        object.__setattr__(self, "_tokenizer", tok)

    @property
    def tokenizer(self) -> JsonTokenizer:
        return self._tokenizer

    @property
    def tokens_per_image(self) -> int:
        """Placeholder tokens one image costs in a packed row (at least; its tags add a few)."""
        return self.image_tokens

    @classmethod
    def for_config(cls, config, tokenizer_path, **kwargs) -> Gr00tInputBuilder:
        """A builder matching a ``Gr00tConfig``'s cameras, lengths and dimensions."""
        return cls(
            tokenizer_path,
            camera_names=config.camera_names,
            image_tokens=config.vision.num_patches,
            image_token_id=config.image_token_id,
            max_token_len=config.max_token_len,
            max_state_dim=config.max_state_dim,
            action_dim=config.action_dim,
            image_size=config.vision.image_size,
            **kwargs,
        )

    def prompt_ids(self, task: str, num_images: int) -> np.ndarray:
        """The unpadded prompt's token ids (int32) for ``num_images`` image blocks; a task holding
        one of the chat template's special tokens, or too long for ``max_token_len``, is a
        ``PromptError`` (the task's fault, not the tokenizer's)."""
        special = [t for t in SPECIAL_TOKENS if t in task]
        if special:
            raise PromptError(f"task: holds the special token {special[0]}, which only the prompt template may place")
        ids = self._tokenizer.encode(eagle_prompt(task.strip(), num_images, self.image_tokens))
        if len(ids) > self.max_token_len:
            raise PromptError(
                f"task: the GR00T prompt has {len(ids)} tokens, more than max_token_len={self.max_token_len}"
            )
        found = sum(i == self.image_token_id for i in ids)
        if found != num_images * self.image_tokens:
            raise ValueError(
                f"{self.tokenizer_path}: the prompt tokenised to {found} {IMAGE_CONTEXT} tokens, "
                f"expected {num_images * self.image_tokens}"
            )
        return np.asarray(ids, np.int32)

    def tokenize(self, task: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self.prompt_ids(task, len(self.camera_names))
        tokens = np.full((self.max_token_len,), self._tokenizer.pad_id, np.int32)
        tokens[: len(ids)] = ids
        mask = np.arange(self.max_token_len) < len(ids)
        return tokens, mask

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        for key in ("task", "state", "images"):
            if key not in sample:
                raise KeyError(f"GR00T input builder: sample has no {key!r} (keys: {sorted(sample)})")
        unknown = set(sample["images"]) - set(self.camera_names)
        if unknown:
            raise KeyError(f"GR00T input builder: cameras {sorted(unknown)} not in cameras {self.camera_names}")
        cameras = [c for c in self.camera_names if c in sample["images"]]
        if not self.packed and len(cameras) < len(self.camera_names):
            raise KeyError(
                f"GR00T input builder: sample images lack cameras "
                f"{[c for c in self.camera_names if c not in cameras]} (have {sorted(sample['images'])})"
            )
        if self.image_size is not None:
            for c in cameras:
                shape = np.shape(sample["images"][c])
                if tuple(shape) != (self.image_size, self.image_size, 3):
                    raise ValueError(
                        f"GR00T input builder: image {c!r} has shape {shape}, the model expects "
                        f"({self.image_size}, {self.image_size}, 3) (set the data pipeline's image_size)"
                    )
        state = np.asarray(sample["state"], np.float32).reshape(-1)
        if state.shape[0] > self.max_state_dim:
            raise ValueError(
                f"GR00T input builder: state has {state.shape[0]} dims > max_state_dim={self.max_state_dim}"
            )
        out = {
            "state": np.pad(state, (0, self.max_state_dim - state.shape[0])),
            "embodiment_id": np.int32(sample.get("embodiment_id", self.embodiment_id)),
        }
        if self.packed:
            out["tokens"] = self.prompt_ids(sample["task"], len(cameras))
            size = self.image_size or 1
            images = [to_unit_range(sample["images"][c]) for c in cameras]
            out["images"] = np.stack(images) if images else np.zeros((0, size, size, 3), np.float32)
        else:
            out["tokens"], out["token_mask"] = self.tokenize(sample["task"])
            out["images"] = {c: to_unit_range(sample["images"][c]) for c in self.camera_names}
            out["image_masks"] = {c: np.bool_(True) for c in self.camera_names}
        if "actions" in sample:
            actions = np.asarray(sample["actions"], np.float32)
            if actions.ndim != 2 or actions.shape[1] > self.action_dim:
                raise ValueError(
                    f"GR00T input builder: actions must be [horizon, <= {self.action_dim}], got {actions.shape}"
                )
            pad = self.action_dim - actions.shape[1]
            out["actions"] = np.pad(actions, ((0, 0), (0, pad)))
            out["action_mask"] = np.pad(np.ones_like(actions, bool), ((0, 0), (0, pad)))
        return out

    def in_program(self, instruction: str, front: RowTransform) -> InProgramInputs:
        """This builder's unpadded inputs for ``instruction`` as jnp for one row: every camera
        present, images as the data layer made them, the state padded."""
        slots = [slot for _, slot in front.cameras]
        lacking = [c for c in self.camera_names if c not in slots]
        if lacking:
            raise DeviceIOError(
                f"GR00T reads cameras {list(self.camera_names)}; the run's inputs give none for {lacking}"
            )
        tokens, token_mask = self.tokenize(instruction)  # PromptError names a task it cannot take
        tokens, token_mask = np.asarray(tokens, np.int32), np.asarray(token_mask, bool)
        size = None if self.image_size is None else (self.image_size, self.image_size)
        embodiment = np.int32(self.embodiment_id)

        def row(state, images):
            state, images = front.state(state), front.images(images)
            for slot in self.camera_names:
                check_image_size(slot, images[slot], size, "GR00T")
            return {
                "state": pad_state(state.reshape(-1), self.max_state_dim),
                "embodiment_id": jnp.asarray(embodiment),
                "tokens": jnp.asarray(tokens),
                "token_mask": jnp.asarray(token_mask),
                "images": {c: to_unit_range(images[c], xp=jnp) for c in self.camera_names},
                "image_masks": {c: jnp.asarray(True) for c in self.camera_names},
            }

        return InProgramInputs(row)


def packed_sample(sample: dict[str, Any], cameras) -> dict[str, Any]:
    """An unpadded builder sample (every camera present) -> the packer's form: its real prompt
    tokens and ``images`` [n, H, W, 3]; other values unchanged (synthetic data, tests)."""
    out = {k: v for k, v in sample.items() if k not in ("images", "image_masks", "tokens", "token_mask")}
    out["tokens"] = np.asarray(sample["tokens"])[np.asarray(sample["token_mask"], bool)].astype(np.int32)
    out["images"] = np.stack([np.asarray(sample["images"][c], np.float32) for c in cameras])
    return out
