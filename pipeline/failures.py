"""A local run that failed, told in one line: the exception Beam raises (a worker's, wrapped with the step's name or,
from a worker process, as its traceback's text) is recognised as the --max_images limit or a model that could not
be loaded (UsageError, exit 2) or a full disk (DiskFull, exit 1); anything else is raised as it is. Beam's own
tracebacks of those are kept off the command line's log (`quiet_worker_tracebacks`): the line says it."""

from __future__ import annotations

import logging
import re

from transforms.progress import read_progress
from transforms.requests import MaxImagesExceeded

from model import ModelError

from .disk_full import DiskFull, disk_full_error, disk_full_line
from .errors import UsageError, exception_chain

_STEP_SUFFIX = re.compile(r" \[while running '[^']*'\]")
# How a worker process's model error reads in the text Beam passes on from it (multi_processing workers).
_MODEL_ERROR_TEXT = re.compile(r"^model\.errors\.(\w+): (.+)$", re.MULTILINE)
# Beam's loggers that report a worker's failed DoFn setup, in this process or from a worker process.
_WORKER_ERROR_LOGGERS = ("apache_beam.runners.common", "apache_beam.runners.portability.local_job_service")


def explained(error: BaseException, *, model: str, output: str, progress_dir: str | None,
              started_at: float) -> Exception | None:
    """The one-line error that a failed run's `error` stands for (raise it from `error`), or None."""
    limit = max_images_error(error)
    if limit:
        return UsageError(limit)
    full = disk_full_error(error)
    if full:
        total = read_progress(progress_dir)[1] if progress_dir else None
        return DiskFull(disk_full_line(full, output, total, started_at))
    failed_load = model_load_error(error)
    if failed_load:  # the launch checked the checkpoint; it changed since, or its copy failed on a worker
        return UsageError(f"--model={model!r} could not be loaded, so no image was generated: {failed_load}")
    return None


def max_images_error(error: BaseException) -> str | None:
    """The --max_images message when `error` (however the runner wrapped it) is the job's image limit."""
    match = re.search(r"the job would generate \d+ images, above --max_images=\d+; .*?split the input", str(error))
    return match.group(0) if match else None


def model_load_error(error: BaseException) -> str | None:
    """'Kind: message' of the model.ModelError that `error` is or wraps (Beam re-raises a worker's exception with the
    step's name added, or, from a worker process, its traceback as text), else None: the model load failed on a
    worker (a failed batch never gets here: it becomes error rows)."""
    for error in exception_chain(error):
        if isinstance(error, ModelError):
            return f"{type(error).__name__}: {_STEP_SUFFIX.sub('', str(error))}"
        found = _MODEL_ERROR_TEXT.findall(str(error))
        if found:
            kind, message = found[-1]
            return f"{kind}: {_STEP_SUFFIX.sub('', message)}"
    return None


class _WithoutModelLoadTraceback(logging.Filter):
    """Drops Beam's reports (tracebacks) of a worker's failed model load, of a full disk or of the --max_images limit:
    `main` says it in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and (isinstance(record.exc_info[1], (ModelError, MaxImagesExceeded))
                                or disk_full_error(record.exc_info[1])):
            return False
        message = record.getMessage()
        return ("model.errors." not in message and disk_full_error(Exception(message)) is None
                and max_images_error(Exception(message)) is None)


def quiet_worker_tracebacks() -> None:
    """Keep Beam's reports of a worker's failed model load, full disk or --max_images limit off the log (the command
    line's one line says it)."""
    for name in _WORKER_ERROR_LOGGERS:
        logging.getLogger(name).addFilter(_WithoutModelLoadTraceback())
