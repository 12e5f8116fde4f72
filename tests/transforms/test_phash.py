"""The DCT pHash (transforms/phash.py): the DCT matrix is the orthonormal DCT-II, a hash is 16 hex digits that the
same picture always gets, small changes move it a few bits and another picture about half of them."""

import numpy as np
import pytest

from transforms import phash


def test_dct_matrix_is_the_orthonormal_dct_ii():
    n = phash.SCALED
    d = phash.dct_matrix(n)
    np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-12)
    x = np.random.default_rng(0).random(n)
    k = np.arange(n)[:, None]
    by_sum = np.sum(x * np.cos(np.pi * (2 * np.arange(n) + 1) * k / (2 * n)), axis=1) * np.sqrt(2 / n)
    by_sum[0] /= np.sqrt(2)
    np.testing.assert_allclose(d @ x, by_sum, atol=1e-12)


def _picture(seed, size=256):
    """A smooth picture (low frequencies dominate, as in photographs), not white noise."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (8, 8, 3)).astype(np.float64)
    from PIL import Image

    return np.asarray(Image.fromarray(small.astype(np.uint8)).resize((size, size), Image.Resampling.BICUBIC))


def test_hash_is_stable_close_for_small_changes_and_far_for_another_picture():
    a = _picture(1)
    h = phash.phash_pixels(a)
    assert len(h) == 16 and int(h, 16) >= 0 and h == phash.phash_pixels(a.copy())
    brighter = np.clip(a.astype(int) + 6, 0, 255).astype(np.uint8)
    assert phash.distance(h, phash.phash_pixels(brighter)) <= 4
    from PIL import Image

    smaller = np.asarray(Image.fromarray(a).resize((200, 200), Image.Resampling.BILINEAR))  # the slow path too
    assert phash.distance(h, phash.phash_pixels(smaller)) <= 4
    others = [phash.distance(h, phash.phash_pixels(_picture(s))) for s in range(2, 8)]
    assert min(others) > 10, others


def test_phash_image_matches_the_pixels_and_bad_values_are_named():
    from PIL import Image

    a = _picture(3, 64)
    assert phash.phash_image(Image.fromarray(a)) == phash.phash_pixels(a)
    with pytest.raises(ValueError, match="16 hex digits"):
        phash.distance("abc", "0" * 16)
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        phash.phash_pixels(np.zeros((4, 4), np.uint8))
