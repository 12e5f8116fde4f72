"""Every read of an input or a reference is bounded: only regular files are opened (a FIFO, device or folder is an
error row at once, never a blocked open), and a read that stalls is abandoned after --read_timeout_s, tried again
on a fresh open while the limit lasts (a GCS response that never comes, through the fault proxy), and otherwise
becomes that record's or that file's error row."""

import os
import threading
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.testing.util import assert_that, equal_to

from fault_proxy import FaultRule, in_front_of
from reference_files import png
from transforms import bounded_reads, layout
from transforms.bounded_reads import NotARegularFile, ReadTimeout, TimedReader, open_timed
from transforms.inputs.readers import ReadRequests
from transforms.inputs.validation import RequestDefaults
from transforms.references import ReferenceError, ReferenceLimits, read_reference

D = RequestDefaults(height=32, width=32)


def _within(seconds: float, fn):
    """fn() on a thread, which must finish within `seconds` (old code blocked forever on a FIFO: fail, not hang)."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds} s"
    return out, time.monotonic() - started


@pytest.fixture
def fifo(tmp_path):
    """A FIFO nobody writes to: opening it for reading blocks (without O_NONBLOCK), reading it never ends. Opened
    for writing at the end, so that a reader an old version left blocked on it is released."""
    path = str(tmp_path / "pipe.png")
    os.mkfifo(path)
    yield path
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    except OSError:
        pass


def test_a_fifo_reference_is_an_error_at_once_not_a_blocked_read(fifo, tmp_path):
    out, took = _within(20, lambda: read_reference(fifo, ReferenceLimits(read_timeout_s=5)))
    error = out.get("error")
    assert isinstance(error, ReferenceError) and "is a FIFO (named pipe), not a regular file" in str(error), out
    assert not error.transient and took < 2
    folder = _within(20, lambda: read_reference(str(tmp_path), ReferenceLimits()))[0]["error"]
    assert "is a folder, not a file" in str(folder)
    with pytest.raises(NotARegularFile, match="a character device"):
        open_timed("/dev/null")


class _Stalling:
    """A file whose first `stalls` reads never return (until released), then reads `data`: a stalled network read."""

    def __init__(self, data: bytes, release: threading.Event, stalls: list):
        self._data, self._release, self._stalls, self._at = data, release, stalls, 0

    def read(self, size=-1):
        if self._stalls and self._stalls[0] > 0:
            self._stalls[0] -= 1
            self._release.wait(30)
            return b""
        piece = self._data[self._at:self._at + (size if size >= 0 else len(self._data))]
        self._at += len(piece)
        return piece

    def seek(self, offset, whence=0):
        self._at = offset
        return offset

    def close(self):
        pass


def test_a_stalled_read_is_tried_again_on_a_fresh_open_within_the_limit():
    release, stalls, opened = threading.Event(), [1], []

    def opener():
        opened.append(1)
        return _Stalling(b"0123456789", release, stalls)

    try:
        with TimedReader(opener, "test file", timeout_s=1.5) as f:
            assert f.read(4) == b"0123"  # the first attempt stalls for 0.5 s, the second reads
            assert f.stalls == 1 and len(opened) == 2
            stalls[0] = 1
            assert f.read(100) == b"456789"  # at the same offset, on another fresh open
            assert f.stalls == 2 and len(opened) == 3
    finally:
        release.set()


def test_a_read_that_never_returns_times_out():
    release = threading.Event()
    try:
        f = TimedReader(lambda: _Stalling(b"x", release, [99]), "test file", timeout_s=1)
        started = time.monotonic()
        with pytest.raises(ReadTimeout, match=r"test file: a read of it did not return within --read_timeout_s=1 s"):
            f.read(1)
        assert time.monotonic() - started < 3
    finally:
        release.set()


def test_an_input_that_is_a_fifo_is_one_error_row_and_the_other_files_are_read(fifo, tmp_path):
    os.rename(fifo, str(tmp_path / "pipe.jsonl"))
    (tmp_path / "ok.jsonl").write_text('{"id": "a", "prompt": "p"}\n')
    found = {}

    def job():
        with beam.Pipeline(options=PipelineOptions(["--runner=FnApiRunner"])) as p:
            read = p | beam.Create([str(tmp_path / "*.jsonl")]) | ReadRequests("auto", D, read_timeout_s=5)
            assert_that(read["requests"] | beam.Map(lambda r: r.id), equal_to(["a"]), label="requests")
            assert_that(read["invalid"] | beam.Map(lambda r: (os.path.basename(r["source"]), r["kind"],
                                                               r["reason"])),
                        equal_to([("pipe.jsonl", layout.UNREADABLE_INPUT, "input file cannot be opened: it is a FIFO "
                                   "(named pipe), not a regular file (only regular files and gs:// objects are "
                                   "read)")]), label="invalid")
        found["done"] = True

    out, _ = _within(120, job)
    assert "error" not in out, out
    os.rename(str(tmp_path / "pipe.jsonl"), fifo)


def test_the_launch_refuses_an_input_that_is_a_fifo(fifo):
    from pipeline.errors import UsageError
    from pipeline.probes import match_inputs

    error = _within(20, lambda: match_inputs((fifo,)))[0].get("error")
    assert isinstance(error, UsageError) and "is not a regular file (a FIFO (named pipe)); give a file" in str(error)


# --------------------------------------------------------------------------------------------- gs:// stalls
def test_a_stalled_gcs_reference_read_is_retried_within_the_limit(gcs_emulator, gcs_bucket, monkeypatch):
    """The proxy holds the first response for the object 8 s: the job abandons it after a third of the 3 s limit and
    reads the object on a fresh request; every response held: the reference is an error, within the limit."""
    data = png(64, 64, seed=3)
    uri = f"gs://{gcs_bucket}/refs/slow.png"
    gcs_emulator.upload_bytes(uri, data)
    limits = ReferenceLimits(read_timeout_s=3)
    with in_front_of(gcs_emulator, monkeypatch) as proxy:
        proxy.add_rule(FaultRule(fraction=1.0, kinds={"read"}, name="refs/slow.png", actions=("delay",),
                                 delay_s=8, limit=1))
        out, took = _within(20, lambda: read_reference(uri, limits))
        assert "error" not in out, out
        assert out["value"].size == (64, 64) and took < 3, took
        assert proxy.stats()["injected"] == {"read/delay": 1}

        proxy.set_rules([FaultRule(fraction=1.0, kinds={"read"}, name="refs/slow.png", actions=("delay",),
                                   delay_s=8)])
        out, took = _within(20, lambda: read_reference(uri, limits))
        error = out.get("error")
        assert isinstance(error, ReferenceError) and "did not return within --read_timeout_s=3 s" in str(error), out
        assert took < 5, took
