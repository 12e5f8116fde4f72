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

from .. import layout
from .columns import ColumnError, ColumnMap
from .files import compression_of
from .lines import MAX_LINE_BYTES
from .records import RawRecord, unreadable

logger = logging.getLogger(__name__)

BATCH_ROWS = 1024  # rows decoded at a time (string columns stay dictionary-encoded until sized)
CHUNK_BYTES = 16 * 1024 * 1024  # most string bytes turned into Python values at once (one larger row alone)


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
    parquet = pq.ParquetFile(file, page_checksum_verification=True)
    # String and binary columns are read as dictionaries where the file stores them so: a few bytes of dictionary
    # page can stand for gigabytes of repeated values, which are sized (`row_bytes`) before any is expanded.
    strings = [f.name for f in parquet.schema_arrow if _is_text(f.type)]
    if not strings:
        return parquet
    file.seek(0)
    return pq.ParquetFile(file, page_checksum_verification=True, read_dictionary=strings)


def _is_text(arrow_type) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_binary(arrow_type)
            or pa.types.is_large_binary(arrow_type))


def row_bytes(batch):
    """Bytes of the string and binary values of each row of a record batch (dictionary-encoded columns sized from
    their dictionaries, nothing expanded), as a numpy int64 array."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    sizes = np.zeros(batch.num_rows, np.int64)
    for column in batch.columns:
        if pa.types.is_dictionary(column.type) and _is_text(column.type.value_type):
            lengths = pc.binary_length(column.dictionary).fill_null(0).to_numpy(zero_copy_only=False)
            indices = column.indices.fill_null(0).to_numpy(zero_copy_only=False)
            sizes += np.where(column.is_valid().to_numpy(zero_copy_only=False), lengths[indices] if len(lengths)
                              else 0, 0)
        elif _is_text(column.type):
            sizes += pc.binary_length(column).fill_null(0).to_numpy(zero_copy_only=False)
    return sizes


def _rows(batch, limit: int, source: str, first_row: int):
    """(row number, values or None, bytes) of a batch's rows: values materialised in chunks of at most CHUNK_BYTES
    of strings, None for a row above `limit` bytes (never expanded)."""
    sizes = row_bytes(batch)
    start = 0
    while start < batch.num_rows:
        if sizes[start] > limit:
            yield first_row + start, None, int(sizes[start])
            start += 1
            continue
        end, total = start, 0
        while end < batch.num_rows and sizes[end] <= limit and (end == start or total + sizes[end] <= CHUNK_BYTES):
            total += sizes[end]
            end += 1
        for offset, values in enumerate(batch.slice(start, end - start).to_pylist()):
            yield first_row + start + offset, values, 0
        start = end


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
                for row, values, size in _rows(batch, MAX_LINE_BYTES, source, row + 1):
                    if values is None:
                        yield RawRecord(source, row, error=layout.error_row(
                            source=source, line=row, field="record", record=None,
                            reason=f"row is too long: {size} bytes of text, above the limit of {MAX_LINE_BYTES} "
                                   f"bytes for one record (it was not read)"))
                    else:
                        yield RawRecord(source, row, fields=values, columns=resolved)
    except errors as e:
        yield unreadable(source, row + 1, f"input file cannot be read to its end: row group {group} of "
                                          f"{parquet.num_row_groups} is damaged ({type(e).__name__}: {e}); the rows "
                                          f"from row {row + 1} on were not read")
