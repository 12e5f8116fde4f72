"""What the job's generation gives besides images: an error row for every image that has none (a failed batch,
RunInference's dead letters; values that are not finite)."""

from __future__ import annotations

from typing import Iterable

import apache_beam as beam
from apache_beam.metrics import Metrics

from . import layout
from .inference import InferenceTimeout, is_out_of_memory
from .metrics import NAMESPACE as METRICS_NAMESPACE

# What the error row of a batch that ran out of memory suggests.
OUT_OF_MEMORY_REMEDY = ("Use a smaller size (the records' height and width, or --height / --width) or a smaller "
                        "--batch_size; on TPU or GPU workers, a machine type with more chips (each batch is sharded "
                        "over a worker's chips) or more memory per chip.")


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
        reason = (f"out of memory: this machine cannot hold a batch of {len(tasks)} image(s) at "
                  f"{first.height}x{first.width}. {OUT_OF_MEMORY_REMEDY} The error: {message}")
    for task in tasks:
        r = task.request
        yield layout.error_row(source=r.source, line=r.line, id=r.id, kind=kind,
                               file_name=task.file_name, reason=reason, record=_task_record(task))


def _task_record(task) -> dict:
    """What an error row of a generated (or attempted) image carries as its record: the request's parameters."""
    r = task.request
    return {"prompt": r.prompt, "seed": task.seed, "height": r.height, "width": r.width,
            "num_inference_steps": r.num_inference_steps, "guidance_scale": r.guidance_scale,
            **({"reference_images": list(r.reference_images)} if r.reference_images else {})}


NON_FINITE_TAG = "nonfinite"


class SplitNonFinite(beam.DoFn):
    """PredictionResults -> the sound ones (main output) and, tagged NON_FINITE_TAG, one error row per image whose
    values are not finite (kind `non_finite_image`, with the stage and the share of NaN/inf values): nothing is
    written for those. Counted in `images_non_finite`."""

    def __init__(self):
        self._count = Metrics.counter(METRICS_NAMESPACE, "images_non_finite")

    def process(self, result):
        generated = result.inference
        if generated.nonfinite is None:
            yield result
            return
        self._count.inc()
        yield beam.pvalue.TaggedOutput(NON_FINITE_TAG, non_finite_row(generated.task, generated.nonfinite))


def non_finite_row(task, why: str) -> dict:
    """The error row of an image whose values are not finite."""
    r = task.request
    return layout.error_row(source=r.source, line=r.line, id=r.id, file_name=task.file_name,
                            kind=layout.NON_FINITE_IMAGE, record=_task_record(task),
                            reason=f"the generated image is not usable, so nothing was written: {why}")
