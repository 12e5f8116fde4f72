"""Image encoding (PNG, WebP, JPEG) on a pool of encoder threads, atomic image writes, manifest and error rows, skip-existing, the run summary.

An image goes straight to its final name as one atomic object write: on GCS (and any other object store Beam's
FileSystems knows) a single object upload that only becomes visible when complete; on a local disk a temporary file
in the same folder, then an atomic rename. The image bytes depend only on the pixels, the request and the encoding
options (never on the thread that encoded them), so a retried bundle rewrites the same bytes and no partial image is
ever visible.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import logging
import os
import time
from typing import Any, Iterable

import apache_beam as beam
import numpy as np
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics
from apache_beam.utils.windowed_value import WindowedValue

from . import layout, retries
from .atomic_files import write_local_atomic, write_object_atomic
from .inference import InferenceTimeout, is_out_of_memory
from .metrics import NAMESPACE as METRICS_NAMESPACE
from .fingerprints import request_fingerprint
from .requests import ImageTask

PNG_SOFTWARE = "flux2-klein-beam"
LOGGER = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------- files
def is_local(path: str) -> bool:
    return "://" not in path


def write_bytes_atomic(path: str, data: bytes, mime_type: str = "application/octet-stream") -> None:
    """Write `data` to `path` so that readers see either nothing (or the old bytes) or all of the new bytes."""
    if is_local(path):
        write_local_atomic(path, lambda f: f.write(data))
        return
    write_object_atomic(path, lambda f: f.write(data), mime_type)


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


# --------------------------------------------------------------------------------------------- PNG
def png_text(task: ImageTask, *, num_inference_steps: int, guidance_scale: float, model: str,
             prompt_truncated: bool | None = None, model_fingerprint: str | None = None) -> dict[str, str]:
    """The PNG text chunks: prompt, seed, steps, guidance and model (plus the id, size, whether the prompt was
    truncated and the request's and the model's fingerprints), all as strings; a resumed job rebuilds an image's
    manifest row from them."""
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
        "request_fingerprint": request_fingerprint(task),
    }
    if model_fingerprint:
        text["model_fingerprint"] = model_fingerprint
    if prompt_truncated is not None:
        text["prompt_truncated"] = "true" if prompt_truncated else "false"
    if r.reference_images:
        text["reference_images"] = reference_text(r)
    return text


def reference_text(request) -> str:
    """An image-conditioned request's references as its image text carries them: JSON [{uri, sha256}, ...]."""
    return json.dumps(request.reference_entries(), ensure_ascii=False, separators=(",", ":"))


