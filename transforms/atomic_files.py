"""Local files that readers see whole or not at all: written under a temporary name in the same folder, synced,
then renamed over the final name (the local half of the job's atomic writes; object stores are atomic per upload)."""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable


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
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
