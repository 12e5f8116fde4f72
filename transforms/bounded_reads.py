"""Reads of inputs and references that cannot hang the job: only regular files, and every call within a time limit.

A local path is opened only when it is a regular file: `os.open` with O_NONBLOCK (so a FIFO put there does not
block the open itself), then `fstat` on the open descriptor (no race with a file swapped in between); a FIFO, a
device, a socket or a folder raises `NotARegularFile`. gs:// objects always are files.

Every open, read and seek then runs on a helper thread and is waited for at most the limit (`--read_timeout_s`): a
call that does not return in time raises `ReadTimeout`, and the caller turns it into that record's or that input
file's error row. A call that stalls is tried again on a fresh open of the same file at the same offset while the
limit lasts (each attempt gets a third of it, `STALL_ATTEMPTS`): a GCS response that never comes is abandoned and
asked again, as the fault proxy's delays show. Reads are cut into pieces of at most `PIECE_BYTES`, so the limit
bounds a stall, not the time a large file takes. A thread stuck in a call that never returns is left behind (a
daemon: it never holds the process open); at most `READ_THREADS` exist per process, and once they are all stuck
further calls wait for one and time out.
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import queue
import stat
import threading
import time
from typing import Any, Callable

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from . import layout
from .defaults import DEFAULT_READ_TIMEOUT_S

READ_THREADS = 32  # helper threads of one process that may be inside a read at once (stuck ones included)
STALL_ATTEMPTS = 3  # attempts one call gets within its limit (a stalled one is abandoned and tried on a fresh open)
PIECE_BYTES = 8 * 2**20  # most bytes one timed read asks for


class ReadTimeout(TimeoutError):
    """A read of an input or reference that did not return within its limit (`--read_timeout_s`)."""

    def __init__(self, what: str, timeout_s: float):
        super().__init__(f"{what} did not return within --read_timeout_s={timeout_s:g} s (a stalled read: a "
                         f"network file system or object store that does not answer)")
        self.timeout_s = timeout_s


class NotARegularFile(OSError):
    """A local path that is not a regular file (a FIFO, device, socket or folder): never opened for reading."""

    def __init__(self, path: str, kind: str):
        super().__init__(f"{layout.writable_text(path)!r} is {kind}, not a regular file")
        self.path = path
        self.kind = kind


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a st_mode is, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")


def open_local_regular(path: str):
    """The local regular file `path`, opened for binary reading without ever blocking on the open (O_NONBLOCK) and
    checked on the open descriptor (fstat), so nothing swapped in after a check is read; NotARegularFile else."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(path, file_kind(mode))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# --------------------------------------------------------------------------------------------- helper threads
class _ReadThreads:
    """Daemon threads that run read calls, started as needed up to `limit` (a stuck one is never replaced)."""

    def __init__(self, limit: int):
        self._limit = limit
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._idle == 0 and self._threads < self._limit:
                self._threads += 1
                threading.Thread(target=self._work, name=f"flux2-read-{self._threads}", daemon=True).start()
            else:
                self._idle -= 1 if self._idle else 0
        self._jobs.put((fn, future))
        return future

    def _work(self):
        while True:
            fn, future = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which raises it
                    future.set_exception(e)
            with self._lock:
                self._idle += 1


_threads = _ReadThreads(READ_THREADS)


def call_within(fn: Callable[[], Any], timeout_s: float | None, what: str, limit_s: float | None = None):
    """`fn()` run on a helper thread and waited for at most `timeout_s` (None: no limit): its result, its exception,
    or ReadTimeout naming `what` and `limit_s` (the option's value; default `timeout_s`). A call that times out
    is abandoned: it may still finish on its thread, and its result is dropped."""
    if timeout_s is None:
        return fn()
    future = _threads.submit(fn)
    try:
        return future.result(timeout=max(0.0, timeout_s))
    except concurrent.futures.TimeoutError:
        future.cancel()  # not started yet (every thread stuck): it never will be
        raise ReadTimeout(what, timeout_s if limit_s is None else limit_s) from None


# --------------------------------------------------------------------------------------------- timed file
def open_raw(path: str):
    """`path` opened for binary reading as stored (no decompression): a local regular file (`open_local_regular`),
    or a gs:// (any FileSystems) object."""
    if layout.is_local_path(path):
        return open_local_regular(path)
    return FileSystems.open(path, mime_type="application/octet-stream",
                            compression_type=CompressionTypes.UNCOMPRESSED)


