"""Files that readers see whole or not at all, written through Beam's file systems (the job's credentials, retries
and metrics): the discipline itself (a local temporary file renamed over the name; an object upload finalised only
when complete, else abandoned) is the storage room's (model/storage/atomic.py)."""

from __future__ import annotations

from typing import BinaryIO, Callable

from model import finish_or_abandon, umask, write_local_atomic

__all__ = ["umask", "write_local_atomic", "write_object_atomic"]


def write_object_atomic(path: str, fill: Callable[[BinaryIO], None], mime_type: str) -> None:
    """Create the object `path` (gs://...) with what `fill(file)` writes, as one upload through Beam's GCS writer
    that is finalised only when `fill` returned; an error abandons it and leaves no object."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    out = FileSystems.create(path, mime_type=mime_type, compression_type=CompressionTypes.UNCOMPRESSED)
    finish_or_abandon(out, path, fill)
