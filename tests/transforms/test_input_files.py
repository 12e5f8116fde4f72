"""Compressed inputs: every supported compression read whole (concatenated streams too); a cut or corrupt file
raises after returning the complete data before the damage."""

import bz2
import gzip
import io
import lzma
import zlib

import pytest
import zstandard

from transforms.inputs.files import DecompressingReader, InputReadError, compression_of, open_decompressed

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


class _Trickle(io.BytesIO):
    """A stream that returns at most 3 bytes a read (as a network stream may)."""

    def read(self, size=-1):
        return super().read(3 if size is None or size < 0 else min(size, 3))


@pytest.mark.parametrize("kind", ["gzip", "zstd", "lzma", "bzip2"])
def test_compressed_data_under_a_plain_name_is_sniffed(kind):
    """What GCS serves for `gsutil cp -Z prompts.jsonl`: gzip bytes under a name without .gz (and zstd/xz/bzip2)."""
    packed = COMPRESS[kind](DATA)
    for stream in (io.BytesIO(packed), _Trickle(packed)):
        reader = open_decompressed(stream, "gs://b/in/prompts.jsonl")
        assert read_all(reader) == DATA and reader.compressions == [kind]
    cut = open_decompressed(io.BytesIO(packed[:len(packed) // 2]), "prompts.jsonl")
    with pytest.raises(InputReadError, match="ends before its end marker"):
        read_all(cut)


@pytest.mark.parametrize("data", [DATA, b"", b"\x1f", b"(", "(\u00e9t\u00e9) un prompt\n".encode(), b"BZh9 is text\n",
                                  b"BZh91AY&S", b"BZh01AY&SY prompt\n", b"\xef\xbb\xbfwith a BOM\n"])
def test_plain_data_is_returned_unchanged_whatever_its_length(data):
    """Text is not sniffed (bzip2 only by its whole 10-byte signature, as 'BZh' is text); the bytes read to sniff
    are not lost."""
    for stream in (io.BytesIO(data), _Trickle(data)):
        reader = open_decompressed(stream, "prompts.txt")
        assert read_all(reader) == data and reader.compressions == []


def test_the_suffix_decides_before_the_bytes():
    packed = gzip.compress(DATA)
    reader = open_decompressed(io.BytesIO(packed), "p.jsonl.gz")
    assert read_all(reader) == DATA and reader.compressions == ["gzip"]
    reader = open_decompressed(io.BytesIO(b"plain\n"), "p.jsonl.gz")
    with pytest.raises(InputReadError, match="not valid gzip data"):
        read_all(reader)


def test_an_empty_bzip2_stream_is_sniffed_by_its_end_of_stream_signature():
    reader = open_decompressed(io.BytesIO(bz2.compress(b"")), "prompts.txt")
    assert read_all(reader) == b"" and reader.compressions == ["bzip2"]


@pytest.mark.parametrize("name", ["gs://b/in/prompts.jsonl.gz", "gs://b/in/prompts.jsonl"])
@pytest.mark.parametrize("inner", ["gzip", "zstd", "bzip2"])
def test_compressed_data_inside_compressed_data_is_read_through(name, inner):
    """`gsutil cp -Z prompts.jsonl.gz` stores gzip(gzip(text)), and GCS serves it as stored: both layers are read,
    whether the name says gzip or not; a cut inner stream raises after the complete lines, as a cut outer one."""
    packed = gzip.compress(COMPRESS[inner](DATA))
    for stream in (io.BytesIO(packed), _Trickle(packed)):
        reader = open_decompressed(stream, name)
        assert read_all(reader) == DATA and reader.compressions == ["gzip", inner]
    inner_cut = gzip.compress(COMPRESS[inner](DATA)[:-20])
    reader = open_decompressed(io.BytesIO(inner_cut), name)
    got = b""
    with pytest.raises(InputReadError, match=f"the {inner} data ends before its end marker"):
        while piece := reader.read():
            got += piece
    assert DATA.startswith(got) and reader.complete_lines == got.count(b"\n")


def test_layers_are_read_up_to_a_bound():
    """Compression inside compression is undone at most MAX_LAYERS times; deeper bytes come back as they are."""
    from transforms.inputs.files import MAX_LAYERS

    packed = DATA
    for _ in range(MAX_LAYERS + 1):
        packed = gzip.compress(packed)
    reader = open_decompressed(io.BytesIO(packed), "p.jsonl")
    assert gzip.decompress(read_all(reader)) == DATA and reader.compressions == ["gzip"] * MAX_LAYERS


# ---------------------------------------------------------------------------------------------- zstd bombs

BOMB_SCRIPT = r'''
import io, json, sys, zstandard
from transforms.inputs.files import open_decompressed
from transforms.inputs.lines import decoded_lines
line = b"\0" * ((64 << 20) - 1) + b"\n"
stream = zstandard.ZstdCompressor(level=3).compressobj()  # one frame of 2 GiB in 32 lines
bomb = b"".join(stream.compress(line) for _ in range(32)) + stream.flush()
bomb += zstandard.ZstdCompressor().compress(b'{"prompt": "after the bomb"}\n')
rows = [(n, text, err) for n, text, err in decoded_lines(open_decompressed(io.BytesIO(bomb), "p.jsonl.zst"), "p")]
print(json.dumps([len(bomb), len(rows), sum(e is not None for _, _, e in rows), rows[-1][1],
                  int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1])]))
'''


def test_a_zstd_bomb_is_one_error_row_within_bounded_memory():
    """One zstd frame of ~70 KB that expands to 2 GiB in 32 lines: one 'line is too long' error row each, the record
    after them read, and the reader's peak RSS stays far below the expansion (each read returns at most 1 MiB,
    where one decompress call used to return the whole frame). Peak RSS is VmHWM, which exec resets (ru_maxrss
    would count the forking test process)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", BOMB_SCRIPT], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    size, rows, errors, last, rss_kib = json.loads(out.stdout.strip().splitlines()[-1])
    assert size < 200_000 and rows == 33 and errors == 32 and last == '{"prompt": "after the bomb"}'
    print(f"zstd bomb: {size / 1e3:.0f} KB -> 2 GiB; peak RSS {rss_kib / 1024:.0f} MiB")
    assert rss_kib < 400 * 1024


def test_a_zstd_window_above_the_limit_is_refused_naming_it():
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=28, enable_ldm=True)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()  # size unknown: the window stays
    packed = stream.compress(DATA) + stream.flush()
    with pytest.raises(InputReadError, match="window"):
        read_all(DecompressingReader(io.BytesIO(packed), "zstd"))


def test_zstd_cut_between_blocks_or_frames_and_skippable_frames():
    one = zstandard.ZstdCompressor(write_checksum=True).compress(DATA)
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"12345"
    assert read_all(DecompressingReader(io.BytesIO(skippable + one + one), "zstd")) == DATA * 2
    for cut in (4, 6, len(one) - 4, len(one) - 1, len(one) + 3):
        with pytest.raises(InputReadError, match="cut short"):
            read_all(DecompressingReader(io.BytesIO((one + one)[:cut]), "zstd"))
