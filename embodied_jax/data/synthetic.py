"""Synthetic LeRobot episodes for tests and benchmarks, with frames that identify themselves.

`frame_id_image` draws a grid of large black/white blocks encoding (episode, frame, camera):
8 bits of frame index, 5 of episode index, 3 of camera number. Codec noise cannot turn one
frame into its neighbour, so a decode that is off by one frame is caught exactly.
"""

from __future__ import annotations

import numpy as np

HEIGHT, WIDTH = 48, 64


def frame_id_image(episode: int, frame: int, camera: int, height: int = HEIGHT, width: int = WIDTH) -> np.ndarray:
    """uint8 [height, width, 3] image: a 4x4 grid of blocks, white where the id has a 1 bit."""
    if not (0 <= frame < 256 and 0 <= episode < 32 and 0 <= camera < 8):
        raise ValueError(f"frame id out of range: episode {episode}, frame {frame}, camera {camera}")
    code = frame | (episode << 8) | (camera << 13)
    block_h, block_w = height // 4, width // 4
    image = np.zeros((height, width, 3), np.uint8)
    for bit in range(16):
        if code >> bit & 1:
            row, col = divmod(bit, 4)
            image[row * block_h : (row + 1) * block_h, col * block_w : (col + 1) * block_w] = 255
    return image


def decode_frame_id(image: np.ndarray) -> tuple[int, int, int]:
    """(episode, frame, camera) read back from the centres of the blocks."""
    height, width = image.shape[:2]
    block_h, block_w = height // 4, width // 4
    margin_h, margin_w = block_h // 4, block_w // 4
    code = 0
    for bit in range(16):
        row, col = divmod(bit, 4)
        centre = image[
            row * block_h + margin_h : (row + 1) * block_h - margin_h,
            col * block_w + margin_w : (col + 1) * block_w - margin_w,
        ]
        if centre.mean() > 127:
            code |= 1 << bit
    return code >> 8 & 31, code & 255, code >> 13


def make_episodes(
    lengths,
    cameras=("front", "wrist"),
    state_dim=4,
    action_dim=3,
    seed=0,
    tasks=("pick", "place"),
    height: int = HEIGHT,
    width: int = WIDTH,
):
    """Episodes for `write_lerobot_dataset`: random state/action, self-identifying camera frames."""
    rng = np.random.default_rng(seed)
    episodes = []
    for e, length in enumerate(lengths):
        episode = {
            "task": tasks[e % len(tasks)],
            "observation.state": rng.normal(size=(length, state_dim)).astype(np.float32),
            "action": rng.normal(size=(length, action_dim)).astype(np.float32),
        }
        for c, camera in enumerate(cameras):
            episode[f"observation.images.{camera}"] = np.stack(
                [frame_id_image(e, t, c, height, width) for t in range(length)]
            )
        episodes.append(episode)
    return episodes