def encode_png(pixels: np.ndarray, text: dict[str, str] | None = None,
               compress_level: int | None = None) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes with `text` as iTXt chunks (UTF-8); deterministic for the same input.
    `compress_level` (zlib, 0-9) defaults to DEFAULT_PNG_COMPRESS_LEVEL."""
    return ImageEncoding("png", DEFAULT_PNG_COMPRESS_LEVEL if compress_level is None else compress_level) \
        .encode(pixels, text)


# --------------------------------------------------------------------------------------------- image formats
# --image_format choices and the encoders' defaults live in layout (light enough for the option table)
from .layout import DEFAULT_PNG_COMPRESS_LEVEL, DEFAULT_QUALITY, IMAGE_FORMATS  # noqa: E402,F401
MIME_TYPES = {"png": "image/png", "webp": "image/webp", "jpeg": "image/jpeg"}
PIL_FORMATS = {"png": "PNG", "webp": "WEBP", "jpeg": "JPEG"}
EXIF_IMAGE_DESCRIPTION = 0x010E  # WebP/JPEG: the PNG text chunks as one JSON object, in this EXIF tag
EXIF_SOFTWARE = 0x0131
JPEG_MAX_EXIF_BYTES = 65_000  # a JPEG APP1 segment holds at most 65,533 bytes of EXIF


@dataclasses.dataclass(frozen=True)
class ImageEncoding:
    """How images are stored: `format` (png, webp, jpeg), zlib level of PNG, quality (1-100) of WebP and JPEG."""

    format: str = "png"
    png_compress_level: int = DEFAULT_PNG_COMPRESS_LEVEL
    quality: int = DEFAULT_QUALITY

    def __post_init__(self):
        if self.format not in IMAGE_FORMATS:
            raise ValueError(f"--image_format={self.format!r} is not one of {', '.join(IMAGE_FORMATS)}")
        if isinstance(self.png_compress_level, bool) or not isinstance(self.png_compress_level, int) \
                or not 0 <= self.png_compress_level <= 9:
            raise ValueError(f"--png_compress_level={self.png_compress_level!r} is not an integer from 0 to 9")
        if isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100:
            raise ValueError(f"--quality={self.quality!r} is not an integer from 1 to 100")

    @property
    def mime_type(self) -> str:
        return MIME_TYPES[self.format]

    def stored_name(self, file_name: str) -> str:
        """A task's file name with this format's extension."""
        return layout.stored_image_name(file_name, self.format)

    def encode(self, pixels: np.ndarray, text: dict[str, str] | None = None) -> bytes:
        """uint8 [H, W, 3] -> bytes of this format carrying `text` (PNG: iTXt chunks; WebP/JPEG: EXIF, see
        `exif_description`); the same input gives the same bytes, whichever thread encodes it."""
        from PIL import Image, PngImagePlugin

        pixels = np.asarray(pixels)
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[-1] != 3:
            raise ValueError(f"expected uint8 [H, W, 3] pixels, got {pixels.dtype} {pixels.shape}")
        image = Image.fromarray(pixels, mode="RGB")
        buf = io.BytesIO()
        if self.format == "png":
            info = PngImagePlugin.PngInfo()
            for key, value in (text or {}).items():
                info.add_itxt(key, value)
            image.save(buf, format="PNG", pnginfo=info, compress_level=self.png_compress_level)
        else:
            exif = Image.Exif()
            exif[EXIF_IMAGE_DESCRIPTION] = exif_description(text or {}, jpeg=self.format == "jpeg")
            exif[EXIF_SOFTWARE] = PNG_SOFTWARE
            image.save(buf, format=PIL_FORMATS[self.format], quality=self.quality, exif=exif.tobytes())
        return buf.getvalue()


def exif_description(text: dict[str, str], *, jpeg: bool = False) -> str:
    """The image's text (png_text) as the EXIF ImageDescription of a WebP or JPEG: one JSON object, ASCII-escaped
    (EXIF text is ASCII) so every prompt round-trips. A JPEG's EXIF is capped at 64 KiB: when the prompt does not
    fit, `prompt_sha256` stands in for it (the manifest row still has the whole prompt)."""
    out = json.dumps(text, ensure_ascii=True, sort_keys=True)
    if jpeg and len(out) > JPEG_MAX_EXIF_BYTES and "prompt" in text:
        short = dict(text)
        short["prompt_sha256"] = hashlib.sha256(short.pop("prompt").encode("utf-8")).hexdigest()
        out = json.dumps(short, ensure_ascii=True, sort_keys=True)
    return out


def read_image_text(image) -> dict[str, str]:
    """The text an open PIL image carries: PNG text chunks, or the JSON of a WebP/JPEG EXIF ImageDescription."""
    if image.format == "PNG":
        return dict(getattr(image, "text", {}) or {})
    raw = image.getexif().get(EXIF_IMAGE_DESCRIPTION)
    try:
        text = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return {str(k): str(v) for k, v in text.items()} if isinstance(text, dict) else {}


def default_encode_threads() -> int:
    """The encoder threads of a writer when none are asked for: one per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class StoredImage:
    """What an encoder thread reports back for one image: where it went, its size and its sha256."""

    uri: str
    num_bytes: int
    sha256: str


def store_image(generated, output: str, encoding: ImageEncoding, model_fingerprint: str | None = None) -> StoredImage:
    """Encode one GeneratedImage and write it atomically under `output`; thread-safe (no Beam state touched)."""
    task: ImageTask = generated.task
    data = encoding.encode(generated.pixels, png_text(
        task, num_inference_steps=generated.num_inference_steps, guidance_scale=generated.guidance_scale,
        model=generated.model, prompt_truncated=generated.prompt_truncated, model_fingerprint=model_fingerprint))
    uri = layout.join(output, encoding.stored_name(task.file_name))
    write_bytes_atomic(uri, data, mime_type=encoding.mime_type)
    return StoredImage(uri, len(data), hashlib.sha256(data).hexdigest())


