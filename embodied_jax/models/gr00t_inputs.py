"""GR00T-N1.5 input builder (one raw sample -> model arrays) and the packed VL layout.

Prompt: Eagle 2.5's chat template as GR00T applies it (one user turn holding the images
then the task text, generation prompt added), with each image marker ``<image-k>``
expanded as Eagle's processor does to ``<image k><img>`` + ``<IMG_CONTEXT>`` x 256 +
``</img>``::

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n<|im_start|>user\\n
    <image 1><img><IMG_CONTEXT>...</img>{task}<|im_end|>\\n<|im_start|>assistant\\n

The Qwen3 tokenizer is read from a local ``tokenizer.json`` (``tokenizers`` package); the
special tokens above must be in its added vocabulary and ``<IMG_CONTEXT>`` must have the
config's ``image_token_id``. Prompts are right-padded (``token_mask`` marks real tokens).
State is zero-padded to ``max_state_dim``, actions to ``action_dim`` with an ``action_mask``.

``pack_batch`` turns an unpacked batch into the packed VL layout ``Gr00tPolicy`` accepts:
samples' prompts laid end to end in rows (in sample order), ``segment_ids``/``positions``
per token, and ``sample_row``/``sample_segment`` per sample; the action-side arrays stay
per sample.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from embodied_jax.models.tokenizer import JsonTokenizer

SYSTEM_PROMPT = "You are a helpful assistant."
IMAGE_CONTEXT = "<IMG_CONTEXT>"
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<img>", "</img>", IMAGE_CONTEXT)


def eagle_prompt(task: str, num_images: int, image_tokens: int = 256) -> str:
    """The Eagle 2.5 chat prompt GR00T feeds the backbone, image-context tokens expanded."""
    images = "".join(
        f"<image {i + 1}><img>{IMAGE_CONTEXT * image_tokens}</img>" for i in range(num_images)
    )
    return (f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{images}{task}<|im_end|>\n"
            "<|im_start|>assistant\n")


@dataclasses.dataclass(frozen=True)
class Gr00tInputBuilder:
    """Callable mapping one sample {"task", "images": {cam: [H, W, 3]}, "state", "actions"?, "embodiment_id"?}."""

    tokenizer_path: str | os.PathLike
    cameras: tuple[str, ...] = ("ego_view",)
    image_tokens: int = 256
    image_token_id: int = 151669
    max_token_len: int = 320
    max_state_dim: int = 64
    action_dim: int = 32
    embodiment_id: int = 31  # upstream "new_embodiment"
    pad_token: str = "<|endoftext|>"
    image_size: int | None = None  # expected square image side (None: not checked)

    def __post_init__(self):
        tok = JsonTokenizer(self.tokenizer_path, pad_token=self.pad_token)
        for token in SPECIAL_TOKENS:
            tok._token_id(token)  # raises naming the file and the token when absent
        got = tok._token_id(IMAGE_CONTEXT)
        if got != self.image_token_id:
            raise ValueError(f"{self.tokenizer_path}: {IMAGE_CONTEXT} has id {got}, the model expects "
                             f"image_token_id={self.image_token_id}")
        object.__setattr__(self, "_tokenizer", tok)

    @property
    def tokenizer(self) -> JsonTokenizer:
        return self._tokenizer

    @classmethod
    def for_config(cls, cfg, tokenizer_path, **kwargs) -> "Gr00tInputBuilder":
        """A builder matching a ``Gr00tConfig``'s cameras, lengths and dimensions."""
        return cls(tokenizer_path, cameras=cfg.cameras, image_tokens=cfg.image_tokens,
                   image_token_id=cfg.image_token_id, max_token_len=cfg.max_token_len,
                   max_state_dim=cfg.max_state_dim, action_dim=cfg.action_dim, image_size=cfg.image_size,
                   **kwargs)

    def tokenize(self, task: str) -> tuple[np.ndarray, np.ndarray]:
        ids = self._tokenizer.encode(eagle_prompt(task.strip(), len(self.cameras), self.image_tokens))
        if len(ids) > self.max_token_len:
            raise ValueError(f"GR00T prompt has {len(ids)} tokens, more than max_token_len={self.max_token_len} "
                             f"(task: {task[:60]!r})")
        found = sum(i == self.image_token_id for i in ids)
        if found != len(self.cameras) * self.image_tokens:
            raise ValueError(f"{self.tokenizer_path}: the prompt tokenised to {found} {IMAGE_CONTEXT} tokens, "
                             f"expected {len(self.cameras) * self.image_tokens}")
        tokens = np.full((self.max_token_len,), self._tokenizer.pad_id, np.int32)
        tokens[: len(ids)] = ids
        mask = np.arange(self.max_token_len) < len(ids)
        return tokens, mask

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        for key in ("task", "state", "images"):
            if key not in sample:
                raise KeyError(f"GR00T input builder: sample has no {key!r} (keys: {sorted(sample)})")
        missing = [c for c in self.cameras if c not in sample["images"]]
        if missing:
            raise KeyError(f"GR00T input builder: sample images lack cameras {missing} "
                           f"(have {sorted(sample['images'])})")
        if self.image_size is not None:
            for c in self.cameras:
                shape = np.shape(sample["images"][c])
                if tuple(shape) != (self.image_size, self.image_size, 3):
                    raise ValueError(f"GR00T input builder: image {c!r} has shape {shape}, the model expects "
                                     f"({self.image_size}, {self.image_size}, 3) (set the data pipeline's image_size)")
        tokens, token_mask = self.tokenize(sample["task"])
        state = np.asarray(sample["state"], np.float32).reshape(-1)
        if state.shape[0] > self.max_state_dim:
            raise ValueError(f"GR00T input builder: state has {state.shape[0]} dims > "
                             f"max_state_dim={self.max_state_dim}")
        out = {
            "images": {c: _unit_range(sample["images"][c]) for c in self.cameras},
            "image_masks": {c: np.bool_(True) for c in self.cameras},
            "tokens": tokens,
            "token_mask": token_mask,
            "state": np.pad(state, (0, self.max_state_dim - state.shape[0])),
            "embodiment_id": np.int32(sample.get("embodiment_id", self.embodiment_id)),
        }
        if "actions" in sample:
            actions = np.asarray(sample["actions"], np.float32)
            if actions.ndim != 2 or actions.shape[1] > self.action_dim:
                raise ValueError(f"GR00T input builder: actions must be [horizon, <= {self.action_dim}], "
                                 f"got {actions.shape}")
            pad = self.action_dim - actions.shape[1]
            out["actions"] = np.pad(actions, ((0, 0), (0, pad)))
            out["action_mask"] = np.pad(np.ones_like(actions, bool), ((0, 0), (0, pad)))
        return out


