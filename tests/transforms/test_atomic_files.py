"""Writes that readers see whole or not at all: a gs:// write cut part-way, by the writer or on the wire (the fault
proxy), leaves no object (Beam's GCS writer would otherwise finalise what it buffered when closed or
garbage-collected), and local files get the umask's mode."""

import gc
import os
import stat
import uuid

import pytest

from fault_proxy import FaultRule, in_front_of
from transforms.atomic_files import write_local_atomic, write_object_atomic

MIB = 1024 * 1024


class Cut(Exception):
    pass


def _cut_after(nbytes: int):
    def fill(out):
        out.write(b"x" * nbytes)
        raise Cut(f"failed after {nbytes} bytes")
    return fill


@pytest.fixture
def bucket(gcs_emulator):
    name = f"atomic-{uuid.uuid4().hex[:8]}"
    gcs_emulator.client().create_bucket(name)
    return name


@pytest.mark.parametrize("nbytes", [1000, 20 * MIB], ids=["buffered", "past-a-chunk"])
def test_a_cut_gcs_write_leaves_no_object(gcs_emulator, bucket, nbytes):
    uri = f"gs://{bucket}/shards/shard-00000.tar"
    with pytest.raises(Cut):
        write_object_atomic(uri, _cut_after(nbytes), "application/x-tar")
    gc.collect()  # a writer's finaliser would complete the upload here
    assert not gcs_emulator.client().bucket(bucket).blob("shards/shard-00000.tar").exists()
    write_object_atomic(uri, lambda out: out.write(b"whole"), "application/x-tar")
    assert gcs_emulator.client().bucket(bucket).blob("shards/shard-00000.tar").download_as_bytes() == b"whole"


def test_the_plain_writer_would_publish_a_torn_object(gcs_emulator, bucket):
    """What the atomic write guards against (the shard writer before it): Beam's GCS writer left unclosed after a
    failure is garbage-collected, and its finaliser completes the upload with the bytes written so far."""
    from apache_beam.io.filesystem import CompressionTypes
    from apache_beam.io.filesystems import FileSystems

    out = FileSystems.create(f"gs://{bucket}/torn.tar", compression_type=CompressionTypes.UNCOMPRESSED)
    with pytest.raises(Cut):
        _cut_after(1000)(out)
    del out
    gc.collect()
    assert gcs_emulator.client().bucket(bucket).blob("torn.tar").download_as_bytes() == b"x" * 1000


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_local_files_follow_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        path = tmp_path / "out" / "image.png"
        write_local_atomic(str(path), lambda f: f.write(b"png"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == mode and path.read_bytes() == b"png"
    assert not [n for n in os.listdir(path.parent) if n.endswith(".tmp")]


# ------------------------------------------------------------------------------ a write cut on the wire
CHUNK = 256 * 1024  # the smallest resumable chunk GCS takes: a 1.2 MiB shard is four chunks and a final one


@pytest.fixture
def small_chunks(monkeypatch):
    """Beam's GCS writer with 256 KiB resumable chunks instead of 16 MiB: the same upload protocol (one resumable
    session, chunk after chunk, finalised by the last one), at a size that costs milliseconds."""
    from apache_beam.io.gcp import gcsio

    class SmallChunkWriter(gcsio.BeamBlobWriter):
        def __init__(self, blob, content_type, **kw):
            super().__init__(blob, content_type, chunk_size=CHUNK, **kw)

    monkeypatch.setattr(gcsio, "BeamBlobWriter", SmallChunkWriter)


@pytest.fixture
def wire(gcs_emulator, monkeypatch):
    """The fault proxy in front of the emulator, and Beam's GCS retry policy (same predicate) with a 2 s budget, so
    that an upload cut on every attempt is given up in seconds."""
    from apache_beam.io.gcp import gcsio_retry

    fast = gcsio_retry.DEFAULT_RETRY_WITH_THROTTLING_COUNTER.with_delay(initial=0.02, maximum=0.2, multiplier=2)
    monkeypatch.setattr(gcsio_retry, "DEFAULT_RETRY_WITH_THROTTLING_COUNTER", fast.with_timeout(2.0))
    with in_front_of(gcs_emulator, monkeypatch, seed=5) as proxy:
        yield proxy


# (object size, the writer, upload requests let through before the cut, body bytes after which each later one is
# cut, upload requests that reach the emulator at least)
WIRE_CUTS = {
    # a shard of five chunks: the session opens, two chunks arrive, every later request dies 100 KB into its body
    "mid-upload": (4 * CHUNK + 12345, "shard", 2, 100_000, 3),
    # an image-sized object, sent whole by close(): the session-opening request dies (a finaliser that re-ran
    # close() once the network is back would open a new session and publish the object after its write failed)
    "in-close": (3000, "bytes", 0, None, 0),
}


@pytest.mark.parametrize("case", sorted(WIRE_CUTS))
def test_an_upload_cut_on_the_wire_leaves_no_object(gcs_emulator, bucket, small_chunks, wire, tmp_path, case):
    """Every upload request for one object loses its connection part-way (Beam's GCS writer, retried until its
    budget runs out): the write fails with the network error, and neither then nor once the network is back and
    the failed writer has been garbage-collected is there an object under its name; one written beside it is whole."""
    from apache_beam.io.filesystems import FileSystems

    from transforms.sinks.writes import write_bytes_atomic
    from transforms.shards import write_file_atomic

    size, writer, skip_first, cut_after, arrived = WIRE_CUTS[case]
    data = os.urandom(size)
    (tmp_path / "object").write_bytes(data)

    def write(uri):
        if writer == "shard":
            write_file_atomic(uri, str(tmp_path / "object"), "application/x-tar")
        else:
            write_bytes_atomic(uri, data, "application/x-tar")

    cut, whole = f"gs://{bucket}/shards/shard-00001.tar", f"gs://{bucket}/shards/shard-00002.tar"
    wire.add_rule(FaultRule(fraction=1.0, kinds={"upload"}, name=r"/shards/shard-00001\.tar$", actions=("cut",),
                            cut_after_bytes=cut_after, skip_first=skip_first))
    with pytest.raises(Exception) as failed:
        write(cut)
    error = f"{type(failed.value).__name__}: {failed.value}"
    del failed  # its traceback holds the failed writer: let garbage collection reach it
    assert "Connection" in error and "reset" in error, error
    blob = gcs_emulator.client().bucket(bucket).blob("shards/shard-00001.tar")  # straight to the emulator
    assert not blob.exists()
    stats = wire.stats()
    assert stats["injected"]["upload/cut"] >= 2 and stats["forwarded"].get("upload", 0) >= arrived, stats
    write(whole)  # the rule is limited to the one name: this upload goes through untouched
    wire.clear_rules()  # the network is back: a writer still holding the upload could finalise it now
    gc.collect()
    assert not blob.exists()
    assert not FileSystems.exists(cut)
    assert [m.path for m in FileSystems.match([f"gs://{bucket}/shards/*"])[0].metadata_list] == [whole]
    assert gcs_emulator.read_bytes(whole) == data