# --------------------------------------------------------------------------------------------- Beam: write images
class WriteImagesFn(beam.DoFn):
    """PredictionResult(example=ImageTask, inference=GeneratedImage) -> writes the image, yields its manifest row.

    Encoding and upload run on a pool of `threads` encoder threads (zlib, libwebp and libjpeg release the GIL), so
    `process` returns at once and RunInference starts the next batch on the device while this one is stored. At
    most `max_in_flight` images wait or run in the pool (back-pressure: `process` then waits for the oldest), which
    bounds memory when the store is slow. Every image is stored before its bundle ends (`finish_bundle` waits), and
    a failed write fails the bundle, so a retry stores the same bytes again: nothing is lost, nothing partial.
    `model_fingerprint` (transforms/fingerprints.py) goes into each image's text and manifest row.
    """

    def __init__(self, output: str, progress_dir: str | None = None, encoding: ImageEncoding | None = None,
                 threads: int | None = None, max_in_flight: int | None = None, model_fingerprint: str | None = None):
        self._output = output
        self._model_fingerprint = model_fingerprint or None
        self._progress_dir = progress_dir
        self._encoding = encoding or ImageEncoding()
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"--encode_threads={threads!r} is not an integer >= 1")
        if max_in_flight is not None and (not isinstance(max_in_flight, int) or max_in_flight < 1):
            raise ValueError(f"max_in_flight={max_in_flight!r} is not an integer >= 1")
        self._threads = threads
        self._max_in_flight = max_in_flight
        self._written = Metrics.counter(METRICS_NAMESPACE, "images_generated")
        self._bytes = Metrics.counter(METRICS_NAMESPACE, "image_bytes_written")
        self._gen_ms = Metrics.distribution(METRICS_NAMESPACE, "generation_ms_per_image")
        self._in_flight = Metrics.distribution(METRICS_NAMESPACE, "images_in_flight")
        self._progress = None
        self._pool = None
        self._pending: collections.deque = collections.deque()

    def setup(self):
        retries.install()
        threads = self._threads or default_encode_threads()
        self._limit = self._max_in_flight or 2 * threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="flux2-encode")
        if self._progress_dir:
            from .progress import ProgressWriter

            self._progress = ProgressWriter(self._progress_dir)

    def start_bundle(self):
        self._pending = collections.deque()

    def process(self, result, window=beam.DoFn.WindowParam, timestamp=beam.DoFn.TimestampParam):
        generated = result.inference
        # Waits for the oldest images while the pool is full, so at most `limit` images are held here.
        while len(self._pending) >= self._limit or (self._pending and self._pending[0][0].done()):
            yield self._take_oldest()
        future = self._pool.submit(store_image, generated, self._output, self._encoding, self._model_fingerprint)
        self._pending.append((future, generated, window, timestamp))
        self._in_flight.update(len(self._pending))

    def finish_bundle(self):
        while self._pending:
            yield self._take_oldest()
        # Loads that happened in this process but were not yet reported (see inference.flush_model_load_metrics).
        from .inference import flush_model_load_metrics

        flush_model_load_metrics()
        retries.flush_to_metrics()
        if self._progress is not None:
            self._progress.flush()

    def teardown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _take_oldest(self) -> WindowedValue:
        """Wait for the oldest pending image; its manifest row in its element's window. A failed write cancels the
        images not yet started and fails the bundle (the runner retries it)."""
        future, generated, window, timestamp = self._pending.popleft()
        try:
            stored: StoredImage = future.result()
        except BaseException:
            while self._pending:
                self._pending.popleft()[0].cancel()
            raise
        self._written.inc()
        self._bytes.inc(stored.num_bytes)
        self._gen_ms.update(int(round(generated.generation_ms)))
        if self._progress is not None:
            self._progress.add(1)
        task: ImageTask = generated.task
        r = task.request
        row = layout.manifest_row(
            request_id=r.id, file_name=self._encoding.stored_name(task.file_name), uri=stored.uri, prompt=r.prompt,
            prompt_truncated=generated.prompt_truncated, seed=task.seed, height=r.height, width=r.width,
            num_inference_steps=generated.num_inference_steps, guidance_scale=generated.guidance_scale,
            model=generated.model, sha256=stored.sha256, num_bytes=stored.num_bytes,
            generation_ms=generated.generation_ms, source=r.source, line=r.line, metadata=r.metadata_values(),
            reference_images=r.reference_entries(), request_fingerprint=request_fingerprint(task),
            model_fingerprint=self._model_fingerprint)
        return WindowedValue(row, timestamp, [window])


