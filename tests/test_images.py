"""``embodied_jax.images``: resize-with-pad and the unit-range conversion, checked against the two
forms they replaced (the π0.5 builder's and the data layer's)."""

import numpy as np
import pytest

import embodied_jax.images as image


def _old_pi05_resize_with_pad(img, size):  # models/pi05/inputs.py before images.py (float, floor, pad -1)
    from PIL import Image

    height, width = size
    cur_h, cur_w = img.shape[:2]
    if (cur_h, cur_w) == (height, width):
        return img
    ratio = max(cur_w / width, cur_h / height)
    new_h, new_w = int(cur_h / ratio), int(cur_w / ratio)
    channels = [
        np.asarray(Image.fromarray(img[..., c].astype(np.float32), mode="F").resize((new_w, new_h), Image.BILINEAR))
        for c in range(img.shape[-1])
    ]
    out = np.full((height, width, img.shape[-1]), -1.0, np.float32)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    out[top : top + new_h, left : left + new_w] = np.clip(np.stack(channels, axis=-1), -1.0, 1.0)
    return out


def _old_data_resize_with_pad(img, height, width):  # data/transforms.py before images.py (uint8, round, pad 0)
    in_h, in_w = img.shape[:2]
    if (in_h, in_w) == (height, width):
        return img
    scale = min(height / in_h, width / in_w)
    new_h, new_w = max(1, int(round(in_h * scale))), max(1, int(round(in_w * scale)))
    out = np.zeros((height, width, 3), np.uint8)
    top, left = (height - new_h) // 2, (width - new_w) // 2
    out[top : top + new_h, left : left + new_w] = image.resize(img, new_h, new_w)
    return out


@pytest.mark.parametrize(
    "shape, size",
    [((48, 64), (32, 32)), ((30, 17), (24, 24)), ((10, 30), (12, 16)), ((21, 21), (21, 21)), ((7, 5), (32, 20))],
)
def test_resize_with_pad_matches_both_previous_forms(shape, size):
    rng = np.random.default_rng(0)
    signed = rng.uniform(-1, 1, (*shape, 3)).astype(np.float32)
    got = image.resize_with_pad(signed, *size, rounding="floor")
    assert got.dtype == np.float32 and got.shape == (*size, 3)
    np.testing.assert_array_equal(got, _old_pi05_resize_with_pad(signed, size))
    pixels = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
    got = image.resize_with_pad(pixels, *size)
    assert got.dtype == np.uint8 and got.shape == (*size, 3)
    np.testing.assert_array_equal(got, _old_data_resize_with_pad(pixels, *size))
    # black padding in either range: 0 for uint8, -1 for float in [-1, 1]
    if shape == (48, 64):
        assert not got[:4].any() and not got[-4:].any()
        np.testing.assert_array_equal(image.resize_with_pad(signed, *size, rounding="floor")[:4], -1.0)


def test_resize_with_pad_rounding_rules_differ_and_are_checked():
    pixels = np.full((11, 20, 3), 255, np.uint8)  # 20 -> 16 wide: 11 * 0.8 = 8.8 rows

    def rows(out):
        return int(out.any(axis=(1, 2)).sum())

    assert rows(image.resize_with_pad(pixels, 16, 16)) == 9  # nearest
    assert rows(image.resize_with_pad(pixels, 16, 16, rounding="floor")) == 8  # openpi
    with pytest.raises(ValueError, match="rounding"):
        image.resize_with_pad(pixels, 12, 16, rounding="ceil")


def test_to_unit_range_matches_previous_forms():
    pixels = np.arange(256, dtype=np.uint8).reshape(16, 16)
    got = image.to_unit_range(pixels)
    assert got.dtype == np.float32 and got[0, 0] == -1.0 and got[-1, -1] == 1.0
    np.testing.assert_array_equal(got, pixels.astype(np.float32) / 127.5 - 1.0)  # both builders' formula
    old_data = pixels.astype(np.float32) * np.float32(2.0 / 255.0) - np.float32(1.0)  # the data layer's
    np.testing.assert_allclose(got, old_data, rtol=0, atol=1.2e-7)  # last float32 bit only
    np.testing.assert_allclose(got, pixels / 127.5 - 1.0, rtol=0, atol=6e-8)  # within half an ulp of exact
    unit = np.linspace(0, 1, 12, dtype=np.float32).reshape(2, 2, 3)
    signed = unit * 2 - 1
    np.testing.assert_array_equal(image.to_unit_range(unit), unit)  # GR00T / data: floats are [-1, 1]
    np.testing.assert_array_equal(image.to_unit_range(unit, floats="auto"), unit * 2.0 - 1.0)  # π0.5: [0, 1]
    np.testing.assert_array_equal(image.to_unit_range(signed, floats="auto"), signed)
    assert image.to_unit_range(unit.astype(np.float64)).dtype == np.float32
    with pytest.raises(ValueError, match="floats"):
        image.to_unit_range(unit, floats="unit")
