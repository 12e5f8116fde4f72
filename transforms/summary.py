"""`{output}/summary.json`: the run's figures, written by the pipeline itself once every count is known.

Computed inside the pipeline (not from the launcher's metrics query), so it is written on every runner, including
Dataflow where the launcher exits after submitting; the launcher adds the retry counts once the job is over
(pipeline/closing.py).
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable

import apache_beam as beam

from . import layout, retries
from .sinks.writes import write_bytes_atomic


# What a --skip_existing run generated again, and why: stale (the image there was made for another request or
# model), damaged (unreadable or damaged bytes), missing (not there, or not in a whole shard).
SUMMARY_FIGURES = ("records_read", "requests", "images_planned", "images_generated", "skipped", "stale", "damaged",
                   "missing", "invalid", "duplicates", "failed", "prompts_truncated")
REMADE = {"stale": "stale", "damaged": "damaged", "missing": "missing"}  # figure -> its words in the summary line


def build_summary(counts: dict[str, int], *, started_at: float, finished_at: float, extra: dict | None = None) -> dict:
    wall = max(finished_at - started_at, 1e-9)
    summary: dict[str, Any] = {name: int(counts.get(name, 0)) for name in SUMMARY_FIGURES}
    summary["wall_time_s"] = round(wall, 3)
    summary["images_per_s"] = round(summary["images_generated"] / wall, 4)
    summary["images_per_hour"] = round(summary["images_generated"] * 3600.0 / wall, 1)
    summary["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at))
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(finished_at))
    if extra:
        summary.update(extra)
    return summary


def format_summary(summary: dict) -> str:
    text = (f"records read {summary['records_read']}, images generated {summary['images_generated']}, "
            f"skipped {summary['skipped']}, "
            + "".join(f"{words} (generated again) {summary[name]}, " for name, words in REMADE.items()
                      if summary.get(name))
            + (f"filtered out by scores {sum(summary['filtered_by_rule'].values())}, "
               if summary.get("filtered_by_rule") else "")
            + f"invalid {summary['invalid']}, failed {summary['failed']}, "
            f"wall time {summary['wall_time_s']:.1f} s, {summary['images_per_s']:.3f} images/s")
    retried = summary.get("retries")
    if retried:
        text += ", retries: " + ", ".join(f"{k} {v}" for k, v in retried.items())
    return text


class _WriteSummaryFn(retries.CountingRetriesFn):
    def __init__(self, path: str, started_at: float, extra: dict):
        self._path = path
        self._started_at = started_at
        self._extra = extra

    def process(self, _, **side):
        counts = {k: v for k, v in side.items() if not k.startswith(("_after_", "_rows_", "_tally_"))}
        rows = {k[len("_rows_"):]: v for k, v in side.items() if k.startswith("_rows_")}
        summary = build_summary(counts, started_at=self._started_at, finished_at=time.time(), extra=self._extra)
        for name, pairs in side.items():
            if name.startswith("_tally_"):
                summary[name[len("_tally_"):]] = dict(sorted((str(k), int(n)) for k, n in pairs))
        for name, found in rows.items():
            if found:
                summary[name] = sorted(found, key=_row_order)[:MAX_SUMMARY_ROWS]
                summary[f"{name}_count"] = len(found)
        write_bytes_atomic(self._path, (json.dumps(summary, indent=2) + "\n").encode("utf-8"),
                           mime_type="application/json")
        yield summary


MAX_SUMMARY_ROWS = 100  # rows (warnings) listed in summary.json; `{name}_count` says how many there were


def _row_order(row: dict) -> tuple:
    return str(row.get("source")), row.get("line") if isinstance(row.get("line"), int) else -1


class WriteSummary(beam.PTransform):
    """{figure name: PCollection to count} -> writes `{output}/summary.json` once every count is known.

    Computed inside the pipeline (not from the launcher's metrics query), so it is written on every runner,
    including Dataflow where the launcher exits after submitting. PCollections in `after` (e.g. the file names
    WriteToText returns) are waited for, so that summary.json appears only once those outputs are complete.
    `rows`: {name: PCollection of JSON rows} listed in the summary under `name` (the first MAX_SUMMARY_ROWS by
    source and line) with `{name}_count`; absent when there are none.
    `tallies`: {name: PCollection of values} listed under `name` as {value: how many} (e.g. error rows by kind).
    """

    def __init__(self, output: str, started_at: float, extra: dict | None = None, after: Iterable = (),
                 rows: dict | None = None, tallies: dict | None = None):
        super().__init__()
        self._tallies = dict(tallies or {})
        self._output = output
        self._started_at = started_at
        self._extra = dict(extra or {})
        self._after = list(after)
        self._rows = dict(rows or {})

    def expand(self, pcolls: dict):
        side = {}
        for name, pcoll in pcolls.items():
            side[name] = beam.pvalue.AsSingleton(pcoll | f"Count_{name}" >> beam.combiners.Count.Globally())
        for name, pcoll in self._rows.items():  # few rows (one per file at most): listed whole, then cut
            side[f"_rows_{name}"] = beam.pvalue.AsList(pcoll)
        for name, pcoll in self._tallies.items():
            side[f"_tally_{name}"] = beam.pvalue.AsList(pcoll | f"Tally_{name}" >> beam.combiners.Count.PerElement())
        for i, pcoll in enumerate(self._after):
            side[f"_after_{i}"] = beam.pvalue.AsList(pcoll)
        return (pcolls[next(iter(pcolls))].pipeline
                | "SummaryTrigger" >> beam.Create([None])
                | "WriteSummary" >> beam.ParDo(_WriteSummaryFn(layout.summary_path(self._output), self._started_at,
                                                               self._extra), **side))