# --------------------------------------------------------------------------------------------- Beam: skip existing
SKIPPED_TAG = "skipped"


class ExistingImageMismatch(ValueError):
    """An image already at a task's name is not that task's image (other request, wrong size, damaged bytes)."""

    def __init__(self, file_name: str, problem: str):
        super().__init__(f"{file_name}: {problem}")
        self.file_name = file_name
        self.problem = problem


class StaleImage(ExistingImageMismatch):
    """A sound image already at a task's name that was made for another request or by another model (its
    fingerprints, or the fields its text records, differ): generated again and counted `stale`."""


def existing_manifest_row(task: ImageTask, data: bytes, uri: str, encoding: ImageEncoding | None = None,
                          model_fingerprint: str | None = None) -> dict:
    """The manifest row of an image a previous run wrote for `task`, rebuilt from its bytes and the text it carries
    (PNG text chunks; the EXIF description of a WebP or JPEG).

    Raises ExistingImageMismatch unless the bytes are a complete, undamaged image of the encoding's format (PNG:
    every chunk checksum; WebP/JPEG: all pixels decode), and StaleImage unless it has the task's size and its text
    records the task's id, prompt (or its sha256, for a JPEG whose EXIF could not hold it) and seed, its steps and
    guidance when the record gives them, and the task's request fingerprint and `model_fingerprint` when the text
    has them (images of older runs do not; their row's model_fingerprint is then None)."""
    from PIL import Image

    encoding = encoding or ImageEncoding()
    expected_format = PIL_FORMATS[encoding.format]
    r = task.request
    file_name = encoding.stored_name(task.file_name)
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, size, text = im.format, im.size, read_image_text(im)
            if fmt != "PNG":
                im.load()  # a truncated WebP/JPEG fails to decode here
        if fmt == "PNG":
            with Image.open(io.BytesIO(data)) as im:
                im.verify()  # every chunk's CRC, through IEND: a truncated or damaged file fails here
    except Exception as e:  # noqa: BLE001 - PIL raises many types for bad bytes; all mean the same here
        raise ExistingImageMismatch(file_name, f"not a readable {expected_format} ({type(e).__name__}: {e})") \
            from None
    if fmt != expected_format:
        raise ExistingImageMismatch(file_name, f"is {fmt}, not {expected_format}")
    if size != (r.width, r.height):
        raise StaleImage(file_name, f"is {size[0]}x{size[1]} (WxH), the request asks for {r.width}x{r.height}")
    expected = {"id": r.id, "seed": str(task.seed)}
    if "prompt" in text or "prompt_sha256" not in text:
        expected["prompt"] = r.prompt
    else:
        expected["prompt_sha256"] = hashlib.sha256(r.prompt.encode("utf-8")).hexdigest()
    if r.num_inference_steps is not None:
        expected["num_inference_steps"] = str(int(r.num_inference_steps))
    if r.guidance_scale is not None:
        expected["guidance_scale"] = repr(float(r.guidance_scale))
    # References: the same files (URIs and sha256); an image without references is not one made with them.
    expected["reference_images"] = reference_text(r) if r.reference_images else None
    for key, value in expected.items():
        if text.get(key) != value:
            raise StaleImage(file_name, f"was made for another request (its {key!r} differs)")
    fingerprint = request_fingerprint(task)
    if text.get("request_fingerprint", fingerprint) != fingerprint:
        raise StaleImage(file_name, "was made for another request (its request fingerprint differs)")
    if model_fingerprint and text.get("model_fingerprint", model_fingerprint) != model_fingerprint:
        raise StaleImage(file_name, "was made by another model (its model fingerprint differs: another checkpoint, "
                                    "dtype or max_sequence_length)")
    try:
        steps, guidance = int(text["num_inference_steps"]), float(text["guidance_scale"])
    except (KeyError, ValueError):
        raise ExistingImageMismatch(file_name, "lacks its steps/guidance text") from None
    truncated = {"true": True, "false": False}.get(text.get("prompt_truncated", ""))
    return layout.manifest_row(
        request_id=r.id, file_name=file_name, uri=uri, prompt=r.prompt, prompt_truncated=truncated,
        seed=task.seed, height=r.height, width=r.width, num_inference_steps=steps, guidance_scale=guidance,
        model=text.get("model", ""), sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data),
        generation_ms=None, source=r.source, line=r.line, metadata=r.metadata_values(),
        reference_images=r.reference_entries(), request_fingerprint=fingerprint,
        model_fingerprint=text.get("model_fingerprint"))


