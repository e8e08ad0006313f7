"""First-fit packing: no sample split, segment ids/positions, cap per row, padding fraction."""
import grain
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embodied_jax.data.packing import PackingConfig, pack, padding_fraction


def _samples(lengths):
    # tokens encode (sample id, position) so every packed token can be traced back
    return [{"tokens": (1000 * (i + 1) + np.arange(n)).astype(np.int32), "token_mask": np.ones(n, bool),
             "state": np.full(3, i, np.float32), "task": np.asarray(f"task {i}")} for i, n in enumerate(lengths)]


def _pack(lengths, seq_len, cap, bins=4):
    config = PackingConfig(seq_len=seq_len, token_keys=("tokens", "token_mask"), max_samples_per_row=cap,
                           num_packing_bins=bins)
    ds = grain.MapDataset.source(_samples(lengths)).to_iter_dataset()
    return list(pack(ds, config, meta_keys=("state", "task"), token_dtypes=(np.int32, np.bool_)))


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
        assert np.all(real[:real.sum()]) and not np.any(real[real.sum():])
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
