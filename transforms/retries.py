"""Counts the Google Cloud client's retries in this process, so the job can report how many it rode over.

Every GCS call Beam's GCS filesystem makes (reads, listings, uploads, the renames that finalise the manifest) goes
through google-api-core's `Retry`, which logs one "Retrying due to ..." debug line per retry through the module's
logger. `install()` wraps that logger object (messages still reach it unchanged, at the same level) to count those
lines; `flush_to_metrics()`, called from inside a bundle, moves the count into the Beam counter `gcs_retries`.
Retries outside any bundle (the launcher's checks) stay pending and are read with `take_pending()`.
"""

from __future__ import annotations

import logging
import threading

import apache_beam as beam
from apache_beam.metrics import Metrics

from .metrics import NAMESPACE as METRICS_NAMESPACE

GCS_RETRIES = "gcs_retries"
_RETRY_MESSAGE = "Retrying due to"

_lock = threading.Lock()
_pending = 0


class _CountingLogger:
    """Stands in for google-api-core's retry logger: counts retry lines, then logs them exactly as before."""

    def __init__(self, logger: logging.Logger):
        self._logger = logger

    def debug(self, msg, *args, **kwargs):
        if str(msg).startswith(_RETRY_MESSAGE):
            _note_retry()
        self._logger.debug(msg, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._logger, name)


def _note_retry() -> None:
    global _pending
    with _lock:
        _pending += 1


def install() -> bool:
    """Start counting retries in this process (idempotent). False when google-api-core's layout is not the one
    this knows, in which case nothing is counted and nothing else changes."""
    try:
        from google.api_core.retry import retry_base
    except ImportError:
        return False
    with _lock:
        current = getattr(retry_base, "_LOGGER", None)
        if isinstance(current, _CountingLogger):
            return True
        if not isinstance(current, logging.Logger):
            return False
        retry_base._LOGGER = _CountingLogger(current)
    return True


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