STALE_TAG = "stale"


class _SkipExistingFn(beam.DoFn):
    """Reads and checks each listed image (the listing as a side input {file name: size}): a task whose image
    checks out -> its manifest row (tagged `skipped`); else the task, to be generated (an image made for another
    request or model is counted `stale` and tagged so; a damaged one is counted replaced). What --skip_existing
    does for an image no earlier manifest row describes; alone, the whole check of runs before fingerprints."""

    def __init__(self, output: str, encoding: ImageEncoding | None = None, model_fingerprint: str | None = None):
        self._output = output
        self._encoding = encoding or ImageEncoding()
        self._model_fingerprint = model_fingerprint or None
        self._skipped = Metrics.counter(METRICS_NAMESPACE, "images_skipped")
        self._replaced = Metrics.counter(METRICS_NAMESPACE, "existing_images_replaced")
        self._stale = Metrics.counter(METRICS_NAMESPACE, "images_stale")
        self._read = Metrics.counter(METRICS_NAMESPACE, "existing_images_read")

    def setup(self):
        retries.install()

    def finish_bundle(self):
        retries.flush_to_metrics()

    def process(self, task: ImageTask, existing):
        if self._encoding.stored_name(task.file_name) not in existing:
            yield task
            return
        yield from self._read_and_check(task)

    def _read_and_check(self, task: ImageTask):
        file_name = self._encoding.stored_name(task.file_name)
        uri = layout.join(self._output, file_name)
        try:
            data = read_bytes(uri)
        except FileNotFoundError:  # deleted since the listing
            yield task
            return
        self._read.inc()
        try:
            row = existing_manifest_row(task, data, uri, self._encoding, self._model_fingerprint)
        except StaleImage as e:
            yield from self._stale_task(task, str(e))
            return
        except ExistingImageMismatch as e:
            self._replaced.inc()
            LOGGER.warning("--skip_existing: %s; generating it again", e)
            yield task
            return
        self._skipped.inc()
        yield beam.pvalue.TaggedOutput(SKIPPED_TAG, row)

    def _stale_task(self, task: ImageTask, why: str):
        self._stale.inc()
        LOGGER.info("--skip_existing: %s; generating it again", why)
        yield beam.pvalue.TaggedOutput(STALE_TAG, self._encoding.stored_name(task.file_name))
        yield task


# What a skip decision needs of an earlier manifest row (never its prompt or metadata, which can be large).
RECORDED_FIELDS = ("request_fingerprint", "model_fingerprint", "bytes", "sha256", "model", "prompt_truncated",
                   "num_inference_steps", "guidance_scale")


def recorded_rows(readable_file) -> Iterable[tuple[str, dict]]:
    """An earlier run's manifest file (manifest-*.jsonl or existing-*.jsonl) -> (file name, RECORDED_FIELDS) for
    each row with both fingerprints, read line by line. Rows without them (older runs) and lines that do not parse
    are left out: their images are read and checked instead."""
    with readable_file.open() as f:
        for number, line in enumerate(io.TextIOWrapper(f, encoding="utf-8", errors="replace"), 1):
            try:
                row = json.loads(line)
                file_name = row["file_name"]
            except (ValueError, KeyError, TypeError):
                if line.strip():
                    LOGGER.warning("--skip_existing: line %d of %s is not a manifest row; ignored", number,
                                   readable_file.metadata.path)
                continue
            if isinstance(file_name, str) and row.get("request_fingerprint") and row.get("model_fingerprint"):
                yield file_name, {k: row.get(k) for k in RECORDED_FIELDS}


