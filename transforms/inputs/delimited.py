"""CSV and TSV tables with a header row -> raw records; quoting as Python's csv `excel` / `excel-tab` dialects.

The header names the columns and is resolved once (`columns.py`): a header that cannot give requests (no prompt
column, a column named twice, two columns for one field) is one error row for the whole file, never one per row.
Quoted fields may span lines; a row's line is where it starts. A row with a line that cannot be read (not UTF-8, too
long) is rejected whole, with that line's reason: its other lines are not spliced into another record.
"""

from __future__ import annotations

import csv
import io
from typing import Any, Iterable, Iterator

from .. import layout
from .columns import ColumnError, ColumnMap
from .lines import decoded_lines
from .records import RawRecord, unreadable

DIALECTS = {"csv": "excel", "tsv": "excel-tab"}

# Python's csv module refuses fields over 131,072 characters by default; a prompt may be up to --max_prompt_bytes.
DEFAULT_FIELD_LIMIT = 131072


def field_limit_for(max_prompt_bytes: int) -> int:
    """The longest CSV/TSV field read: room for any prompt --max_prompt_bytes allows (the limit also bounds the
    memory an unterminated quote can take, so it is not unlimited)."""
    return max(DEFAULT_FIELD_LIMIT, max_prompt_bytes + 1)


def _rows(stream: Iterable[bytes], source: str, fmt: str, field_limit: int
          ) -> Iterator[tuple[int, list[str] | None, RawRecord | None]]:
    """(line, cells, None) per non-blank row, or (line, None, error row) for a row that cannot be read."""
    csv.field_size_limit(field_limit)  # a process-wide setting of the csv module; one job's readers share one value
    state: dict[str, Any] = {"first": None, "error": None, "first_text": None}
    name = fmt.upper()

    def lines():
        for number, text, error in decoded_lines(stream, source, keep_undecodable=True):
            if state["first"] is None:
                state["first"], state["first_text"] = number, text
            if error is not None and state["error"] is None:
                state["error"] = error
            yield ("" if text is None else text) + "\n"

    reader = csv.reader(lines(), dialect=DIALECTS[fmt], strict=True)
    while True:
        state["first"], state["error"], state["first_text"] = None, None, None
        try:
            row = next(reader)
        except StopIteration:
            if state["error"] is not None:
                yield state["error"].line, None, state["error"]
            return
        except csv.Error as e:
            line = state["first"] or 0
            reason = f"malformed {name} row: {e}"
            if "field larger than field limit" in str(e):
                reason = (f"malformed {name} row: a field is longer than {csv.field_size_limit()} characters (the "
                          f"limit follows --max_prompt_bytes), or a quote is not closed")
            yield line, None, state["error"] or RawRecord(source, line, error=layout.error_row(
                source=source, line=line, reason=reason, field="record", record=state["first_text"]))
            continue
        line = state["first"] or 0
        if state["error"] is not None:
            yield line, None, state["error"]
        elif any(cell.strip() for cell in row):
            yield line, row, None


def table_header(stream: Iterable[bytes], source: str, fmt: str, field_limit: int = DEFAULT_FIELD_LIMIT
                 ) -> list[str] | None:
    """The column names of a CSV/TSV file's header row (None when the file is empty or its header cannot be read,
    which the job reports as an error row)."""
    for _line, row, error in _rows(stream, source, fmt, field_limit):
        return None if error is not None else [cell.strip() for cell in row]
    return None


def iter_delimited(stream: Iterable[bytes], source: str, fmt: str, columns: ColumnMap,
                   field_limit: int = DEFAULT_FIELD_LIMIT) -> Iterator[RawRecord]:
    """Every record of a CSV (`fmt` 'csv') or TSV ('tsv') file with a header row."""
    name = fmt.upper()
    header: list[str] | None = None
    resolved = None
    for line, row, error in _rows(stream, source, fmt, field_limit):
        if header is None:
            if error is not None:  # without its header no row can be read: one row for the file
                yield unreadable(source, line, f"the {name} header (line {line}) cannot be read: "
                                               f"{error.error['reason']}; none of the file's records were read",
                                 field="header", record=error.error["record"])
                return
            header = [cell.strip() for cell in row]
            try:
                resolved = columns.resolve(header, f"the {name} header (line {line})")
            except ColumnError as e:
                yield unreadable(source, line, f"{e.reason}; none of the file's records were read",
                                 field=e.field or "header", record=_joined(row, fmt))
                return
            continue
        if error is not None:
            yield error
        elif len(row) > len(header):
            yield RawRecord(source, line, error=layout.error_row(
                source=source, line=line, reason=f"{name} row has {len(row)} fields, the header has {len(header)}",
                record=_joined(row, fmt), field="record"))
        else:
            yield RawRecord(source, line, fields=dict(zip(header, row)), text_values=True, text=_joined(row, fmt),
                            columns=resolved)


def _joined(row: list[str], fmt: str) -> str:
    """A row as it would be written in its file (for an error row)."""
    buf = io.StringIO()
    csv.writer(buf, dialect=DIALECTS[fmt], lineterminator="").writerow(row)
    return buf.getvalue()