class TimedReader(io.RawIOBase):
    """A file opened with `opener()` whose every call (open, read, seek) returns within `timeout_s` or raises
    ReadTimeout; a call that stalls is tried again, within the same limit, on a fresh `opener()` at the same
    offset (STALL_ATTEMPTS attempts). `deadline` (time.monotonic()) caps every call further: the whole read of a
    reference ends by then. `timeout_s` None: no limit (calls run on the caller's thread)."""

    def __init__(self, opener: Callable[[], Any], what: str, timeout_s: float | None = DEFAULT_READ_TIMEOUT_S,
                 deadline: float | None = None):
        super().__init__()
        self._opener = opener
        self._what = what
        self._timeout_s = timeout_s
        self._deadline = deadline
        self._position = 0
        self._raw = None
        self.stalls = 0  # attempts abandoned and tried again (for tests and logs)
        self._raw = self._call(opener, "opening it", reopen=False)

    # ------------------------------------------------------------------ io.RawIOBase
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._position = self._call(lambda raw: raw.seek(offset, whence), "seeking in it")
        return self._position

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        out = bytearray()
        while len(out) < size:
            want = min(size - len(out), PIECE_BYTES)
            piece = self._call(lambda raw, want=want: raw.read(want), "a read of it")
            if not piece:
                break
            self._position += len(piece)
            out += piece
            if len(piece) < want:  # a short read: return what came (the next call asks again)
                break
        return bytes(out)

    def readall(self) -> bytes:
        chunks = []
        while piece := self.read(PIECE_BYTES):
            chunks.append(piece)
        return b"".join(chunks)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        raw, self._raw = self._raw, None
        if raw is not None:
            try:
                call_within(raw.close, self._limit(), f"{self._what}: closing it")
            except Exception:  # noqa: BLE001 - nothing read depends on it; a stuck close is left on its thread
                pass
        super().close()

    # ------------------------------------------------------------------ the limit
    def _limit(self) -> float | None:
        if self._timeout_s is None:
            return None
        if self._deadline is None:
            return self._timeout_s
        return min(self._timeout_s, max(0.0, self._deadline - time.monotonic()))

    def _call(self, op, doing: str, *, reopen: bool = True):
        """`op(raw)` (or the opener, for `reopen=False`) within the limit; a stalled attempt is abandoned and the
        call tried again on a fresh open at the current offset."""
        limit = self._limit()
        what = f"{self._what}: {doing}"
        if limit is None:
            return self._opener() if not reopen else op(self._raw)
        end = time.monotonic() + limit
        for attempt in range(STALL_ATTEMPTS):
            left = end - time.monotonic()
            if left <= 0:
                break
            share = left if attempt == STALL_ATTEMPTS - 1 else min(left, limit / STALL_ATTEMPTS)
            try:
                if not reopen:
                    return call_within(self._opener, share, what, self._timeout_s)
                if self._raw is None:  # the last attempt's file was abandoned: open it again where we were
                    self._raw = call_within(self._reopen_at_position, share, f"{what} (opening it again)",
                                            self._timeout_s)
                    left = end - time.monotonic()
                    share = left if attempt == STALL_ATTEMPTS - 1 else min(left, limit / STALL_ATTEMPTS)
                return call_within(lambda raw=self._raw: op(raw), share, what, self._timeout_s)
            except ReadTimeout:
                self.stalls += 1
                self._raw = None  # left to its stuck thread; the next attempt opens the file again
        raise ReadTimeout(what, self._timeout_s)

    def _reopen_at_position(self):
        raw = self._opener()
        if self._position:
            raw.seek(self._position)
        return raw


def open_timed(path: str, timeout_s: float | None = DEFAULT_READ_TIMEOUT_S, deadline: float | None = None,
               what: str | None = None) -> TimedReader:
    """`path` (local or gs://) opened for binary reading as stored, every call within `timeout_s` (see
    TimedReader); a local path only if it is a regular file (NotARegularFile else)."""
    return TimedReader(lambda: open_raw(path), what or layout.writable_text(path), timeout_s, deadline)
