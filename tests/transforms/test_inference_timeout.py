"""--inference_timeout_s: a generate call that does not return in time fails its batch as `inference_timeout` error
rows and the job goes on; the stuck call keeps the model, so later batches of the process fail at once instead of
queueing behind it, until it returns. Model loading is not counted. A model stand-in that blocks plays the hung
device (no JAX, no checkpoint)."""

import threading
import time

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.ml.inference.base import RunInference
from apache_beam.testing.test_pipeline import TestPipeline as BeamTestPipeline
from apache_beam.testing.util import assert_that

from transforms import layout
from model import GenerationResult
from transforms.inference import Flux2KleinModelHandler, InferenceTimeout, is_retriable
from transforms.generation import failed_batch_rows
from transforms.requests import GenerationRequest, ImageTask

TIMEOUT_S = 1


def batch(*ids):
    return [ImageTask(GenerationRequest(id=i, prompt=f"prompt {i}", seed=1, height=16, width=16,
                                        num_inference_steps=None, guidance_scale=None, num_images=1, source="/in/p.jsonl",
                                        line=1),
                      0) for i in ids]


class StandIn:
    """LoadedGenerator's generate_batch; a batch whose first prompt says 'hang' blocks until `release` is set."""

    def __init__(self, release: threading.Event):
        self.release = release
        self.calls: list[list[str]] = []

    def generate_batch(self, prompts, seeds, height, width, steps, guidance, refs=None):
        self.calls.append(list(prompts))
        if "hang" in prompts[0]:
            self.release.wait(60)  # bounded, so that a failing test cannot leave it blocked for ever
        return GenerationResult(images=np.zeros((len(prompts), height, width, 3), np.uint8),
                                prompt_truncated=(False,) * len(prompts), nonfinite=(None,) * len(prompts),
                                num_inference_steps=4, guidance_scale=1.0, model="stand-in", seconds=0.01)


def handler(**kw):
    return Flux2KleinModelHandler("/no/checkpoint", inference_timeout_s=TIMEOUT_S, retry_backoff_s=0.0, **kw)


def test_a_hung_batch_times_out_and_later_batches_fail_fast_until_it_returns():
    release = threading.Event()
    model, h = StandIn(release), handler(inference_retries=2)
    try:
        assert [r.example.request.id for r in h.run_inference(batch("ok"), model)] == ["ok"]
        with pytest.raises(InferenceTimeout, match=r"timed out: .* batch of 2 image\(s\) ran past "
                                                   r"--inference_timeout_s=1 s"):
            h.run_inference(batch("hang", "hang2"), model)
        assert len(model.calls) == 2  # the timeout was not retried: the device is still busy with it
        with pytest.raises(InferenceTimeout, match="not run: .*first id 'hang'.* has not returned"):
            h.run_inference(batch("next"), model)
        assert len(model.calls) == 2  # failed at once, never queued behind the stuck call
    finally:
        release.set()
    deadline = time.monotonic() + 30
    while True:  # the stuck call returns: the model is used again
        try:
            assert [r.example.request.id for r in h.run_inference(batch("later"), model)] == ["later"]
            break
        except InferenceTimeout:
            assert time.monotonic() < deadline, "the model stayed unusable after the stuck call returned"
            time.sleep(0.05)
    assert not is_retriable(InferenceTimeout("x"))


def test_no_timeout_when_zero():
    release = threading.Event()
    release.set()
    h = Flux2KleinModelHandler("/no/checkpoint", inference_timeout_s=0)
    assert len(h.run_inference(batch("hang"), StandIn(release))) == 1
    with pytest.raises(ValueError, match="inference_timeout_s must be >= 0"):
        Flux2KleinModelHandler("/no/checkpoint", inference_timeout_s=-1)


class SlowLoadingHandler(Flux2KleinModelHandler):
    """Loads the stand-in in more time than the timeout allows a batch: loading must not count."""

    release = threading.Event()

    def load_model(self):
        time.sleep(TIMEOUT_S * 1.5)
        return StandIn(self.release)


def test_in_the_job_a_hung_batch_is_error_rows_and_the_rest_goes_on():
    h = SlowLoadingHandler("/no/checkpoint", inference_timeout_s=TIMEOUT_S, inference_retries=0)
    try:
        with BeamTestPipeline(runner="FnApiRunner") as p:
            results, dlq = (p | beam.Create([batch("first"), batch("hang", "hang2"), batch("after")])
                            | RunInference(h.with_no_batching()).with_exception_handling())
            ok = results | "Ids" >> beam.Map(lambda r: r.example.request.id)
            rows = dlq.failed_inferences | beam.FlatMap(failed_batch_rows) | beam.Map(
                lambda r: (r["id"], r["kind"], r["reason"]))

            def check_ok(ids):
                assert sorted(ids) == ["first"], ids  # loaded slower than the timeout, then generated

            def check_rows(found):
                got = {rid: (kind, reason) for rid, kind, reason in found}
                assert set(got) == {"hang", "hang2", "after"}, got
                assert all(kind == layout.INFERENCE_TIMEOUT for kind, _ in got.values()), got
                assert "ran past --inference_timeout_s=1 s" in got["hang"][1], got
                assert "not run" in got["after"][1] and "has not returned" in got["after"][1], got

            assert_that(ok, check_ok, label="generated")
            assert_that(rows, check_rows, label="error rows")
    finally:
        SlowLoadingHandler.release.set()
