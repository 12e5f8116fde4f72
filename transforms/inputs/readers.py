"""Prompt files (JSONL, CSV/TSV with a header, Parquet, plain text) -> validated `GenerationRequest`s, or error rows.

Every record is validated into a typed request (transforms/inputs/validation.py). A record that cannot be read or
fails validation becomes one error row (source file, line, offending value, reason) and never stops the job. Columns
are mapped to generation fields by transforms/inputs/columns.py; every other column (or JSON key) is kept as the
request's metadata, for its manifest rows. `iter_raw_records` and `parse_lines` need no pipeline; `ReadRequests` is
the Beam transform, and `ParseRecordsFn` the part it shares with the BigQuery reader (transforms/inputs/bigquery.py).
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

import apache_beam as beam
from apache_beam.metrics import Metrics

from .. import layout, retries
from ..bounded_reads import NotARegularFile, open_timed
from ..defaults import DEFAULT_READ_TIMEOUT_S
from ..metrics import NAMESPACE as METRICS_NAMESPACE
from ..requests import INVALID_TAG, GenerationRequest
from .columns import ColumnMap, ColumnResolver
from .delimited import DEFAULT_FIELD_LIMIT as _CSV_DEFAULT_FIELD_LIMIT
from .delimited import field_limit_for as csv_field_limit_for
from .delimited import iter_delimited
from .files import InputReadError, open_decompressed
from .formats import InputFormatError, detect_format, header_warning
from .jsonl import iter_jsonl
from .parquet import iter_parquet
from .records import RawRecord, record_fault, unreadable
from .text import iter_text
from .validation import RequestDefaults, parse_raw

logger = logging.getLogger(__name__)

WARNING_TAG = "warnings"


def iter_raw_records(stream, source: str, fmt: str, csv_field_limit: int = _CSV_DEFAULT_FIELD_LIMIT,
                     columns: ColumnMap = ColumnMap()) -> Iterator[RawRecord]:
    """Every record of one file: `stream` is its decompressed bytes (a binary file object or an iterable of byte
    lines), for Parquet the file itself (seekable)."""
    if fmt == "jsonl":
        return iter_jsonl(stream, source)
    if fmt in ("csv", "tsv"):
        return iter_delimited(stream, source, fmt, columns, csv_field_limit)
    if fmt == "parquet":
        return iter_parquet(stream, source, columns)
    if fmt == "text":
        return iter_text(stream, source)
    raise ValueError(f"unknown input format {fmt!r}")


def parse_lines(data: bytes, source: str, fmt: str, defaults: RequestDefaults,
                columns: ColumnMap = ColumnMap()) -> list[GenerationRequest | dict]:
    """Convenience for tests and tools: every request or error row of one file's bytes."""
    import io

    limit = csv_field_limit_for(defaults.max_prompt_bytes)
    resolver = ColumnResolver(columns)
    return [parse_raw(r, defaults, resolver) for r in iter_raw_records(io.BytesIO(data), source, fmt, limit, columns)]


class ParseRecordsFn(retries.CountingRetriesFn):
    """The part every reader shares: raw records -> GenerationRequest (main output) or error row (INVALID_TAG),
    counted. Subclasses implement `process` and hand their records to `_parsed`."""

    def __init__(self, defaults: RequestDefaults, columns: ColumnMap):
        self._defaults = defaults
        self._columns = columns
        self._resolver = None
        self._read = Metrics.counter(METRICS_NAMESPACE, "records_read")
        self._invalid = Metrics.counter(METRICS_NAMESPACE, "records_invalid")

    def setup(self):
        super().setup()
        self._resolver = ColumnResolver(self._columns)

    def _parsed(self, raw: RawRecord):
        """The per-record boundary: whatever interpreting this record's data raises (columns, types, validation,
        ids, reference paths, metadata), the record becomes its error row and the job goes on."""
        self._read.inc()
        try:
            parsed = parse_raw(raw, self._defaults, self._resolver)
        except Exception as e:  # noqa: BLE001 - every exception type: the record's data caused it
            parsed = record_fault(raw.source, raw.line, e, raw.text if raw.text is not None else raw.fields)
        if isinstance(parsed, GenerationRequest):
            return parsed
        self._invalid.inc()
        return beam.pvalue.TaggedOutput(INVALID_TAG, parsed)

    def _unparsed(self, source: str, line: int | None, error: BaseException, record=None):
        """A record that could not even be taken from its input (a BigQuery row that cannot be converted)."""
        self._read.inc()
        self._invalid.inc()
        return beam.pvalue.TaggedOutput(INVALID_TAG, record_fault(source, line, error, record))


