"""Video and PNG codecs through PyAV: encode frames to mp4, decode frames by timestamp.

A frame of a LeRobot video is addressed by time, never by counting frames from the start:
the frame for timestamp ``t`` (seconds inside the file) is the one whose presentation time
is ``round(t * fps) / fps``, and its real presentation time must lie within ``tolerance_s``
of ``t``. Decoding seeks to the keyframe before the first requested time and decodes forward.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import pathlib
import threading
from collections.abc import Sequence

import av
import numpy as np

from embodied_jax.errors import InputError

CODEC_ENCODERS = {"av1": "libsvtav1", "h264": "h264"}


class VideoDecodeError(InputError, RuntimeError):
    """A video file could not be opened or decoded, or lacks a requested frame."""


@functools.cache
def _quiet_svt_av1() -> None:
    """Keep SVT-AV1's configuration banner off stderr (errors only) unless ``SVT_LOG`` is already set.

    The encoder library reads the variable itself when an encoder opens and logs outside
    FFmpeg's logger, so ``av.logging`` cannot silence it; set once, before the first AV1 encoder.
    """
    os.environ.setdefault("SVT_LOG", "1")


def encoder_options(codec: str, preset: int = 10) -> dict[str, str]:
    """Options close to LeRobot's (AV1: yuv420p, keyframe every 2 frames, crf 30)."""
    if codec == "av1":
        return {"g": "2", "crf": "30", "preset": str(preset)}
    if codec == "h264":
        return {"g": "2", "crf": "18", "preset": "veryfast"}
    raise ValueError(f"unknown video codec {codec!r}; expected one of {sorted(CODEC_ENCODERS)}")


