"""A live progress line (done / total, images per second, ETA) for local runs.

Beam's local runners only report metrics when the job is over, so workers (threads or processes on this machine)
report through small files in a local folder instead: `total` (images to generate, written once the plan is known)
and one `done-<pid>-<n>` count file per writer. `ProgressReporter` polls that folder from the launching process and
prints the line. Only used with local runners (the folder must be shared by every worker); on Dataflow, use the
job's metrics page.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import apache_beam as beam


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class ProgressWriter:
    """Counts images done by one DoFn instance; rewrites its count file at most every `interval` seconds."""

    def __init__(self, folder: str, interval: float = 0.5):
        self._path = os.path.join(folder, f"done-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self._count = 0
        self._interval = interval
        self._last = 0.0

    def add(self, n: int) -> None:
        self._count += n
        now = time.monotonic()
        if now - self._last >= self._interval:
            self.flush()
            self._last = now

    def flush(self) -> None:
        try:
            _write_atomic(self._path, str(self._count))
        except OSError:
            pass  # progress is best effort: never fail a bundle over it


class _WriteTotalFn(beam.DoFn):
    def __init__(self, folder: str):
        self._folder = folder

    def process(self, total):
        try:
            _write_atomic(os.path.join(self._folder, "total"), str(int(total)))
        except OSError:
            pass
        yield total


class ReportTotal(beam.PTransform):
    """PCollection of image tasks -> their count, also written as the progress total."""

    def __init__(self, folder: str):
        super().__init__()
        self._folder = folder

    def expand(self, tasks):
        """Returns the count (a singleton PCollection), written to the folder on the way."""
        return (tasks
                | "CountTasks" >> beam.combiners.Count.Globally()
                | "WriteTotal" >> beam.ParDo(_WriteTotalFn(self._folder)))


def read_progress(folder: str) -> tuple[int, int | None]:
    done, total = 0, None
    try:
        names = os.listdir(folder)
    except OSError:
        return 0, None
    for name in names:
        if name.endswith(".tmp"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                value = int(f.read().strip() or 0)
        except (OSError, ValueError):
            continue
        if name == "total":
            total = value
        elif name.startswith("done-"):
            done += value
    return done, total


def format_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}"


def progress_line(done: int, total: int | None, rate: float, elapsed: float) -> str:
    total_text = "?" if total is None else str(total)
    line = f"[progress] {done}/{total_text} images, {rate:.2f} images/s"
    if total is not None and rate > 0:
        line += f", ETA {format_eta(max(total - done, 0) / rate)}"
    return line + f", elapsed {format_eta(elapsed)}"


class ProgressReporter:
    """Polls a progress folder in a background thread and prints the progress line to `stream`.

    On a terminal the line is rewritten in place; otherwise a new line is printed only when the count changes
    (at most every `log_interval` seconds), so logs stay readable.
    """

    def __init__(self, folder: str, stream=None, interval: float = 1.0, log_interval: float = 10.0):
        self._folder = folder
        self._stream = stream or sys.stderr
        self._interval = interval
        self._log_interval = log_interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._started = time.monotonic()
        self._first: tuple[float, int] | None = None  # (time, done) when images were first seen done
        self._last_printed: tuple | None = None
        self._last_print_time = 0.0

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self._print(final=True)
        return False

    def _print(self, final: bool = False) -> None:
        done, total = read_progress(self._folder)
        now = time.monotonic()
        if done and self._first is None:
            self._first = (now, done)
        # The rate is measured from the first finished batch on, so model loading and compilation do not count;
        # until a second batch finishes it is the plain average over the elapsed time.
        if self._first is not None and done > self._first[1] and now > self._first[0]:
            rate = (done - self._first[1]) / (now - self._first[0])
        else:
            rate = done / max(now - self._started, 1e-9)
        state = (done, total)
        if not final and state == self._last_printed and not self._tty:
            return
        if not final and not self._tty and now - self._last_print_time < self._log_interval \
                and self._last_printed is not None:
            return
        line = progress_line(done, total, rate, now - self._started)
        try:
            if self._tty:
                self._stream.write("\r" + line + ("\n" if final else ""))
            else:
                self._stream.write(line + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            return
        self._last_printed = state
        self._last_print_time = now

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._print()
