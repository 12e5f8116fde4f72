"""transforms/beam_adapter.py: each use of Beam (or google-api-core) where they offer no public way works against the
installed libraries. A failure here after an upgrade names the function to rewrite."""

import argparse

import pytest
from google.api_core import exceptions, retry as api_retry

from transforms import beam_adapter
from flaky_calls import fails_then_works


def test_an_options_class_is_registered_and_parsed_by_beam():
    from apache_beam.options.pipeline_options import PipelineOptions

    def declare(parser):
        parser.add_argument("--adapter_probe_value", type=int, default=3)

    cls = beam_adapter.options_class("AdapterProbeOptions", __name__, "A probe.", declare)
    assert cls in beam_adapter.option_classes()
    assert PipelineOptions(["--adapter_probe_value=7"]).view_as(cls).adapter_probe_value == 7
    assert PipelineOptions([]).view_as(cls).adapter_probe_value == 3
    assert "adapter_probe_value" in PipelineOptions([]).get_all_options()  # Beam's own parser knows it


def test_beams_option_classes_declare_their_options_on_any_argparse_parser():
    from apache_beam.options.pipeline_options import GoogleCloudOptions, StandardOptions

    classes = beam_adapter.option_classes()
    assert StandardOptions in classes and GoogleCloudOptions in classes
    parser = argparse.ArgumentParser(add_help=False)
    beam_adapter.declare_options(StandardOptions, parser)
    assert parser.parse_args(["--runner=X"]).runner == "X"


def test_value_provider_arguments_declare_on_a_plain_parser():
    from apache_beam.options.value_provider import StaticValueProvider

    parser = argparse.ArgumentParser(add_help=False)
    beam_adapter.add_value_provider_argument(parser, "--templated", type=int)
    value = parser.parse_args(["--templated=5"]).templated
    assert isinstance(value, StaticValueProvider) and value.get() == 5


def test_windowed_value():
    from apache_beam.transforms.window import GlobalWindow

    value = beam_adapter.windowed_value({"a": 1}, 10, GlobalWindow())
    assert (value.value, value.timestamp.micros, list(value.windows)) == ({"a": 1}, 10_000_000, [GlobalWindow()])


def test_gcs_retry_is_beams_gcs_policy():
    from apache_beam.io.gcp import gcsio_retry
    from apache_beam.options.pipeline_options import PipelineOptions

    assert beam_adapter.gcs_retry() is gcsio_retry.get_retry(PipelineOptions([]))
    assert isinstance(beam_adapter.gcs_retry(), api_retry.Retry)
    assert all(isinstance(p, api_retry.Retry) for p in beam_adapter.gcs_retry_policies())


def test_hooked_retries_are_reported_and_the_policys_own_handler_still_runs():
    """The hook runs on each retry, before the policy's own handler, which still sees the retry loop's sleeps in its
    caller's frame (Beam's throttling count reads them there)."""
    seen, inner = [], []

    def own_handler(exc):
        import inspect

        inner.append((type(exc).__name__, "sleep_iterator" in inspect.currentframe().f_back.f_locals))

    policy = api_retry.Retry(predicate=api_retry.if_exception_type(exceptions.ServiceUnavailable), timeout=5,
                             on_error=own_handler)
    beam_adapter.hook_retries(policy, seen.append)
    beam_adapter.hook_retries(policy, seen.append)  # idempotent: each retry reported once
    assert fails_then_works(policy, 2)() == "ok"
    assert [type(e).__name__ for e in seen] == ["ServiceUnavailable"] * 2
    assert inner == [("ServiceUnavailable", True)] * 2


def test_a_policy_without_a_handler_is_hooked():
    seen = []
    policy = api_retry.Retry(predicate=api_retry.if_exception_type(exceptions.ServiceUnavailable), timeout=5)
    beam_adapter.hook_retries(policy, seen.append)
    assert fails_then_works(policy, 3)() == "ok" and len(seen) == 3


def test_beams_throttling_count_still_reads_its_sleep(monkeypatch):
    """Beam's ThrottlingHandler, behind the hook, finds the retry loop's next sleep for a 429 (its counter gets the
    seconds)."""
    from apache_beam.io.gcp import gcsio_retry

    slept = []
    monkeypatch.setattr(gcsio_retry.ThrottlingHandler, "_THROTTLED_SECS",
                        type("Counter", (), {"inc": lambda self, n: slept.append(n)})())
    policy = api_retry.Retry(predicate=api_retry.if_exception_type(exceptions.TooManyRequests), timeout=5,
                             initial=1.5, maximum=1.5, on_error=gcsio_retry.ThrottlingHandler())
    beam_adapter.hook_retries(policy, lambda exc: None)
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls = []

    def call():
        calls.append(1)
        if len(calls) == 1:
            raise exceptions.TooManyRequests("slow down")
        return "ok"

    assert policy(call)() == "ok"
    assert len(slept) == 1 and slept[0] >= 1  # the sleep was found (none: 0 seconds)


@pytest.mark.parametrize("project, region, job", [("p", "r", "j")])
def test_dataflow_job_state_asks_beams_client(project, region, job, monkeypatch):
    from apache_beam.runners.dataflow.internal import apiclient

    asked = []

    class Client:
        def __init__(self, options):
            asked.append(options.get_all_options()["project"])

        def get_job(self, job_id):
            asked.append(job_id)
            return type("Job", (), {"current_state": type("State", (), {"name": "JOB_STATE_RUNNING"})()})()

    monkeypatch.setattr(apiclient, "DataflowApplicationClient", Client)
    assert beam_adapter.dataflow_job_state(project, region, job) == "JOB_STATE_RUNNING"
    assert asked == [project, job]
