"""Plain-text input: one prompt a line."""

from __future__ import annotations

from typing import Iterable, Iterator

from .. import layout
from .columns import Resolved
from .lines import decoded_lines
from .records import RawRecord

TEXT_COLUMNS = Resolved({"prompt": "prompt"})  # a text line's one field


def iter_text(stream: Iterable[bytes], source: str) -> Iterator[RawRecord]:
    for number, text, error in decoded_lines(stream, source):
        if error is not None:
            yield error
        elif "\r" in text.strip():
            # Lines end at LF (or CRLF); a CR inside a line is most likely a file with CR-only (classic Mac) line
            # endings, whose prompts would otherwise run together into one.
            yield RawRecord(source, number, error=layout.error_row(
                source=source, line=number, record=text, field="record",
                reason="line contains a carriage return (CR) that does not end it: CR-only line endings? Convert the "
                       "file to LF or CRLF line endings"))
        elif text.strip():
            yield RawRecord(source, number, fields={"prompt": text.strip()}, text_values=True, text=text,
                            columns=TEXT_COLUMNS)
