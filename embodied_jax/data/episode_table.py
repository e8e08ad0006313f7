"""The frames of a dataset's loaded episodes laid end to end: where each episode starts, which
position holds which episode index, one episode's slice of a per-frame feature, a frame's task.

``LeRobotDataset`` (parquet + mp4) and ``FrameStore`` (the TensorStore cache) both hold their
per-frame features as arrays over all loaded frames; this is their shared bookkeeping. A holder
sets ``root``, ``arrays``, ``tasks``, ``camera_keys`` and ``images(position, key, frame_indices)``,
and calls ``index_episodes(indices, lengths)``.
"""

from __future__ import annotations

import abc
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from embodied_jax.data import lerobot_format as fmt


class EpisodeTable(abc.ABC):
    root: pathlib.Path
    arrays: dict[str, np.ndarray]  # per-frame features over all loaded frames
    tasks: list[str]
    camera_keys: tuple[str, ...]

    @abc.abstractmethod
    def images(self, position: int, key: str, frame_indices: Sequence[int]) -> np.ndarray:
        """uint8 [N, H, W, 3] frames of camera ``key`` (each holder reads its own: video, PNG, TensorStore)."""

    def index_episodes(self, indices, lengths) -> None:
        """The loaded episodes, in order: their dataset indices and frame counts."""
        self.episode_indices = np.asarray(indices, np.int64)
        self.episode_lengths = np.asarray(lengths, np.int64)
        self.episode_starts = np.concatenate([[0], np.cumsum(self.episode_lengths)]).astype(np.int64)
        self._position = {int(e): i for i, e in enumerate(self.episode_indices)}

    @property
    def num_episodes(self) -> int:
        return len(self.episode_indices)

    @property
    def num_frames(self) -> int:
        return int(self.episode_starts[-1])

    def position_of(self, episode_index: int) -> int:
        """Position (0..num_episodes-1) of a dataset episode index."""
        if int(episode_index) not in self._position:
            raise KeyError(f"{self.root}: episode {episode_index} is not loaded")
        return self._position[int(episode_index)]

    def episode_array(self, position: int, key: str) -> np.ndarray:
        """All frames of one per-frame feature of an episode, [T, ...]."""
        return self.arrays[key][self.episode_starts[position] : self.episode_starts[position + 1]]

    def task(self, position: int, frame_index: int) -> str:
        return self.tasks[int(self.arrays[fmt.TASK_INDEX][self.episode_starts[position] + frame_index])]

    def frame(self, position: int, frame_index: int) -> dict[str, Any]:
        """One frame's raw values: every feature under its dataset key, cameras uint8 HWC, task string."""
        if not 0 <= frame_index < self.episode_lengths[position]:
            raise IndexError(
                f"frame {frame_index} outside episode {self.episode_indices[position]} "
                f"(length {self.episode_lengths[position]})"
            )
        row = self.episode_starts[position] + frame_index
        out: dict[str, Any] = {key: self.arrays[key][row] for key in self.arrays}
        for key in self.camera_keys:
            out[key] = self.images(position, key, [frame_index])[0]
        out["task"] = self.task(position, frame_index)
        return out
