"""Text inputs saved as UTF-16 or UTF-32 (Excel's "Unicode text" and many Windows tools write UTF-16 with a byte-order
mark) read as the UTF-8 the line readers take: the encoding is told by the byte-order mark at the start of the data,
and the data re-encoded as it is read, a chunk at a time (line numbers unchanged). Data without one of these marks is
passed on as it is (UTF-8, with or without its own mark, which the line readers drop).
"""

from __future__ import annotations

import codecs

from .files import InputReadError, WithHead

# Byte-order marks and the codec that reads the text after them; UTF-32's little-endian mark starts with UTF-16's,
# so it is looked for first.
BOMS = ((codecs.BOM_UTF32_LE, "utf-32-le"), (codecs.BOM_UTF32_BE, "utf-32-be"),
        (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))
_HEAD_BYTES = 4
_SNIFF_BYTES = 16  # bytes that must all look like ASCII in UTF-16 before a file without a mark is refused
_CHUNK = 256 * 1024


def sniff_text_encoding(raw) -> tuple[object, str | None]:
    """(a reader of `raw`'s data as UTF-8, the encoding its byte-order mark named, or None for data passed on as it
    is). Reads at most 4 bytes before the first `read()` of the result."""
    head = b""
    while len(head) < _HEAD_BYTES and (piece := raw.read(_HEAD_BYTES - len(head))):
        head += piece
    for bom, encoding in BOMS:
        if head.startswith(bom):
            return Utf8Recoder(head[len(bom):], raw, encoding), encoding
    reader = WithHead(head, raw)
    if looks_like_utf16(head):
        head += raw.read(_SNIFF_BYTES - len(head))
        reader = WithHead(head, raw)
        if looks_like_utf16(head, len(head)):
            return _Refused(InputReadError(
                "the file looks like UTF-16 text without a byte-order mark (a NUL byte beside each character); "
                "save it as UTF-8 (in Excel: CSV UTF-8), or as UTF-16 with its byte-order mark")), None
    return reader, None


def looks_like_utf16(head: bytes, most: int = _HEAD_BYTES) -> bool:
    """Whether the first bytes are printable ASCII characters each beside a NUL byte (UTF-16, either byte order),
    which UTF-8 prompts never start with."""
    head = head[:most - most % 2]
    if len(head) < _HEAD_BYTES:
        return False
    for text, nul in ((head[0::2], head[1::2]), (head[1::2], head[0::2])):
        if set(nul) == {0} and all(0x20 <= b < 0x7f or b in (0x09, 0x0a, 0x0d) for b in text):
            return True
    return False


class _Refused:
    """A reader whose first read raises the error that says why the file is not read."""

    def __init__(self, error: InputReadError):
        self._error = error

    def read(self, size: int = -1) -> bytes:
        raise self._error


class Utf8Recoder:
    """A binary reader giving the UTF-8 form of text in another encoding, decoded as it is read. Text that is not
    valid in that encoding raises InputReadError naming the encoding and where, after the text before it."""

    def __init__(self, head: bytes, raw, encoding: str):
        self._raw = raw
        self._encoding = encoding
        self._decoder = codecs.getincrementaldecoder(encoding)("strict")
        self._pending = head  # encoded bytes read but not decoded yet
        self._out = b""
        self._done = False
        self._offset = 0  # encoded bytes given to the decoder so far (for the error's position)
        self._error: InputReadError | None = None  # raised once the text before it has been read

    def read(self, size: int = -1) -> bytes:
        want = None if size is None or size < 0 else size
        if self._error is not None and not self._out:
            raise self._error
        while not self._done and (want is None or len(self._out) < want):
            self._fill()
        if want is None:
            out, self._out = self._out, b""
        else:
            out, self._out = self._out[:want], self._out[want:]
        return out

    def _fill(self) -> None:
        data, self._pending = self._pending + self._raw.read(_CHUNK), b""
        final = not data
        buffered = self._decoder.getstate()[0]
        try:
            text = self._decoder.decode(data, final=final)
        except UnicodeDecodeError as e:  # the text before the bad bytes is still returned, then the error
            self._done = True
            self._out += (buffered + data)[:e.start].decode(self._encoding).encode("utf-8", "surrogatepass")
            name = self._encoding[:6].upper()
            self._error = InputReadError(f"the file starts with a {name} byte-order mark, but its bytes at "
                                         f"{self._offset - len(buffered) + e.start} (after the mark) are not valid "
                                         f"{name}; save it again as UTF-8 (in Excel: CSV UTF-8)")
            return
        self._offset += len(data)
        self._out += text.encode("utf-8", "surrogatepass")
        self._done = final
