"""Launch-time check of the inputs: each CSV/TSV header and Parquet schema must give a prompt column, and so must
at least one of the first records of the first JSONL file.

A table without its prompt column would otherwise become one error row per record after the job has started; the
launcher calls `check_input_files` on the files it matched and stops with the columns the file has. Only the header
(or the Parquet footer) of each table is read, several files at a time. JSONL records may vary in their keys, so only
a first file none of whose first JSONL_RECORDS records has the prompt column stops the launch (a `--prompt_column`
typo); a later record without it is still an error row. So does a first file none of whose first JSONL_RECORDS lines
is a JSON object at all (not JSONL, or every line malformed), naming the first such line and the parser's message.
A file that cannot be read at all (not a regular file, or a read that does not return within --read_timeout_s) is
left to the job, which reports it as an error row like any damaged file.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import difflib
import itertools
import logging

from ..bounded_reads import open_timed
from ..defaults import DEFAULT_READ_TIMEOUT_S
from ..layout import UNREADABLE_INPUT
from .columns import ColumnError, ColumnMap, MissingPromptColumn
from .delimited import DEFAULT_FIELD_LIMIT, table_header
from .files import InputReadError, open_decompressed
from .formats import InputFormatError, detect_format
from .jsonl import iter_jsonl
from .parquet import parquet_columns

logger = logging.getLogger(__name__)

_PARALLEL = 16  # files whose header is read at once (a glob on gs:// can match thousands)
JSONL_RECORDS = 100  # non-empty lines of the first JSONL file looked at for the prompt column


class InputCheckError(ValueError):
    """An input file the job cannot read as asked: a table without its prompt column, a table read as text."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"--input {path}: {reason}")
        self.path = path
        self.reason = reason


def table_columns(path: str, fmt: str, field_limit: int = DEFAULT_FIELD_LIMIT,
                  read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S) -> list[str] | None:
    """The column names of one table file (None: not a table format, or unreadable, which the job reports)."""
    if fmt not in ("csv", "tsv", "parquet"):
        return None
    with open_timed(path, read_timeout_s) as raw:
        if fmt == "parquet":
            return parquet_columns(raw, path)
        try:
            return table_header(open_decompressed(raw, path), path, fmt, field_limit)
        except InputReadError:
            return None


def _check_one(path: str, input_format: str | None, columns: ColumnMap, field_limit: int,
               read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S) -> list[str]:
    try:
        fmt = detect_format(path, input_format)
    except InputFormatError as e:
        raise InputCheckError(path, str(e)) from None
    try:
        header = table_columns(path, fmt, field_limit, read_timeout_s)
    except OSError as e:  # gone since the match, a folder or FIFO, a read timed out: the job reports it as a row
        logger.info("cannot read the header of %s at launch (%s); the job reports it", path, e)
        return []
    if header is None:
        return []
    what = "its header" if fmt != "parquet" else "its Parquet schema"
    try:
        columns.resolve(header, what)
    except ColumnError as e:
        raise InputCheckError(path, e.reason) from None
    return [f"--column_map renames {old!r}, but {path} has no such column (its columns: "
            f"{', '.join(map(repr, header))})" for old in columns.unused_renames(header)]


@dataclasses.dataclass(frozen=True)
class JsonlSample:
    """What the first non-empty lines of a JSONL file hold: the key sets of its JSON objects (each once, in order),
    how many lines were looked at and how many were objects, and the first line that was none (its number and the
    parser's message); `unreadable` when reading stopped on a damaged file (the job reports that)."""

    key_sets: list[tuple[str, ...]]
    lines: int = 0
    objects: int = 0
    first_error: tuple[int | None, str] | None = None
    unreadable: bool = False


