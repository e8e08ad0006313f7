"""The frames of a dataset's loaded episodes laid end to end: where each episode starts, which
position holds which episode index, one episode's slice of a per-frame feature, a frame's task.

``LeRobotDataset`` (parquet + mp4) and ``FrameStore`` (the TensorStore cache) both hold their
per-frame features as arrays over all loaded frames; this is their shared bookkeeping. A holder
sets ``root``, ``arrays``, ``tasks`` and calls ``index_episodes(indices, lengths)``.
"""

from __future__ import annotations

import pathlib

import numpy as np

from embodied_jax.data import lerobot_format as fmt


class EpisodeTable:
    root: pathlib.Path
    arrays: dict[str, np.ndarray]  # per-frame features over all loaded frames
    tasks: list[str]

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
