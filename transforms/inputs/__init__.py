"""The job's inputs: prompt files and BigQuery rows -> validated `GenerationRequest`s (transforms/requests.py), or
error rows.

Reading: `readers` (every file format, and the `ReadRequests` transform), `bigquery` (tables and queries), one
module a format (`jsonl`, `delimited` for CSV/TSV, `parquet`, `text`) over `files` (decompression, complete files
only) and `lines` (bounded, decoded lines); `formats` picks a file's format, `check` looks at headers at launch.
A record as read is a `records.RawRecord`; `columns` maps its columns to generation fields.
Validation: `validation` (`RequestDefaults`, `validate_record`, `parse_raw`) with `coercion` (a value as its field's
type; model.contract's checks as `InvalidRecord`), `identity` (ids and seeds) and `json_values` (extra columns).

Nothing is imported here, so that a Beam-free module (such as `formats`, which the option table reads) stays so.
"""
