"""Writes that readers see whole or not at all: a gs:// write cut part-way leaves no object (Beam's GCS writer would
otherwise finalise what it buffered when closed or garbage-collected), and local files get the umask's mode."""

import gc
import os
import stat
import uuid

import pytest

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
