"""Writing rollout frames to disk: H.264 mp4 videos (PyAV) and PNG frame grids (Pillow)."""

from __future__ import annotations

import os
import pathlib

import numpy as np


def write_mp4(path: str | os.PathLike, frames: np.ndarray, fps: int) -> pathlib.Path:
    """Encode uint8 frames [T, H, W, 3] as H.264/yuv420p (odd sizes are padded by one pixel)."""
    import av

    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def frame_grid(frames: np.ndarray) -> np.ndarray:
    """Tile uint8 frames [rows, columns, H, W, 3] into one image with 2-pixel white gutters."""
    rows, cols, h, w, c = frames.shape
    gap = 2
    grid = np.full((rows * (h + gap) - gap, cols * (w + gap) - gap, c), 255, np.uint8)
    for r in range(rows):
        for k in range(cols):
            grid[r * (h + gap) : r * (h + gap) + h, k * (w + gap) : k * (w + gap) + w] = frames[r, k]
    return grid


def write_png(path: str | os.PathLike, image: np.ndarray) -> pathlib.Path:
    from PIL import Image

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.asarray(image, np.uint8)).save(path)
    return path