class _DecideExistingFn(_SkipExistingFn):
    """(file name, {tasks, listed sizes, recorded rows}) -> the same outputs as _SkipExistingFn, from the listing
    and the earlier manifest rows alone: an image listed at the size its rows record, all of whose rows carry the
    task's request fingerprint and this model's, is skipped without being read; one whose rows all carry other
    fingerprints is stale; one with no row (a run killed before its manifest was written), rows that disagree, or
    another size, is read and checked as _SkipExistingFn does."""

    def process(self, element, existing=None):
        file_name, found = element
        listed, recorded = list(found["listed"]), list(found["recorded"])
        for task in found["tasks"]:
            if not listed:
                yield task
            elif not recorded:
                yield from self._read_and_check(task)
            else:
                yield from self._decide(task, file_name, listed[0], recorded)

    def _decide(self, task: ImageTask, file_name: str, size: int, recorded: list[dict]):
        want = (request_fingerprint(task), self._model_fingerprint)
        prints = {(rec["request_fingerprint"], rec["model_fingerprint"]) for rec in recorded}
        if want not in prints:
            which = "request" if all(p[1] == want[1] for p in prints) else "model"
            yield from self._stale_task(task, f"{file_name}: its manifest row has another {which} fingerprint")
            return
        rec = next((r for r in recorded if r.get("bytes") == size), None)
        if len(prints) > 1 or rec is None:  # rows that disagree, or an object of another size: look at it
            yield from self._read_and_check(task)
            return
        r = task.request
        self._skipped.inc()
        yield beam.pvalue.TaggedOutput(SKIPPED_TAG, layout.manifest_row(
            request_id=r.id, file_name=file_name, uri=layout.join(self._output, file_name), prompt=r.prompt,
            prompt_truncated=rec["prompt_truncated"], seed=task.seed, height=r.height, width=r.width,
            num_inference_steps=rec["num_inference_steps"], guidance_scale=rec["guidance_scale"],
            model=rec["model"], sha256=rec["sha256"], num_bytes=size, generation_ms=None, source=r.source,
            line=r.line, metadata=r.metadata_values(), reference_images=r.reference_entries(),
            request_fingerprint=want[0], model_fingerprint=want[1]))


class SkipExisting(beam.PTransform):
    """Image tasks -> {'tasks': those still to generate, 'skipped': manifest rows of the images already there,
    'stale': file names of images already there that were made for another request or model}.

    The existing images are listed once (one match of `{output}/images/*.png`, or the extension of the job's
    --image_format), and the earlier runs' manifest rows (`manifest/*.jsonl`: manifest-* and existing-*) read once,
    keeping only their fingerprints and stored figures. Both are joined with the tasks by file name
    (_DecideExistingFn), so that an image whose rows say it is this request's, made by this model
    (`model_fingerprint`), is skipped without being read. Only images no row describes are read and checked
    (`existing_manifest_row`). Every kept image's row goes to manifest/existing-*.jsonl, so a resumed job's
    manifests still list every image, including those of a run that was killed before writing its manifest.
    `read_manifest=False`: every listed image is read and checked (the behaviour before fingerprints; benchmarks).
    """

    def __init__(self, output: str, encoding: ImageEncoding | None = None, model_fingerprint: str | None = None,
                 read_manifest: bool = True):
        super().__init__()
        self._output = output
        self._encoding = encoding or ImageEncoding()
        self._model_fingerprint = model_fingerprint or None
        self._read_manifest = read_manifest

    def expand(self, tasks):
        from apache_beam.io import fileio

        output, encoding = self._output, self._encoding
        listed = (tasks.pipeline
                  | "ImagesGlob" >> beam.Create([layout.images_glob(output, encoding.format)])
                  | "ListImages" >> fileio.MatchAll(empty_match_treatment=fileio.EmptyMatchTreatment.ALLOW)
                  | "ToFileName" >> beam.Map(lambda m: (f"{layout.IMAGES_DIR}/{m.path.rsplit('/', 1)[-1]}",
                                                        m.size_in_bytes)))
        fn_args = (output, encoding, self._model_fingerprint)
        if not self._read_manifest:
            out = tasks | "SkipExisting" >> beam.ParDo(_SkipExistingFn(*fn_args), beam.pvalue.AsDict(listed)) \
                .with_outputs(SKIPPED_TAG, STALE_TAG, main="tasks")
        else:
            recorded = (tasks.pipeline
                        | "ManifestGlob" >> beam.Create([layout.manifest_rows_glob(output)])
                        | "ListManifests" >> fileio.MatchAll(empty_match_treatment=fileio.EmptyMatchTreatment.ALLOW)
                        | "OpenManifests" >> fileio.ReadMatches()
                        | "RecordedRows" >> beam.FlatMap(recorded_rows))
            keyed = tasks | "ByFileName" >> beam.Map(lambda t: (encoding.stored_name(t.file_name), t))
            out = ({"tasks": keyed, "listed": listed, "recorded": recorded}
                   | "JoinExisting" >> beam.CoGroupByKey()
                   | "DecideExisting" >> beam.ParDo(_DecideExistingFn(*fn_args))
                   .with_outputs(SKIPPED_TAG, STALE_TAG, main="tasks"))
        return {"tasks": out.tasks, "skipped": out[SKIPPED_TAG], "stale": out[STALE_TAG]}


