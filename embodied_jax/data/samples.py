"""Training samples over (episode, frame): action chunks with pad masks, cameras, task, delta actions.

A *frame source* is anything with the reader's access methods (`LeRobotDataset` and
`FrameStore` both are): `fps`, `num_frames`, `episode_starts`, `episode_lengths`,
`episode_indices`, `camera_keys`, `tasks`, `arrays`, `episode_array(position, key)`,
`task(position, frame)`, `images(position, key, frames)` and `modality`.

Padding follows LeRobot: a query past the episode's end (or before its start) takes the
nearest frame and is flagged in ``<key>_is_pad``; keys listed as relative are zero at
padded steps instead. Delta actions subtract the current state on the masked dimensions
after padding (so a padded step holds the last absolute target, as openpi does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from embodied_jax.config_registry import register
from embodied_jax.data import lerobot_format as fmt

STATE_KEY = "observation.state"
ACTION_KEY = "action"


@register
@dataclasses.dataclass(frozen=True)
class SampleSpec:
    """What one sample holds.

    action_horizon: steps in each action chunk (offsets 0..horizon-1 frames) unless
      `delta_timestamps` names the key; None: the model's, set before a run (`DataSource.fit`).
    delta_timestamps: per key, offsets in seconds (LeRobot's `delta_timestamps`), for actions,
      state history or camera history.
    relative_keys: keys zero-padded at padded steps (already-relative features).
    delta_action_mask: convert `action` to `action - state` on dims where True.
    camera_keys: cameras to decode (None: all of the source's).
    extra_keys: other per-frame features to include at the current frame.
    use_modality: add the dataset's modality.json views (`state.<name>`, ...).
    """

    action_horizon: int | None = 50
    action_keys: tuple[str, ...] = (ACTION_KEY,)
    state_keys: tuple[str, ...] = (STATE_KEY,)
    camera_keys: tuple[str, ...] | None = None
    delta_timestamps: Mapping[str, tuple[float, ...]] | None = None
    relative_keys: tuple[str, ...] = ()
    delta_action_mask: tuple[bool, ...] | None = None
    extra_keys: tuple[str, ...] = ()
    use_modality: bool = True

    def offsets(self, key: str, fps: float) -> np.ndarray | None:
        """Frame offsets for `key`, or None for a single current-frame value."""
        if self.delta_timestamps and key in self.delta_timestamps:
            return np.rint(np.asarray(self.delta_timestamps[key], np.float64) * fps).astype(np.int64)
        if key in self.action_keys:
            if self.action_horizon is None:
                raise ValueError("SampleSpec.action_horizon is None: fit the data to its model first (DataSource.fit)")
            return np.arange(self.action_horizon, dtype=np.int64)
        return None


def to_delta_actions(actions: np.ndarray, state: np.ndarray, mask: Sequence[bool]) -> np.ndarray:
    """actions[..., d] - state[d] on dimensions d where mask is True (mask may be shorter than A).

    `state` is one frame's state vector [S]; `actions` is [..., A] (a chunk or one step).
    """
    mask = np.asarray(mask, bool)
    dims = len(mask)
    out = np.array(actions, dtype=np.float32, copy=True)
    out[..., :dims] -= np.where(mask, np.asarray(state, np.float32)[:dims], np.float32(0))
    return out


def to_absolute_actions(actions: Any, state: Any, mask: Sequence[bool], *, xp: Any = np) -> Any:
    """Inverse of `to_delta_actions` (one sample: actions [..., A], state [S]); ``xp``: ``numpy``,
    or ``jax.numpy`` inside a jitted program."""
    mask = np.asarray(mask, bool)
    dims = len(mask)
    actions = xp.asarray(actions, xp.float32)
    offset = xp.where(xp.asarray(mask), xp.asarray(state, xp.float32)[:dims], np.float32(0))
    return xp.concatenate([actions[..., :dims] + offset, actions[..., dims:]], axis=-1)


def gather_window(
    values: np.ndarray, frame: int, offsets: np.ndarray, *, relative: bool
) -> tuple[np.ndarray, np.ndarray]:
    """values[frame + offsets] clamped to the episode, with a pad mask; relative keys zero-pad."""
    length = len(values)
    query = frame + offsets
    is_pad = (query < 0) | (query >= length)
    window = values[np.clip(query, 0, length - 1)]
    if relative and is_pad.any():
        window = np.where(is_pad.reshape((-1,) + (1,) * (window.ndim - 1)), np.zeros_like(window), window)
    return window, is_pad


def locate(source, index: int) -> tuple[int, int]:
    """(episode position, frame index) of a flat sample index over all frames of the source."""
    if not 0 <= index < source.num_frames:
        raise IndexError(f"sample {index} outside 0..{source.num_frames - 1}")
    position = int(np.searchsorted(source.episode_starts, index, side="right")) - 1
    return position, int(index - source.episode_starts[position])


class SampleLoader:
    """Builds the raw (untransformed) sample for a flat frame index of a frame source."""

    def __init__(self, source, spec: SampleSpec = SampleSpec()):
        self.source = source
        self.spec = spec
        cameras = spec.camera_keys if spec.camera_keys is not None else source.camera_keys
        missing = [k for k in cameras if k not in source.camera_keys]
        if missing:
            raise KeyError(f"cameras {missing} are not in the dataset; it has {source.camera_keys}")
        self.cameras = tuple(cameras)
        for key in spec.action_keys + spec.state_keys + spec.extra_keys:
            if key not in source.arrays:
                raise KeyError(f"feature {key!r} is not in the dataset; it has {sorted(source.arrays)}")
        if spec.delta_action_mask is not None:
            action_dim = source.arrays[spec.action_keys[0]].shape[-1]
            if len(spec.delta_action_mask) > action_dim:
                raise ValueError(f"delta_action_mask has {len(spec.delta_action_mask)} dims, action has {action_dim}")

    def __len__(self) -> int:
        return self.source.num_frames

    def __call__(self, index: int) -> dict[str, Any]:
        return self.sample(*locate(self.source, int(index)))

    def sample(self, position: int, frame: int) -> dict[str, Any]:
        source, spec = self.source, self.spec
        out: dict[str, Any] = {}
        for key in spec.state_keys + spec.action_keys + spec.extra_keys:
            values = source.episode_array(position, key)
            offsets = spec.offsets(key, source.fps)
            if offsets is None:
                out[key] = np.asarray(values[frame], np.float32)
            else:
                out[key], out[f"{key}_is_pad"] = gather_window(
                    values, frame, offsets, relative=key in spec.relative_keys
                )
                out[key] = out[key].astype(np.float32)
        if spec.delta_action_mask is not None:
            state = source.episode_array(position, spec.state_keys[0])[frame]
            key = spec.action_keys[0]
            out[key] = to_delta_actions(out[key], state, spec.delta_action_mask)
        length = int(source.episode_lengths[position])
        for key in self.cameras:
            offsets = spec.offsets(key, source.fps)
            if offsets is None:
                out[key] = source.images(position, key, [frame])[0]
            else:
                query = frame + offsets
                out[key] = source.images(position, key, np.clip(query, 0, length - 1))
                out[f"{key}_is_pad"] = (query < 0) | (query >= length)
        row = int(source.episode_starts[position]) + frame
        out["task"] = source.task(position, frame)
        out[fmt.TIMESTAMP] = np.float32(source.arrays[fmt.TIMESTAMP][row])
        out[fmt.EPISODE_INDEX] = np.int64(source.episode_indices[position])
        out[fmt.FRAME_INDEX] = np.int64(frame)
        out[fmt.INDEX] = np.int64(source.arrays[fmt.INDEX][row])
        if spec.use_modality and source.modality is not None:
            for key in source.modality.annotation_columns():
                if key in source.arrays:
                    out[key] = source.arrays[key][row]
            out = source.modality.split(out, source.tasks)
        return out
