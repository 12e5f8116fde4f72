"""Byte lines of an input file -> decoded text lines, each bounded in size, or the error row of a bad line.

A line longer than MAX_LINE_BYTES is one error row; it is read in bounded chunks and never held whole in memory.
A line that is not UTF-8 is one error row naming the byte and the encodings read (UTF-16/32 with a byte-order
mark are re-encoded before: transforms/inputs/encodings.py). Shared by the JSONL, text, CSV and TSV readers.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from .. import layout
from .records import RawRecord

MAX_LINE_BYTES = 16 * 1024 * 1024
_READ_CHUNK = 1024 * 1024


# What a line that is not UTF-8 is told to do: which encodings are read.
ENCODING_HINT = ("inputs are read as UTF-8, or as UTF-16/UTF-32 when the file starts with its byte-order mark: save "
                 "the file as UTF-8 (in Excel: CSV UTF-8)")


def decode_error(source: str, line: int, raw: bytes, err: UnicodeDecodeError) -> RawRecord:
    """The error row of a line that is not UTF-8, saying which encodings are read."""
    start = err.start
    looks = " (its NUL bytes look like UTF-16 without a byte-order mark)" if b"\x00" in raw else ""
    reason = f"line is not valid UTF-8: byte {raw[start:start + 1]!r} at position {start}{looks}; {ENCODING_HINT}"
    return RawRecord(source, line, error=layout.error_row(source=source, line=line, reason=reason, record=raw,
                                                          field="encoding", value=raw[max(0, start - 20):start + 20]))


_PREFIX_BYTES = 200  # what an error row keeps of a line that is too long


def _bounded_lines(stream, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[bytes | None, bytes, int]]:
    """(line with its line break, b"", 0) per line of `stream`; (None, first bytes, length) for a line of more than
    `limit` bytes (line break not counted), which is skipped in bounded chunks, never held whole in memory.

    `stream` is a binary file object (read in chunks: Beam's compressed files have no bounded readline) or any
    iterable of byte lines."""
    if not hasattr(stream, "read"):
        for raw in stream:
            n = len(raw.rstrip(b"\r\n"))
            yield (raw, b"", 0) if n <= limit else (None, raw[:_PREFIX_BYTES], n)
        return
    pieces: list[bytes] = []  # the current line so far (while it is within the limit)
    size = 0  # bytes of the current line so far
    prefix: bytes | None = None  # set once the current line is over the limit: only its start is kept
    while True:
        chunk = stream.read(_READ_CHUNK)
        if not chunk:
            break
        start = 0
        while start < len(chunk):
            nl = chunk.find(b"\n", start)
            end = len(chunk) if nl < 0 else nl + 1
            piece = chunk[start:end]
            start = end
            size += len(piece)
            if prefix is None:
                pieces.append(piece)
                if size - (nl >= 0) > limit:
                    prefix = _head(pieces)
                    pieces = []
            if nl < 0:
                continue
            if prefix is None:
                yield b"".join(pieces), b"", 0
            else:
                yield None, prefix, size - 1
            pieces, size, prefix = [], 0, None
    if prefix is not None:
        yield None, prefix, size
    elif pieces:
        yield b"".join(pieces), b"", 0


def _head(pieces: list[bytes]) -> bytes:
    out = b""
    for piece in pieces:
        out += piece[:_PREFIX_BYTES - len(out)]
        if len(out) >= _PREFIX_BYTES:
            break
    return out


def decoded_lines(stream: Iterable[bytes], source: str, keep_undecodable: bool = False
                   ) -> Iterator[tuple[int, str | None, RawRecord | None]]:
    """(line number, text without its line break, None) per line; (line, None, error) for a line that is not
    UTF-8 or is longer than MAX_LINE_BYTES. `keep_undecodable`: a line that is not UTF-8 also comes with its text,
    its bad bytes as lone surrogates (for CSV, whose rows may span lines: the row, not the line, is rejected)."""
    for number, (raw, prefix, length) in enumerate(_bounded_lines(stream), 1):
        if raw is None:
            yield number, None, RawRecord(source, number, error=layout.error_row(
                source=source, line=number, record=prefix, field="record",
                reason=f"line is too long: {length} bytes, above the limit of {MAX_LINE_BYTES} bytes for one record"))
            continue
        if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        error = None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            error = decode_error(source, number, raw.rstrip(b"\r\n"), e)
            if not keep_undecodable:
                yield number, None, error
                continue
            text = raw.decode("utf-8", "surrogateescape")
        yield number, text.rstrip("\r\n") if text.endswith("\n") else text, error
