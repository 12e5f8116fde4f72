"""Open an input file as a stream of bytes, decompressing it by its extension and checking that it is complete.

Beam's own decompression ends a stream silently where the compressed bytes run out, so a cut `.gz` file would be
read up to the cut (its last line cut too) as if it were whole. Here every compressed stream must reach its end
marker: a cut or corrupt file raises `InputReadError` after the complete data before the damage has been returned.
Concatenated streams (several gzip members, bzip2 streams, zstd frames) are read one after the other, as Beam does.
A file whose name says nothing but whose bytes start with a gzip, zstd or xz magic number (which no UTF-8 text can
start with), or with bzip2's whole stream signature, is decompressed too: what GCS serves for an object uploaded with
`gsutil cp -Z` (Content-Encoding gzip), which Beam reads as stored. Decompressed data is sniffed again, so a `.gz`
file uploaded with `-Z` (gzip inside gzip) reads as its text.
"""

from __future__ import annotations

import bz2
import logging
import lzma
import re
import zlib

logger = logging.getLogger(__name__)

# Compression by file-name suffix (lower case). Beam knows these except ".gzip", which it would read undecompressed.
COMPRESSION_BY_SUFFIX = {
    ".gz": "gzip", ".gzip": "gzip", ".bz2": "bzip2", ".zst": "zstd", ".zstd": "zstd", ".deflate": "deflate",
    ".xz": "lzma", ".lzma": "lzma",
}
# Magic numbers of compressed data; none can begin UTF-8 text (0x1f is a control character, 0xb5 after "(" and a
# leading 0xfd are not UTF-8), so a prompt file is never mistaken for one.
COMPRESSION_BY_MAGIC = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"\xfd7zXZ\x00": "lzma"}
# bzip2's "BZh" is text, so only its whole 10-byte signature counts: "BZh", the block size 1-9, then the first block's
# magic (the digits of pi, "1AY&SY") or, for an empty stream, the end-of-stream magic (those of sqrt(pi)).
BZIP2_SIGNATURE = re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P\x90)")
_MAGIC_BYTES = 10  # bytes read to sniff: the bzip2 signature, the longest
MAX_LAYERS = 3  # compressions inside each other read (gzip in gzip: a .gz file uploaded with gsutil cp -Z)
_IN_CHUNK = 256 * 1024  # compressed bytes read at a time
_OUT_CHUNK = 1024 * 1024  # most decompressed bytes produced at a time (a highly compressed file stays bounded)
# zstd: the largest window a frame may ask for (memory the decoder allocates); zstd's levels use at most 8 MiB, its
# --long mode 128 MiB. A frame asking for more is refused, naming this limit.
ZSTD_MAX_WINDOW = 2**27


class WithHead:
    """`raw` with bytes already read from it put back in front (the compression sniff, the byte-order mark)."""

    def __init__(self, head: bytes, raw):
        self._head = head
        self._raw = raw

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._raw.read(size)
        if size is None or size < 0:
            out, self._head = self._head + self._raw.read(), b""
            return out
        out, self._head = self._head[:size], self._head[size:]
        return out


class InputReadError(Exception):
    """An input file that cannot be read to its end: cut short, corrupt, or not in the format its name says."""


def compression_of(path: str) -> str | None:
    """The compression of `path` from its suffix (None: not compressed)."""
    lowered = path.lower()
    for suffix, kind in COMPRESSION_BY_SUFFIX.items():
        if lowered.endswith(suffix):
            return kind
    return None


def open_decompressed(raw, path: str) -> "InputStream":
    """A binary reader of the data in `raw` (the file at `path`, opened as stored): decompressed by the name's
    suffix, else by a magic number at its start, then again while the result starts with one (up to MAX_LAYERS in
    all); as it is otherwise. Nothing is read before the reader's first `read()`."""
    return InputStream(raw, path)