def encode_video(
    path: str | os.PathLike, segments: Sequence[np.ndarray], fps: int, codec: str = "av1"
) -> list[tuple[float, float]]:
    """Encodes one or more frame segments ([T, H, W, 3] uint8 each) into one mp4 stream.

    Segments follow each other in time; every segment starts on a forced keyframe (as
    LeRobot's per-episode encode-then-concatenate does). Returns (from_timestamp,
    to_timestamp) in seconds of each segment inside the file.
    """
    if codec not in CODEC_ENCODERS:
        raise ValueError(f"unknown video codec {codec!r}; expected one of {sorted(CODEC_ENCODERS)}")
    if not segments:
        raise ValueError(f"{path}: no frames to encode")
    height, width = segments[0].shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"{path}: yuv420p video needs even height and width, got {height}x{width}")
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    if codec == "av1":
        _quiet_svt_av1()
    spans = []
    pts = 0
    with _keep_scheduling(), av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream(CODEC_ENCODERS[codec], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = encoder_options(codec)
        for segment in segments:
            if segment.dtype != np.uint8 or segment.ndim != 4 or segment.shape[1:] != (height, width, 3):
                raise ValueError(
                    f"{path}: frames must be uint8 [T, {height}, {width}, 3], got {segment.dtype} {segment.shape}"
                )
            start = pts
            for index, image in enumerate(segment):
                frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
                frame.pts = pts
                if index == 0:
                    frame.pict_type = av.video.frame.PictureType.I
                pts += 1
                for packet in stream.encode(frame):
                    container.mux(packet)
            spans.append((start / fps, pts / fps))
        for packet in stream.encode():
            container.mux(packet)
    return spans


@contextlib.contextmanager
def _keep_scheduling():
    """Restores the calling thread's scheduling policy after an encode: SVT-AV1 raises its
    caller to SCHED_FIFO where it may (as root), and every process started from the thread
    afterwards would inherit real-time priority (two such training processes waiting on each
    other's collectives starved their own parent)."""
    if not hasattr(os, "sched_getscheduler"):  # not Linux
        yield
        return
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        yield
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


def probe_video(path: str | os.PathLike) -> dict:
    """Codec name, resolution, frame rate and frame count (when the container knows it)."""
    try:
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            return {
                "codec": stream.codec_context.codec.canonical_name,
                "height": stream.codec_context.height,
                "width": stream.codec_context.width,
                "fps": float(stream.average_rate) if stream.average_rate else None,
                "frames": stream.frames,
                "pix_fmt": stream.codec_context.pix_fmt,
            }
    except (av.error.FFmpegError, IndexError) as exc:
        raise VideoDecodeError(f"{path}: cannot open video ({exc})") from exc


class VideoFile:
    """One open mp4; decodes the frames nearest to given timestamps."""

    def __init__(self, path: str | os.PathLike, *, threads: int = 1):
        self.path = str(path)
        try:
            self._container = av.open(self.path)
            self._stream = self._container.streams.video[0]
        except (av.error.FFmpegError, IndexError) as exc:
            raise VideoDecodeError(f"{self.path}: cannot open video ({exc})") from exc
        self._stream.codec_context.thread_count = threads
        self._time_base = float(self._stream.time_base)
        self.lock = threading.Lock()  # a container decodes from one thread at a time

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) the stream declares, known before any frame is decoded."""
        return int(self._stream.codec_context.height), int(self._stream.codec_context.width)

    def close(self) -> None:
        self._container.close()

    def frames_at(self, timestamps: Sequence[float], fps: float, tolerance_s: float) -> np.ndarray:
        """Frames for `timestamps` (seconds in this file) as uint8 [N, H, W, 3].

        The frame chosen for ``t`` is the one at index ``round(t * fps)``; its presentation time
        must be within ``tolerance_s`` of ``t``.
        """
        with self.lock:
            return self._frames_at(timestamps, fps, tolerance_s)

    def _frames_at(self, timestamps: Sequence[float], fps: float, tolerance_s: float) -> np.ndarray:
        timestamps = np.asarray(timestamps, dtype=np.float64)
        wanted = np.rint(timestamps * fps).astype(np.int64)
        target_set = set(wanted.tolist())
        targets = sorted(target_set)
        found: dict[int, tuple[float, np.ndarray]] = {}
        try:
            self._container.seek(
                max(0, int(targets[0] / fps / self._time_base)), stream=self._stream, backward=True, any_frame=False
            )
            for frame in self._container.decode(self._stream):
                if frame.pts is None:
                    continue
                time = frame.pts * self._time_base
                index = int(round(time * fps))
                if index in target_set and index not in found:
                    found[index] = (time, frame.to_ndarray(format="rgb24"))
                if index >= targets[-1] or len(found) == len(targets):
                    break
        except av.error.FFmpegError as exc:
            raise VideoDecodeError(f"{self.path}: decoding failed near t={targets[0] / fps:.4f}s ({exc})") from exc
        out = []
        for t, index in zip(timestamps, wanted, strict=True):
            if index not in found:
                raise VideoDecodeError(
                    f"{self.path}: no frame at t={t:.4f}s (frame {index}); the video is shorter or lacks it"
                )
            time, image = found[index]
            if abs(time - t) > tolerance_s:
                raise VideoDecodeError(
                    f"{self.path}: frame {index} is at t={time:.6f}s but t={t:.6f}s was requested "
                    f"(outside tolerance_s={tolerance_s})"
                )
            out.append(image)
        return np.stack(out)

    def frames_between(self, from_s: float, to_s: float, fps: float) -> tuple[np.ndarray, np.ndarray]:
        """All frames with presentation time in [from_s, to_s): (times [N], frames [N, H, W, 3])."""
        with self.lock:
            return self._frames_between(from_s, to_s, fps)

    def _frames_between(self, from_s: float, to_s: float, fps: float) -> tuple[np.ndarray, np.ndarray]:
        times, frames = [], []
        end = to_s - 0.5 / fps
        try:
            self._container.seek(
                max(0, int(from_s / self._time_base)), stream=self._stream, backward=True, any_frame=False
            )
            for frame in self._container.decode(self._stream):
                if frame.pts is None:
                    continue
                time = frame.pts * self._time_base
                if time < from_s - 0.5 / fps:
                    continue
                if time > end:
                    break
                times.append(time)
                frames.append(frame.to_ndarray(format="rgb24"))
        except av.error.FFmpegError as exc:
            raise VideoDecodeError(
                f"{self.path}: decoding failed between {from_s:.4f}s and {to_s:.4f}s ({exc})"
            ) from exc
        if not frames:
            raise VideoDecodeError(f"{self.path}: no frames between {from_s:.4f}s and {to_s:.4f}s")
        return np.asarray(times), np.stack(frames)


class VideoFileCache:
    """A small per-process LRU of open video files (re-opening an mp4 costs a few ms); thread-safe.

    Evicted files are not closed explicitly (another thread may still be decoding from one);
    they close when garbage-collected.
    """

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._files: collections.OrderedDict[str, VideoFile] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str | os.PathLike) -> VideoFile:
        key = str(path)
        with self._lock:
            video = self._files.pop(key, None)
            if video is None:
                video = VideoFile(key)
            self._files[key] = video
            while len(self._files) > self.capacity:
                self._files.popitem(last=False)
            return video

    def clear(self) -> None:
        with self._lock:
            self._files.clear()

    def __getstate__(self):
        return {"capacity": self.capacity}

    def __setstate__(self, state):
        self.__init__(state["capacity"])


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of a uint8 [H, W, 3] image (lossless)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"PNG images must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    context = av.CodecContext.create("png", "w")
    context.width, context.height, context.pix_fmt = image.shape[1], image.shape[0], "rgb24"
    frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")
    return b"".join(bytes(packet) for packet in list(context.encode(frame)) + list(context.encode(None)))


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) a PNG's IHDR header declares, read without decoding; None for other bytes."""
    if len(data) < 24 or not data.startswith(PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return int.from_bytes(data[20:24], "big"), int.from_bytes(data[16:20], "big")


def decode_png(data: bytes) -> np.ndarray:
    """uint8 [H, W, 3] from PNG (or any still-image codec FFmpeg sniffs as PNG) bytes."""
    context = av.CodecContext.create("png", "r")
    frames = list(context.decode(av.Packet(data)))
    if not frames:
        raise VideoDecodeError("PNG bytes did not decode to an image")
    return frames[0].to_ndarray(format="rgb24")
