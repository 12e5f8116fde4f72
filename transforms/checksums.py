"""Which bytes an object holds, without trusting a manifest: CRC32C as GCS records it, and the stored figures of
objects (size and CRC32C from a gs:// listing; a local file hashed).

Every image and shard the job writes has its CRC32C (google_crc32c, base64 of the big-endian value: the form GCS
lists) recorded in its manifest row, sidecar row or marker, so that `--skip_existing` keeps an object only when
the object now there is the one a row vouches for: on gs:// the listing carries each object's CRC32C (nothing is
downloaded), locally the file is hashed.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from typing import Iterator

from . import layout

_READ_CHUNK = 4 * 2**20


def crc32c(data: bytes) -> str:
    """The CRC32C of `data` as GCS writes it in an object's metadata (base64 of the 4 big-endian bytes)."""
    import google_crc32c

    return checksum_text(google_crc32c.Checksum(data))


def checksum_text(checksum) -> str:
    """A google_crc32c.Checksum's value as GCS lists it (base64 of the 4 big-endian bytes)."""
    return base64.b64encode(checksum.digest()).decode("ascii")


@dataclasses.dataclass(frozen=True)
class Stored:
    """What the store says an object holds: its size, and its CRC32C where the store lists one (gs://; None for a
    local file, whose `sha256`/`crc32c` are computed from its bytes when asked: `local_digests`)."""

    size: int
    crc32c: str | None = None


def local_digests(path: str, *, sha256: bool = True) -> tuple[int, str | None, str]:
    """(size, sha256 hex, crc32c) of a local file, read in chunks; `sha256=False`: no sha256 (None), for a caller
    that needs only the CRC32C (a whole tar: its sha256 would cost seconds more)."""
    import google_crc32c

    sha, crc, size = hashlib.sha256() if sha256 else None, google_crc32c.Checksum(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ_CHUNK):
            if sha is not None:
                sha.update(chunk)
            crc.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest() if sha is not None else None, checksum_text(crc)


def _gcs_client():
    """A google-cloud-storage client made as Beam's GCS filesystem makes its own for each call (the job's
    credentials, anonymous against the emulator; the endpoint as the environment says now)."""
    from apache_beam.io.gcp import gcsio

    return gcsio.GcsIO().client


def _retry():
    from .beam_adapter import gcs_retry

    return gcs_retry()


def _split(uri: str) -> tuple[str, str]:
    bucket, _, name = uri[len("gs://"):].partition("/")
    return bucket, name


def stored(uri: str) -> Stored | None:
    """The stored figures of one object (None: there is none): gs:// from its metadata (one request, nothing
    downloaded), a local file from its bytes (size and CRC32C, read through)."""
    if layout.is_local_path(uri):
        try:
            size, _, crc = local_digests(uri, sha256=False)
        except FileNotFoundError:
            return None
        return Stored(size, crc)
    bucket, name = _split(uri)
    blob = _gcs_client().bucket(bucket).get_blob(name, retry=_retry())
    if blob is None:
        return None
    return Stored(int(blob.size), blob.crc32c)


def list_folder(folder: str, suffix: str) -> Iterator[tuple[str, Stored]]:
    """(name, Stored) of every object directly in `folder` (gs:// prefix or local folder; no sub-folders) whose
    name ends with `suffix`: one listing, with each object's CRC32C on gs://; sizes only for local files."""
    if layout.is_local_path(folder):
        import os

        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.endswith(suffix) and entry.is_file():
                yield entry.name, Stored(entry.stat().st_size)
        return
    bucket, prefix = _split(folder.rstrip("/") + "/")
    for blob in _gcs_client().list_blobs(bucket, prefix=prefix, retry=_retry()):
        name = blob.name[len(prefix):]
        if name and "/" not in name and name.endswith(suffix):
            yield name, Stored(int(blob.size), blob.crc32c)
