"""CRC32C as GCS records it for every object: of bytes, of a local file, and of two pieces joined.

GCS lists an object's crc32c as base64 of the 4 big-endian bytes (`Blob.crc32c`); every text here has that form,
so a local file and its upload have one value.
"""

from __future__ import annotations

import base64
import functools
import hashlib

READ_CHUNK = 4 * 2**20  # bytes of a local file read at a time
_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def checksum_text(checksum) -> str:
    """A google_crc32c.Checksum's value as GCS lists it (base64 of the 4 big-endian bytes)."""
    return base64.b64encode(checksum.digest()).decode("ascii")


def crc32c(data: bytes) -> str:
    """The CRC32C of `data` as GCS writes it in an object's metadata (base64 of the 4 big-endian bytes)."""
    import google_crc32c

    return checksum_text(google_crc32c.Checksum(data))


def to_base64(crc: int) -> str:
    """A crc32c as GCS writes it (`Blob.crc32c`): the big-endian 4 bytes, base64."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode("ascii")


def local_digests(path: str, *, sha256: bool = True) -> tuple[int, str | None, str]:
    """(size, sha256 hex, crc32c) of a local file, read in chunks; `sha256=False`: no sha256 (None), for a caller
    that needs only the CRC32C (a whole tar: its sha256 would cost seconds more)."""
    import google_crc32c

    sha, crc, size = hashlib.sha256() if sha256 else None, google_crc32c.Checksum(), 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            if sha is not None:
                sha.update(chunk)
            crc.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest() if sha is not None else None, checksum_text(crc)


# --------------------------------------------------------------------------------------------- joining pieces
def _times(matrix: tuple, vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _square(matrix: tuple) -> tuple:
    return tuple(_times(matrix, row) for row in matrix)


@functools.lru_cache(maxsize=64)
def _zeros_operator(length: int) -> tuple:
    """The GF(2) matrix that moves a crc past `length` zero bytes (zlib's crc32_combine, for CRC-32C's polynomial);
    cached, so the equal slices of a file cost one product each."""
    one_bit = (_POLY,) + tuple(1 << n for n in range(31))  # one zero bit
    op = _square(_square(_square(one_bit)))  # one zero byte
    result = None
    while length:
        if length & 1:
            result = op if result is None else tuple(_times(op, row) for row in result)
        length >>= 1
        if length:
            op = _square(op)
    return result


def crc32c_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """crc32c of A + B from crc32c(A), crc32c(B) and len(B)."""
    if length_b == 0:
        return crc_a
    return _times(_zeros_operator(length_b), crc_a) ^ crc_b
