"""Names and path templates of the LeRobot dataset formats v2.1 and v3.0 (shared by reader and writer).

A dataset's own ``info.json`` gives its templates (``data_path``, ``video_path``): Python format
strings, filled here by ``fill_template``, which accepts only what LeRobot's templates use.
"""

from __future__ import annotations

import numbers
import re
import string
from typing import Any

V21 = "v2.1"
V30 = "v3.0"
SUPPORTED_VERSIONS = ("v2.0", V21, V30)

V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
V30_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"

# The widest integer field a dataset's template may ask for ("{episode_index:06d}" is 6).
MAX_TEMPLATE_WIDTH = 12
# Largest camera side a reader accepts (8K video is 7680 x 4320): a header claiming more is refused
# before a frame of that size is allocated.
MAX_IMAGE_SIDE = 8192
# Episode indices and frame counts or row indices at or past these are refused outright (nothing
# allocates by them, but they must fit int64 arithmetic); tighter bounds come from the dataset itself.
MAX_EPISODE_INDEX = 2**31
MAX_FRAMES = 2**40
# Largest frame rate accepted (the rate divides timestamps; zero or absurd rates are refused).
MAX_FPS = 10_000
_INT_SPEC = re.compile(r"0?(\d{0,2})d?")

INFO_PATH = "meta/info.json"
V21_EPISODES_PATH = "meta/episodes.jsonl"
V21_TASKS_PATH = "meta/tasks.jsonl"
V21_EPISODES_STATS_PATH = "meta/episodes_stats.jsonl"
STATS_PATH = "meta/stats.json"
V30_TASKS_PATH = "meta/tasks.parquet"
MODALITY_PATH = "meta/modality.json"

# Per-frame bookkeeping columns every LeRobot data file carries.
TIMESTAMP = "timestamp"
FRAME_INDEX = "frame_index"
EPISODE_INDEX = "episode_index"
INDEX = "index"
TASK_INDEX = "task_index"
BOOKKEEPING_KEYS = (TIMESTAMP, FRAME_INDEX, EPISODE_INDEX, INDEX, TASK_INDEX)

# Quantiles LeRobot v3.0 stores in stats.json next to min/max/mean/std/count.
STATS_QUANTILES = {"q01": 0.01, "q10": 0.10, "q50": 0.50, "q90": 0.90, "q99": 0.99}


def fill_template(template: object, **values: int | str) -> str:
    """``template`` filled with ``values``, LeRobot's fields (``episode_chunk``, ``episode_index``,
    ``chunk_index``, ``file_index``, ``video_key``), without ``str.format``.

    Only the fields given may appear; integers take a spec such as ``03d`` (width at most
    ``MAX_TEMPLATE_WIDTH``), strings none; attribute or index access and conversions are refused.
    A ``ValueError`` names the offending part; its message never shows an object's repr.
    """
    if not isinstance(template, str):
        raise ValueError(f"expected a path template string, got {shown(template)}")
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"{shown(template)} is not a path template ({exc})") from exc
    template = shown(template, 120)
    allowed = ", ".join("{" + name + "}" for name in values)
    out = []
    for literal, name, spec, conversion in parts:
        out.append(literal)
        if name is None:
            continue
        field = "{" + _cut(name) + (f"!{conversion}" if conversion else "") + (f":{_cut(spec)}" if spec else "") + "}"
        if name not in values:
            raise ValueError(f"{template}: {field} is not a field of this template (allowed: {allowed})")
        if conversion is not None:
            raise ValueError(f"{template}: {field}: conversions are refused")
        value = values[name]
        if isinstance(value, str):
            if spec:
                raise ValueError(f"{template}: {field}: a string field takes no format spec")
            out.append(value)
            continue
        width = _INT_SPEC.fullmatch(spec)
        if width is None or int(width.group(1) or 0) > MAX_TEMPLATE_WIDTH:
            raise ValueError(
                f"{template}: {field}: an integer field takes a spec like '03d' (width at most {MAX_TEMPLATE_WIDTH})"
            )
        out.append(format(int(value), spec))
    return "".join(out)


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for messages about values read from a file."""
    return _cut(repr(value), limit)


def bounded_int(
    value: Any, where: str, field: str, *, low: int = 0, high: int | None = None, error: type[Exception] = ValueError
) -> int:
    """``value`` (an integer, or an integral float as JSON may hold) in [low, high); else ``error``
    naming ``where`` and ``field``."""
    number = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        number = int(value)
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    if number is None or number < low or (high is not None and number >= high):
        expected = f"an integer in [{low}, {high})" if high is not None else f"an integer >= {low}"
        raise error(f"{where}: {field} = {shown(value)}: expected {expected}")
    return number
