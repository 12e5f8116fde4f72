"""Beam log lines that the job's own design makes alarming for nothing, dropped from the command line's log.

The manifest, existing and errors row files (and metadata.jsonl) are written under fixed names, one shard each, so
that a rerun into the same output replaces the previous run's files (pipeline/graph.py build_pipeline). Beam's file
sink then warns `Deleting 1 existing files in target path matching: ...` once per file on every rerun
(`--skip_existing`, `--overwrite`): that replacement is the intended one, so only that message of that logger is
dropped; every other warning of Beam's file sinks still shows.
"""

from __future__ import annotations

import logging

FILE_SINK_LOGGER = "apache_beam.io.filebasedsink"
REPLACED_FILES_MESSAGE = "Deleting %d existing files in target path matching: %s"


class DropReplacedFilesWarning(logging.Filter):
    """Drops the file sink's 'Deleting N existing files in target path' record; passes every other one."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != REPLACED_FILES_MESSAGE


def quiet_replaced_row_files() -> None:
    """Install the filter on Beam's file sink logger, once per process (Beam's FnApiRunner finalizes the row files
    in the launching process; a multi-process or Dataflow worker logs the line in its own log)."""
    sink_logger = logging.getLogger(FILE_SINK_LOGGER)
    if not any(isinstance(f, DropReplacedFilesWarning) for f in sink_logger.filters):
        sink_logger.addFilter(DropReplacedFilesWarning())
