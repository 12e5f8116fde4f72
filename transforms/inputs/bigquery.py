"""BigQuery tables (`--input bq://project.dataset.table`) and queries (`--input_query`) -> requests or error rows.

Read with Beam's `ReadFromBigQuery` (EXPORT method: BigQuery exports a snapshot as Avro files under the pipeline's
`--temp_location`, then the workers read them), with the same column mapping as files. What the job's service
account needs: `bigquery.tables.getData` and `bigquery.tables.get` on the table, `bigquery.jobs.create` in the
project (the export, and the query), read/write on the temp location's bucket; for `--input_query` also a dataset to
hold the query's result: by default Beam creates a temporary dataset (`bigquery.datasets.create`) and deletes it
after the read; with `--bigquery_temp_dataset` it uses that one (create and delete tables there).

Rows have no order, so a row's error row has no line (null); its id, when valid, and the row itself identify it.
Not run against the real service here: the graph is checked with the Dataflow runner's offline dry run and the row
conversion on dict rows as Beam yields them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import apache_beam as beam

from ..requests import INVALID_TAG
from .columns import ColumnMap
from .readers import ParseRecordsFn
from .records import RawRecord
from .validation import RequestDefaults

SCHEME = "bq://"
QUERY_SOURCE = "bq-query"  # the `source` of the rows of --input_query
# project (optionally domain-scoped, "example.com:project"), dataset, table: BigQuery's own rules, loosely
_TABLE = re.compile(r"bq://(?P<project>[A-Za-z0-9.:_-]+)\.(?P<dataset>\w+)\.(?P<table>[^.`/\s][^.`/]*)\Z")
_DATASET = re.compile(r"(?:(?P<project>[A-Za-z0-9.:_-]+)[.:])?(?P<dataset>\w+)\Z")


def is_table_uri(value: str) -> bool:
    return value.startswith(SCHEME)


def table_spec(uri: str) -> str:
    """`bq://project.dataset.table` -> Beam's `project:dataset.table`; ValueError naming the expected form."""
    match = _TABLE.match(uri)
    if not match:
        raise ValueError(f"--input {uri!r} is not a BigQuery table: give bq://project.dataset.table")
    return f"{match['project']}:{match['dataset']}.{match['table']}"


def dataset_reference(spec: str, default_project: str | None):
    """`project.dataset` (or `project:dataset`, or `dataset` in --project) -> Beam's DatasetReference."""
    from apache_beam.io.gcp.internal.clients import bigquery

    match = _DATASET.match(spec or "")
    project = match and (match["project"] or default_project)
    if not project:
        raise ValueError(f"--bigquery_temp_dataset must be project.dataset (or a dataset of --project), got {spec!r}")
    return bigquery.DatasetReference(projectId=project, datasetId=match["dataset"])


@dataclasses.dataclass(frozen=True)
class BigQueryInput:
    """One BigQuery read: a table (`bq://project.dataset.table`) or a standard-SQL query."""

    uri: str | None = None
    query: str | None = None

    @property
    def source(self) -> str:
        """What the rows' manifest and error rows name as their source."""
        return self.uri or QUERY_SOURCE


def row_record(row: Mapping[str, Any], source: str) -> RawRecord:
    """A BigQuery row, as Beam's reader yields it (a dict by column: INT64 int, FLOAT64 float, NUMERIC Decimal,
    STRING str, BYTES bytes, BOOL bool, TIMESTAMP/DATE datetime objects, REPEATED list, RECORD dict, NULL None), as a
    raw record; its columns are resolved from its keys, as a JSON object's."""
    return RawRecord(source, None, fields=dict(row))


class _ParseRowsFn(ParseRecordsFn):
    """BigQuery row (dict) -> GenerationRequest (main output) or error row (INVALID_TAG)."""

    def __init__(self, source: str, defaults: RequestDefaults, columns: ColumnMap):
        super().__init__(defaults, columns)
        self._source = source

    def process(self, row):
        try:
            raw = row_record(row, self._source)
        except Exception as e:  # noqa: BLE001 - the per-record boundary: this row's data could not be converted
            yield self._unparsed(self._source, None, e, row)
            return
        yield self._parsed(raw)


class ReadBigQueryRequests(beam.PTransform):
    """Pipeline root -> {'requests': ..., 'invalid': error rows} of one BigQuery table or query."""

    def __init__(self, read: BigQueryInput, defaults: RequestDefaults, columns: ColumnMap = ColumnMap(),
                 temp_dataset=None):
        super().__init__()
        self._input = read
        self._defaults = defaults
        self._columns = columns
        self._temp_dataset = temp_dataset  # a DatasetReference for the query's result, or None: Beam makes one

    def expand(self, root):
        kwargs: dict[str, Any] = {"method": beam.io.ReadFromBigQuery.Method.EXPORT}
        if self._input.uri is not None:
            kwargs["table"] = table_spec(self._input.uri)
        else:
            kwargs.update(query=self._input.query, use_standard_sql=True)
            if self._temp_dataset is not None:
                kwargs["temp_dataset"] = self._temp_dataset
        rows = root | "ReadRows" >> beam.io.ReadFromBigQuery(**kwargs)
        parsed = rows | "ParseRows" >> beam.ParDo(
            _ParseRowsFn(self._input.source, self._defaults, self._columns)).with_outputs(INVALID_TAG,
                                                                                          main="requests")
        return {"requests": parsed.requests, "invalid": parsed[INVALID_TAG]}
