"""A record as read from its input, before validation (or the error row saying why it could not be read)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .. import layout
from .columns import Resolved


@dataclasses.dataclass(frozen=True)
class RawRecord:
    """A record as read, before validation: `fields` by column name (a JSON object's keys, a table's header or
    schema, a BigQuery row's columns), with `columns` telling which are generation fields when the reader knows
    them for the whole file (tables, text); or an `error` row when the record could not even be read (bad bytes,
    bad JSON, a bad CSV row, a damaged file)."""

    source: str
    line: int | None
    fields: Mapping[str, Any] | None = None
    text_values: bool = False  # every value is text as written (CSV, TSV, text): empty means absent
    error: dict | None = None
    text: str | None = None  # the record as written (shown in its error row if it is rejected)
    columns: Resolved | None = None  # None: resolved from the record's own keys (JSONL, BigQuery)


def unreadable(source: str, line: int | None, reason: str, *, field: str = "file", record: Any = None) -> RawRecord:
    """The one error row of an input that cannot be read (further): a damaged file, a header that cannot give
    requests. `line` is where reading stopped (None: nothing could be read)."""
    return RawRecord(source, line, error=layout.error_row(source=source, line=line, reason=reason, field=field,
                                                          record=record, kind=layout.UNREADABLE_INPUT))
