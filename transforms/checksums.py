"""Which bytes an object holds, without trusting a manifest: CRC32C as GCS records it, and the stored figures of
objects (size and CRC32C from a gs:// listing; a local file hashed).

Every image and shard the job writes has its CRC32C (google_crc32c, base64 of the big-endian value: the form GCS
lists) recorded in its manifest row, sidecar row or marker, so that `--skip_existing` keeps an object only when
the object now there is the one a row vouches for: on gs:// the listing carries each object's CRC32C (nothing is
downloaded), locally the file is hashed. GCS is reached through the model's one client (model/storage/gcs.py), each
request retried as Beam's own GCS requests are (its retry policy, which counts throttling for the autoscaler).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from model import checksum_text, crc32c, gcs_client, local_digests, split_gs_object

from . import layout

__all__ = ["Stored", "checksum_text", "crc32c", "list_folder", "local_digests", "stored"]


@dataclasses.dataclass(frozen=True)
class Stored:
    """What the store says an object holds: its size, and its CRC32C where the store lists one (gs://; None for a
    local file, whose `sha256`/`crc32c` are computed from its bytes when asked: `local_digests`)."""

    size: int
    crc32c: str | None = None


def _retry():
    from .beam_adapter import gcs_retry

    return gcs_retry()


def stored(uri: str) -> Stored | None:
    """The stored figures of one object (None: there is none): gs:// from its metadata (one request, nothing
    downloaded), a local file from its bytes (size and CRC32C, read through)."""
    if layout.is_local_path(uri):
        try:
            size, _, crc = local_digests(uri, sha256=False)
        except FileNotFoundError:
            return None
        return Stored(size, crc)
    bucket, name = split_gs_object(uri)
    blob = gcs_client().bucket(bucket).get_blob(name, retry=_retry())
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
    bucket, prefix = split_gs_object(folder.rstrip("/") + "/")
    for blob in gcs_client().list_blobs(bucket, prefix=prefix, retry=_retry()):
        name = blob.name[len(prefix):]
        if name and "/" not in name and name.endswith(suffix):
            yield name, Stored(int(blob.size), blob.crc32c)
