"""First-fit packing: no sample split, segment ids/positions, cap per row, images per row, padding fraction."""

import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embodied_jax.data.packing import PackingConfig, pack, pack_samples, padding_fraction


def _samples(lengths):
    # tokens encode (sample id, position) so every packed token can be traced back
    return [
        {
            "tokens": (1000 * (i + 1) + np.arange(n)).astype(np.int32),
            "token_mask": np.ones(n, bool),
            "state": np.full(3, i, np.float32),
            "task": np.asarray(f"task {i}"),
        }
        for i, n in enumerate(lengths)
    ]


def _pack(lengths, seq_len, cap, bins=4):
    config = PackingConfig(
        seq_len=seq_len, token_keys=("tokens", "token_mask"), max_samples_per_row=cap, num_packing_bins=bins
    )
    samples = _samples(lengths)
    ds = grain.MapDataset.source(samples).to_iter_dataset()
    return list(pack(ds, config, probe=samples[0]))


def _check_rows(rows, lengths, seq_len, cap):
    seen = []
    for row in rows:
        tokens, seg, pos = row["tokens"], row["segment_ids"], row["positions"]
        assert tokens.shape == seg.shape == pos.shape == (seq_len,)
        assert seg.dtype == np.int32 and pos.dtype == np.int32 and row["token_mask"].dtype == np.bool_
        count = int(seg.max())
        assert 1 <= count <= cap
        # segments are contiguous runs 1..count followed by padding
        real = seg > 0
        assert np.all(real[: real.sum()]) and not np.any(real[real.sum() :])
        np.testing.assert_array_equal(np.unique(seg[real]), np.arange(1, count + 1))
        assert np.all(np.diff(seg[real]) >= 0)
        assert not tokens[~real].any() and not pos[~real].any() and not row["token_mask"][~real].any()
        for s in range(1, count + 1):
            span = tokens[seg == s]
            sample_id = span[0] // 1000 - 1
            # the whole sample, unsplit, with positions restarting at 0
            np.testing.assert_array_equal(span, 1000 * (sample_id + 1) + np.arange(lengths[sample_id]))
            np.testing.assert_array_equal(pos[seg == s], np.arange(lengths[sample_id]))
            assert row["token_mask"][seg == s].all()
            # per-sample values are stacked in segment order
            assert row["state"][s - 1, 0] == sample_id and row["task"][s - 1] == f"task {sample_id}"
            seen.append(int(sample_id))
        np.testing.assert_array_equal(row["sample_mask"], np.arange(cap) < count)
        assert not row["state"][count:].any() and all(t == "" for t in row["task"][count:])
        assert row["padding_fraction"] == pytest.approx(1 - real.sum() / seq_len)
    assert sorted(seen) == list(range(len(lengths)))  # every sample exactly once


def test_packing_example():
    lengths = [3, 5, 2, 7, 4, 1, 6, 8]
    rows = _pack(lengths, seq_len=8, cap=2)
    _check_rows(rows, lengths, 8, 2)
    # first fit over 4 bins: [3,5] [2,4] [7,1] [6] then [8]
    assert [np.bincount(r["segment_ids"], minlength=3)[1:].tolist() for r in rows[:3]] == [[3, 5], [2, 4], [7, 1]]
    batch = {"segment_ids": np.stack([r["segment_ids"] for r in rows])}
    assert padding_fraction(batch) == pytest.approx(1 - sum(lengths) / (8 * len(rows)))


def test_packing_rejects_too_long_samples():
    with pytest.raises(ValueError, match="a sample has 9 tokens; packing needs 1..seq_len=8"):
        _pack([3, 9], seq_len=8, cap=4)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 16), min_size=1, max_size=30), cap=st.integers(1, 5), bins=st.integers(1, 6))
def test_packing_property(lengths, cap, bins):
    rows = _pack(lengths, seq_len=16, cap=cap, bins=bins)
    _check_rows(rows, lengths, 16, cap)


def test_images_pack_with_their_samples_and_bound_the_row():
    # sample i has i % 3 images, every pixel = i; 10 tokens each
    samples = [
        {
            "tokens": np.full(10, i + 1, np.int32),
            "images": np.full((i % 3, 2, 2, 3), i, np.float32),
            "actions": np.full((2,), i, np.float32),
        }
        for i in range(7)
    ]
    config = PackingConfig(seq_len=40, max_samples_per_row=4, max_images_per_row=3)
    batch = pack_samples(samples, config, num_rows=5)
    assert batch["images"].shape == (5, 3, 2, 2, 3) and batch["image_segment_ids"].shape == (5, 3)
    seen = 0
    for r in range(5):
        tokens, seg, images, image_seg = (batch[k][r] for k in ("tokens", "segment_ids", "images", "image_segment_ids"))
        for s in range(1, int(seg.max(initial=0)) + 1):
            sample = int(tokens[seg == s][0]) - 1
            assert batch["actions"][r, s - 1, 0] == sample
            own = images[image_seg == s]
            assert len(own) == sample % 3 and np.all(own == sample)  # its own images, in order
            seen += 1
        assert not images[image_seg == 0].any()  # empty slots are zeros
        assert np.count_nonzero(image_seg) <= 3
    assert seen == 7
    with pytest.raises(ValueError, match="num_rows=1"):
        pack_samples(samples, config, num_rows=1)
    with pytest.raises(ValueError, match="max_images_per_row"):
        pack_samples(samples, PackingConfig(seq_len=40, max_images_per_row=0))
