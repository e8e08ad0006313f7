"""The Grain input pipeline: per-process batches from LeRobot datasets or frame stores.

Order of operations (all lazy, per index, on a `grain.MapDataset`):

1. each source is the range of its frames, globally shuffled with the seed (a new order each
   epoch) and repeated; several sources are mixed with weights ``weight x num_frames`` (GR00T:
   datasets in proportion to weight and length, trajectories in proportion to length);
   with ``balance_tasks`` each source's frames are grouped by task, each task's frames shuffled
   and repeated on their own, and the tasks mixed equally (a task with three times the
   demonstrations is drawn as often as the others, not three times as often);
2. load the raw sample (action chunk, pad masks, cameras, task) and apply the run's
   ``SampleTransform`` (``data/sample_transform.py``: normalise, resize/augment images with
   Grain's per-record RNG, rename to the model's layout, the model's input builder), the
   same object a policy bundle applies to a robot's observation;
3. this process takes every `process_count`-th record starting at `process_index`, so the
   processes' shards are disjoint and together cover each epoch;
4. optional first-fit packing (``data/packing.py``; ``batch_size`` then counts rows),
   batching, and `mp_prefetch` worker processes.

`make_data_iterator` returns a `DataIterator` whose `get_state()` is JSON-serialisable and
whose `set_state()` makes a restored run yield exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from embodied_jax.config_registry import register
from embodied_jax.data.framestore import FrameStore
from embodied_jax.data.iterator import BatchIterator, IteratorStateMismatch
from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.data.lerobot_format import TASK_INDEX
from embodied_jax.data.packing import PackingConfig, pack
from embodied_jax.data.sample_transform import ModelInputs, SampleTransform
from embodied_jax.data.samples import SampleLoader, SampleSpec
from embodied_jax.data.stats import FeatureStats, NormStats, compute_stats
from embodied_jax.data.transforms import AugmentConfig

STATE_FORMAT = "embodied_jax.data.iterator/1"


@register
@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One dataset of a mixture. `frame_store`: read frames from this converted store instead of video."""

    root: str
    weight: float = 1.0
    frame_store: str | None = None
    episodes: tuple[int, ...] | None = None


@register
@dataclasses.dataclass(frozen=True)
class DataConfig:
    sources: tuple[SourceConfig, ...]
    spec: SampleSpec = SampleSpec()
    image_size: tuple[int, int] | None = (224, 224)
    augment: AugmentConfig | None = None
    norm_modes: tuple[tuple[str, str], ...] = (("observation.state", "mean_std"), ("action", "mean_std"))
    stats_path: str | None = None
    num_workers: int = 0
    worker_buffer_size: int = 2
    read_threads: int = 4
    read_buffer: int = 64
    tolerance_s: float = 1e-4
    skip_bad_episodes: bool = False
    balance_tasks: bool = False  # every task of a source drawn equally often, whatever its frame count

    ADDED_FIELDS = ("balance_tasks",)  # configs saved before it load with its default

    def sample_transform(
        self,
        stats: Mapping[str, FeatureStats] | None,
        cameras: Sequence[str],
        *,
        inputs: ModelInputs | None = None,
        builder: Callable[[dict], dict] | None = None,
        training: bool = True,
    ) -> SampleTransform:
        """The per-sample transform of this data: the pipeline's (``training``: with ``augment``)
        and a policy bundle's (``training=False``) come from here, so they cannot drift apart."""
        return SampleTransform.create(
            stats=stats,
            norm_modes=self.norm_modes,
            cameras=cameras,
            image_size=self.image_size,
            augment=self.augment if training else None,
            inputs=inputs,
            builder=builder,
        )


def open_source(source: SourceConfig, config: DataConfig):
    if source.frame_store:
        return FrameStore(source.frame_store)
    return LeRobotDataset(
        source.root,
        tolerance_s=config.tolerance_s,
        skip_bad_episodes=config.skip_bad_episodes,
        episodes=source.episodes,
    )


@dataclasses.dataclass(frozen=True)
class _Tag:
    source: int

    def __call__(self, index: int) -> tuple[int, int]:
        return self.source, int(index)


class _LoadAndTransform:
    """Load + the run's ``SampleTransform``: the per-record work, run in Grain workers."""

    def __init__(self, loaders: Sequence[SampleLoader], transform: SampleTransform):
        self.loaders = list(loaders)
        self.transform = transform

    def __call__(self, record: tuple[int, int], rng: np.random.Generator) -> dict[str, Any]:
        source, index = record
        sample = self.loaders[source](index)
        sample["source_index"] = np.int32(source)
        sample = self.transform(sample, rng)
        # strings (the task) batch as NumPy unicode arrays
        return {k: np.asarray(v, dtype=str) if isinstance(v, str) else v for k, v in sample.items()}


def mixture_weights(sources: Sequence[SourceConfig], lengths: Sequence[int]) -> list[float]:
    """GR00T-style sampling weights: dataset weight x number of frames, normalised."""
    raw = np.asarray([s.weight for s in sources], np.float64) * np.asarray(lengths, np.float64)
    if np.any(raw < 0) or raw.sum() <= 0:
        raise ValueError(f"mixture weights must be non-negative and not all zero, got {[s.weight for s in sources]}")
    return (raw / raw.sum()).tolist()


