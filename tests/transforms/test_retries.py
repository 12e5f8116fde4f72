"""transforms/retries.py: the Google Cloud client's retries are counted through the public logger google-api-core
reports them on, with real `Retry` objects, and what the logs show is what it was without the count."""

import logging

import pytest
from google.api_core import exceptions, retry as api_retry

from transforms import retries

LOGGER = logging.getLogger("google.api_core.retry")  # the name google-api-core reports retries under


class _Seen(logging.Handler):
    def __init__(self):
        super().__init__(logging.NOTSET)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def seen():
    """A handler at NOTSET (as logging.basicConfig's is) on the retry logger itself: what the logger passes on to
    any handler, whether or not records go on up to the root's (google-api-core's client logging stops the "google"
    logger propagating once a generated client starts in the process). The root's level is WARNING meanwhile; the
    retry logger's own level and filters are put back afterwards."""
    level, filters = LOGGER.level, list(LOGGER.filters)
    root_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.WARNING)
    handler = _Seen()
    LOGGER.addHandler(handler)
    retries.take_pending()
    try:
        yield handler
    finally:
        LOGGER.removeHandler(handler)
        logging.getLogger().setLevel(root_level)
        LOGGER.setLevel(level)
        LOGGER.filters[:] = filters


def _fails_then_works(times: int):
    calls = []

    def call():
        calls.append(1)
        if len(calls) <= times:
            raise exceptions.ServiceUnavailable("try again")
        return "ok"

    return api_retry.Retry(initial=0.001, maximum=0.002, timeout=5)(call)


def test_retries_are_counted_and_the_logs_unchanged(seen):
    LOGGER.setLevel(logging.NOTSET)  # as it is in a fresh process: the root's WARNING applies
    retries.install()
    retries.install()  # idempotent: each retry counted once
    assert _fails_then_works(2)() == "ok"
    assert retries.take_pending() == 2 and retries.take_pending() == 0
    assert seen.lines == []  # debug lines stay below the WARNING the logger had: nothing more is printed


def test_a_level_set_on_the_retry_logger_is_honoured(seen):
    """A level someone sets later (a test's caplog, --sdk_harness_log_level_overrides) decides what is shown; the
    count goes on either way."""
    retries.install()
    LOGGER.setLevel(logging.DEBUG)
    assert _fails_then_works(1)() == "ok"
    assert retries.take_pending() == 1
    assert len(seen.lines) == 1 and seen.lines[0].startswith("Retrying due to")
    retries.install()  # the next job in this process: DEBUG is kept as the level shown
    assert _fails_then_works(1)() == "ok"
    assert retries.take_pending() == 1 and len(seen.lines) == 2


def test_retries_are_counted_through_the_logger_name_whatever_object_the_module_holds(seen, monkeypatch):
    """How google-api-core's retry module holds its logger is its own business (here a LoggerAdapter over the same
    logger, as a release may change it to): what is counted is what reaches the logger of that name."""
    from google.api_core.retry import retry_base

    monkeypatch.setattr(retry_base, "_LOGGER", logging.LoggerAdapter(LOGGER, {}))
    retries.install()
    assert _fails_then_works(3)() == "ok"
    assert retries.take_pending() == 3