class InputStream:
    """The data of an input file with its layers of compression undone, found on the first `read()` (so a damaged
    layer raises InputReadError from `read`, after the complete data before the damage has been returned).

    `compressions`: the layers found, outermost first ([] for plain data; complete after the first read).
    `complete_lines`: line breaks in the data returned so far."""

    def __init__(self, raw, path: str):
        self._reader = raw
        self._path = path
        self._opened = False
        self.compressions: list[str] = []
        self.text_encoding: str | None = None  # UTF-16/32 told by a byte-order mark (None: read as UTF-8)
        self.complete_lines = 0

    def read(self, size: int = -1) -> bytes:
        if not self._opened:
            self._opened = True
            self._undo_layers()
            self._to_utf8()
        piece = self._reader.read(size)
        self.complete_lines += piece.count(b"\n")
        return piece

    def _to_utf8(self):
        """Text in UTF-16 or UTF-32, told by its byte-order mark, is read as UTF-8 (transforms/inputs/encodings.py)."""
        from .encodings import sniff_text_encoding

        self._reader, self.text_encoding = sniff_text_encoding(self._reader)
        if self.text_encoding:
            logger.info("input file %s is %s text (byte-order mark): reading it as such", self._path,
                        self.text_encoding)

    def _undo_layers(self):
        kind = compression_of(self._path)
        while len(self.compressions) < MAX_LAYERS:
            if kind is None:
                self._reader, kind = sniff_compression(self._reader)
                if kind is None:
                    return
                where = f"inside its {'+'.join(self.compressions)} data" if self.compressions else \
                    "under a name without its suffix"
                logger.info("input file %s holds %s data %s (an object uploaded with gsutil cp -Z?): decompressing "
                            "it", self._path, kind, where)
            self.compressions.append(kind)
            self._reader, kind = DecompressingReader(self._reader, kind), None


def sniff_compression(raw):
    """(`raw` with nothing lost, the compression its first bytes show or None)."""
    head = b""
    while len(head) < _MAGIC_BYTES and (piece := raw.read(_MAGIC_BYTES - len(head))):
        head += piece  # a network stream may return fewer bytes than asked
    kind = next((k for magic, k in COMPRESSION_BY_MAGIC.items() if head.startswith(magic)), None)
    if kind is None and BZIP2_SIGNATURE.match(head):
        kind = "bzip2"
    return WithHead(head, raw), kind


def _new_decompressor(kind: str):
    if kind == "gzip":
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if kind == "deflate":
        return zlib.decompressobj()
    if kind == "bzip2":
        return bz2.BZ2Decompressor()
    if kind == "lzma":
        return lzma.LZMADecompressor()
    raise ValueError(f"unknown compression {kind!r}")


class ZstdFrames:
    """Follows the frame structure of zstd bytes fed to it (RFC 8878: frame headers, block headers and sizes, content
    checksums, skippable frames), without decompressing: `complete` tells whether the bytes so far end exactly
    between frames. zstd's bounded stream reader stops silently at a cut frame; this is how a cut file is told."""

    def __init__(self):
        self._buf = b""     # header bytes being collected
        self._need = 4      # bytes wanted for the current step
        self._skip = 0      # body bytes to pass over
        self._step = "magic"
        self._checksum = False

    @property
    def complete(self) -> bool:
        return self._step == "magic" and not self._buf and not self._skip

    def feed(self, data: bytes) -> None:
        view, i = memoryview(data), 0
        while i < len(view):
            if self._skip:
                n = min(self._skip, len(view) - i)
                self._skip -= n
                i += n
                continue
            take = min(self._need - len(self._buf), len(view) - i)
            self._buf += bytes(view[i:i + take])
            i += take
            if len(self._buf) == self._need:
                self._advance()

    def _advance(self):
        buf, self._buf = self._buf, b""
        if self._step == "magic":
            magic = int.from_bytes(buf, "little")
            if magic == 0xFD2FB528:
                self._step, self._need = "descriptor", 1
            elif magic & 0xFFFFFFF0 == 0x184D2A50:
                self._step, self._need = "skippable", 4
            else:
                raise InputReadError(f"not valid zstd data: no frame starts with bytes {buf.hex()}")
        elif self._step == "skippable":
            self._step, self._need, self._skip = "magic", 4, int.from_bytes(buf, "little")
        elif self._step == "descriptor":
            d = buf[0]
            fcs_flag, single, self._checksum, did_flag = d >> 6, bool(d & 0x20), bool(d & 0x04), d & 0x03
            rest = (0 if single else 1) + (0, 1, 2, 4)[did_flag] + (1 if single else 0, 2, 4, 8)[fcs_flag]
            self._step, self._need = "block", 3
            self._skip = rest
        elif self._step == "block":
            header = int.from_bytes(buf, "little")
            last, kind, size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3:
                raise InputReadError("not valid zstd data: a reserved block type")
            self._skip = 1 if kind == 1 else size
            if last:
                self._step, self._need = ("magic", 4) if not self._checksum else ("checksum", 4)
        elif self._step == "checksum":
            self._step, self._need = "magic", 4


