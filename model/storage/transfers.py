"""Moving bytes to and from GCS: whole objects by google-cloud-storage's transfer_manager (byte ranges in parallel,
checked against the crc32c GCS lists), byte ranges of an object, and folders of files uploaded at once.

Errors name the object (`CheckpointError`, the kind every caller of a read reports): a short read, a checksum or
size mismatch, an object that changed since it was listed.
"""

from __future__ import annotations

import os

from ..errors import CheckpointError

SLICE_BYTES = 32 * 1024 * 1024  # one range request (transfer_manager's own default chunk size)
SLICE_THREADS = 16  # byte-range requests in flight


def download_object(blob, dest: str, object_uri: str, *, threads: int = SLICE_THREADS,
                    chunk_size: int = SLICE_BYTES) -> int:
    """Copy one listed object to `dest` as stored (raw: the bytes its checksums cover) with transfer_manager's
    download_chunks_concurrently: `chunk_size` byte ranges on `threads` threads, each written in place while its
    crc32c is computed; the combined crc32c must be the one the listing gave. A short read, a size or checksum
    mismatch raises CheckpointError naming the object (the caller removes the partial copy). Returns the size
    written."""
    from google.cloud.storage import transfer_manager
    from google.cloud.storage.exceptions import DataCorruption

    os.makedirs(os.path.dirname(dest), exist_ok=True)
    listed_crc32c, size = blob.crc32c, int(blob.size or 0)  # a download overwrites them with its response headers
    if listed_crc32c is None:
        raise CheckpointError("checkpoint object has no crc32c checksum to verify against", path=object_uri)
    try:
        transfer_manager.download_chunks_concurrently(
            blob, dest, chunk_size=chunk_size, download_kwargs={"raw_download": True},
            worker_type=transfer_manager.THREAD, max_workers=max(1, threads), crc32c_checksum=True)
    except Exception as e:
        written = os.path.getsize(dest) if os.path.exists(dest) else 0
        if written < size:  # a range read past the stored bytes: an error, or an empty range transfer_manager trips on
            raise CheckpointError(f"short read: the copy has {written} of the {size} bytes GCS lists "
                                  f"({type(e).__name__}: {e})", path=object_uri) from e
        if isinstance(e, DataCorruption):
            raise CheckpointError(f"checksum mismatch: crc32c of the copy is not the {listed_crc32c} GCS lists "
                                  f"({e})", path=object_uri) from e
        raise CheckpointError(f"cannot download checkpoint object: {type(e).__name__}: {e}", path=object_uri) from e
    written = os.path.getsize(dest)
    if written != size:
        raise CheckpointError(f"size mismatch: copy has {written} bytes, GCS says {size} (a short read)",
                              path=object_uri)
    if size and blob.crc32c not in (None, listed_crc32c):  # transfer_manager checked against a newer object's
        raise CheckpointError(f"checksum mismatch: the object changed since it was listed (crc32c {blob.crc32c}, "
                              f"listed {listed_crc32c})", path=object_uri)
    return written


def read_range(blob, offset: int, length: int, object_uri: str) -> bytes:
    """Bytes [offset, offset + length) of a listed gs:// object as stored (fewer where it ends first)."""
    end = min(offset + length, int(blob.size or 0))
    if end <= offset:
        return b""
    try:
        return blob.download_as_bytes(start=offset, end=end - 1, raw_download=True, checksum=None)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint object (bytes {offset}-{end - 1}): {type(e).__name__}: {e}",
                              path=object_uri) from e


def upload_files(bucket, files: list[str], *, source_directory: str, prefix: str, threads: int, retry=None) -> None:
    """Upload `files` (paths relative to `source_directory`, '/'-separated) to `{prefix}/{file}` in `bucket` (a
    client's Bucket) with transfer_manager, `threads` at once, each with `retry` (None: google-cloud-storage's
    DEFAULT_RETRY). Once every upload has ended, the first failure is raised."""
    from google.cloud.storage import transfer_manager
    from google.cloud.storage.retry import DEFAULT_RETRY

    transfer_manager.upload_many_from_filenames(
        bucket, files, source_directory=source_directory, blob_name_prefix=f"{prefix}/",
        upload_kwargs={"retry": retry or DEFAULT_RETRY}, worker_type=transfer_manager.THREAD,
        max_workers=threads, raise_exception=True)