# --------------------------------------------------------------------------------------------- failed batches
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


# --------------------------------------------------------------------------------------------- summary
def _row_order(row: dict) -> tuple:
    return str(row.get("source")), row.get("line") if isinstance(row.get("line"), int) else -1
# stale: images already there (--skip_existing) made for another request or model, so generated again.
SUMMARY_FIGURES = ("records_read", "requests", "images_planned", "images_generated", "skipped", "stale", "invalid",
                   "duplicates", "failed", "prompts_truncated")


def build_summary(counts: dict[str, int], *, started_at: float, finished_at: float, extra: dict | None = None) -> dict:
    wall = max(finished_at - started_at, 1e-9)
    summary: dict[str, Any] = {name: int(counts.get(name, 0)) for name in SUMMARY_FIGURES}
    summary["wall_time_s"] = round(wall, 3)
    summary["images_per_s"] = round(summary["images_generated"] / wall, 4)
    summary["images_per_hour"] = round(summary["images_generated"] * 3600.0 / wall, 1)
    summary["started_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at))
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(finished_at))
    if extra:
        summary.update(extra)
    return summary


def format_summary(summary: dict) -> str:
    text = (f"records read {summary['records_read']}, images generated {summary['images_generated']}, "
            f"skipped {summary['skipped']}, "
            + (f"stale (generated again) {summary['stale']}, " if summary.get("stale") else "")
            + f"invalid {summary['invalid']}, failed {summary['failed']}, "
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
        counts = {k: v for k, v in side.items() if not k.startswith(("_after_", "_rows_", "_tally_"))}
        rows = {k[len("_rows_"):]: v for k, v in side.items() if k.startswith("_rows_")}
        summary = build_summary(counts, started_at=self._started_at, finished_at=time.time(), extra=self._extra)
        for name, pairs in side.items():
            if name.startswith("_tally_"):
                summary[name[len("_tally_"):]] = dict(sorted((str(k), int(n)) for k, n in pairs))
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
    `tallies`: {name: PCollection of values} listed under `name` as {value: how many} (e.g. error rows by kind).
    """

    def __init__(self, output: str, started_at: float, extra: dict | None = None, after: Iterable = (),
                 rows: dict | None = None, tallies: dict | None = None):
        super().__init__()
        self._tallies = dict(tallies or {})
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
        for name, pcoll in self._tallies.items():
            side[f"_tally_{name}"] = beam.pvalue.AsList(pcoll | f"Tally_{name}" >> beam.combiners.Count.PerElement())
        for i, pcoll in enumerate(self._after):
            side[f"_after_{i}"] = beam.pvalue.AsList(pcoll)
        return (pcolls[next(iter(pcolls))].pipeline
                | "SummaryTrigger" >> beam.Create([None])
                | "WriteSummary" >> beam.ParDo(_WriteSummaryFn(layout.summary_path(self._output), self._started_at,
                                                               self._extra), **side))
