"""A record as read from its input, before validation (or the error row saying why it could not be read)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

from .. import layout
from .columns import Resolved

logger = logging.getLogger(__name__)


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


# The typed errors the readers and validation raise for bad data; any other exception raised inside the per-record
# boundary is still the record's error row, and its traceback is logged (it may be a bug of ours).
EXPECTED_FAULTS: tuple[type[BaseException], ...] = (ValueError, UnicodeError, OverflowError, RecursionError)
_logged_unexpected: set = set()


def record_fault(source: str, line: int | None, error: BaseException, record: Any = None, *,
                 kind: str = layout.INVALID_RECORD, what: str = "record") -> dict:
    """The error row of one record (or one input file, `kind` unreadable_input) whose data raised `error` while it
    was read, decoded, parsed, validated or resolved: the per-record boundary (docs/developers.md). Whatever the
    exception, the record gets its row and the job goes on; an exception of a type the readers do not raise for
    bad data has its traceback logged once per type and place, since it may be a bug of ours."""
    name = type(error).__name__
    if not isinstance(error, EXPECTED_FAULTS) and (name, what) not in _logged_unexpected:
        _logged_unexpected.add((name, what))
        logger.warning("a %s of %s (line %s) raised %s; it is an error row and the job goes on (traceback below: "
                       "this may be a bug)", what, layout.writable_text(source), line, name, exc_info=error)
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - an exception whose message cannot even be made
        text = ""
    reason = f"{what} could not be read: {name}" + (f": {text}" if text else "")
    try:
        shown = record if record is None or isinstance(record, (str, bytes)) else layout.truncate_record(record)
    except Exception:  # noqa: BLE001 - a record that cannot even be shown: the row names it by source and line
        shown = None
    return layout.error_row(source=source, line=line, reason=layout.truncate_record(reason, 500), record=shown,
                            kind=kind)
