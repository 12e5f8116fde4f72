"""transforms/retries.py: the Google Cloud client's retries are counted through the retry policies' own `on_error`
hook, with real `Retry` calls, whatever the logs show."""

import logging

from google.api_core import exceptions

from transforms import beam_adapter, retries
from flaky_calls import fails_then_works


def test_gcs_retries_are_counted_once_each():
    retries.install()
    retries.install()  # idempotent: each retry counted once
    retries.take_pending()
    for policy in beam_adapter.gcs_retry_policies():
        assert fails_then_works(policy, 2, timeout=5)() == "ok"
    assert retries.take_pending() == 4 and retries.take_pending() == 0


def test_the_count_does_not_depend_on_the_logs():
    """Retries are counted with the retry logger silenced (the count used to be read from its debug lines)."""
    logger = logging.getLogger("google.api_core.retry")
    level, disabled = logger.level, logger.disabled
    logger.setLevel(logging.CRITICAL)
    logger.disabled = True
    try:
        retries.install()
        retries.take_pending()
        assert fails_then_works(beam_adapter.gcs_retry(), 3, timeout=5)() == "ok"
        assert retries.take_pending() == 3
    finally:
        logger.setLevel(level)
        logger.disabled = disabled


def test_a_policy_replaced_since_is_counted_after_the_next_install(monkeypatch):
    """A job's tests replace Beam's policy with a faster copy (tests/support/fault_jobs.py); the job's launch counts
    that one too."""
    from apache_beam.io.gcp import gcsio_retry

    fresh = type(gcsio_retry.DEFAULT_RETRY_WITH_THROTTLING_COUNTER)(
        predicate=lambda e: isinstance(e, exceptions.ServiceUnavailable), timeout=5)
    monkeypatch.setattr(gcsio_retry, "DEFAULT_RETRY_WITH_THROTTLING_COUNTER", fresh)
    retries.install()
    retries.take_pending()
    assert fails_then_works(beam_adapter.gcs_retry(), 1, timeout=5)() == "ok"
    assert retries.take_pending() == 1