def _unit_range(image) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype == np.uint8:
        return image.astype(np.float32) / 127.5 - 1.0
    return image.astype(np.float32)


def pack_batch(batch: dict[str, Any], row_len: int, num_rows: int | None = None) -> dict[str, Any]:
    """Unpacked batch (``tokens``/``token_mask`` [B, L], real tokens first) -> packed VL layout.

    Samples fill rows of ``row_len`` tokens in order (a new row starts when the next prompt
    does not fit). ``num_rows`` fixes the row count (static shapes; raises if too small).
    """
    tokens = np.asarray(batch["tokens"])
    lengths = np.asarray(batch["token_mask"]).sum(axis=1)
    rows: list[list[int]] = [[]]
    used = 0
    for b, n in enumerate(lengths):
        if n > row_len:
            raise ValueError(f"pack_batch: sample {b} has {n} tokens, more than row_len={row_len}")
        if used + n > row_len:
            rows.append([])
            used = 0
        rows[-1].append(b)
        used += n
    num_rows = len(rows) if num_rows is None else num_rows
    if len(rows) > num_rows:
        raise ValueError(f"pack_batch: the batch needs {len(rows)} rows of {row_len} tokens, num_rows={num_rows}")
    packed_tokens = np.zeros((num_rows, row_len), np.int32)
    segment_ids = np.zeros((num_rows, row_len), np.int32)
    positions = np.zeros((num_rows, row_len), np.int32)
    sample_row = np.zeros((len(lengths),), np.int32)
    sample_segment = np.zeros((len(lengths),), np.int32)
    for r, members in enumerate(rows):
        cursor = 0
        for seg, b in enumerate(members, start=1):
            n = int(lengths[b])
            packed_tokens[r, cursor: cursor + n] = tokens[b, :n]
            segment_ids[r, cursor: cursor + n] = seg
            positions[r, cursor: cursor + n] = np.arange(n)
            sample_row[b], sample_segment[b] = r, seg
            cursor += n
    out = {k: v for k, v in batch.items() if k not in ("tokens", "token_mask")}
    out.update(tokens=packed_tokens, segment_ids=segment_ids, positions=positions, sample_row=sample_row,
               sample_segment=sample_segment)
    return out
