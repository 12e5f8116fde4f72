"""Counts the Google Cloud client's retries in this process, so the job can report how many it rode over.

Every GCS call Beam's GCS filesystem makes (reads, listings, uploads, the renames that finalise the manifest) goes
through google-api-core's `Retry`, which logs one "Retrying due to ..." debug line per retry through the logger
`google.api_core.retry`. `install()` adds a filter to that logger that counts those lines (what reaches the handlers
is unchanged); `flush_to_metrics()`, called from inside a bundle, moves the count into the Beam counter `gcs_retries`.
Retries outside any bundle (the launcher's checks) stay pending and are read with `take_pending()`.
"""

from __future__ import annotations

import logging
import threading

import apache_beam as beam
from apache_beam.metrics import Metrics

from .metrics import NAMESPACE as METRICS_NAMESPACE

GCS_RETRIES = "gcs_retries"
RETRY_LOGGER = "google.api_core.retry"  # the logger google-api-core's Retry reports each retry through, at DEBUG
_RETRY_MESSAGE = "Retrying due to"

_lock = threading.Lock()
_pending = 0


# The retry logger's level while counting: below DEBUG, so the retry lines are made, and unlike any level a user
# sets, so that a level set later (`setLevel`, a test's caplog) is told apart from this one and honoured.
_COUNTING_LEVEL = logging.DEBUG - 1


class _RetryCounter(logging.Filter):
    """Counts the retry logger's "Retrying due to" lines; passes a record on only at the level the logger would have
    without counting (one set on it since, else the one it had before, else its parent's), so logs read as before."""

    def __init__(self):
        super().__init__()
        self.wanted = logging.NOTSET  # the logger's own level before counting began

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.DEBUG and str(record.msg).startswith(_RETRY_MESSAGE):
            _note_retry()
        logger = logging.getLogger(RETRY_LOGGER)
        level = self.wanted if logger.level == _COUNTING_LEVEL else logger.level
        if level == logging.NOTSET:
            level = logger.parent.getEffectiveLevel() if logger.parent else logging.WARNING
        return record.levelno >= level


_COUNTER = _RetryCounter()


def _note_retry() -> None:
    global _pending
    with _lock:
        _pending += 1


def install() -> None:
    """Start counting retries in this process (idempotent). A level someone set on the retry logger since the last
    call is kept as the level its records are passed on at."""
    logger = logging.getLogger(RETRY_LOGGER)
    with _lock:
        if _COUNTER not in logger.filters:
            logger.addFilter(_COUNTER)
        if logger.level != _COUNTING_LEVEL:
            _COUNTER.wanted = logger.level
            logger.setLevel(_COUNTING_LEVEL)


def take_pending() -> int:
    """Retries counted in this process since the last take or flush."""
    global _pending
    with _lock:
        n, _pending = _pending, 0
    return n


def flush_to_metrics() -> None:
    """Report this process's pending retries into the `gcs_retries` counter (call from inside a bundle)."""
    n = take_pending()
    if n:
        Metrics.counter(METRICS_NAMESPACE, GCS_RETRIES).inc(n)


class CountingRetriesFn(beam.DoFn):
    """A DoFn that reads or writes through GCS, whose client's retries are counted: `setup` installs the count in
    the worker process, each bundle's end reports it. A subclass that overrides either calls super()'s."""

    def setup(self):
        install()

    def finish_bundle(self):
        flush_to_metrics()