def _decompress_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [zlib.error, lzma.LZMAError, OSError, EOFError, ValueError]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - zstandard comes with Beam
        pass
    return tuple(errors)


class DecompressingReader:
    """A binary reader over the decompressed bytes of `raw` (a binary file object) compressed as `kind`.

    `read()` returns the next piece of data (at most ~1 MiB, never empty before the end), b"" at the end, and raises
    InputReadError when the compressed data is cut short or corrupt (everything before that has been returned)."""

    def __init__(self, raw, kind: str):
        self._raw = raw
        self._kind = kind
        self._pieces = self._decompressed()
        self._done = False
        self.complete_lines = 0  # line breaks in the data returned so far

    def read(self, size: int = -1) -> bytes:  # noqa: ARG002 - pieces are bounded already
        """The next piece of decompressed data (b"" at the end)."""
        if self._done:
            return b""
        try:
            piece = next(self._pieces)
        except StopIteration:
            self._done = True
            return b""
        self.complete_lines += piece.count(b"\n")
        return piece

    def _zstd_pieces(self):
        """zstd through its bounded stream reader (at most _OUT_CHUNK bytes per read, whatever the ratio: a 65 KB
        bomb cannot expand in one step), frames read one after the other, a window above ZSTD_MAX_WINDOW refused;
        a cut file is told by following the frame structure of the bytes read (ZstdFrames)."""
        import zstandard  # a Beam dependency

        frames, raw = ZstdFrames(), self._raw

        class Tee:
            @staticmethod
            def read(size=-1):
                data = raw.read(size)
                frames.feed(data)
                return data

        reader = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW).stream_reader(
            Tee(), read_size=_IN_CHUNK, read_across_frames=True)
        try:
            while out := reader.read(_OUT_CHUNK):
                yield out
            while Tee.read(_IN_CHUNK):  # what the reader left unread still has to be whole frames
                pass
        except zstandard.ZstdError as e:
            text = str(e).lower()
            window = (f" (a frame may ask for a window of at most {ZSTD_MAX_WINDOW >> 20} MiB)"
                      if "window" in text or "too much memory" in text else "")
            raise InputReadError(f"not valid zstd data: {e}{window}") from None
        if not frames.complete:
            raise InputReadError("the zstd data ends before its end marker: the file is cut short (an incomplete "
                                 "upload or copy?)")

    def _step(self, d, data: bytes) -> tuple[bytes, bytes, bool]:
        """Feed `data`: (output, the input still to feed, whether the decompressor may hold more output)."""
        if self._kind in ("gzip", "deflate"):
            out = d.decompress(data, _OUT_CHUNK)
            rest = d.unused_data if d.eof else d.unconsumed_tail
            return out, rest, len(out) == _OUT_CHUNK and not d.eof
        out = d.decompress(data, _OUT_CHUNK)  # bzip2, lzma
        return out, d.unused_data if d.eof else b"", not d.eof and not d.needs_input

    def _decompressed(self):
        if self._kind == "zstd":
            yield from self._zstd_pieces()
            return
        errors = _decompress_errors()
        d = None  # the current stream's decompressor (None between streams)
        data = b""  # compressed bytes not fed yet
        more_output = False
        while True:
            if not data and not more_output:
                data = self._raw.read(_IN_CHUNK)
                if not data:
                    if d is not None:
                        raise InputReadError(f"the {self._kind} data ends before its end marker: the file is cut "
                                             f"short (an incomplete upload or copy?)")
                    return
            if d is None:
                d = _new_decompressor(self._kind)
            try:
                out, data, more_output = self._step(d, data)
            except errors as e:
                raise InputReadError(f"not valid {self._kind} data: {e}") from None
            if out:
                yield out
            if d.eof:
                d, more_output = None, False
