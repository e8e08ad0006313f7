"""Action chunks and pad masks, delta actions, normalisation statistics and modes, image transforms."""

import json

import numpy as np
import pytest

from embodied_jax.data.lerobot import LeRobotDataset
from embodied_jax.data.samples import SampleLoader, SampleSpec, to_absolute_actions, to_delta_actions
from embodied_jax.data.stats import (
    FeatureStats,
    Normalizer,
    NormStats,
    QuantileSketch,
    compute_stats,
    iter_values,
    normalize,
    unnormalize,
)
from embodied_jax.data.synthetic import decode_frame_id, make_episodes
from embodied_jax.data.transforms import AugmentConfig, ImageTransform, random_shift
from embodied_jax.data.writer import write_lerobot_dataset
from embodied_jax.images import resize_with_pad, to_unit_range

FPS = 10


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    episodes = make_episodes([6, 9], cameras=("front",), state_dim=3, action_dim=3)
    root = write_lerobot_dataset(tmp_path_factory.mktemp("ds"), episodes, fps=FPS, version="v3.0", image_storage="png")
    return LeRobotDataset(root), episodes


def test_action_chunk_pads_at_episode_end(dataset):
    ds, episodes = dataset
    actions = episodes[0]["action"]
    sample = SampleLoader(ds, SampleSpec(action_horizon=4)).sample(0, 4)
    expected = actions[[4, 5, 5, 5]]  # absolute key: the last action repeats
    np.testing.assert_array_equal(sample["action"], expected)
    np.testing.assert_array_equal(sample["action_is_pad"], [False, False, True, True])
    relative = SampleLoader(ds, SampleSpec(action_horizon=4, relative_keys=("action",))).sample(0, 4)
    np.testing.assert_array_equal(relative["action"], np.concatenate([actions[4:6], np.zeros((2, 3), np.float32)]))
    # the flat sample index runs across episodes: index 6 is episode 1, frame 0
    first = SampleLoader(ds, SampleSpec(action_horizon=2))(6)
    np.testing.assert_array_equal(first["action"], episodes[1]["action"][:2])
    assert decode_frame_id(first["observation.images.front"]) == (1, 0, 0)
    assert first["task"] == "place" and int(first["episode_index"]) == 1


def test_history_from_delta_timestamps(dataset):
    ds, episodes = dataset
    spec = SampleSpec(
        action_horizon=2,
        delta_timestamps={"observation.state": (-0.2, -0.1, 0.0), "observation.images.front": (-0.1, 0.0)},
    )
    sample = SampleLoader(ds, spec).sample(1, 1)
    state = episodes[1]["observation.state"]
    np.testing.assert_array_equal(sample["observation.state"], state[[0, 0, 1]])
    np.testing.assert_array_equal(sample["observation.state_is_pad"], [True, False, False])
    assert [decode_frame_id(f) for f in sample["observation.images.front"]] == [(1, 0, 0), (1, 1, 0)]
    np.testing.assert_array_equal(sample["observation.images.front_is_pad"], [False, False])


