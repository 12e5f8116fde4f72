"""Storing images: atomic object writes, and the encoder-thread pool every sink stores its images with.

An image goes to its object as one atomic write: on GCS (and any other object store Beam's FileSystems knows) a
single upload that only becomes visible when complete; on a local disk a temporary file in the same folder, then an
atomic rename. The bytes depend only on the pixels, the request and the encoding options (never on the thread that
encoded them), so a retried bundle rewrites the same bytes and no partial image is ever visible.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import os
from typing import Callable

import apache_beam as beam
from apache_beam.io.filesystem import CompressionTypes
from apache_beam.io.filesystems import FileSystems
from apache_beam.metrics import Metrics

from .. import beam_adapter, layout, retries
from ..atomic_files import write_local_atomic, write_object_atomic
from ..checksums import crc32c
from ..identity import ImageIdentity, ModelIdentity
from ..metrics import NAMESPACE as METRICS_NAMESPACE
from .encoding import ImageEncoding, generated_text, image_xmp


def write_bytes_atomic(path: str, data: bytes, mime_type: str = "application/octet-stream") -> None:
    """Write `data` to `path` so that readers see either nothing (or the old bytes) or all of the new bytes."""
    if layout.is_local_path(path):
        write_local_atomic(path, lambda f: f.write(data))
        return
    write_object_atomic(path, lambda f: f.write(data), mime_type)


def read_bytes(path: str) -> bytes:
    with FileSystems.open(path, compression_type=CompressionTypes.UNCOMPRESSED) as f:
        return f.read()


def default_encode_threads() -> int:
    """The encoder threads of a writer when none are asked for: one per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a sink puts one image: `file_name` and `uri` as its manifest row names them, `write_to` the object its
    bytes are written to (the uri itself, or a staging object that a later step packs), and `key`, its sample key
    in a shard (None outside shards)."""

    file_name: str
    uri: str
    write_to: str
    key: str | None = None


@dataclasses.dataclass(frozen=True)
class InFiltered:
    """Where every sink puts an image a score filter left out (transforms/score_filters.py): `filtered/{name}`,
    written in place (never into a shard); a shard task keeps its key in its row."""

    output: str
    encoding: ImageEncoding = ImageEncoding()

    def __call__(self, task) -> Placement:
        name = layout.filtered_file_name(self.encoding.stored_name(task.file_name))
        uri = layout.join(self.output, name)
        return Placement(file_name=name, uri=uri, write_to=uri, key=getattr(task, "key", None))


@dataclasses.dataclass(frozen=True)
class StoredImage:
    """What an encoder thread reports back for one image: its size, sha256 and CRC32C (as GCS lists it)."""

    num_bytes: int
    sha256: str
    crc32c: str
    phash: str | None = None  # of the pixels (transforms/phash.py)


def store_image(generated, place: Placement, encoding: ImageEncoding,
                model_identity: ModelIdentity | None = None) -> StoredImage:
    """Encode one GeneratedImage with its provenance (transforms/provenance.py: the XMP names the fingerprints of
    its identity record; signed when the encoding has a C2PA signer) and write it atomically to `place.write_to`;
    its pixels' pHash (a per-image output, GeneratedImage.phash) comes back with its figures.
    Thread-safe (no Beam state touched)."""
    data = encoding.encode(generated.pixels, generated_text(generated, model_identity),
                           xmp=image_xmp(generated, model_identity))
    if encoding.c2pa is not None:
        data = encoding.c2pa.sign(data, encoding.mime_type, model=generated.model, title=place.file_name)
    write_bytes_atomic(place.write_to, data, mime_type=encoding.mime_type)
    return StoredImage(len(data), hashlib.sha256(data).hexdigest(), crc32c(data), generated.phash)


class StoreImagesFn(retries.CountingRetriesFn):
    """GeneratedImage -> encodes it, writes it where `place(task)` says, yields its manifest row.

    Encoding and upload run on a pool of `threads` encoder threads (zlib, libwebp and libjpeg release the GIL), so
    `process` returns at once and RunInference starts the next batch on the device while this one is stored. At
    most `max_in_flight` images wait or run in the pool (back-pressure: `process` then waits for the oldest), which
    bounds memory when the store is slow. Every image is stored before its bundle ends (`finish_bundle` waits), and
    a failed write fails the bundle, so a retry stores the same bytes again: nothing is lost, nothing partial.
    `model_identity` (transforms/identity.py: the job's model) goes into each image's text and manifest row.
    Counted in every sink alike: `images_generated`, `image_bytes_written`, `generation_ms_per_image`, the progress
    line.
    """

    def __init__(self, place: Callable[..., Placement], encoding: ImageEncoding | None = None,
                 threads: int | None = None, max_in_flight: int | None = None,
                 model_identity: ModelIdentity | str | None = None, progress_dir: str | None = None,
                 filtered_place: Callable[..., Placement] | None = None):
        """`filtered_place(task)`: where an image a score filter left out goes (InFiltered; None: where `place`
        says)."""
        self._place = place
        self._filtered_place = filtered_place or place
        self._model = ModelIdentity.of(model_identity)
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
        super().setup()
        threads = self._threads or default_encode_threads()
        self._limit = self._max_in_flight or 2 * threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="flux2-encode")
        if self._progress_dir:
            from ..progress import ProgressWriter

            self._progress = ProgressWriter(self._progress_dir)

    def start_bundle(self):
        self._pending = collections.deque()

    def process(self, generated, window=beam.DoFn.WindowParam, timestamp=beam.DoFn.TimestampParam):
        # Waits for the oldest images while the pool is full, so at most `limit` images are held here.
        while len(self._pending) >= self._limit or (self._pending and self._pending[0][0].done()):
            yield self._take_oldest()
        place = (self._filtered_place if getattr(generated, "filtered", None) else self._place)(generated.task)
        future = self._pool.submit(store_image, generated, place, self._encoding, self._model)
        self._pending.append((future, generated, place, window, timestamp))
        self._in_flight.update(len(self._pending))

    def finish_bundle(self):
        while self._pending:
            yield self._take_oldest()
        # Loads that happened in this process but were not yet reported (see inference.flush_model_load_metrics).
        from ..inference import flush_model_load_metrics

        flush_model_load_metrics()
        super().finish_bundle()
        if self._progress is not None:
            self._progress.flush()

    def teardown(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _take_oldest(self):
        """Wait for the oldest pending image; its manifest row in its element's window. A failed write cancels the
        images not yet started and fails the bundle (the runner retries it)."""
        future, generated, place, window, timestamp = self._pending.popleft()
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
        row = layout.manifest_row(
            generated.task, file_name=place.file_name, uri=place.uri, sha256=stored.sha256,
            num_bytes=stored.num_bytes, num_inference_steps=generated.num_inference_steps,
            guidance_scale=generated.guidance_scale, prompt_truncated=generated.prompt_truncated,
            model=generated.model, generation_ms=generated.generation_ms,
            identity=ImageIdentity.of(generated.task, self._model), key=place.key, crc32c=stored.crc32c,
            phash=stored.phash, scores=getattr(generated, "scores", None),
            filtered=getattr(generated, "filtered", None))
        return beam_adapter.windowed_value(row, timestamp, window)
