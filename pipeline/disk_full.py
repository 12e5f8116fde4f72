"""A disk that fills during a run: one line naming where, how much is free and about how much more the run needs.

Beam passes a worker's error on wrapped (a RuntimeError naming the step; from a worker process, its traceback as
text), so the disk-full error (ENOSPC, or EDQUOT for a quota) is recognised in the exception chain or in its text.
model/storage/atomic.py puts the path of the file being written into it. What was written stays (every write is
atomic: no torn image), the run's temporary folders are removed (pipeline/output_lease.py), and `--skip_existing`
resumes once there is room. Pure functions, but for the free-space and image-size look-ups of `disk_full_line`.
"""

from __future__ import annotations

import errno
import os
import re
import shutil

from transforms import layout

from .errors import exception_chain

_CODES = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded"}
_TEXT = re.compile(r"\[Errno (28|122)\] [^:\n\[]+(?::\s+'([^']*)')?")


class DiskFull(Exception):
    """The run stopped because a disk filled; its message is the one line to print."""


def disk_full_error(error: BaseException | None) -> tuple[int, str | None] | None:
    """(errno, path of the file being written or None) when `error` is, or wraps, a disk-full error; else None."""
    for error in exception_chain(error):
        if isinstance(error, OSError) and error.errno in _CODES:
            return error.errno, error.filename if isinstance(error.filename, str) else None
        found = _TEXT.search(str(error))
        if found:
            return int(found.group(1)), found.group(2)
    return None


def size_text(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def free_bytes(path: str) -> int | None:
    """Free bytes on the disk holding `path` (its nearest existing folder), or None when it cannot be told."""
    while path and not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return shutil.disk_usage(path or ".").free
    except OSError:
        return None


def _images(output: str, since: float) -> tuple[int, int, int]:
    """(count, total bytes, count written at or after `since`) of the images under a local output's images/."""
    count = size = recent = 0
    try:
        with os.scandir(os.path.join(output, layout.IMAGES_DIR)) as entries:
            for e in entries:
                if not e.name.startswith(".") and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    count += 1
                    size += st.st_size
                    recent += st.st_mtime >= since
    except OSError:
        pass
    return count, size, recent


def disk_full_line(found: tuple[int, str | None], output: str, to_generate: int | None, started_at: float) -> str:
    """The line for a disk-full error `found` (`disk_full_error`) in a run writing to `output` since `started_at`;
    `to_generate`: the images this run was to generate (the local progress files' total), None if not known."""
    code, path = found
    where = path or output
    free = free_bytes(where)
    free_text = f" ({size_text(free)} free)" if free is not None else ""
    line = f"{_CODES[code]} writing {where}{free_text}"
    under_output = layout.is_local_path(output) and os.path.abspath(where).startswith(os.path.abspath(output))
    if under_output:
        count, size, this_run = _images(output, started_at - 1.0)
        if count and to_generate is not None and to_generate > this_run:
            left = to_generate - this_run
            line += (f": about {size_text(left * size / count)} more are needed for the {left} image(s) still to "
                     f"generate ({size_text(size / count)} each)")
        elif count:
            line += f": each image takes about {size_text(size / count)}"
        line += f"; the {count} image(s) written are kept"
    return line + "; free space, then run the same command with --skip_existing to resume"
