"""The job's one generation stage: image tasks -> shape batches -> RunInference -> generated images, and an error
row for every image that has none (a failed batch, RunInference's dead letters; values that are not finite).

Every sink (transforms/sinks/) receives what this stage gives, so retries (the handler's), dead letters, timeouts,
RunInference's metrics and the model's sharing across processes (`large_model` / `model_copies`) are the same
whichever way the images are stored.
"""

from __future__ import annotations

from typing import Iterable

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.ml.inference.base import RunInference

from . import layout
from .inference import BatchByShape, InferenceTimeout, is_out_of_memory
from .metrics import NAMESPACE as METRICS_NAMESPACE
from .score_filters import apply_rules

IMAGES = "images"  # GeneratedImage (transforms/inference.py) of every image whose values are finite
FAILED = "failed"  # (ImageTask, error row) of every image that could not be generated
NON_FINITE_TAG = "nonfinite"

# What the error row of a batch that ran out of memory suggests.
OUT_OF_MEMORY_REMEDY = ("Use a smaller size (the records' height and width, or --height / --width); on TPU or GPU "
                        "workers, a machine type with more chips (each batch is sharded over a worker's chips) or "
                        "more memory per chip.")


class Generate(beam.PTransform):
    """ImageTasks -> {IMAGES: GeneratedImage, FAILED: (ImageTask, error row)}.

    Tasks are batched by shape (BatchByShape: at most `batch_size` per batch) and each batch is one generate call
    of `handler` through `RunInference(handler.with_no_batching()).with_exception_handling()`; a batch that still
    fails after the handler's retries is a dead letter, one error row per image (`failed_batch_rows`); an image
    whose values are not finite is one error row too (SplitNonFinite). The tasks may be any ImageTask, subclasses
    included: a sink that needs to know more of an image once generated (its shard, its key) gives its tasks that
    (transforms/sinks/webdataset.py), and gets the same object back as `GeneratedImage.task`.
    """

    def __init__(self, handler, batch_size: int, score_rules: tuple = ()):
        """`score_rules`: the score filters (transforms/score_filters.py) each scored image is checked against."""
        super().__init__()
        self._handler = handler
        self._batch_size = batch_size
        self._score_rules = tuple(score_rules)

    def expand(self, tasks):
        batches = tasks | "BatchByShape" >> BatchByShape(self._batch_size)
        results, dlq = batches | "RunInference" >> RunInference(self._handler.with_no_batching()) \
            .with_exception_handling()
        split = results | "SplitNonFinite" >> beam.ParDo(SplitNonFinite()).with_outputs(NON_FINITE_TAG,
                                                                                        main=IMAGES)
        failed = ((dlq.failed_inferences | "FailedBatchRows" >> beam.FlatMap(failed_images)), split[NON_FINITE_TAG]) \
            | "FailedImages" >> beam.Flatten()
        images = split[IMAGES]
        if self._score_rules:
            images = images | "ApplyScoreFilters" >> beam.Map(apply_rules, self._score_rules)
        return {IMAGES: images, FAILED: failed}


def failed_batch_rows(failed) -> Iterable[dict]:
    """A RunInference dead-letter element `(batch of ImageTask, (exc type, repr, traceback))` -> one error row
    per image of the batch, carrying the exception; out of memory, the row says so and what to change; a timeout
    (InferenceTimeout) is kind `inference_timeout`."""
    batch, exc_info = failed
    exc_type, exc_repr = (exc_info[0], exc_info[1]) if isinstance(exc_info, tuple) else (type(exc_info), exc_info)
    type_name = getattr(exc_type, "__name__", str(exc_type))
    message = str(exc_repr)
    if isinstance(exc_info, BaseException):
        message = f"{type_name}: {exc_info}"
    elif type_name not in message:
        message = f"{type_name}: {message}"
    message = layout.truncate_record(message, 2000)
    tasks = list(batch)
    Metrics.counter(METRICS_NAMESPACE, "images_failed").inc(len(tasks))
    reason = f"inference failed for a batch of {len(tasks)} image(s): {message}"
    kind = layout.INFERENCE_FAILED
    if type_name == InferenceTimeout.__name__:
        kind, reason = layout.INFERENCE_TIMEOUT, f"inference did not finish in time for a batch of {len(tasks)} " \
                                                 f"image(s): {message}"
    elif tasks and is_out_of_memory(message):
        first = tasks[0].request  # a batch has one shape
        # The handler splits a batch that runs out of memory down to single images: what fails, fails alone.
        reason = (f"out of memory: this machine cannot hold one image at {first.height}x{first.width} (its batch of "
                  f"{len(tasks)} was also tried in parts, down to one image). {OUT_OF_MEMORY_REMEDY} "
                  f"The error: {message}")
    for task in tasks:
        r = task.request
        yield layout.error_row(source=r.source, line=r.line, id=r.id, kind=kind,
                               file_name=task.file_name, reason=reason, record=_task_record(task))


def failed_images(failed) -> Iterable[tuple]:
    """A dead-letter element -> (ImageTask, its error row) for each image of the batch."""
    tasks = list(failed[0])
    return zip(tasks, failed_batch_rows((tasks, failed[1])))


def _task_record(task) -> dict:
    """What an error row of a generated (or attempted) image carries as its record: the request's parameters."""
    r = task.request
    return {"prompt": r.prompt, "seed": task.seed, "height": r.height, "width": r.width,
            "num_inference_steps": r.num_inference_steps, "guidance_scale": r.guidance_scale,
            **({"reference_images": list(r.reference_images)} if r.reference_images else {})}


class SplitNonFinite(beam.DoFn):
    """PredictionResults -> the sound images (main output: their GeneratedImage) and, tagged NON_FINITE_TAG,
    (task, error row) for each image whose values are not finite (kind `non_finite_image`, with the stage and the
    share of NaN/inf values): nothing is written for those. Counted in `images_non_finite`."""

    def __init__(self):
        self._count = Metrics.counter(METRICS_NAMESPACE, "images_non_finite")

    def process(self, result):
        generated = result.inference
        if generated.nonfinite is None:
            yield generated
            return
        self._count.inc()
        task = generated.task
        yield beam.pvalue.TaggedOutput(NON_FINITE_TAG, (task, non_finite_row(task, generated.nonfinite)))


def non_finite_row(task, why: str) -> dict:
    """The error row of an image whose values are not finite."""
    r = task.request
    return layout.error_row(source=r.source, line=r.line, id=r.id, file_name=task.file_name,
                            kind=layout.NON_FINITE_IMAGE, record=_task_record(task),
                            reason=f"the generated image is not usable, so nothing was written: {why}")
