"""PNG encoding, atomic image writes, manifest and error rows, skip-existing, the run summary.

An image goes straight to its final name as one atomic object write: on GCS (and any other object store Beam's
FileSystems knows) a single object upload that only becomes visible when complete; on a local disk a temporary file
in the same folder, then an atomic rename. The PNG bytes depend only on the pixels and the request, so a retried
bundle rewrites the same bytes and no partial image is ever visible.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import time
from typing import Any, Iterable

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from . import layout, retries
from .inference import is_out_of_memory
from .metrics import NAMESPACE as METRICS_NAMESPACE
from .requests import ImageTask

PNG_SOFTWARE = "flux2-klein-beam"
LOGGER = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- files
def is_local(path: str) -> bool:
    return "://" not in path


def write_bytes_atomic(path: str, data: bytes, mime_type: str = "application/octet-stream") -> None:
    """Write `data` to `path` so that readers see either nothing (or the old bytes) or all of the new bytes."""
    if is_local(path):
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return
    with FileSystems.create(path, mime_type=mime_type, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        f.write(data)


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


# --------------------------------------------------------------------------------------------- PNG
def png_text(task: ImageTask, *, num_inference_steps: int, guidance_scale: float, model: str,
             prompt_truncated: bool | None = None) -> dict[str, str]:
    """The PNG text chunks: prompt, seed, steps, guidance and model (plus the id, size and whether the prompt was
    truncated), all as strings; a resumed job rebuilds an image's manifest row from them."""
    r = task.request
    text = {
        "prompt": r.prompt,
        "seed": str(task.seed),
        "num_inference_steps": str(int(num_inference_steps)),
        "steps": str(int(num_inference_steps)),
        "guidance_scale": repr(float(guidance_scale)),
        "guidance": repr(float(guidance_scale)),
        "model": model,
        "id": r.id,
        "height": str(r.height),
        "width": str(r.width),
        "Software": PNG_SOFTWARE,
    }
    if prompt_truncated is not None:
        text["prompt_truncated"] = "true" if prompt_truncated else "false"
    return text


