"""Prompt tables for the tests: TSV text and Parquet files written with pyarrow (several row groups, dictionary
columns, nulls), plus the damage a real file can have (cut short, a row group's pages overwritten)."""

from __future__ import annotations

import csv
import io


def tsv_bytes(rows: list[list]) -> bytes:
    """Rows (the first is the header) as a TSV file, quoted as the excel-tab dialect does."""
    buf = io.StringIO()
    csv.writer(buf, dialect="excel-tab", lineterminator="\n").writerows(rows)
    return buf.getvalue().encode("utf-8")


def parquet_bytes(columns: dict, *, row_group_size: int | None = None, dictionary: tuple = (),
                  types: dict | None = None) -> bytes:
    """A Parquet file of `columns` ({name: values}); `dictionary`: columns stored dictionary-encoded as such (a
    pandas category); `types`: pyarrow types by column. Page checksums are written, as careful writers do."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = {}
    for name, values in columns.items():
        array = pa.array(values, type=(types or {}).get(name))
        arrays[name] = array.dictionary_encode() if name in dictionary else array
    buf = io.BytesIO()
    pq.write_table(pa.table(arrays), buf, row_group_size=row_group_size, write_page_checksum=True)
    return buf.getvalue()


def damage_row_group(data: bytes, group: int) -> bytes:
    """`data` with the first data page of row group `group` overwritten (every column chunk of it)."""
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(io.BytesIO(data)).metadata.row_group(group)
    out = bytearray(data)
    for c in range(meta.num_columns):
        chunk = meta.column(c)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        for i in range(start + 8, start + 40):
            out[i] ^= 0x5A
    return bytes(out)
