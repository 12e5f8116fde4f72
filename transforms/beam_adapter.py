"""The job's only uses of Beam (and google-api-core) where they offer no public way, each a small function.

Everything else in the job uses Beam's and argparse's public APIs. A Beam or client upgrade that changes one of these
fails tests/transforms/test_beam_adapter.py, which exercises each against the installed libraries. Beam is imported
inside the functions, so the command line's quick check (pipeline/usage.py) can import this module without it.
"""

from __future__ import annotations

import sys
from typing import Callable


# ------------------------------------------------------------------------------------------------ option classes
def options_class(name: str, module: str, doc: str, declare: Callable) -> type:
    """A `PipelineOptions` subclass named `module.name` whose options are declared by `declare(parser)`: Beam finds
    option classes by subclassing and asks each through its `_add_argparse_args` hook (the way Beam's documentation
    shows; its name is private)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    def _add_argparse_args(cls, parser):
        declare(parser)

    cls = type(name, (PipelineOptions,), {"__doc__": doc, "__module__": module,
                                          "_add_argparse_args": classmethod(_add_argparse_args)})
    cls.__qualname__ = name
    return cls


def option_classes() -> list[type]:
    """Every registered `PipelineOptions` class that declares options (subclasses of subclasses included), each once,
    in Beam's order: what Beam's own parser is built from."""
    from apache_beam.options.pipeline_options import PipelineOptions

    found: dict[str, type] = {}
    pending = list(PipelineOptions.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        if "_add_argparse_args" in cls.__dict__:
            found.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    return list(found.values())


def declare_options(cls: type, parser) -> None:
    """Declare option class `cls`'s options on an argparse parser (or argument group), as Beam does."""
    cls._add_argparse_args(parser)  # noqa: SLF001 - Beam's hook for option classes


def add_value_provider_argument(parser, *args, **kwargs) -> None:
    """Beam's `add_value_provider_argument` (a templated option) on a parser that is not Beam's own: option classes
    may declare options with it, which only Beam's parser class has."""
    from apache_beam.options.pipeline_options import _BeamArgumentParser

    _BeamArgumentParser.add_value_provider_argument(parser, *args, **kwargs)


# ------------------------------------------------------------------------------------------------ bundles
def windowed_value(value, timestamp, window):
    """`value` in `window` at `timestamp`: what a DoFn's finish_bundle yields."""
    from apache_beam.utils.windowed_value import WindowedValue

    return WindowedValue(value, timestamp, [window])


# ------------------------------------------------------------------------------------------------ GCS retries
def gcs_retry():
    """The retry policy Beam's GCS filesystem gives its client calls (its predicate, back-off and throttling count)."""
    from apache_beam.io.gcp import gcsio_retry

    return gcsio_retry.DEFAULT_RETRY_WITH_THROTTLING_COUNTER


def gcs_retry_policies() -> list:
    """The `google.api_core.retry.Retry` objects the job's GCS calls retry under: Beam's GCS filesystem's (both of its
    choices) and google-cloud-storage's default, which the client's own calls and Beam's downloads take."""
    from google.cloud.storage import retry as storage_retry

    return [gcs_retry(), storage_retry.DEFAULT_RETRY]


class RetryHook:
    """A Retry's `on_error` that reports each retry to `on_retry(exc)`, then calls the policy's own handler (Beam's
    throttling count reads the retry loop's `sleep_iterator` from its caller's frame: this frame holds the same)."""

    def __init__(self, on_retry: Callable[[Exception], None], inner: Callable | None):
        self.on_retry, self.inner = on_retry, inner

    def __call__(self, exc: Exception) -> None:
        self.on_retry(exc)
        if self.inner is not None:
            sleep_iterator = sys._getframe(1).f_locals.get("sleep_iterator")  # noqa: F841, SLF001 - read by inner
            self.inner(exc)


def hook_retries(policy, on_retry: Callable[[Exception], None]) -> None:
    """Make `policy` (a google-api-core Retry) report each retry to `on_retry` through its `on_error` hook, keeping
    its own handler; idempotent (a policy already hooked to `on_retry` is left as it is). api-core takes `on_error`
    only when a Retry is made and keeps it in `_on_error`: copies (`with_delay`, `with_timeout`) keep the hook."""
    current = policy._on_error  # noqa: SLF001
    if isinstance(current, RetryHook) and current.on_retry == on_retry:
        return
    policy._on_error = RetryHook(on_retry, current)  # noqa: SLF001


# ------------------------------------------------------------------------------------------------ Dataflow
def dataflow_job_state(project: str, region: str, job_id: str) -> str:
    """The current state of a Dataflow job (e.g. JOB_STATE_RUNNING), through Beam's Dataflow client."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.dataflow.internal.apiclient import DataflowApplicationClient

    client = DataflowApplicationClient(PipelineOptions([f"--project={project}", f"--region={region}"]))
    state = client.get_job(job_id).current_state
    return getattr(state, "name", str(state))
