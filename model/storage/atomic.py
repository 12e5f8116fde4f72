"""Files that readers see whole or not at all.

Local: written under a temporary name in the same folder, synced, given the mode the umask allows (as `open` would:
0644 under umask 022), renamed over the final name, and the folder synced so the rename survives a crash. Object
stores (gs://): one upload, finalised only when everything was written; on an error the upload is abandoned, so no
object, not even a short one, appears under the final name (a google-cloud-storage writer otherwise completes the
upload with what it buffered when it is closed, or garbage-collected, after a failure). Whoever opens the object's
writer (transforms/atomic_files.py: Beam's file system) hands it to `finish_or_abandon`."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from typing import BinaryIO, Callable

logger = logging.getLogger(__name__)


def umask() -> int:
    """This process's umask, read without changing it (Linux /proc), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_local_atomic(path: str, fill: Callable[[BinaryIO], None]) -> None:
    """Create `path` with what `fill(file)` writes; on any error the temporary file is removed and `path` is left
    as it was (absent, or its previous bytes)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as out:
            fill(out)
            out.flush()
            os.fchmod(out.fileno(), 0o666 & ~umask())  # mkstemp makes 0600 whatever the umask
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) and not e.filename:
            raise OSError(e.errno, os.strerror(e.errno), path) from e  # a full disk: say which file did not fit
        raise
    sync_folder(folder)


def sync_folder(folder: str) -> None:
    """fsync a folder, so that a rename into it is on disk (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def finish_or_abandon(writer, path: str, fill: Callable[[BinaryIO], None]) -> None:
    """Write what `fill(writer)` writes through an object `writer` opened for `path` (a google-cloud-storage
    BlobWriter, or one built on it) and finalise the upload only when `fill` returned; an error abandons it and
    leaves no object. That includes an error of close() itself: an object smaller than a chunk is sent whole by
    close(), and a writer left holding it after, say, its session could not be opened would send it again when
    garbage-collected, publishing an object whose write had been reported failed."""
    try:
        fill(writer)
        writer.close()
    except BaseException:
        abandon_upload(writer, path)
        raise


def abandon_upload(writer, path: str) -> None:
    """Make an unfinished object writer never finalise its upload: google-cloud-storage's BlobWriter (Beam's GCS
    writer) uploads what it buffered and completes the object in close(), which garbage collection also calls; its
    public `terminate()` cancels the resumable upload (if one was opened) and closes the buffer, so close() sends
    nothing. Should the cancel request itself fail (it is logged), an upload cut on the wire still cannot complete
    (the writer's stream no longer matches what GCS holds); only one abandoned for `fill`'s own error, with the
    network gone just for the cancel, could be completed by a close() once it is back."""
    terminate = getattr(writer, "terminate", None)
    if terminate is None:
        return
    try:
        terminate()
    except Exception as e:  # noqa: BLE001 - the write's own error is what the caller raises
        logger.warning("could not cancel the unfinished upload of %s: %s: %s", path, type(e).__name__, e)
