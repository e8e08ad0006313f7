"""What a policy takes from a robot, checked on the host before anything is sampled.

``check_raw_observation`` turns a raw observation (one or a batch, dataset keys) into validated
arrays, naming the first problem as an ``ObservationError`` (every rule is in
``docs/observations.md``); ``RtcPrefix`` is one request's real-time chunking input and its
checks; ``check_finite_stats`` refuses normalisation statistics a policy cannot act with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from embodied_jax.data.stats import FeatureStats
from embodied_jax.errors import InputError, ObservationError


class NormStatsError(InputError, ValueError):
    """Normalisation statistics a policy cannot act with (non-finite values)."""


@dataclasses.dataclass(frozen=True)
class RtcPrefix:
    """Real-time chunking input of one request: ``actions`` [P, A], the previous chunk's actions
    (robot units) from the new chunk's first step on, P <= horizon; ``delay``: how many of them
    execute while the new chunk is sampled (0 <= delay <= P)."""

    actions: np.ndarray
    delay: int

    def check(self, horizon: int, width: int) -> np.ndarray:
        actions = np.asarray(self.actions)
        if actions.ndim != 2 or not 1 <= actions.shape[0] <= horizon or actions.shape[1] != width:
            raise ObservationError(
                f"prefix_actions: expected float32 [P, {width}] with 1 <= P <= {horizon}, got shape {actions.shape}"
            )
        if actions.dtype.kind != "f" or not np.isfinite(actions).all():
            raise ObservationError(f"prefix_actions: expected finite float values, got dtype {actions.dtype}")
        if not 0 <= self.delay <= actions.shape[0]:
            raise ObservationError(f"inference_delay: expected 0 <= delay <= {actions.shape[0]}, got {self.delay}")
        return actions.astype(np.float32)


def check_finite_stats(stats: Mapping[str, FeatureStats], modes: Mapping[str, str]) -> None:
    """The statistics a policy normalises with must be finite: NaN there would make every action NaN."""
    for key in modes:
        if key not in stats:
            continue
        feature = stats[key]
        values = {"mean": feature.mean, "std": feature.std, "min": feature.min, "max": feature.max, **feature.quantiles}
        bad = [name for name, v in values.items() if not np.isfinite(np.asarray(v, np.float64)).all()]
        if bad:
            raise NormStatsError(f"norm_stats[{key!r}]: {', '.join(bad)} hold non-finite values")


# Where in its episode an observation is, under the dataset's keys (every training sample carries
# both): optional in a robot's observation; the simulator gives its control step as ``frame_index``.
TIME_KEYS = ("frame_index", "timestamp")


def _check_time(key: str, value: Any) -> np.ndarray:
    """``frame_index`` (an integer) or ``timestamp`` (seconds), ``[]`` or ``[B]``, finite and >= 0,
    as the training samples held them (int64, float32)."""
    array = np.asarray(value)
    if array.ndim > 1:
        raise ObservationError(f"{key}: expected one value or a batch of values [B], got shape {array.shape}")
    integer = key == "frame_index"
    kinds = "iu" if integer else "fiu"
    if array.dtype.kind not in kinds:
        want = "integers" if integer else "real numbers (seconds)"
        raise ObservationError(f"{key}: expected {want}, got dtype {array.dtype}")
    if not np.isfinite(array).all() or (array < 0).any():
        raise ObservationError(f"{key}: expected finite values >= 0 (since the episode's start), got {array!r:.60}")
    return array.astype(np.int64 if integer else np.float32)


def check_raw_observation(
    raw: Mapping[str, Any],
    *,
    state_key: str,
    cameras: Sequence[str],
    state_dim: int | None,
    image_size: tuple[int, int] | None,
    image_range: tuple[float, float] | None,
    resize: bool,
    batched: bool | None = None,
) -> tuple[dict[str, np.ndarray], list[str] | None]:
    """The observation's state, images and time keys (``TIME_KEYS``, where given) as validated
    arrays (images uint8) and its tasks (None when unbatched), each problem named; ``batched``:
    require a batch (True) or one observation (False), checked before any value is read."""
    keys = (state_key, "task", *cameras)
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ObservationError(f"observation lacks {missing}; a policy of this run needs {list(keys)}")
    state = np.asarray(raw[state_key])
    if state.ndim not in (1, 2):
        raise ObservationError(f"{state_key}: expected a state [S] or a batch of states [B, S], got {state.shape}")
    if batched is not None and (state.ndim == 2) != batched:
        want = "one observation (state [S], images [H, W, 3])" if not batched else "a batch"
        raise ObservationError(f"{state_key}: expected {want}, got a state of shape {state.shape}")
    if state.dtype.kind not in "fiu":
        raise ObservationError(f"{state_key}: expected real numbers (float or int), got dtype {state.dtype}")
    if state_dim is not None and state.shape[-1] != state_dim:
        raise ObservationError(
            f"{state_key}: expected {state_dim} values per state (the run's state), got shape {state.shape}"
        )
    state = state.astype(np.float32)
    if not np.isfinite(state).all():
        bad = int(np.size(state) - np.isfinite(state).sum())
        raise ObservationError(f"{state_key} holds {bad} non-finite values (of {np.size(state)})")
    images = {key: np.asarray(raw[key]) for key in cameras}
    for key, image in images.items():
        if image.ndim not in (3, 4):
            raise ObservationError(
                f"{key}: expected an image [H, W, 3] or a batch [B, H, W, 3], got shape {image.shape}"
            )
    times = {key: _check_time(key, raw[key]) for key in TIME_KEYS if key in raw}
    batched = {
        state_key: state.ndim == 2,
        **{key: image.ndim == 4 for key, image in images.items()},
        **{key: value.ndim == 1 for key, value in times.items()},
    }
    task = raw["task"]
    if isinstance(task, (list, tuple, np.ndarray)) and all(isinstance(t, str) for t in task):
        batched["task"] = True
        tasks = list(task)
    elif not isinstance(task, str):
        raise ObservationError(f"task: expected the instruction as a str (or B of them), got {type(task).__name__}")
    if len(set(batched.values())) > 1:
        with_batch = [k for k, b in batched.items() if b]
        without = [k for k, b in batched.items() if not b]
        raise ObservationError(
            f"observation mixes batched keys {with_batch} with unbatched keys {without}: give every key a "
            f"leading batch dimension B, or none"
        )
    batch = state.shape[0] if state.ndim == 2 else None
    out = {state_key: state}
    for key, image in images.items():
        if image.shape[-1] != 3 or (batch is not None and image.shape[0] != batch):
            layout = "[H, W, 3]" if batch is None else f"[{batch}, H, W, 3] (one per state)"
            raise ObservationError(f"{key}: expected an RGB image {layout}, got shape {image.shape}")
        size = tuple(image.shape[-3:-1])
        if min(size) < 1 or (image_size is not None and size != image_size and not resize):
            h, w = image_size or ("H", "W")
            raise ObservationError(
                f"{key}: expected images of the policy's input size [{h}, {w}, 3], got shape {image.shape} "
                f"(predict(..., resize=True) resizes other sizes with padding, as the training pipeline did)"
            )
        if image.dtype == np.uint8:
            out[key] = image
        elif np.issubdtype(image.dtype, np.floating) and image_range is not None:
            lo, hi = image_range
            if not np.isfinite(image).all() or image.min() < lo or image.max() > hi:
                raise ObservationError(f"{key}: values outside image_range={image_range} (or not finite)")
            out[key] = np.round((image - lo) / (hi - lo) * 255.0).astype(np.uint8)
        elif np.issubdtype(image.dtype, np.floating):
            raise ObservationError(
                f"{key}: a {image.dtype} image needs predict(..., image_range=(lo, hi)) "
                f"naming its range; uint8 images are taken as they are"
            )
        else:
            raise ObservationError(f"{key}: images must be uint8 (or float with image_range), got {image.dtype}")
    for key, value in times.items():
        if batch is not None and value.shape[0] != batch:
            raise ObservationError(f"{key}: the observation has {batch} states but {value.shape[0]} values of {key}")
        out[key] = value if value.ndim else value[()]  # one observation's: a scalar, as in a training sample
    if batch is None:
        return out, None
    tasks = tasks if batched.get("task") else [task] * batch
    if len(tasks) != batch:
        raise ObservationError(f"task: the observation has {batch} states but {len(tasks)} tasks")
    return out, tasks
