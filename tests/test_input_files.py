"""Compressed inputs: every supported compression read whole (concatenated streams too); a cut or corrupt file
raises after returning the complete data before the damage."""

import bz2
import gzip
import io
import lzma
import zlib

import pytest
import zstandard

from transforms.input_files import DecompressingReader, InputReadError, compression_of

DATA = b"".join(b'{"id": "r%d", "prompt": "prompt number %d"}\n' % (i, i) for i in range(4000))
COMPRESS = {"gzip": gzip.compress, "bzip2": bz2.compress, "lzma": lzma.compress, "deflate": zlib.compress,
            "zstd": lambda d: zstandard.ZstdCompressor().compress(d)}


def read_all(reader):
    out = b""
    while piece := reader.read():
        out += piece
    return out


@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_whole_and_concatenated_streams(kind):
    packed = COMPRESS[kind](DATA)
    assert read_all(DecompressingReader(io.BytesIO(packed), kind)) == DATA
    if kind != "deflate":  # zlib streams are not concatenated in practice
        assert read_all(DecompressingReader(io.BytesIO(packed + packed), kind)) == DATA + DATA


@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_cut_file_raises_after_the_complete_data(kind):
    packed = COMPRESS[kind](DATA)
    for cut in (len(packed) // 2, len(packed) - 4):
        reader = DecompressingReader(io.BytesIO(packed[:cut]), kind)
        got = b""
        with pytest.raises(InputReadError, match="ends before its end marker"):
            while piece := reader.read():
                got += piece
        assert DATA.startswith(got) and reader.complete_lines == got.count(b"\n")


def test_not_compressed_data_and_empty_file():
    with pytest.raises(InputReadError, match="not valid gzip data"):
        read_all(DecompressingReader(io.BytesIO(b"plain text\n"), "gzip"))
    assert read_all(DecompressingReader(io.BytesIO(b""), "gzip")) == b""


def test_compression_from_suffix():
    assert [compression_of(p) for p in ("a.jsonl.gz", "b.CSV.GZIP", "c.txt.bz2", "d.zst", "e.xz", "f.jsonl")] == \
        ["gzip", "gzip", "bzip2", "zstd", "lzma", None]