def _task_balanced(task_of_frame: np.ndarray, seed: int):
    """A source's frame indices, each task's shuffled and repeated apart, the tasks mixed equally."""
    tasks = np.unique(task_of_frame)
    per_task = [
        grain.MapDataset.source(np.flatnonzero(task_of_frame == task).tolist())
        .shuffle(seed=seed + 7919 * j)
        .repeat(None)
        for j, task in enumerate(tasks)
    ]
    if len(per_task) == 1:
        return per_task[0]
    return grain.MapDataset.mix(per_task, weights=[1.0] * len(per_task))


def build_dataset(
    config: DataConfig,
    *,
    process_index: int,
    process_count: int,
    seed: int,
    inputs: ModelInputs | None = None,
    builder: Callable[[dict], dict] | None = None,
    stats: NormStats | None = None,
):
    """(grain MapDataset of this process's samples, the NormStats used, the frame sources)."""
    if not config.sources:
        raise ValueError("DataConfig.sources is empty")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} outside 0..{process_count - 1}")
    frame_sources = [open_source(s, config) for s in config.sources]
    modes = dict(config.norm_modes)
    if stats is None and modes:
        stats = (
            NormStats.load(config.stats_path)
            if config.stats_path
            else compute_stats(frame_sources, tuple(modes), spec=config.spec)
        )
    loaders = [SampleLoader(s, config.spec) for s in frame_sources]
    cameras = sorted({c for loader in loaders for c in loader.cameras})
    transform = config.sample_transform(stats, cameras, inputs=inputs, builder=builder, training=True)

    per_source = []
    for i, loader in enumerate(loaders):
        source_seed = seed * 1000003 + i
        if config.balance_tasks:
            ds = _task_balanced(np.asarray(loader.source.arrays[TASK_INDEX]), source_seed)
        else:
            ds = grain.MapDataset.range(len(loader)).shuffle(seed=source_seed).repeat(None)
        per_source.append(ds.map(_Tag(i)))
    if len(per_source) == 1:
        mixed = per_source[0]
    else:
        weights = mixture_weights(config.sources, [len(loader) for loader in loaders])
        mixed = grain.MapDataset.mix(per_source, weights=weights)
    samples = mixed.random_map(_LoadAndTransform(loaders, transform), seed=seed)
    return samples[process_index::process_count], stats, frame_sources


def _ensure_absl_flags() -> None:
    # Grain's worker processes read absl flags; programs that never parse them (pytest, scripts) need this.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _to_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, dict):
        return {str(k): _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__bytes__"}:
            return base64.b64decode(value["__bytes__"])
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


class DataIterator(BatchIterator):
    """Iterator of per-process NumPy batches (dicts, batch-first) with JSON-serialisable state."""

    def __init__(
        self,
        dataset: grain.IterDataset,
        *,
        stats: NormStats | None,
        sources: Sequence[Any],
        description: Mapping[str, Any],
    ):
        self._dataset = dataset
        self._iterator = iter(dataset)
        self._stats = stats
        self.sources = list(sources)
        self.description = dict(description)

    @property
    def stats(self) -> NormStats | None:
        return self._stats

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iterator)

    def get_state(self) -> dict[str, Any]:
        state = {"format": STATE_FORMAT, "pipeline": self.description, "grain": _to_json(self._iterator.get_state())}
        json.dumps(state)  # fail here, not in the checkpointer, if something is not serialisable
        return state

    def set_state(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a data iterator state (format {state.get('format')!r}, expected {STATE_FORMAT!r})")
        if state.get("pipeline") != self.description:
            raise IteratorStateMismatch(
                f"iterator state was saved by a different pipeline: {state.get('pipeline')} vs {self.description}"
            )
        self._iterator.set_state(_from_json(state["grain"]))

    def close(self) -> None:
        self._iterator.close()  # stops Grain's worker processes and prefetch threads


def make_data_iterator(
    config: DataConfig,
    *,
    process_index: int,
    process_count: int,
    batch_size: int,
    seed: int,
    inputs: ModelInputs | None = None,
    builder: Callable[[dict], dict] | None = None,
    stats: NormStats | None = None,
    packing: PackingConfig = PackingConfig(),
) -> DataIterator:
    """Per-process batches of `batch_size` samples (packed rows when `packing` is on) for this
    process's shard of `config`'s data.

    `inputs` renames dataset keys into the model's layout and `builder(sample) -> sample` is the
    model's input builder (prompt tokens etc.; with packing, its variable-length form); without
    `inputs` the builder sees the dataset keys. `stats` overrides statistics from
    `config.stats_path` or computed from the sources.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    samples, stats, sources = build_dataset(
        config,
        process_index=process_index,
        process_count=process_count,
        seed=seed,
        inputs=inputs,
        builder=builder,
        stats=stats,
    )
    ds = samples.to_iter_dataset(
        grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=config.read_buffer)
    )
    if packing.enabled:
        ds = pack(ds, packing, seed=seed, probe=samples[0])
    ds = ds.batch(batch_size, drop_remainder=True)
    if config.num_workers > 0:
        _ensure_absl_flags()
        ds = ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=config.num_workers, per_worker_buffer_size=config.worker_buffer_size
            )
        )
    description = {
        "process_index": process_index,
        "process_count": process_count,
        "batch_size": batch_size,
        "seed": seed,
        "num_workers": config.num_workers,
        "packed": packing.enabled,
    }
    return DataIterator(ds, stats=stats, sources=sources, description=description)
