"""Counts the Google Cloud client's retries in this process, so the job can report how many it rode over.

Every GCS call Beam's GCS filesystem makes (reads, listings, uploads, the renames that finalise the manifest) and
every call of the job's own storage client retries under a google-api-core `Retry` policy. `install()` hooks this
count into those policies' `on_error` (transforms/beam_adapter.py: the policies' own handlers still run);
`flush_to_metrics()`, called from inside a bundle, moves the count into the Beam counter `gcs_retries`. Retries outside
any bundle (the launcher's checks) stay pending and are read with `take_pending()`.
"""

from __future__ import annotations

import threading

import apache_beam as beam
from apache_beam.metrics import Metrics

from . import beam_adapter
from .metrics import NAMESPACE as METRICS_NAMESPACE

GCS_RETRIES = "gcs_retries"

_lock = threading.Lock()
_pending = 0


def _note_retry(exc: Exception) -> None:
    global _pending
    with _lock:
        _pending += 1


def install() -> None:
    """Start counting the GCS retries of this process (idempotent; again after a policy was replaced)."""
    for policy in beam_adapter.gcs_retry_policies():
        beam_adapter.hook_retries(policy, _note_retry)


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
