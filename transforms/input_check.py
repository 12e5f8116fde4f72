"""Launch-time check of the input tables: each CSV/TSV header and Parquet schema must give a prompt column.

A table without its prompt column would otherwise become one error row per record after the job has started; the
launcher calls `check_input_files` on the files it matched and stops with the columns the file has. Only the header
(or the Parquet footer) of each table is read, several files at a time. A file that cannot be read at all is left to
the job, which reports it as an error row like any damaged file.
"""

from __future__ import annotations

import concurrent.futures
import logging

from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems

from . import input_files
from .columns import ColumnError, ColumnMap
from .delimited import DEFAULT_FIELD_LIMIT, table_header
from .input_formats import InputFormatError, detect_format
from .parquet_input import parquet_columns

logger = logging.getLogger(__name__)

_PARALLEL = 16  # files whose header is read at once (a glob on gs:// can match thousands)


class InputCheckError(ValueError):
    """An input file the job cannot read as asked: a table without its prompt column, a table read as text."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"--input {path}: {reason}")
        self.path = path
        self.reason = reason


def table_columns(path: str, fmt: str, field_limit: int = DEFAULT_FIELD_LIMIT) -> list[str] | None:
    """The column names of one table file (None: not a table format, or unreadable, which the job reports)."""
    if fmt not in ("csv", "tsv", "parquet"):
        return None
    with FileSystems.open(path, mime_type="application/octet-stream",
                          compression_type=CompressionTypes.UNCOMPRESSED) as raw:
        if fmt == "parquet":
            return parquet_columns(raw, path)
        try:
            return table_header(input_files.open_decompressed(raw, path), path, fmt, field_limit)
        except input_files.InputReadError:
            return None


def _check_one(path: str, input_format: str | None, columns: ColumnMap, field_limit: int) -> list[str]:
    try:
        fmt = detect_format(path, input_format)
    except InputFormatError as e:
        raise InputCheckError(path, str(e)) from None
    try:
        header = table_columns(path, fmt, field_limit)
    except OSError as e:  # gone since the match, or a folder: the job reports it as an error row
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


def check_input_files(paths: list[str], input_format: str | None, columns: ColumnMap,
                      field_limit: int = DEFAULT_FIELD_LIMIT) -> list[str]:
    """Check every table among `paths`; raise InputCheckError for the first that cannot give requests. Returns
    warnings (a --column_map column a table does not have)."""
    if not paths:
        return []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(_PARALLEL, len(paths))) as pool:
        found = list(pool.map(lambda p: _check_one(p, input_format, columns, field_limit), paths))
    return [warning for warnings in found for warning in warnings]