def test_delta_actions(dataset):
    ds, episodes = dataset
    mask = (True, True, False)
    sample = SampleLoader(ds, SampleSpec(action_horizon=3, delta_action_mask=mask)).sample(1, 7)
    state, actions = episodes[1]["observation.state"][7], episodes[1]["action"][[7, 8, 8]]
    expected = actions.copy()
    expected[:, 0] -= state[0]
    expected[:, 1] -= state[1]
    np.testing.assert_allclose(sample["action"], expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(to_absolute_actions(sample["action"], state, mask), actions, atol=1e-6)
    np.testing.assert_allclose(to_delta_actions(actions, state, mask), expected, atol=1e-6)


def _stats(values):
    values = np.asarray(values, np.float64)
    return FeatureStats(
        mean=values.mean(0),
        std=values.std(0),
        min=values.min(0),
        max=values.max(0),
        count=len(values),
        quantiles={"q01": np.quantile(values, 0.01, axis=0), "q99": np.quantile(values, 0.99, axis=0)},
    )


def test_normalisation_modes_and_inverse():
    rng = np.random.default_rng(0)
    values = rng.normal(3.0, 2.0, size=(1000, 4)).astype(np.float32)
    stats = _stats(values)
    x = values[::5]
    np.testing.assert_allclose(
        normalize(x, stats, "mean_std"), (x - values.mean(0)) / values.std(0), rtol=1e-4, atol=1e-5
    )
    lo, hi = values.min(0), values.max(0)
    np.testing.assert_allclose(normalize(x, stats, "min_max"), 2 * (x - lo) / (hi - lo) - 1, atol=1e-5)
    q01, q99 = np.quantile(values, 0.01, axis=0), np.quantile(values, 0.99, axis=0)
    expected = np.clip(2 * (x - q01) / (q99 - q01) - 1, -1, 1)
    quantile = normalize(x, stats, "quantile")
    np.testing.assert_allclose(quantile, expected, atol=1e-5)
    assert quantile.min() == -1.0 and quantile.max() == 1.0  # samples outside [q01, q99] are clipped
    inside = np.all((x > q01) & (x < q99), axis=1)
    for mode in ("mean_std", "min_max"):
        np.testing.assert_allclose(unnormalize(normalize(x, stats, mode), stats, mode), x, atol=1e-4)
    np.testing.assert_allclose(unnormalize(quantile, stats, "quantile")[inside], x[inside], atol=1e-4)
    normalizer = Normalizer({"action": stats}, {"action": "min_max"})
    np.testing.assert_allclose(normalizer.unnormalize(normalizer({"action": x}))["action"], x, atol=1e-4)
    with pytest.raises(ValueError, match="width 3 but its statistics have width 4"):
        normalize(x[:, :3], stats, "mean_std", key="action")
    with pytest.raises(ValueError, match="unknown normalisation mode 'zscore'"):
        Normalizer({"action": stats}, {"action": "zscore"})


def test_quantile_sketch_rank_error():
    rng = np.random.default_rng(1)
    n = 240_000
    values = np.concatenate([rng.normal(size=(n // 2, 2)), rng.exponential(4.0, size=(n // 2, 2)) + 2.0])
    values = values[rng.permutation(n)]
    sketch = QuantileSketch(k=1024)  # small k so that many compactions happen
    for batch in np.array_split(values, 53):
        sketch.add(batch)
    assert len(sketch.levels) > 4
    qs = [0.01, 0.1, 0.5, 0.9, 0.99]
    estimates = sketch.quantiles(qs)
    for i, q in enumerate(qs):
        for d in range(2):
            rank = np.mean(values[:, d] <= estimates[i, d])
            assert abs(rank - q) < 0.005, (q, d, rank)
    # exact while nothing was compacted
    small = values[:500]
    exact = QuantileSketch()
    exact.add(small)
    np.testing.assert_allclose(exact.quantiles(qs), np.quantile(small, qs, axis=0))


def test_streaming_stats_match_numpy_and_json_round_trip(dataset, tmp_path):
    ds, episodes = dataset
    stats = compute_stats(ds, ("observation.state", "action"))
    actions = np.concatenate([e["action"] for e in episodes]).astype(np.float64)
    np.testing.assert_allclose(stats["action"].mean, actions.mean(0), atol=1e-6)
    np.testing.assert_allclose(stats["action"].std, actions.std(0), atol=1e-6)
    np.testing.assert_array_equal(stats["action"].min, actions.min(0))
    np.testing.assert_allclose(stats["action"].q99, np.quantile(actions, 0.99, axis=0), atol=1e-6)
    assert stats["action"].count == 15
    stats.save(tmp_path / "norm_stats.json")
    loaded = NormStats.load(tmp_path / "norm_stats.json")
    for key in stats:
        for field in ("mean", "std", "min", "max", "q01", "q99"):
            np.testing.assert_array_equal(getattr(loaded[key], field), getattr(stats[key], field))
    json.loads((tmp_path / "norm_stats.json").read_text())
    # the dataset's own meta/stats.json loads too
    lerobot_stats = NormStats.load(ds.root / "meta/stats.json")
    np.testing.assert_allclose(lerobot_stats["action"].mean, actions.mean(0), atol=1e-6)
    # a mixture: the same dataset twice has the same mean, twice the count
    mixed = compute_stats([ds, ds], ("action",))
    np.testing.assert_allclose(mixed["action"].mean, actions.mean(0), atol=1e-6)
    assert mixed["action"].count == 30
    # stats over delta action chunks
    spec = SampleSpec(action_horizon=2, delta_action_mask=(True, False, False))
    delta = compute_stats(ds, ("action",), spec=spec)["action"]
    loader = SampleLoader(ds, spec)
    chunks = np.concatenate([loader(i)["action"] for i in range(ds.num_frames)])
    np.testing.assert_allclose(delta.mean, chunks.mean(0), atol=1e-5)
    assert iter_values([chunks[:10], chunks[10:]]).count == len(chunks)


def test_image_transforms_are_seeded():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, size=(48, 64, 3), dtype=np.uint8)
    padded = resize_with_pad(image, 32, 32)
    assert padded.shape == (32, 32, 3)
    assert not padded[:4].any() and not padded[-4:].any()  # 48x64 -> 24x32 centred: 4 black rows top and bottom
    float_image = to_unit_range(padded)
    assert float_image.dtype == np.float32 and float_image.min() >= -1 and float_image.max() <= 1
    transform = ImageTransform(cameras=("cam",), size=(32, 32), augment=AugmentConfig())
    a = transform({"cam": image}, np.random.default_rng(7))["cam"]
    b = transform({"cam": image}, np.random.default_rng(7))["cam"]
    c = transform({"cam": image}, np.random.default_rng(8))["cam"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    plain = ImageTransform(cameras=("cam",), size=(32, 32))({"cam": image})["cam"]
    np.testing.assert_array_equal(plain, to_unit_range(padded))


def test_random_shift_translates_with_edge_padding():
    image = np.random.default_rng(0).integers(0, 255, size=(16, 20, 3), dtype=np.uint8)
    seen = set()
    for seed in range(40):
        out = random_shift(image, np.random.default_rng(seed), 3)
        assert out.shape == image.shape and out.dtype == image.dtype
        # find the offset: the output is the input moved by (dy, dx), edges replicated
        edge = np.pad(image, ((3, 3), (3, 3), (0, 0)), mode="edge")
        offsets = [
            (dy, dx) for dy in range(7) for dx in range(7) if np.array_equal(edge[dy : dy + 16, dx : dx + 20], out)
        ]
        assert offsets, "not a translation of the input"
        dy, dx = offsets[0]
        np.testing.assert_array_equal(
            out[max(0, 3 - dy) : 16 - max(0, dy - 3), max(0, 3 - dx) : 20 - max(0, dx - 3)],
            image[max(0, dy - 3) : 16 - max(0, 3 - dy), max(0, dx - 3) : 20 - max(0, 3 - dx)],
        )
        seen.add((dy, dx))
    assert len(seen) > 10  # offsets drawn over the whole range, not one fixed move
    only_shift = AugmentConfig(
        shift=3, crop_scale=1.0, max_rotation_degrees=0, brightness=0, contrast=0, saturation=0, hue=0
    )
    np.testing.assert_array_equal(
        only_shift.apply(image, np.random.default_rng(5)), random_shift(image, np.random.default_rng(5), 3)
    )
    with pytest.raises(ValueError, match="shift=-1"):
        AugmentConfig(shift=-1)