def encode_png(pixels: np.ndarray, text: dict[str, str] | None = None) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes with `text` as iTXt chunks (UTF-8); deterministic for the same input."""
    from PIL import Image, PngImagePlugin

    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
        raise ValueError(f"expected uint8 [H, W, 3] pixels, got {pixels.dtype} {pixels.shape}")
    info = PngImagePlugin.PngInfo()
    for key, value in (text or {}).items():
        info.add_itxt(key, value)
    buf = io.BytesIO()
    Image.fromarray(pixels, mode="RGB").save(buf, format="PNG", pnginfo=info, compress_level=6)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------- Beam: write images
class WriteImagesFn(beam.DoFn):
    """PredictionResult(example=ImageTask, inference=GeneratedImage) -> writes the PNG, yields its manifest row."""

    def __init__(self, output: str, progress_dir: str | None = None):
        self._output = output
        self._progress_dir = progress_dir
        self._written = Metrics.counter(METRICS_NAMESPACE, "images_generated")
        self._bytes = Metrics.counter(METRICS_NAMESPACE, "image_bytes_written")
        self._gen_ms = Metrics.distribution(METRICS_NAMESPACE, "generation_ms_per_image")
        self._progress = None

    def setup(self):
        retries.install()
        if self._progress_dir:
            from .progress import ProgressWriter

            self._progress = ProgressWriter(self._progress_dir)

    def process(self, result):
        generated = result.inference
        task: ImageTask = generated.task
        png = encode_png(generated.pixels, png_text(task, num_inference_steps=generated.num_inference_steps,
                                                    guidance_scale=generated.guidance_scale,
                                                    model=generated.model,
                                                    prompt_truncated=generated.prompt_truncated))
        uri = layout.join(self._output, task.file_name)
        write_bytes_atomic(uri, png, mime_type="image/png")
        self._written.inc()
        self._bytes.inc(len(png))
        self._gen_ms.update(int(round(generated.generation_ms)))
        if self._progress is not None:
            self._progress.add(1)
        r = task.request
        yield layout.manifest_row(
            request_id=r.id, file_name=task.file_name, uri=uri, prompt=r.prompt,
            prompt_truncated=generated.prompt_truncated, seed=task.seed, height=r.height, width=r.width,
            num_inference_steps=generated.num_inference_steps, guidance_scale=generated.guidance_scale,
            model=generated.model, sha256=hashlib.sha256(png).hexdigest(), num_bytes=len(png),
            generation_ms=generated.generation_ms, source=r.source, line=r.line, metadata=r.metadata_values())

    def finish_bundle(self):
        # Loads that happened in this process but were not yet reported (see inference.flush_model_load_metrics).
        from .inference import flush_model_load_metrics

        flush_model_load_metrics()
        retries.flush_to_metrics()
        if self._progress is not None:
            self._progress.flush()


# --------------------------------------------------------------------------------------------- Beam: skip existing
SKIPPED_TAG = "skipped"


class ExistingImageMismatch(ValueError):
    """An image already at a task's name is not that task's image (other request, wrong size, damaged bytes)."""

    def __init__(self, file_name: str, problem: str):
        super().__init__(f"{file_name}: {problem}")
        self.file_name = file_name
        self.problem = problem


def existing_manifest_row(task: ImageTask, data: bytes, uri: str) -> dict:
    """The manifest row of an image a previous run wrote for `task`, rebuilt from its bytes and PNG text chunks.

    Raises ExistingImageMismatch unless the bytes are a complete, undamaged PNG (every chunk checksum) of the
    task's size whose text chunks record the task's id, prompt and seed (and its steps and guidance when the
    record gives them)."""
    from PIL import Image

    r = task.request
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, size, text = im.format, im.size, dict(getattr(im, "text", {}) or {})
        with Image.open(io.BytesIO(data)) as im:
            im.verify()  # every chunk's CRC, through IEND: a truncated or damaged file fails here
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes; all mean the same here
        raise ExistingImageMismatch(task.file_name, f"not a readable PNG ({type(e).__name__}: {e})") from None
    if fmt != "PNG":
        raise ExistingImageMismatch(task.file_name, f"is {fmt}, not PNG")
    if size != (r.width, r.height):
        raise ExistingImageMismatch(task.file_name, f"is {size[0]}x{size[1]} (WxH), the request asks for "
                                                    f"{r.width}x{r.height}")
    expected = {"id": r.id, "prompt": r.prompt, "seed": str(task.seed)}
    if r.num_inference_steps is not None:
        expected["num_inference_steps"] = str(int(r.num_inference_steps))
    if r.guidance_scale is not None:
        expected["guidance_scale"] = repr(float(r.guidance_scale))
    for key, value in expected.items():
        if text.get(key) != value:
            raise ExistingImageMismatch(task.file_name, f"was made for another request (its {key!r} differs)")
    try:
        steps, guidance = int(text["num_inference_steps"]), float(text["guidance_scale"])
    except (KeyError, ValueError):
        raise ExistingImageMismatch(task.file_name, "lacks its steps/guidance text chunks") from None
    truncated = {"true": True, "false": False}.get(text.get("prompt_truncated", ""))
    return layout.manifest_row(
        request_id=r.id, file_name=task.file_name, uri=uri, prompt=r.prompt, prompt_truncated=truncated,
        seed=task.seed, height=r.height, width=r.width, num_inference_steps=steps, guidance_scale=guidance,
        model=text.get("model", ""), sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data),
        generation_ms=None, source=r.source, line=r.line, metadata=r.metadata_values())


class _SkipExistingFn(beam.DoFn):
    """A task whose image exists and checks out -> its manifest row (tagged `skipped`); else the task, to be
    generated (an image that does not check out is replaced, and counted)."""

    def __init__(self, output: str):
        self._output = output
        self._skipped = Metrics.counter(METRICS_NAMESPACE, "images_skipped")
        self._replaced = Metrics.counter(METRICS_NAMESPACE, "existing_images_replaced")

    def setup(self):
        retries.install()

    def finish_bundle(self):
        retries.flush_to_metrics()

    def process(self, task: ImageTask, existing):
        if task.file_name not in existing:
            yield task
            return
        uri = layout.join(self._output, task.file_name)
        try:
            data = read_bytes(uri)
        except FileNotFoundError:  # deleted since the listing
            yield task
            return
        try:
            row = existing_manifest_row(task, data, uri)
        except ExistingImageMismatch as e:
            self._replaced.inc()
            LOGGER.warning("--skip_existing: %s; generating it again", e)
            yield task
            return
        self._skipped.inc()
        yield beam.pvalue.TaggedOutput(SKIPPED_TAG, row)


class SkipExisting(beam.PTransform):
    """Image tasks -> {'tasks': those still to generate, 'skipped': manifest rows of the images already there}.

    The existing images are listed once (one match of `{output}/images/*.png`) and handed to the filter as a side
    input, rather than one existence check per image. Each listed image of a task is then read and checked
    (`existing_manifest_row`): its row goes to manifest/existing-*.jsonl, so a resumed job's manifests still list
    every image, including those of a run that was killed before writing its manifest.
    """

    def __init__(self, output: str):
        super().__init__()
        self._output = output

    def expand(self, tasks):
        from apache_beam.io import fileio

        output = self._output
        existing = (tasks.pipeline
                    | "ImagesGlob" >> beam.Create([layout.images_glob(output)])
                    | "ListImages" >> fileio.MatchAll(empty_match_treatment=fileio.EmptyMatchTreatment.ALLOW)
                    | "ToFileName" >> beam.Map(lambda m: (f"{layout.IMAGES_DIR}/{m.path.rsplit('/', 1)[-1]}", True)))
        out = tasks | "SkipExisting" >> beam.ParDo(_SkipExistingFn(output), beam.pvalue.AsDict(existing)) \
            .with_outputs(SKIPPED_TAG, main="tasks")
        return {"tasks": out.tasks, "skipped": out[SKIPPED_TAG]}


# --------------------------------------------------------------------------------------------- failed batches
# What the error row of a batch that ran out of memory suggests.
OUT_OF_MEMORY_REMEDY = ("Use a smaller size (the records' height and width, or --height / --width) or a smaller "
                        "--batch_size; on TPU or GPU workers, a machine type with more chips (each batch is sharded "
                        "over a worker's chips) or more memory per chip.")


def failed_batch_rows(failed) -> Iterable[dict]:
    """A RunInference dead-letter element `(batch of ImageTask, (exc type, repr, traceback))` -> one error row
    per image of the batch, carrying the exception; out of memory, the row says so and what to change."""
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
    if tasks and is_out_of_memory(message):
        first = tasks[0].request  # a batch has one shape
        reason = (f"out of memory: this machine cannot hold a batch of {len(tasks)} image(s) at "
                  f"{first.height}x{first.width}. {OUT_OF_MEMORY_REMEDY} The error: {message}")
    for task in tasks:
        r = task.request
        yield layout.error_row(
            source=r.source, line=r.line, id=r.id, kind=layout.INFERENCE_FAILED, file_name=task.file_name,
            reason=reason,
            record={"prompt": r.prompt, "seed": task.seed, "height": r.height, "width": r.width,
                    "num_inference_steps": r.num_inference_steps, "guidance_scale": r.guidance_scale})


# --------------------------------------------------------------------------------------------- summary
def _row_order(row: dict) -> tuple:
    return str(row.get("source")), row.get("line") if isinstance(row.get("line"), int) else -1
SUMMARY_FIGURES = ("records_read", "requests", "images_planned", "images_generated", "skipped", "invalid",
                   "duplicates", "failed", "prompts_truncated")


def build_summary(counts: dict[str, int], *, started_at: float, finished_at: float, extra: dict | None = None) -> dict:
    wall = max(finished_at - started_at, 1e-9)
    summary: dict[str, Any] = {name: int(counts.get(name, 0)) for name in SUMMARY_FIGURES}
    summary["wall_time_s"] = round(wall, 3)
    summary["images_per_s"] = round(summary["images_generated"] / wall, 4)
    summary["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at))
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(finished_at))
    if extra:
        summary.update(extra)
    return summary


def format_summary(summary: dict) -> str:
    text = (f"records read {summary['records_read']}, images generated {summary['images_generated']}, "
            f"skipped {summary['skipped']}, invalid {summary['invalid']}, failed {summary['failed']}, "
            f"wall time {summary['wall_time_s']:.1f} s, {summary['images_per_s']:.3f} images/s")
    retried = summary.get("retries")
    if retried:
        text += ", retries: " + ", ".join(f"{k} {v}" for k, v in retried.items())
    return text


class _WriteSummaryFn(beam.DoFn):
    def __init__(self, path: str, started_at: float, extra: dict):
        self._path = path
        self._started_at = started_at
        self._extra = extra

    def setup(self):
        retries.install()

    def finish_bundle(self):
        retries.flush_to_metrics()

    def process(self, _, **side):
        counts = {k: v for k, v in side.items() if not k.startswith(("_after_", "_rows_"))}
        rows = {k[len("_rows_"):]: v for k, v in side.items() if k.startswith("_rows_")}
        summary = build_summary(counts, started_at=self._started_at, finished_at=time.time(), extra=self._extra)
        for name, found in rows.items():
            if found:
                summary[name] = sorted(found, key=_row_order)[:MAX_SUMMARY_ROWS]
                summary[f"{name}_count"] = len(found)
        write_bytes_atomic(self._path, (json.dumps(summary, indent=2) + "\n").encode("utf-8"),
                           mime_type="application/json")
        yield summary


MAX_SUMMARY_ROWS = 100  # rows (warnings) listed in summary.json; `{name}_count` says how many there were


class WriteSummary(beam.PTransform):
    """{figure name: PCollection to count} -> writes `{output}/summary.json` once every count is known.

    Computed inside the pipeline (not from the launcher's metrics query), so it is written on every runner,
    including Dataflow where the launcher exits after submitting. PCollections in `after` (e.g. the file names
    WriteToText returns) are waited for, so that summary.json appears only once those outputs are complete.
    `rows`: {name: PCollection of JSON rows} listed in the summary under `name` (the first MAX_SUMMARY_ROWS by
    source and line) with `{name}_count`; absent when there are none.
    """

    def __init__(self, output: str, started_at: float, extra: dict | None = None, after: Iterable = (),
                 rows: dict | None = None):
        super().__init__()
        self._output = output
        self._started_at = started_at
        self._extra = dict(extra or {})
        self._after = list(after)
        self._rows = dict(rows or {})

    def expand(self, pcolls: dict):
        side = {}
        for name, pcoll in pcolls.items():
            side[name] = beam.pvalue.AsSingleton(pcoll | f"Count_{name}" >> beam.combiners.Count.Globally())
        for name, pcoll in self._rows.items():  # few rows (one per file at most): listed whole, then cut
            side[f"_rows_{name}"] = beam.pvalue.AsList(pcoll)
        for i, pcoll in enumerate(self._after):
            side[f"_after_{i}"] = beam.pvalue.AsList(pcoll)
        return (pcolls[next(iter(pcolls))].pipeline
                | "SummaryTrigger" >> beam.Create([None])
                | "WriteSummary" >> beam.ParDo(_WriteSummaryFn(layout.summary_path(self._output), self._started_at,
                                                               self._extra), **side))
