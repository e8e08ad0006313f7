"""Writing rollout frames to disk: H.264 mp4 videos (PyAV), PNG frame grids and line plots (Pillow)."""

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


PLOT_COLORS = (
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
    (227, 119, 194),
    (127, 127, 127),
    (188, 189, 34),
    (23, 190, 207),
    (0, 0, 128),
    (128, 0, 0),
)


def line_plot(
    series: dict[str, list[tuple[float, float]]], *, title: str = "", size: tuple[int, int] = (860, 400)
) -> np.ndarray:
    """uint8 [H, W, 3]: each series' (x, y) points as a line with markers (the first drawn thicker:
    the overall figure), y in [0, 1] (success rates), x from 0 to the largest x; a legend beside
    the plot and a grid line at each 0.25."""
    from PIL import Image, ImageDraw

    width, height = size
    left, right, top, bottom = 48, 230, 28, 36
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    x_max = max((x for points in series.values() for x, _ in points), default=1) or 1

    def at(x: float, y: float) -> tuple[float, float]:
        px = left + (width - left - right) * x / x_max
        py = height - bottom - (height - top - bottom) * min(max(y, 0.0), 1.0)
        return px, py

    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        _, y = at(0, tick)
        draw.line([(left, y), (width - right, y)], fill=(225, 225, 225))
        draw.text((4, y - 6), f"{tick:.0%}", fill=(0, 0, 0))
    draw.line([(left, top), (left, height - bottom), (width - right, height - bottom)], fill=(0, 0, 0))
    for frac in (0.0, 0.5, 1.0):
        x, y = at(frac * x_max, 0.0)
        draw.text((x - 12, y + 6), f"{frac * x_max:g}", fill=(0, 0, 0))
    draw.text((width // 2 - 20, height - 16), "step", fill=(0, 0, 0))
    draw.text((left, 6), title, fill=(0, 0, 0))
    for k, (name, points) in enumerate(series.items()):
        color = PLOT_COLORS[k % len(PLOT_COLORS)]
        xy = [at(x, y) for x, y in sorted(points)]
        thick = 4 if k == 0 else 2
        if len(xy) > 1:
            draw.line(xy, fill=color, width=thick)
        for x, y in xy:
            draw.ellipse([x - thick, y - thick, x + thick, y + thick], fill=color)
        draw.text((width - right + 12, top + 4 + 14 * k), name, fill=color)
    return np.asarray(image)