class _ReadRequestsFn(ParseRecordsFn):
    """fileio.ReadableFile -> GenerationRequest (main output), error row (INVALID_TAG) or, for a text file whose
    first line looks like a table's header, a warning row (WARNING_TAG).

    A file is opened only if it is a regular file (locally), and every open and read of it returns within
    `read_timeout_s` (transforms/bounded_reads.py). Whatever opening or reading the file raises becomes one
    `unreadable_input` row naming where reading stopped; the records before it are kept."""

    def __init__(self, input_format: str | None, defaults: RequestDefaults, columns: ColumnMap = ColumnMap(),
                 read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S):
        super().__init__(defaults, columns)
        self._input_format = input_format
        self._csv_field_limit = csv_field_limit_for(defaults.max_prompt_bytes)
        self._read_timeout_s = read_timeout_s
        self._files = Metrics.counter(METRICS_NAMESPACE, "input_files")

    def process(self, readable_file):
        path = readable_file.metadata.path
        self._files.inc()
        try:
            fmt = detect_format(path, self._input_format)
        except InputFormatError as e:  # the launch refuses this; a file matched only since then gets a row
            yield self._parsed(unreadable(path, None, str(e), field="input_format"))
            return
        try:
            raw_file = open_timed(path, self._read_timeout_s)
        except Exception as e:  # noqa: BLE001 - a folder or FIFO matched by a glob, a file removed since the match,
            # an object Beam refuses to read (Content-Encoding gzip with Content-Type application/gzip), a store
            # that does not answer within --read_timeout_s: this file's one error row
            yield self._parsed(unreadable(path, None, f"input file cannot be opened: {_cause(e)}"))
            return
        with raw_file:
            # Parquet seeks in the file as stored; the line formats read its bytes with compression undone.
            stream = raw_file if fmt == "parquet" else open_decompressed(raw_file, path)
            first = fmt == "text"
            last = 0  # the line of the last record taken from the file
            try:
                for raw in iter_raw_records(stream, path, fmt, self._csv_field_limit, self._columns):
                    last = raw.line if raw.line is not None else last
                    if first and raw.text is not None:
                        first = False
                        warning = self._header_warning(raw)
                        if warning is not None:
                            yield beam.pvalue.TaggedOutput(WARNING_TAG, warning)
                    yield self._parsed(raw)
            except Exception as e:  # noqa: BLE001 - InputReadError (cut, corrupt), a timed-out or failed read, ...
                # The records before the damage are kept. A damaged stream says where its complete lines end (the
                # cut last line is not a record); any other failure stops after the last record taken.
                done = getattr(stream, "complete_lines", None)
                where = done + 1 if isinstance(e, InputReadError) and done is not None else last + 1
                yield self._parsed(unreadable(path, where, f"input file cannot be read to its end: {_cause(e)}; "
                                                           f"the records from line {where} on were not read"))

    def _header_warning(self, raw: RawRecord) -> dict | None:
        """A warning row when a text file's first line looks like a table's header (the file is still read as
        asked: one prompt per line)."""
        why = header_warning(raw.text, self._columns.known_names())
        if why is None:
            return None
        warning = (f"{raw.source} is read as plain text (one prompt per line), but its first line looks like the "
                   f"header of a table: {why}; if it is a table, name it .csv/.tsv or pass --input_format")
        logger.warning("%s (line %s: %r)", warning, raw.line, layout.truncate_record(raw.text, 100))
        return {"source": raw.source, "line": raw.line, "warning": warning}


def _cause(error: BaseException) -> str:
    """What an error row says of an exception: its own words for the typed ones, else its type too."""
    if isinstance(error, NotARegularFile):
        return f"it is {error.kind}, not a regular file (only regular files and gs:// objects are read)"
    if isinstance(error, (InputReadError, OSError, NotImplementedError)):  # ReadTimeout, NotARegularFile too
        return str(error)
    return f"{type(error).__name__}: {error}"


def canonical_path(path: str) -> str:
    """One spelling per file, so that a file matched by two patterns is read once: local paths absolute and
    normalised ('a/./b.txt' and 'a/b.txt' are one file); URIs (gs://...) as they are."""
    if "://" in path:
        return path
    return os.path.normpath(os.path.abspath(path))


class ReadRequests(beam.PTransform):
    """PCollection of file patterns (gs:// or local, globs allowed) -> {'requests': ..., 'invalid': error rows,
    'warnings': warning rows (text files that look like tables)}.

    Every pattern must match at least one file (the pipeline checks that before it starts, with a clear message).
    """

    def __init__(self, input_format: str | None, defaults: RequestDefaults, columns: ColumnMap = ColumnMap(),
                 read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S):
        super().__init__()
        self._input_format = input_format
        self._defaults = defaults
        self._columns = columns
        self._read_timeout_s = read_timeout_s  # each open and read of an input file (--read_timeout_s)

    def expand(self, patterns):
        from apache_beam.io import fileio

        files = (patterns
                 | "MatchInputs" >> fileio.MatchAll()
                 | "FilePaths" >> beam.Map(lambda metadata: canonical_path(metadata.path))
                 | "DistinctFiles" >> beam.Distinct()  # a file matched by two patterns is read once
                 | "ReadMatches" >> fileio.ReadMatches()  # opened uncompressed: inputs.files decompresses
                 | "SpreadFiles" >> beam.Reshuffle())
        parsed = files | "ParseRecords" >> beam.ParDo(
            _ReadRequestsFn(self._input_format, self._defaults, self._columns, self._read_timeout_s)).with_outputs(
                INVALID_TAG, WARNING_TAG, main="requests")
        return {"requests": parsed.requests, "invalid": parsed[INVALID_TAG], WARNING_TAG: parsed[WARNING_TAG]}
