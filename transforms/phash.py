"""Perceptual hashes of images: the 64-bit DCT pHash, as 16 hex digits, and the Hamming distance between two.

The image is made grey (the mean of its channels) and scaled to 32x32 in one box filter over its bytes read as one
grey row of 3 x width values (no copy of the pixels, every channel of every pixel counted once), then transformed with the
orthonormal 2-D DCT-II (two products with one 32x32 matrix); the 8x8 lowest frequencies, compared with their
median, give the 64 bits, row by row, the first the highest bit. Images that look alike get hashes a few bits apart,
whatever their size or encoding. Pure functions: numpy and Pillow only.
"""

from __future__ import annotations

import functools

import numpy as np

HASH_BITS = 64
HASH_HEX = HASH_BITS // 4
SCALED = 32  # the side of the grey image the DCT runs on
LOW = 8  # the side of the block of lowest frequencies kept (LOW * LOW == HASH_BITS)


@functools.lru_cache(maxsize=None)
def dct_matrix(n: int = SCALED) -> np.ndarray:
    """The orthonormal DCT-II matrix of size n: `dct_matrix(n) @ x` is the DCT of the vector x."""
    k = np.arange(n, dtype=np.float64)[:, None]
    i = np.arange(n, dtype=np.float64)[None, :]
    m = np.cos(np.pi * (2 * i + 1) * k / (2 * n)) * np.sqrt(2.0 / n)
    m[0] /= np.sqrt(2.0)
    return m


def hash_of_grey(grey: np.ndarray) -> str:
    """A SCALED x SCALED grey image (any numeric dtype) -> its pHash as 16 lower-case hex digits."""
    d = dct_matrix(grey.shape[0])
    coefficients = d @ np.asarray(grey, dtype=np.float64) @ d.T
    low = coefficients[:LOW, :LOW]
    bits = (low > np.median(low)).ravel()
    value = int.from_bytes(np.packbits(bits).tobytes(), "big")
    return f"{value:0{HASH_HEX}x}"


def phash_pixels(pixels: np.ndarray) -> str:
    """uint8 [H, W, 3] RGB pixels -> their pHash."""
    from PIL import Image

    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    if pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"expected uint8 [H, W, 3] pixels, got {pixels.dtype} {pixels.shape}")
    height, width, _ = pixels.shape
    spread = Image.frombuffer("L", (3 * width, height), pixels, "raw", "L", 0, 1)  # R G B R G B ... per row
    if (3 * width) % SCALED == 0 and height % SCALED == 0:
        grey = spread.reduce((3 * width // SCALED, height // SCALED))  # exact box means, the fast path
    else:
        grey = spread.resize((SCALED, SCALED), Image.Resampling.BOX)
    return hash_of_grey(np.asarray(grey))


def phash_image(image) -> str:
    """A PIL image (any mode and size; a stored image read back) -> the pHash of its RGB pixels."""
    return phash_pixels(np.asarray(image.convert("RGB")))


def as_int(phash: str) -> int:
    """A pHash's 16 hex digits as an integer; ValueError naming the value when it is not one."""
    if not isinstance(phash, str) or len(phash) != HASH_HEX:
        raise ValueError(f"a pHash is {HASH_HEX} hex digits, got {phash!r}")
    return int(phash, 16)


def distance(a: str, b: str) -> int:
    """The Hamming distance between two pHashes: how many of their 64 bits differ."""
    return (as_int(a) ^ as_int(b)).bit_count()
