"""Names and path templates of the LeRobot dataset formats v2.1 and v3.0 (shared by reader and writer)."""

from __future__ import annotations

V21 = "v2.1"
V30 = "v3.0"
SUPPORTED_VERSIONS = ("v2.0", V21, V30)

V21_DATA_PATH = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
V21_VIDEO_PATH = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
V30_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
V30_VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
V30_EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"

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
