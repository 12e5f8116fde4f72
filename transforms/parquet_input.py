"""Parquet tables -> raw records, through pyarrow on the file Beam's FileSystems opened (local or gs://).

Only the footer and one row group's pages at a time are read (in batches of BATCH_ROWS rows), never the whole file.
Values come typed as pyarrow gives them (integers, floats, strings, large and dictionary-encoded strings alike;
null as None, nested columns as lists and dicts, binary as bytes); validation then treats them as it treats JSON
values. A record's `line` is its row number in the file (from 1). A file that cannot be read to its end gives one
error row naming the row where reading stopped; the rows of the row groups before the damage still count. Page
checksums are verified where the writer stored them.
"""

from __future__ import annotations

import logging
from typing import Iterator

from .columns import ColumnError, ColumnMap
from .input_files import compression_of
from .records import RawRecord, unreadable

logger = logging.getLogger(__name__)

BATCH_ROWS = 1024  # rows turned into Python values at a time


def _errors() -> tuple[type[BaseException], ...]:
    import pyarrow as pa

    # ArrowInvalid (not Parquet, bad footer) is a ValueError; damaged pages raise OSError; a cut stream EOFError.
    return pa.ArrowException, OSError, ValueError, EOFError


def open_parquet(file, source: str):
    """A pyarrow ParquetFile over `file` (an open seekable binary file); raises the reason it cannot be read."""
    import pyarrow.parquet as pq

    kind = compression_of(source)
    if kind is not None:
        raise ValueError(f"a Parquet file compresses its own pages and cannot be read through {kind}: give the "
                         f"uncompressed .parquet file")
    return pq.ParquetFile(file, page_checksum_verification=True)


def parquet_columns(file, source: str) -> list[str] | None:
    """The top-level column names of a Parquet file's schema (None when it cannot be read as Parquet: the job
    reports that file as an error row)."""
    try:
        return list(open_parquet(file, source).schema_arrow.names)
    except _errors() as e:
        logger.info("%s cannot be read as Parquet at launch (%s); the job reports it as an error row", source, e)
        return None


def iter_parquet(file, source: str, columns: ColumnMap) -> Iterator[RawRecord]:
    """Every row of one Parquet file as a record (`file`: open, seekable, binary)."""
    errors = _errors()
    try:
        parquet = open_parquet(file, source)
        names = list(parquet.schema_arrow.names)
    except errors as e:
        yield unreadable(source, 1, f"input file cannot be read as Parquet: {e}; none of its rows were read")
        return
    try:
        resolved = columns.resolve(names, "the Parquet schema")
    except ColumnError as e:
        yield unreadable(source, None, f"{e.reason}; none of the file's rows were read", field=e.field or "header")
        return
    row = 0
    group = 0
    try:
        for group in range(parquet.num_row_groups):
            # Row group by row group: a damaged group stops reading after every row of the groups before it.
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], use_threads=False):
                for values in batch.to_pylist():
                    row += 1
                    yield RawRecord(source, row, fields=values, columns=resolved)
    except errors as e:
        yield unreadable(source, row + 1, f"input file cannot be read to its end: row group {group} of "
                                          f"{parquet.num_row_groups} is damaged ({type(e).__name__}: {e}); the rows "
                                          f"from row {row + 1} on were not read")
