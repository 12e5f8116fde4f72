"""Reference image files for the image-conditioned job's tests: small real images and files that only look like one."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image


def png(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    """A PNG of random pixels, `width` x `height`."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode=mode).save(buf, format="PNG")
    return buf.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A decompression bomb's disguise: a valid 64x64 PNG whose header (IHDR, checksum fixed) declares
    `width` x `height`; a reader that trusts the header before decoding would allocate that much."""
    data = bytearray(png(64, 64))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def pil(data: bytes) -> Image.Image:
    """The image a reference file holds, opened as the generator's caller would (RGB)."""
    with Image.open(io.BytesIO(data)) as im:
        return im.convert("RGB")