def jsonl_sample(path: str, most: int = JSONL_RECORDS,
                 read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S) -> JsonlSample:
    """The first `most` non-empty lines of a JSONL file, read within the readers' size bound and parsed as the job
    parses them. Nothing when the file cannot be read at all: the job reports that."""
    found: dict[tuple[str, ...], None] = {}
    lines = objects = 0
    first_error = None
    unreadable = False
    try:
        with open_timed(path, read_timeout_s) as raw:
            for record in itertools.islice(iter_jsonl(open_decompressed(raw, path), path), most):
                lines += 1
                if record.fields is not None:
                    objects += 1
                    found.setdefault(tuple(record.fields), None)
                elif record.error is not None:
                    unreadable = unreadable or record.error.get("kind") == UNREADABLE_INPUT
                    if first_error is None:
                        first_error = (record.error.get("line"), str(record.error.get("reason")))
    except (OSError, InputReadError) as e:
        logger.info("cannot read the first records of %s at launch (%s); the job reports it", path, e)
        return JsonlSample([])
    return JsonlSample(list(found), lines, objects, first_error, unreadable)


def malformed_reason(sample: JsonlSample) -> str | None:
    """Why a JSONL file cannot give a single request because none of its sampled lines is a JSON object (with the
    first one's line and the parser's message); None when one is, or reading stopped on damage (the job's error
    row says that)."""
    if not sample.lines or sample.objects or sample.unreadable or sample.first_error is None:
        return None
    line, message = sample.first_error
    first = f"its {sample.lines} line(s)" if sample.lines < JSONL_RECORDS else f"its first {sample.lines} lines"
    return f"none of {first} is a JSON object (one record a line); line {line}: {message}"


def missing_prompt_reason(key_sets: list[tuple[str, ...]], lines: int, columns: ColumnMap) -> str | None:
    """Why JSONL records with these key sets cannot give a single request because none has the prompt column, with
    the key closest to --prompt_column as a suggestion; None when one has it (or there is no record to judge)."""
    if not key_sets:
        return None
    for keys in key_sets:
        try:
            columns.resolve(keys, "the record")
        except MissingPromptColumn:
            continue
        except ColumnError:  # a record with another fault: its own error row says it
            return None
        return None
    keys = list(dict.fromkeys(k for ks in key_sets for k in ks))
    folded = {k.casefold(): k for k in keys}
    close = difflib.get_close_matches(columns.prompt_column.casefold(), list(folded), n=1, cutoff=0.6)
    hint = f" (did you mean --prompt_column={folded[close[0]]}?)" if close else ""
    shown = ", ".join(map(repr, keys[:40])) + (f" and {len(keys) - 40} more" if len(keys) > 40 else "")
    first = f"its {lines} record(s)" if lines < JSONL_RECORDS else f"its first {lines} records"
    return (f"none of {first} has the prompt column {columns.prompt_column!r} (--prompt_column); "
            f"their keys are: {shown or '(none)'}{hint}")


def _check_first_jsonl(paths: list[str], input_format: str | None, columns: ColumnMap,
                       read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S) -> None:
    """InputCheckError when the first JSONL file among `paths` starts with lines none of which is a JSON object, or
    with records none of which has a prompt."""
    for path in paths:
        try:
            fmt = detect_format(path, input_format)
        except InputFormatError:
            continue  # reported by the table check
        if fmt != "jsonl":
            continue
        sample = jsonl_sample(path, read_timeout_s=read_timeout_s)
        reason = malformed_reason(sample) or missing_prompt_reason(sample.key_sets, sample.lines, columns)
        if reason:
            raise InputCheckError(path, reason)
        return


def check_input_files(paths: list[str], input_format: str | None, columns: ColumnMap,
                      field_limit: int = DEFAULT_FIELD_LIMIT,
                      read_timeout_s: float | None = DEFAULT_READ_TIMEOUT_S) -> list[str]:
    """Check every table among `paths` and the first JSONL file; raise InputCheckError for the first that cannot
    give requests. Returns warnings (a --column_map column a table does not have). Every read of a file returns
    within `read_timeout_s` (--read_timeout_s), so a stalled one cannot hold the launch."""
    if not paths:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(_PARALLEL, len(paths))) as pool:
        found = list(pool.map(lambda p: _check_one(p, input_format, columns, field_limit, read_timeout_s), paths))
    _check_first_jsonl(paths, input_format, columns, read_timeout_s)
    return [warning for warnings in found for warning in warnings]
